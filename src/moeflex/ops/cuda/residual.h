// The residual add and the precision casts of mixed-precision training, on the GPU.
//   residual_add: out[i] = a[i] + b[i] (=), T float or bf16, out may alias a or b.
//     This is Megatron's bias-dropout-add reduced to what the model has: no bias and
//     no dropout, so the fused op is the add; its backward passes the gradient
//     unchanged to both inputs (no kernel).
//   cast: dst[i] = src[i] converted (=): float -> bf16 rounds to nearest even (the
//     bf16 working copy of the fp32 master weights); bf16 -> float is exact.
//   accumulate: dst[i] += src[i] in float (fp32 gradients accumulating a bf16
//     gradient, or fp32 += fp32).
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// out (=) = a + b over n elements; out may alias a or b.
template <typename T>
void residual_add(const T* a, const T* b, T* out, std::int64_t n, cudaStream_t stream);

/// float -> bf16 (round to nearest even).
void cast(const float* src, bf16* dst, std::int64_t n, cudaStream_t stream);
/// bf16 -> float (exact).
void cast(const bf16* src, float* dst, std::int64_t n, cudaStream_t stream);

/// dst += src, in float.
template <typename T>
void accumulate(const T* src, float* dst, std::int64_t n, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
