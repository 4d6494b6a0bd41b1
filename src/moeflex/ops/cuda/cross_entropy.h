// Softmax cross-entropy on the GPU (CPU reference: ops/cross_entropy.h), fp32.
//   logits, probs, dlogits: [n, V]; targets: [n] int32 (device memory); losses: [n].
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

namespace moeflex::ops::cuda {

/// probs (=) and losses (=) for n rows of V logits.
void cross_entropy_forward(const float* logits, const std::int32_t* targets, float* probs, float* losses,
                           std::int64_t n, std::int64_t V, cudaStream_t stream);

/// dlogits (=) = (probs - onehot(targets)) * scale.
void cross_entropy_backward(const float* probs, const std::int32_t* targets, float* dlogits, std::int64_t n,
                            std::int64_t V, float scale, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
