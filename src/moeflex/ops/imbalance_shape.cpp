// Spike shapes of `--inject-imbalance`: which group is hot on a step and layer
// (skew_for), and the skew towards a target share per group (skew_router_to_shares).
// See imbalance.h; everything here is deterministic.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops {
namespace {

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

/// Each group's share: rank r (0 = the hot group `hot`) of `groups` by the shape.
std::vector<double> shape_shares(const ImbalanceSpec& spec, std::int64_t step, int layer, int groups, int hot) {
  using Shape = ImbalanceSpec::Shape;
  std::vector<double> w(at(groups), 1.0);
  switch (spec.shape) {
    case Shape::zero:
      w[at(hot)] = 0.0;
      break;
    case Shape::zipf:
      for (int r = 0; r < groups; ++r) w[at((hot + r) % groups)] = 1.0 / std::pow(double(r + 1), spec.shape_param);
      break;
    case Shape::dirichlet: {
      // A symmetric Dirichlet(a) draw: normalised Gamma(a, 1) variates, one engine per
      // (seed, step, layer) so that every rank draws the same shares.
      std::seed_seq seq{std::uint64_t(spec.seed), std::uint64_t(step), std::uint64_t(layer), std::uint64_t(0xD1C5)};
      std::mt19937_64 gen(seq);
      std::gamma_distribution<double> gamma(spec.shape_param, 1.0);
      for (double& x : w) x = gamma(gen);
      break;
    }
    case Shape::balanced:
    case Shape::hot:
    case Shape::replay:  // (replay_skew's)
      break;
  }
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  if (!(sum > 0)) std::fill(w.begin(), w.end(), 1.0 / groups);  // (a Dirichlet draw that underflowed)
  else for (double& x : w) x /= sum;
  return w;
}

/// Targets per group: round(share n k), the rounding rest to the largest remainders,
/// capped at `cap` with the excess to the groups with room, largest share first.
std::vector<std::int64_t> share_targets(const std::vector<double>& shares, std::int64_t total, std::int64_t cap) {
  const std::size_t g = shares.size();
  std::vector<std::int64_t> t(g);
  std::vector<std::pair<double, std::size_t>> rest;
  std::int64_t sum = 0;
  for (std::size_t i = 0; i < g; ++i) {
    const double exact = shares[i] * double(total);
    t[i] = std::min(cap, static_cast<std::int64_t>(std::floor(exact)));
    sum += t[i];
    rest.emplace_back(-(exact - std::floor(exact)) - shares[i], i);  // largest remainder, then share
  }
  std::sort(rest.begin(), rest.end());
  for (int pass = 0; pass < 2 && sum < total; ++pass)
    for (const auto& [key, i] : rest)
      while (sum < total && t[i] < cap && (pass == 1 || t[i] < std::ceil(shares[i] * double(total)))) ++t[i], ++sum;
  return t;
}

/// Shape replay: the recorded shares of the step (wrapping around) and layer.
RouterSkew replay_skew(const ImbalanceSpec& spec, std::int64_t step, int layer, int groups) {
  const auto& steps = spec.replay_shares;
  if (steps.empty())
    throw ConfigError(fmt::format("--inject-imbalance replay={}: the recorded shares were not loaded "
                                  "(train/imbalance_replay.h load_replay_shares)", spec.replay_path));
  const std::int64_t n = std::int64_t(steps.size());
  const auto& layers = steps[at(step >= 1 ? (step - 1) % n : 0)];
  RouterSkew skew;
  skew.groups = groups;
  if (layer < 0 || at(layer) >= layers.size() || layers[at(layer)].empty()) return skew;  // no MoE: no skew
  skew.shares = layers[at(layer)];
  if (int(skew.shares.size()) != groups)
    throw ConfigError(fmt::format("--inject-imbalance replay={}: {} recorded EP ranks, but this run has {} groups "
                                  "of experts", spec.replay_path, skew.shares.size(), groups));
  return skew;
}

}  // namespace

RouterSkew skew_for(const ImbalanceSpec& spec, std::int64_t step, int layer, std::int64_t E, int groups) {
  using Shape = ImbalanceSpec::Shape;
  if (spec.shape == Shape::replay) return replay_skew(spec, step, layer, groups);
  RouterSkew skew;
  skew.groups = spec.expert_level ? int(E) : groups;
  if (spec.hot >= skew.groups)
    throw ConfigError(fmt::format("--inject-imbalance: group {} does not exist: there are {} groups of experts ({})",
                                  spec.hot, skew.groups, spec.expert_level || groups == E ? "experts" : "EP ranks"));
  if (spec.shape == Shape::zero && skew.groups < 2)
    throw ConfigError("--inject-imbalance: zero=G needs at least 2 groups of experts (EP ranks, or experts)");
  std::int64_t h = spec.hot;
  if (spec.rotate > 0 && step >= 1) h += (step - 1) / spec.rotate;
  if (spec.per_layer) h += layer;
  skew.hot = static_cast<int>(h % skew.groups);
  if (spec.shape == Shape::hot) skew.ratio = spec.ratio;
  else skew.shares = shape_shares(spec, step, layer, skew.groups, skew.hot);
  return skew;
}

