// Linear layer without bias on the GPU (CPU reference: ops/linear.h), PyTorch
// weight layout, through cuBLAS with fp32 accumulation.
//   x: [n, in], w: [out, in], y: [n, out], all of T (float, or bf16: the bf16
//   working copy of the weight); dw: [out, in] float (the fp32 master gradient).
//   forward:  y = x @ w^T (=)
//   backward: dx = dy @ w (= or += by flag); dw += dy^T @ x (+=, fp32 output).
//   dx or dw may be null to skip them.
// FLOPs: forward 2*n*in*out, backward 4*n*in*out. Device pointers; queued on the
// handle's stream.
#pragma once
#include <cstdint>

#include "moeflex/ops/cuda/blas.h"

namespace moeflex::ops::cuda {

/// y (=) = x @ w^T.
template <typename T>
void linear_forward(Cublas& blas, const T* x, const T* w, T* y, std::int64_t n, std::int64_t in, std::int64_t out);

/// dx (= or += with accumulate_dx) = dy @ w; dw (+=, fp32) = dy^T @ x; null skips one.
template <typename T>
void linear_backward(Cublas& blas, const T* dy, const T* x, const T* w, T* dx, float* dw, std::int64_t n,
                     std::int64_t in, std::int64_t out, bool accumulate_dx = false);

}  // namespace moeflex::ops::cuda
