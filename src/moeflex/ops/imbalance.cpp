// Routing-spike injection: schedule parsing, the step schedule, and the logit skew.
// See imbalance.h for the method; everything here is deterministic.
#include "moeflex/ops/imbalance.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/core/key_values.h"
#include "moeflex/core/rng.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops {
namespace {

/// Stream of uniform01 reserved for the step set of mode prob.
constexpr std::uint64_t kImbalanceStream = 0x1D1BA1A4CEull;

[[noreturn]] void refuse(const std::string& text, const std::string& why) {
  throw ConfigError(fmt::format(
      "--inject-imbalance '{}': {} (expected 'every=N:ratio=R', 'prob=P:ratio=R:seed=S', 'preset=NAME' or 'none', "
      "with shape keys hot=G, rotate=N, per_layer=1, level=expert, zero=G, zipf=S, dirichlet=A, replay=PATH)",
      text, why));
}

void check_shape(std::int64_t E, std::int64_t k, int groups, const char* who) {
  if (groups < 1 || E < 1 || E % groups != 0)
    throw ConfigError(fmt::format("{}: {} experts cannot be split into {} equal groups (EP size)", who, E, groups));
  if (k < 1 || k > E)
    throw ConfigError(fmt::format("{}: num_experts_per_tok {} must be in [1, num_experts = {}]", who, k, E));
}

}  // namespace

const ImbalancePreset kImbalancePresets[6] = {
    {"balanced", "every=1:balanced=1"},
    {"hot-expert", "every=4:ratio=4:level=expert"},
    {"hot-rank", "every=4:ratio=2"},
    {"zero-rank", "every=4:zero=0"},
    {"rotating", "every=1:ratio=2:rotate=2"},
    {"bursts", "prob=0.25:ratio=3:seed=1"},
};

namespace {

/// The parts of a spec as key -> value, in order; refuses malformed or repeated keys.
std::vector<std::pair<std::string, std::string>> split_parts(const std::string& text, const std::string& s) {
  std::string why;
  auto parts = split_key_values(s, why);
  if (!parts) refuse(text, why);
  return *parts;
}

int parse_count(const std::string& text, const std::string& key, const std::string& val, std::uint64_t least) {
  std::uint64_t n = 0;
  if (!parse_u64(val, n) || n < least || n > 2147483647ull)
    refuse(text, fmt::format("{} must be an integer >= {}, got '{}'", key, least, val));
  return static_cast<int>(n);
}

double parse_positive(const std::string& text, const std::string& key, const std::string& val) {
  double x = 0;
  if (!parse_double(val, x) || !(x > 0.0)) refuse(text, fmt::format("{} must be a number > 0, got '{}'", key, val));
  return x;
}

/// Sets the field of one key; `shapes` counts the shape keys given (ratio, zero,
/// zipf, dirichlet, balanced, replay).
void apply_key(ImbalanceSpec& spec, const std::string& text, const std::string& key, const std::string& val,
               int& shapes) {
  using Shape = ImbalanceSpec::Shape;
  if (key == "every") {
    spec.mode = ImbalanceSpec::Mode::every;
    spec.every_n = parse_count(text, key, val, 1);
  } else if (key == "prob") {
    double p = 0;
    if (!parse_double(val, p) || !(p > 0.0) || p > 1.0)
      refuse(text, fmt::format("prob must be a number in (0, 1], got '{}'", val));
    spec.mode = ImbalanceSpec::Mode::prob;
    spec.prob = p;
  } else if (key == "ratio") {
    double r = 0;
    if (!parse_double(val, r) || !(r >= 1.0)) refuse(text, fmt::format("ratio must be a number >= 1, got '{}'", val));
    spec.ratio = r;
    spec.shape = Shape::hot;
    ++shapes;
  } else if (key == "seed") {
    std::uint64_t sd = 0;
    if (!parse_u64(val, sd)) refuse(text, fmt::format("seed must be a non-negative integer, got '{}'", val));
    spec.seed = sd;
  } else if (key == "hot" || key == "zero") {
    spec.hot = parse_count(text, key, val, 0);
    if (key == "zero") spec.shape = Shape::zero, ++shapes;
  } else if (key == "zipf" || key == "dirichlet") {
    spec.shape = key == "zipf" ? Shape::zipf : Shape::dirichlet;
    spec.shape_param = parse_positive(text, key, val);
    ++shapes;
  } else if (key == "balanced" || key == "per_layer") {
    if (val != "0" && val != "1") refuse(text, fmt::format("{} must be 0 or 1, got '{}'", key, val));
    if (key == "per_layer") spec.per_layer = val == "1";
    else if (val == "1") spec.shape = Shape::balanced, ++shapes;
  } else if (key == "replay") {
    if (val.empty()) refuse(text, "replay needs the path of a loads.jsonl or of a run directory holding one");
    spec.shape = Shape::replay;
    spec.replay_path = val;
    ++shapes;
  } else if (key == "rotate") {
    spec.rotate = parse_count(text, key, val, 1);
  } else if (key == "level") {
    if (val != "rank" && val != "expert") refuse(text, fmt::format("level must be rank or expert, got '{}'", val));
    spec.expert_level = val == "expert";
  } else {
    refuse(text, fmt::format("unknown key '{}' in part '{}'", key, key + "=" + val));
  }
}

}  // namespace

