// The MoE router's scores and top-k on the GPU (CPU reference and the rules:
// ops/router.h), computed in fp32 as routers are run in mixed-precision training.
//   logits, dlogits: [n, E] of T (float, or bf16 in the bf16 engine: read widened,
//   written rounded once); probs, dprobs_extra: [n, E] float; topk_idx: [n, k] int32;
//   topk_w, dtopk_w: [n, k] float; opt.bias: [E] float on the device, or null.
//   forward:  probs (=) = softmax or sigmoid of the logits; topk_idx (=) = the k largest
//             probs + bias per row among the allowed experts (all, or those of the
//             topk_group best groups), ties to the lower index, in decreasing order;
//             topk_w (=) = those probs, renormalised when norm_topk_prob, scaled.
//   backward: dlogits (=) from dtopk_w through the scaling and the optional
//             renormalisation, plus dprobs_extra (may be null; the aux loss's
//             gradient), then the softmax Jacobian dlogit_e = p_e (g_e - sum_c p_c g_c)
//             or the sigmoid's p_e (1 - p_e) g_e.
// One warp per row; E <= 1024 (kRouterMaxExperts), 0 < k <= E and n_group <= 32
// (kRouterMaxGroups), else Error.
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops::cuda {

/// Largest expert count the warp-per-row kernels support (32 per lane).
constexpr std::int64_t kRouterMaxExperts = 1024;
/// Largest n_group of group-limited routing (the chosen groups are one 32-bit mask).
constexpr std::int64_t kRouterMaxGroups = 32;

/// probs (=), topk_idx (=), topk_w (=) for n rows of E logits. Throws Error for E, k or
/// the groups out of range.
template <typename T>
void router_forward(const T* logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, const RouterOptions& opt, cudaStream_t stream);

/// dlogits (=) from dtopk_w (and dprobs_extra when not null), through probs and topk_idx
/// of the forward.
template <typename T>
void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                     const std::int32_t* topk_idx, T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                     const RouterOptions& opt, cudaStream_t stream);

/// The default softmax router, with or without renormalisation (tests, benchmarks).
template <typename T>
void router_forward(const T* logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, bool norm_topk_prob, cudaStream_t stream) {
  router_forward(logits, probs, topk_idx, topk_w, n, E, k, RouterOptions{.norm_topk_prob = norm_topk_prob}, stream);
}
template <typename T>
void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                     const std::int32_t* topk_idx, T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                     bool norm_topk_prob, cudaStream_t stream) {
  router_backward(dtopk_w, dprobs_extra, probs, topk_idx, dlogits, n, E, k,
                  RouterOptions{.norm_topk_prob = norm_topk_prob}, stream);
}

}  // namespace moeflex::ops::cuda
