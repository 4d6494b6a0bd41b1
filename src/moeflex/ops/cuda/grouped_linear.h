// The grouped expert GEMM on the GPU (CPU reference: ops/grouped_linear.h): one GEMM
// per expert with rows, issued as one cublasGemmGroupedBatchedEx call (each expert
// its own group of size 1, since row counts differ) or, where cuBLAS does not
// support the types, one cublasGemmEx per expert (GroupedGemmPath).
//   x, dx: [rows, in] sorted by expert; y, dy: [rows, out]; w: [E, out, in] of T;
//   dw: [E, out, in] float (fp32 master gradients); host_offsets: [E+1] on the HOST
//   (from moe_plan_dispatch), since cuBLAS takes the group sizes from host memory.
//   forward:  y_e = x_e @ w_e^T (=)
//   backward: dx_e = dy_e @ w_e (=); dw_e += dy_e^T @ x_e (+=); dx or dw may be null.
// Experts without rows get no GEMM (their dw_e is unchanged). gemm_layout.h builds
// the per-expert arguments (tested on the CPU). The pointer arrays live in the
// handle's device memory and are copied on its stream, so consecutive grouped GEMMs
// on one handle are ordered. FLOPs: forward 2*rows*in*out, backward twice that.
#pragma once
#include <cstdint>

#include "moeflex/ops/cuda/blas.h"

namespace moeflex::ops::cuda {

/// y_e (=) = x_e @ w_e^T for every expert with rows (host_offsets on the host).
template <typename T>
void grouped_linear_forward(Cublas& blas, const T* x, const T* w, T* y, const std::int32_t* host_offsets,
                            std::int64_t E, std::int64_t in, std::int64_t out,
                            GroupedGemmPath path = GroupedGemmPath::automatic);

/// dx_e (=) = dy_e @ w_e; dw_e (+=, fp32) = dy_e^T @ x_e; dx or dw may be null.
template <typename T>
void grouped_linear_backward(Cublas& blas, const T* dy, const T* x, const T* w, T* dx, float* dw,
                             const std::int32_t* host_offsets, std::int64_t E, std::int64_t in, std::int64_t out,
                             GroupedGemmPath path = GroupedGemmPath::automatic);

}  // namespace moeflex::ops::cuda
