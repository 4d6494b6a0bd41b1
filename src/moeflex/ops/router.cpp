// MoE router kernels: scores + (group-limited) top-k forward, backward, aux and z losses.
//   logits, probs, dlogits, dprobs: [n, E]; topk_idx: [n, k] int32; topk_w, dtopk_w: [n, k].
//   router_forward:    probs = softmax|sigmoid(logits), topk_idx / topk_w = top-k of probs + bias  (=)
//   router_backward:   dlogits = J_score^T (scatter(dtopk_w through scale, renorm) + dprobs_extra)  (=)
//   aux_loss_backward: dprobs  += coef * E * f_e / n (through the row normalisation if sigmoid) (+=)
//   z_loss_backward:   dlogits += coef * 2 * lse_i * softmax(logits_i) / n            (+=)
// Every row is processed by one thread with a sequential inner loop, and the
// cross-row sums of the losses go through fixed-size chunks added in chunk order,
// so results are bit-identical for any thread count.
#include "moeflex/ops/router.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex::ops {
namespace {

/// Rows per partial sum of a cross-row reduction; fixed so the summation order
/// does not depend on the thread count.
constexpr std::int64_t kReduceChunkRows = 256;

/// sum_i row_value(i) for i < n, through chunked partial sums added in chunk order.
template <typename F>
double deterministic_row_sum(std::int64_t n, F row_value) {
  const std::int64_t chunks = (n + kReduceChunkRows - 1) / kReduceChunkRows;
  std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t end = std::min(n, (c + 1) * kReduceChunkRows);
    double s = 0.0;
    for (std::int64_t i = c * kReduceChunkRows; i < end; ++i) s += row_value(i);
    partial[static_cast<std::size_t>(c)] = s;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

/// logsumexp of one row, computed as max + log(sum exp(x - max)).
template <typename T>
double row_logsumexp(const T* x, std::int64_t E) {
  double m = static_cast<double>(x[0]);
  for (std::int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(x[e]));
  double s = 0.0;
  for (std::int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(x[e]) - m);
  return m + std::log(s);
}

/// f_e * n * k: assignments to each expert among the top-k, before any capacity drop.
std::vector<std::int64_t> assignment_counts(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                                            std::int64_t k) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0);
  for (std::int64_t a = 0; a < n * k; ++a) {
    const std::int32_t e = topk_idx[a];
    if (e < 0 || e >= E)
      throw Error("router: topk_idx[" + std::to_string(a) + "] = " + std::to_string(e) +
                  " is outside [0, " + std::to_string(E) + ")");
    ++counts[static_cast<std::size_t>(e)];
  }
  return counts;
}

void check_router_options(std::int64_t E, std::int64_t k, const RouterOptions& opt) {
  if (k > E)
    throw Error("router: num_experts_per_tok " + std::to_string(k) + " exceeds num_experts " +
                std::to_string(E));
  if (!opt.group_limited()) return;
  if (opt.n_group <= 0 || E % opt.n_group != 0 || opt.topk_group < 1)
    throw Error("router: n_group " + std::to_string(opt.n_group) + " must divide num_experts " +
                std::to_string(E) + " (topk_group " + std::to_string(opt.topk_group) + " >= 1)");
  const std::int64_t G = E / opt.n_group;
  if (opt.topk_group * G < k)
    throw Error("router: topk_group " + std::to_string(opt.topk_group) + " groups of " + std::to_string(G) +
                " experts hold fewer than num_experts_per_tok " + std::to_string(k));
  if (opt.group_score == GroupScore::top2_sum && G < 2)
    throw Error("router: noaux_tc scores a group by its two best experts, but n_group " +
                std::to_string(opt.n_group) + " leaves " + std::to_string(G) + " per group");
}

/// p (=) softmax(l) or sigmoid(l) over one row of E logits.
template <typename T>
void row_scores(const T* l, T* p, std::int64_t E, RouterScore score) {
  if (score == RouterScore::sigmoid) {
    for (std::int64_t e = 0; e < E; ++e) p[e] = T(1) / (T(1) + std::exp(-l[e]));
    return;
  }
  T m = l[0];
  for (std::int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  T s = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    p[e] = std::exp(l[e] - m);
    s += p[e];
  }
  const T inv = T(1) / s;
  for (std::int64_t e = 0; e < E; ++e) p[e] *= inv;
}

/// idx, val (=) the k largest of v[e] over the e with allowed(e), in decreasing order,
/// ties to the lower index: insertion into a sorted list of length k, scanning in
/// index order and inserting after every entry >= the new one.
template <typename T, typename Allowed>
void select_topk(const T* v, std::int64_t E, std::int64_t k, std::int32_t* idx, T* val, Allowed allowed) {
  std::int64_t filled = 0;
  for (std::int64_t e = 0; e < E && k > 0; ++e) {
    if (!allowed(e)) continue;
    const T ve = v[e];
    if (filled == k && !(ve > val[k - 1])) continue;
    std::int64_t pos = std::min(filled, k - 1);
    while (pos > 0 && val[pos - 1] < ve) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = ve;
    idx[pos] = static_cast<std::int32_t>(e);
    if (filled < k) ++filled;
  }
}