ImbalanceSpec parse_imbalance(const std::string& text) {
  ImbalanceSpec spec;
  const std::string s = trim(text);
  if (s.empty() || s == "none") return spec;
  auto parts = split_parts(text, s);
  std::map<std::string, bool> given;
  for (const auto& [k, v] : parts) given[k] = true;
  // A preset first: its keys are what the others override.
  for (const auto& [k, v] : parts) {
    if (k != "preset") continue;
    const ImbalancePreset* found = nullptr;
    for (const ImbalancePreset& p : kImbalancePresets)
      if (v == p.name) found = &p;
    if (!found) {
      std::string names;
      for (const ImbalancePreset& p : kImbalancePresets) names += fmt::format("{}{}", names.empty() ? "" : ", ", p.name);
      refuse(text, fmt::format("unknown preset '{}' (presets: {})", v, names));
    }
    const auto is_shape = [](const std::string& k) {
      return k == "ratio" || k == "zero" || k == "zipf" || k == "dirichlet" || k == "balanced" || k == "replay";
    };
    bool user_shape = false;
    for (const auto& kv : parts) user_shape |= is_shape(kv.first);
    std::vector<std::pair<std::string, std::string>> merged;
    for (auto& kv : split_parts(found->spec, found->spec)) {
      const bool mode_key = kv.first == "every" || kv.first == "prob" || kv.first == "seed";
      const bool overridden = given.count(kv.first) || (mode_key && (given.count("every") || given.count("prob"))) ||
                              (user_shape && is_shape(kv.first));
      if (!overridden) merged.push_back(kv);
    }
    for (auto& kv : parts)
      if (kv.first != "preset") merged.push_back(kv);
    parts = std::move(merged);
  }
  int shapes = 0;
  bool have_every = false, have_prob = false, have_seed = false;
  for (const auto& [k, v] : parts) {
    apply_key(spec, text, k, v, shapes);
    have_every |= k == "every";
    have_prob |= k == "prob";
    have_seed |= k == "seed";
  }
  using Shape = ImbalanceSpec::Shape;
  if (have_every && have_prob) refuse(text, "every and prob cannot both be given");
  if (!have_every && !have_prob && !spec.replay_path.empty()) {
    spec.mode = ImbalanceSpec::Mode::every;  // a replay skews every step unless told otherwise
    spec.every_n = 1;
  } else if (!have_every && !have_prob) {
    refuse(text, "one of every=N or prob=P is required");
  }
  if (shapes == 0)
    refuse(text, "ratio=R is required (or a shape: zero=G, zipf=S, dirichlet=A, balanced=1, replay=PATH)");
  if (shapes > 1) refuse(text, "give one of ratio, zero, zipf, dirichlet, balanced and replay");
  const bool seeded = have_prob || spec.shape == Shape::dirichlet;
  if (have_seed && !seeded) refuse(text, "seed applies to prob=P and dirichlet=A only");
  if (seeded && !have_seed) refuse(text, fmt::format("{} requires seed=S", have_prob ? "prob=P" : "dirichlet=A"));
  if ((spec.shape == Shape::dirichlet || spec.shape == Shape::balanced || spec.shape == Shape::replay) &&
      (spec.rotate || spec.per_layer || spec.hot))
    refuse(text, "hot, rotate and per_layer apply to ratio, zero and zipf only");
  if (spec.shape == Shape::replay && spec.expert_level)
    refuse(text, "replay gives the shares of the recorded EP ranks: level=expert does not apply");
  if (spec.shape != Shape::hot) spec.ratio = 1.0;
  return spec;
}

std::string format_imbalance(const ImbalanceSpec& spec) {
  using Shape = ImbalanceSpec::Shape;
  std::string out;
  switch (spec.mode) {
    case ImbalanceSpec::Mode::every:
      out = fmt::format("every={}", spec.every_n);
      break;
    case ImbalanceSpec::Mode::prob:
      out = fmt::format("prob={}", spec.prob);
      break;
    case ImbalanceSpec::Mode::none:
      return "none";
  }
  switch (spec.shape) {
    case Shape::hot: out += fmt::format(":ratio={}", spec.ratio); break;
    case Shape::zero: out += fmt::format(":zero={}", spec.hot); break;
    case Shape::zipf: out += fmt::format(":zipf={}", spec.shape_param); break;
    case Shape::dirichlet: out += fmt::format(":dirichlet={}", spec.shape_param); break;
    case Shape::balanced: out += ":balanced=1"; break;
    case Shape::replay: out += fmt::format(":replay={}", spec.replay_path); break;
  }
  if (spec.mode == ImbalanceSpec::Mode::prob || spec.shape == Shape::dirichlet) out += fmt::format(":seed={}", spec.seed);
  if (spec.hot && spec.shape != Shape::zero) out += fmt::format(":hot={}", spec.hot);
  if (spec.rotate) out += fmt::format(":rotate={}", spec.rotate);
  if (spec.per_layer) out += ":per_layer=1";
  if (spec.expert_level) out += ":level=expert";
  return out;
}

