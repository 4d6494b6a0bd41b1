// MoE router: softmax over experts, top-k selection, and the two router losses.
//   logits, probs, dlogits: [n, E]; topk_idx: [n, k] int32; topk_w, dtopk_w: [n, k].
//   forward: probs = softmax(logits) (fp32/fp64, numerically stable);
//            topk_idx = the k largest probs per row, ties broken by the lower expert index,
//            listed in decreasing probability; topk_w = those probs, divided by their
//            sum when norm_topk_prob (Mixtral/Qwen3 style).
//   backward: dlogits (=) from dtopk_w (through the optional renormalisation) plus an
//            optional direct dprobs term (the aux loss), then the softmax Jacobian.
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void router_forward(const T* logits, T* probs, std::int32_t* topk_idx, T* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, bool norm_topk_prob);

/// dprobs_extra: [n, E] or null; added to the gradient reaching probs.
template <typename T>
void router_backward(const T* dtopk_w, const T* dprobs_extra, const T* probs, const std::int32_t* topk_idx,
                     T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, bool norm_topk_prob);

/// Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4; Megatron's
/// switch_load_balancing_loss): coef * E * sum_e f_e * P_e, with
/// f_e = (assignments to e among the top-k) / (n*k) and P_e = mean_i probs[i,e].
/// f is a constant for the gradient.
template <typename T>
double aux_loss_forward(const T* probs, const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                        std::int64_t k, double coef);

/// dprobs[i,e] += coef * E * f_e / n.
template <typename T>
void aux_loss_backward(const std::int32_t* topk_idx, T* dprobs, std::int64_t n, std::int64_t E, std::int64_t k,
                       double coef);

/// Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): coef * mean_i logsumexp(logits_i)^2.
template <typename T>
double z_loss_forward(const T* logits, std::int64_t n, std::int64_t E, double coef);

/// dlogits[i,e] += coef * 2 * lse_i * softmax(logits_i)_e / n.
template <typename T>
void z_loss_backward(const T* logits, T* dlogits, std::int64_t n, std::int64_t E, double coef);

}  // namespace moeflex::ops