/// 1 for the experts a row may choose: all, or, with group-limited routing, those
/// of the topk_group groups of best group score (ties to the lower group).
template <typename T>
std::vector<char> allowed_experts(const T* c, std::int64_t E, const RouterOptions& opt) {
  std::vector<char> allowed(static_cast<std::size_t>(E), opt.group_limited() ? 0 : 1);
  if (!opt.group_limited()) return allowed;
  const std::int64_t G = E / opt.n_group;
  std::vector<T> group(static_cast<std::size_t>(opt.n_group));
  for (std::int64_t g = 0; g < opt.n_group; ++g) {
    std::int32_t best_i[2];
    T best[2];
    const std::int64_t take = opt.group_score == GroupScore::top2_sum ? 2 : 1;
    select_topk(c + g * G, G, take, best_i, best, [](std::int64_t) { return true; });
    group[std::size_t(g)] = take == 2 ? best[0] + best[1] : best[0];
  }
  std::vector<std::int32_t> gi(static_cast<std::size_t>(opt.topk_group));
  std::vector<T> gv(static_cast<std::size_t>(opt.topk_group));
  select_topk(group.data(), opt.n_group, opt.topk_group, gi.data(), gv.data(), [](std::int64_t) { return true; });
  for (std::int32_t g : gi)
    for (std::int64_t e = g * G; e < (g + 1) * G; ++e) allowed[std::size_t(e)] = 1;
  return allowed;
}

}  // namespace

template <typename T>
void router_forward(const T* logits, T* probs, std::int32_t* topk_idx, T* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, const RouterOptions& opt) {
  check_router_options(E, k, opt);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    T* p = probs + i * E;
    row_scores(logits + i * E, p, E, opt.score);
    std::int32_t* idx = topk_idx + i * k;
    T* w = topk_w + i * k;
    if (!opt.bias && !opt.group_limited()) {
      select_topk(p, E, k, idx, w, [](std::int64_t) { return true; });
    } else {
      // The choice scores (bias added) and, with groups, which experts may be chosen.
      std::vector<T> c(static_cast<std::size_t>(E));
      for (std::int64_t e = 0; e < E; ++e) c[std::size_t(e)] = p[e] + (opt.bias ? T(opt.bias[e]) : T(0));
      const std::vector<char> allowed = allowed_experts(c.data(), E, opt);
      select_topk(c.data(), E, k, idx, w, [&](std::int64_t e) { return allowed[std::size_t(e)] != 0; });
      for (std::int64_t j = 0; j < k; ++j) w[j] = p[idx[j]];  // the weights are the unbiased scores
    }
    T scale = static_cast<T>(opt.routed_scaling_factor);
    if (opt.norm_topk_prob) {
      T sw = 0;
      for (std::int64_t j = 0; j < k; ++j) sw += w[j];
      scale /= sw;
    }
    if (scale != T(1))
      for (std::int64_t j = 0; j < k; ++j) w[j] *= scale;
  }
}

template <typename T>
void router_backward(const T* dtopk_w, const T* dprobs_extra, const T* probs, const std::int32_t* topk_idx,
                     T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, const RouterOptions& opt) {
  const T scaling = static_cast<T>(opt.routed_scaling_factor);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* p = probs + i * E;
    const T* dw = dtopk_w + i * k;
    const std::int32_t* idx = topk_idx + i * k;
    T* g = dlogits + i * E;  // holds dprobs for this row until the scores' derivative
    if (dprobs_extra) {
      const T* dx = dprobs_extra + i * E;
      for (std::int64_t e = 0; e < E; ++e) g[e] = dx[e];
    } else {
      for (std::int64_t e = 0; e < E; ++e) g[e] = 0;
    }
    if (opt.norm_topk_prob) {
      // w_j = c p_j / S  =>  dp_j = c (dw_j - sum_l dw_l p_l / S) / S.
      T S = 0;
      for (std::int64_t j = 0; j < k; ++j) S += p[idx[j]];
      const T inv_S = T(1) / S;
      T dot = 0;
      for (std::int64_t j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] * inv_S);
      for (std::int64_t j = 0; j < k; ++j) g[idx[j]] += scaling * (dw[j] - dot) * inv_S;
    } else {
      for (std::int64_t j = 0; j < k; ++j) g[idx[j]] += scaling * dw[j];
    }
    if (opt.score == RouterScore::sigmoid) {
      for (std::int64_t e = 0; e < E; ++e) g[e] *= p[e] * (T(1) - p[e]);  // d sigmoid = p (1 - p)
    } else {
      // Softmax Jacobian: dlogit_e = p_e (dp_e - sum_c p_c dp_c).
      T pg = 0;
      for (std::int64_t e = 0; e < E; ++e) pg += p[e] * g[e];
      for (std::int64_t e = 0; e < E; ++e) g[e] = p[e] * (g[e] - pg);
    }
  }
}

