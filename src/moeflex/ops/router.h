// MoE router: scores over experts, top-k selection, and the two router losses.
//   logits, probs, dlogits: [n, E]; topk_idx: [n, k] int32; topk_w, dtopk_w: [n, k].
//   forward:  probs = softmax(logits) or sigmoid(logits) (RouterOptions::score);
//             topk_idx = the k largest choice scores probs + bias per row among the
//             allowed experts (all, or those of the topk_group best groups), ties broken
//             by the lower expert index, listed in decreasing choice score;
//             topk_w = those probs (without the bias), divided by their sum when
//             norm_topk_prob, times routed_scaling_factor.
//   backward: dlogits (=) from dtopk_w (through the scaling and the optional
//             renormalisation) plus an optional direct dprobs term (the aux loss), then
//             the softmax Jacobian or the sigmoid derivative. The selection (bias,
//             groups) is piecewise constant and has no gradient.
// The field names and rules are Hugging Face's DeepSeek-V2/V3 ones (scoring_func,
// topk_method, n_group, topk_group, routed_scaling_factor, e_score_correction_bias).
#pragma once
#include <cstdint>

namespace moeflex::ops {

/// How the router turns logits into scores (Hugging Face's scoring_func).
enum class RouterScore : std::uint8_t { softmax, sigmoid };

/// How group-limited routing scores a group of experts: DeepSeek-V2's
/// group_limited_greedy takes the group's best choice score, DeepSeek-V3's noaux_tc
/// the sum of its two best.
enum class GroupScore : std::uint8_t { max, top2_sum };

/// The router's rules besides the shape. The defaults are Mixtral's and Qwen's:
/// softmax, top-k of all experts, renormalised, unscaled, no bias.
struct RouterOptions {
  RouterScore score = RouterScore::softmax;
  bool norm_topk_prob = true;        ///< divide the top-k weights by their sum
  double routed_scaling_factor = 1;  ///< then multiply them by this
  /// Group-limited routing when n_group > 1 and topk_group < n_group: the experts
  /// form n_group contiguous groups of E / n_group, and a token's top-k come from
  /// its topk_group best groups (ties to the lower group).
  std::int64_t n_group = 1, topk_group = 1;
  GroupScore group_score = GroupScore::max;
  /// [E] added to the scores for the selection only (DeepSeek-V3's aux-loss-free
  /// e_score_correction_bias), or null. In the backend's memory (device on CUDA).
  const float* bias = nullptr;

  bool group_limited() const { return n_group > 1 && topk_group < n_group; }
};

/// probs (=), topk_idx (=), topk_w (=) as the header says. Throws Error when k > E,
/// or when the groups do not divide E or hold fewer than k experts.
template <typename T>
void router_forward(const T* logits, T* probs, std::int32_t* topk_idx, T* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, const RouterOptions& opt);

/// dlogits (=). dprobs_extra: [n, E] or null; added to the gradient reaching probs.
template <typename T>
void router_backward(const T* dtopk_w, const T* dprobs_extra, const T* probs, const std::int32_t* topk_idx,
                     T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, const RouterOptions& opt);

/// The softmax router of the defaults with or without renormalisation (tests, calibration).
template <typename T>
void router_forward(const T* logits, T* probs, std::int32_t* topk_idx, T* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, bool norm_topk_prob) {
  router_forward(logits, probs, topk_idx, topk_w, n, E, k, RouterOptions{.norm_topk_prob = norm_topk_prob});
}
template <typename T>
void router_backward(const T* dtopk_w, const T* dprobs_extra, const T* probs, const std::int32_t* topk_idx,
                     T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, bool norm_topk_prob) {
  router_backward(dtopk_w, dprobs_extra, probs, topk_idx, dlogits, n, E, k,
                  RouterOptions{.norm_topk_prob = norm_topk_prob});
}

/// Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4; Megatron's
/// switch_load_balancing_loss): coef * E * sum_e f_e * P_e, with
/// f_e = (assignments to e among the top-k) / (n*k) and P_e = mean_i probs[i,e];
/// with sigmoid scores, which do not sum to 1, P_e = mean_i probs[i,e] / sum_c probs[i,c]
/// (as Megatron normalises them for the aux loss). f is a constant for the gradient.
template <typename T>
double aux_loss_forward(const T* probs, const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                        std::int64_t k, double coef, RouterScore score = RouterScore::softmax);

/// dprobs[i,e] += coef * E * f_e / n (softmax); with sigmoid scores that gradient
/// passes back through the row's normalisation, which reads probs (else unused, may be null).
template <typename T>
void aux_loss_backward(const std::int32_t* topk_idx, const T* probs, T* dprobs, std::int64_t n, std::int64_t E,
                       std::int64_t k, double coef, RouterScore score = RouterScore::softmax);
/// The softmax router's aux-loss gradient, which needs no probs.
template <typename T>
void aux_loss_backward(const std::int32_t* topk_idx, T* dprobs, std::int64_t n, std::int64_t E, std::int64_t k,
                       double coef) {
  aux_loss_backward(topk_idx, static_cast<const T*>(nullptr), dprobs, n, E, k, coef, RouterScore::softmax);
}

/// Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): coef * mean_i logsumexp(logits_i)^2.
template <typename T>
double z_loss_forward(const T* logits, std::int64_t n, std::int64_t E, double coef);

/// dlogits[i,e] += coef * 2 * lse_i * softmax(logits_i)_e / n.
template <typename T>
void z_loss_backward(const T* logits, T* dlogits, std::int64_t n, std::int64_t E, double coef);

}  // namespace moeflex::ops