double target_imbalance(const ImbalanceSpec& spec, std::int64_t step, int layers, std::int64_t E, int groups) {
  if (spec.shape == ImbalanceSpec::Shape::hot) return spec.ratio;
  double most = 1.0;
  for (int l = 0; l < std::max(layers, 1); ++l) {
    const RouterSkew s = skew_for(spec, step, l, E, groups);
    if (s.shares.empty()) continue;  // (a replay's layer without MoE)
    most = std::max(most, *std::max_element(s.shares.begin(), s.shares.end()) * double(s.groups));
  }
  return most;
}

double skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, const RouterSkew& skew) {
  if (!skew.shares.empty()) return skew_router_to_shares(logits, n, E, k, skew.shares);
  if (skew.hot == 0 || !(skew.ratio > 1.0)) return skew_router_logits(logits, n, E, k, skew.groups, skew.ratio);
  // Group `hot` in the place of group 0: rotate each row's experts by hot * G, skew,
  // rotate back (softmax and top-k do not depend on the experts' positions, ties aside).
  const std::int64_t s = std::int64_t(skew.hot) * (E / skew.groups);
  std::vector<float> row(at(E));
  auto rotate = [&](std::int64_t by) {
    for (std::int64_t i = 0; i < n; ++i) {
      float* l = logits + i * E;
      for (std::int64_t e = 0; e < E; ++e) row[at(e)] = l[(e + by) % E];
      std::copy(row.begin(), row.end(), l);
    }
  };
  rotate(s);
  const double reached = skew_router_logits(logits, n, E, k, skew.groups, skew.ratio);
  rotate(E - s);
  return reached;
}

double skew_router_to_shares(float* logits, std::int64_t n, std::int64_t E, std::int64_t k,
                             const std::vector<double>& shares) {
  const int groups = int(shares.size());
  if (groups < 1 || E % groups != 0 || k < 1 || k > E)
    throw ConfigError(fmt::format("skew_router_to_shares: {} experts, top-{}, {} groups", E, k, groups));
  if (n <= 0) return 1.0;
  const std::int64_t G = E / groups;
  std::vector<float> probs(at(n * E)), w(at(n * k));
  std::vector<std::int32_t> idx(at(n * k));
  auto route = [&] { router_forward<float>(logits, probs.data(), idx.data(), w.data(), n, E, k, false); };
  route();
  std::vector<std::int64_t> left = share_targets(shares, n * k, n * std::min(k, G));
  std::vector<std::int32_t> order(at(E));
  std::vector<char> chosen(at(E));
  for (std::int64_t i = 0; i < n; ++i) {
    const float* p = probs.data() + i * E;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) { return p[x] > p[y]; });
    std::fill(chosen.begin(), chosen.end(), 0);
    std::int64_t got = 0;
    for (int pass = 0; pass < 2 && got < k; ++pass)  // pass 1: groups with target left
      for (std::int32_t e : order) {
        if (got == k) break;
        if (chosen[at(e)] || (pass == 0 && left[at(e / G)] <= 0)) continue;
        chosen[at(e)] = 1;
        --left[at(e / G)];
        ++got;
      }
    bool natural = true;
    for (std::int64_t j = 0; j < k; ++j) natural &= chosen[at(idx[at(i * k + j)])] != 0;
    if (natural) continue;
    float* l = logits + i * E;
    double min_chosen = INFINITY, max_rest = -INFINITY;
    for (std::int64_t e = 0; e < E; ++e)
      if (chosen[at(e)]) min_chosen = std::min(min_chosen, double(l[e]));
      else max_rest = std::max(max_rest, double(l[e]));
    const double C = max_rest - min_chosen + 1.0;
    if (!std::isfinite(C)) continue;
    for (std::int64_t e = 0; e < E; ++e)
      if (chosen[at(e)]) l[e] = static_cast<float>(double(l[e]) + C);
  }
  route();
  return group_load_imbalance(idx.data(), n, E, k, groups);
}

}  // namespace moeflex::ops
