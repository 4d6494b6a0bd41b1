// RMSNorm on the GPU (CPU reference: ops/rmsnorm.h): y = x * rstd * w,
// rstd = 1/sqrt(mean(x^2) + eps).
//   x, y, dx, dy: [n, d] of T (float or bf16); w: [d] of T (the working copy of the
//   weight); rstd: [n] float, saved by forward; dw: [d] float (the fp32 gradient).
//   forward:  y (=), rstd (=).
//   backward: dx (=); dw (+=), rows summed in a fixed order: rows are cut into
//             fixed chunks whose partial sums go to `workspace`, then added in chunk
//             order, so dw is deterministic (no atomics).
// All arithmetic in float. Every pointer is device memory; work is queued on
// `stream` (nothing synchronizes).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/core/units.h"

namespace moeflex::ops::cuda {

/// y (=) and rstd (=) for n rows of d.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, std::int64_t n, std::int64_t d, float eps,
                     cudaStream_t stream);

/// Bytes of device workspace rmsnorm_backward needs for n rows of d.
Bytes rmsnorm_backward_workspace_bytes(std::int64_t n, std::int64_t d);

/// dx (=) and dw (+=, fp32); `workspace` holds rmsnorm_backward_workspace_bytes(n, d).
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw, float* workspace,
                      std::int64_t n, std::int64_t d, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