bool imbalance_active(const ImbalanceSpec& spec, std::int64_t step) {
  if (step < 1) return false;
  switch (spec.mode) {
    case ImbalanceSpec::Mode::every:
      return spec.every_n >= 1 && step % spec.every_n == 0;
    case ImbalanceSpec::Mode::prob:
      return uniform01(spec.seed, kImbalanceStream, static_cast<std::uint64_t>(step)) < spec.prob;
    case ImbalanceSpec::Mode::none:
      break;
  }
  return false;
}

double max_imbalance_ratio(std::int64_t E, std::int64_t k, int groups) {
  check_shape(E, k, groups, "max_imbalance_ratio");
  const std::int64_t G = E / groups;
  return double(groups) * double(std::min(k, G)) / double(k);
}

double group_load_imbalance(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                            int groups) {
  check_shape(E, k, groups, "group_load_imbalance");
  if (n * k == 0) return 1.0;
  const std::int64_t G = E / groups;
  std::vector<std::int64_t> load(static_cast<std::size_t>(groups), 0);
  for (std::int64_t a = 0; a < n * k; ++a) {
    const std::int32_t e = topk_idx[a];
    if (e < 0 || e >= E)
      throw Error(fmt::format("group_load_imbalance: topk_idx[{}] = {} is outside [0, {})", a, e, E));
    ++load[static_cast<std::size_t>(e / G)];
  }
  const std::int64_t mx = *std::max_element(load.begin(), load.end());
  return double(mx) * double(groups) / double(n * k);
}

double skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, int groups,
                          double ratio) {
  check_shape(E, k, groups, "skew_router_logits");
  if (n < 0) throw Error(fmt::format("skew_router_logits: negative token count {}", n));
  if (n == 0) return 1.0;
  const std::int64_t G = E / groups;
  const std::int64_t b = std::min(k, G);  // most assignments one token can send to one group

  std::vector<float> probs(static_cast<std::size_t>(n * E)), w(static_cast<std::size_t>(n * k));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n * k));
  auto route = [&] { router_forward<float>(logits, probs.data(), idx.data(), w.data(), n, E, k, false); };
  route();
  if (!(ratio > 1.0)) return group_load_imbalance(idx.data(), n, E, k, groups);

  // c_i: natural assignments of token i to group 0.
  std::vector<std::int64_t> c(static_cast<std::size_t>(n), 0);
  std::int64_t natural = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t ci = 0;
    for (std::int64_t j = 0; j < k; ++j) ci += idx[static_cast<std::size_t>(i * k + j)] < G ? 1 : 0;
    c[static_cast<std::size_t>(i)] = ci;
    natural += ci;
  }
  const double mean = double(n * k) / double(groups);
  const std::int64_t target = std::min(static_cast<std::int64_t>(std::llround(ratio * mean)), n * b);
  std::int64_t missing = target - natural;
  if (missing <= 0) return group_load_imbalance(idx.data(), n, E, k, groups);

  std::vector<std::int32_t> order(static_cast<std::size_t>(G));
  std::vector<char> boosted(static_cast<std::size_t>(E));
  for (std::int64_t i = 0; i < n && missing > 0; ++i) {
    const std::int64_t ci = c[static_cast<std::size_t>(i)];
    const std::int64_t add = std::min(b - ci, missing);
    if (add <= 0) continue;
    const std::int64_t m = ci + add;
    missing -= add;

    float* l = logits + i * E;
    const float* p = probs.data() + i * E;
    // Group 0's experts by decreasing probability, ties to the lower index (the
    // router's order); its first ci are the ones the token already uses.
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) { return p[x] > p[y]; });
    std::fill(boosted.begin(), boosted.end(), 0);
    double min_boost = INFINITY, max_rest = -INFINITY;
    for (std::int64_t r = 0; r < m; ++r) {
      boosted[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])] = 1;
      min_boost = std::min(min_boost, double(l[order[static_cast<std::size_t>(r)]]));
    }
    for (std::int64_t e = 0; e < E; ++e)
      if (!boosted[static_cast<std::size_t>(e)]) max_rest = std::max(max_rest, double(l[e]));
    // m < E here (add > 0 implies groups > 1), so max_rest is finite for finite logits.
    const double C = max_rest - min_boost + 1.0;
    if (!std::isfinite(C) || C <= 0.0) continue;
    for (std::int64_t e = 0; e < E; ++e)
      if (boosted[static_cast<std::size_t>(e)]) l[e] = static_cast<float>(double(l[e]) + C);
  }

  route();
  return group_load_imbalance(idx.data(), n, E, k, groups);
}

}  // namespace moeflex::ops