template <typename T>
double aux_loss_forward(const T* probs, const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                        std::int64_t k, double coef, RouterScore score) {
  if (n == 0) return 0.0;
  const auto counts = assignment_counts(topk_idx, n, E, k);
  // coef * E * sum_e f_e P_e = coef * E / (n * n*k) * sum_i sum_e count_e p_ie (/ sum_c p_ic).
  const double total = deterministic_row_sum(n, [&](std::int64_t i) {
    const T* p = probs + i * E;
    double s = 0.0, row = 0.0;
    for (std::int64_t e = 0; e < E; ++e) s += static_cast<double>(counts[static_cast<std::size_t>(e)]) * p[e];
    if (score == RouterScore::softmax) return s;
    for (std::int64_t e = 0; e < E; ++e) row += static_cast<double>(p[e]);
    return s / row;
  });
  return coef * static_cast<double>(E) * total / (static_cast<double>(n) * static_cast<double>(n * k));
}

template <typename T>
void aux_loss_backward(const std::int32_t* topk_idx, const T* probs, T* dprobs, std::int64_t n, std::int64_t E,
                       std::int64_t k, double coef, RouterScore score) {
  if (n == 0) return;
  if (score == RouterScore::sigmoid && !probs) throw Error("router: the sigmoid aux loss's gradient needs probs");
  const auto counts = assignment_counts(topk_idx, n, E, k);
  std::vector<T> g(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) {
    const double f = static_cast<double>(counts[static_cast<std::size_t>(e)]) / static_cast<double>(n * k);
    g[static_cast<std::size_t>(e)] = static_cast<T>(coef * static_cast<double>(E) * f / static_cast<double>(n));
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    T* d = dprobs + i * E;
    if (score == RouterScore::softmax) {
      for (std::int64_t e = 0; e < E; ++e) d[e] += g[static_cast<std::size_t>(e)];
      continue;
    }
    // q_e = p_e / S  =>  dp_e = (g_e - sum_c g_c q_c) / S.
    const T* p = probs + i * E;
    T S = 0, gq = 0;
    for (std::int64_t e = 0; e < E; ++e) S += p[e];
    for (std::int64_t e = 0; e < E; ++e) gq += g[static_cast<std::size_t>(e)] * p[e];
    gq /= S;
    for (std::int64_t e = 0; e < E; ++e) d[e] += (g[static_cast<std::size_t>(e)] - gq) / S;
  }
}

template <typename T>
double z_loss_forward(const T* logits, std::int64_t n, std::int64_t E, double coef) {
  if (n == 0) return 0.0;
  const double total = deterministic_row_sum(n, [&](std::int64_t i) {
    const double lse = row_logsumexp(logits + i * E, E);
    return lse * lse;
  });
  return coef * total / static_cast<double>(n);
}

template <typename T>
void z_loss_backward(const T* logits, T* dlogits, std::int64_t n, std::int64_t E, double coef) {
  if (n == 0) return;
  const double scale = coef * 2.0 / static_cast<double>(n);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* l = logits + i * E;
    T* d = dlogits + i * E;
    const double lse = row_logsumexp(l, E);
    const double c = scale * lse;
    for (std::int64_t e = 0; e < E; ++e)
      d[e] += static_cast<T>(c * std::exp(static_cast<double>(l[e]) - lse));
  }
}

#define MOEFLEX_INSTANTIATE_ROUTER(T)                                                                          \
  template void router_forward<T>(const T*, T*, std::int32_t*, T*, std::int64_t, std::int64_t, std::int64_t,  \
                                  const RouterOptions&);                                                       \
  template void router_backward<T>(const T*, const T*, const T*, const std::int32_t*, T*, std::int64_t,        \
                                   std::int64_t, std::int64_t, const RouterOptions&);                          \
  template double aux_loss_forward<T>(const T*, const std::int32_t*, std::int64_t, std::int64_t, std::int64_t, \
                                      double, RouterScore);                                                    \
  template void aux_loss_backward<T>(const std::int32_t*, const T*, T*, std::int64_t, std::int64_t,           \
                                     std::int64_t, double, RouterScore);                                       \
  template double z_loss_forward<T>(const T*, std::int64_t, std::int64_t, double);                             \
  template void z_loss_backward<T>(const T*, T*, std::int64_t, std::int64_t, double);

MOEFLEX_INSTANTIATE_ROUTER(float)
MOEFLEX_INSTANTIATE_ROUTER(double)
#undef MOEFLEX_INSTANTIATE_ROUTER

}  // namespace moeflex::ops
