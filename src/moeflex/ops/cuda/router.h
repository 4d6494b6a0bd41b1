// The MoE router's softmax and top-k on the GPU (CPU reference: ops/router.h),
// computed in fp32 as routers are run in mixed-precision training.
//   logits, dlogits: [n, E] of T (float, or bf16 in the bf16 engine: read widened,
//   written rounded once); probs, dprobs_extra: [n, E] float; topk_idx: [n, k] int32;
//   topk_w, dtopk_w: [n, k] float.
//   forward:  probs (=) = softmax(logits); topk_idx (=) = the k largest probs per row,
//             ties broken by the lower expert index, in decreasing probability;
//             topk_w (=) = those probs, divided by their sum when norm_topk_prob.
//   backward: dlogits (=) from dtopk_w through the optional renormalisation, plus
//             dprobs_extra (may be null; the aux loss's gradient), then the softmax
//             Jacobian: dlogit_e = p_e (g_e - sum_c p_c g_c).
// One warp per row; E <= 1024 (kMaxExperts) and 0 < k <= E, else Error.
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// Largest expert count the warp-per-row kernels support (32 per lane).
constexpr std::int64_t kRouterMaxExperts = 1024;

/// probs (=), topk_idx (=), topk_w (=) for n rows of E logits. Throws Error for E or k
/// out of range.
template <typename T>
void router_forward(const T* logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, bool norm_topk_prob, cudaStream_t stream);

/// dlogits (=) from dtopk_w (and dprobs_extra when not null), through probs and topk_idx
/// of the forward.
template <typename T>
void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                     const std::int32_t* topk_idx, T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                     bool norm_topk_prob, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
