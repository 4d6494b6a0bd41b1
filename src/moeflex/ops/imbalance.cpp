// Routing-spike injection: schedule parsing, the step schedule, and the logit skew.
// See imbalance.h for the method; everything here is deterministic.
#include "moeflex/ops/imbalance.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops {
namespace {

/// Stream of uniform01 reserved for the step set of mode prob.
constexpr std::uint64_t kImbalanceStream = 0x1D1BA1A4CEull;

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

[[noreturn]] void refuse(const std::string& text, const std::string& why) {
  throw ConfigError(fmt::format(
      "--inject-imbalance '{}': {} (expected 'every=N:ratio=R', 'prob=P:ratio=R:seed=S' or 'none')", text, why));
}

bool all_digits(const std::string& v) {
  return !v.empty() && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// Full-string decimal unsigned integer; false on junk or overflow.
bool parse_u64(const std::string& v, std::uint64_t& out) {
  if (!all_digits(v)) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (errno == ERANGE || end != v.c_str() + v.size()) return false;
  out = static_cast<std::uint64_t>(x);
  return true;
}

/// Full-string finite floating-point number; false otherwise.
bool parse_double(const std::string& v, double& out) {
  if (v.empty() || std::isspace(static_cast<unsigned char>(v[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (errno == ERANGE || end != v.c_str() + v.size() || !std::isfinite(x)) return false;
  out = x;
  return true;
}

void check_shape(std::int64_t E, std::int64_t k, int groups, const char* who) {
  if (groups < 1 || E < 1 || E % groups != 0)
    throw ConfigError(fmt::format("{}: {} experts cannot be split into {} equal groups (EP size)", who, E, groups));
  if (k < 1 || k > E)
    throw ConfigError(fmt::format("{}: num_experts_per_tok {} must be in [1, num_experts = {}]", who, k, E));
}

}  // namespace

ImbalanceSpec parse_imbalance(const std::string& text) {
  ImbalanceSpec spec;
  const std::string s = trim(text);
  if (s.empty() || s == "none") return spec;

  bool have_every = false, have_prob = false, have_ratio = false, have_seed = false;
  std::size_t start = 0;
  while (true) {
    const std::size_t colon = s.find(':', start);
    const std::string part = trim(s.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    const std::size_t eq = part.find('=');
    if (eq == std::string::npos) refuse(text, fmt::format("part '{}' is not of the form key=value", part));
    const std::string key = trim(part.substr(0, eq));
    const std::string val = trim(part.substr(eq + 1));
    auto once = [&](bool& seen) {
      if (seen) refuse(text, fmt::format("'{}' is given twice", key));
      seen = true;
    };
    if (key == "every") {
      once(have_every);
      std::uint64_t n = 0;
      if (!parse_u64(val, n) || n < 1 || n > 2147483647ull)
        refuse(text, fmt::format("every must be an integer >= 1, got '{}'", val));
      spec.every_n = static_cast<int>(n);
    } else if (key == "prob") {
      once(have_prob);
      double p = 0;
      if (!parse_double(val, p) || !(p > 0.0) || p > 1.0)
        refuse(text, fmt::format("prob must be a number in (0, 1], got '{}'", val));
      spec.prob = p;
    } else if (key == "ratio") {
      once(have_ratio);
      double r = 0;
      if (!parse_double(val, r) || !(r >= 1.0)) refuse(text, fmt::format("ratio must be a number >= 1, got '{}'", val));
      spec.ratio = r;
    } else if (key == "seed") {
      once(have_seed);
      std::uint64_t sd = 0;
      if (!parse_u64(val, sd)) refuse(text, fmt::format("seed must be a non-negative integer, got '{}'", val));
      spec.seed = sd;
    } else {
      refuse(text, fmt::format("unknown key '{}' in part '{}'", key, part));
    }
    if (colon == std::string::npos) break;
    start = colon + 1;
  }

  if (have_every && have_prob) refuse(text, "every and prob cannot both be given");
  if (!have_every && !have_prob) refuse(text, "one of every=N or prob=P is required");
  if (!have_ratio) refuse(text, "ratio=R is required");
  if (have_every && have_seed) refuse(text, "seed applies to prob=P only");
  if (have_prob && !have_seed) refuse(text, "prob=P requires seed=S");
  spec.mode = have_every ? ImbalanceSpec::Mode::every : ImbalanceSpec::Mode::prob;
  return spec;
}

std::string format_imbalance(const ImbalanceSpec& spec) {
  switch (spec.mode) {
    case ImbalanceSpec::Mode::every:
      return fmt::format("every={}:ratio={}", spec.every_n, spec.ratio);
    case ImbalanceSpec::Mode::prob:
      return fmt::format("prob={}:ratio={}:seed={}", spec.prob, spec.ratio, spec.seed);
    case ImbalanceSpec::Mode::none:
      break;
  }
  return "none";
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
