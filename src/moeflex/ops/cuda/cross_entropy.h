// Softmax cross-entropy on the GPU (CPU reference: ops/cross_entropy.h), computed in
// fp32 whatever the storage types.
//   logits, probs, dlogits: [n, V] of T (float or bf16: read widened, written rounded
//   once); targets: [n] int32 (device memory); losses: [n] float.
//   forward:  probs (=) = softmax(logits) (may alias logits);
//             losses[i] (=) = log(sum_j exp(x_j - max)) - (x_t - max), as the CPU op
//             (precise when p_t underflows). The mean is taken by the caller on the
//             host, in double and token order.
//   backward: dlogits (=) = (probs - onehot(t)) * scale (may alias probs).
// One block per row; block sums in a fixed tree order (deterministic). Device
// pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// probs (=) and losses (=) for n rows of V logits.
template <typename T>
void cross_entropy_forward(const T* logits, const std::int32_t* targets, T* probs, float* losses, std::int64_t n,
                           std::int64_t V, cudaStream_t stream);

/// dlogits (=) = (probs - onehot(targets)) * scale.
template <typename T>
void cross_entropy_backward(const T* probs, const std::int32_t* targets, T* dlogits, std::int64_t n,
                            std::int64_t V, float scale, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
