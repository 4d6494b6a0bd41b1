// Routing-spike injection: --inject-imbalance parsing, the schedule of skewed steps,
// and the router-logit skew (checked by routing the skewed logits with router_forward
// and counting the load of each expert group).
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/ops/router.h"
#include "moeflex/train/imbalance_replay.h"
#include "scratch_dir.h"

namespace moeflex::test {
namespace {

using ops::ImbalanceSpec;

// ---------------------------------------------------------------------------
// Parsing

TEST(ImbalanceParse, AcceptsEvery) {
  const ImbalanceSpec s = ops::parse_imbalance("every=10:ratio=2.6");
  EXPECT_EQ(s.mode, ImbalanceSpec::Mode::every);
  EXPECT_EQ(s.every_n, 10);
  EXPECT_DOUBLE_EQ(s.ratio, 2.6);
  const ImbalanceSpec t = ops::parse_imbalance(" ratio=1:every=1 ");
  EXPECT_EQ(t.mode, ImbalanceSpec::Mode::every);
  EXPECT_EQ(t.every_n, 1);
  EXPECT_DOUBLE_EQ(t.ratio, 1.0);
}

TEST(ImbalanceParse, AcceptsProb) {
  const ImbalanceSpec s = ops::parse_imbalance("prob=0.25:ratio=3:seed=7");
  EXPECT_EQ(s.mode, ImbalanceSpec::Mode::prob);
  EXPECT_DOUBLE_EQ(s.prob, 0.25);
  EXPECT_DOUBLE_EQ(s.ratio, 3.0);
  EXPECT_EQ(s.seed, 7u);
  const ImbalanceSpec t = ops::parse_imbalance("seed=18446744073709551615:prob=1:ratio=1.5");
  EXPECT_EQ(t.mode, ImbalanceSpec::Mode::prob);
  EXPECT_DOUBLE_EQ(t.prob, 1.0);
  EXPECT_EQ(t.seed, 18446744073709551615ull);
}

TEST(ImbalanceParse, AcceptsNone) {
  EXPECT_EQ(ops::parse_imbalance("").mode, ImbalanceSpec::Mode::none);
  EXPECT_EQ(ops::parse_imbalance("none").mode, ImbalanceSpec::Mode::none);
  EXPECT_EQ(ops::parse_imbalance("  none ").mode, ImbalanceSpec::Mode::none);
}

TEST(ImbalanceParse, FormatRoundTrips) {
  for (const char* text : {"every=10:ratio=2.6", "prob=0.25:ratio=3:seed=7", "none"}) {
    EXPECT_EQ(ops::format_imbalance(ops::parse_imbalance(text)), text);
  }
}

/// Expects parse_imbalance(text) to throw ConfigError whose message contains `part`.
void expect_refused(const std::string& text, const std::string& part) {
  try {
    ops::parse_imbalance(text);
    ADD_FAILURE() << "accepted '" << text << "'";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(part), std::string::npos) << "message for '" << text << "': " << msg;
    EXPECT_NE(msg.find("--inject-imbalance"), std::string::npos) << msg;
  }
}

TEST(ImbalanceParse, RefusesWithMessages) {
  expect_refused("every=0:ratio=2", "every must be an integer >= 1, got '0'");
  expect_refused("every=-3:ratio=2", "every must be an integer >= 1, got '-3'");
  expect_refused("every=2.5:ratio=2", "every must be an integer >= 1, got '2.5'");
  expect_refused("every=x:ratio=2", "got 'x'");
  expect_refused("every=10:ratio=0.5", "ratio must be a number >= 1, got '0.5'");
  expect_refused("every=10:ratio=nan", "ratio must be a number >= 1, got 'nan'");
  expect_refused("every=10:ratio=2abc", "got '2abc'");
  expect_refused("every=10:ratio=", "ratio must be a number >= 1, got ''");
  expect_refused("prob=0:ratio=2:seed=1", "prob must be a number in (0, 1], got '0'");
  expect_refused("prob=1.5:ratio=2:seed=1", "prob must be a number in (0, 1], got '1.5'");
  expect_refused("prob=0.5:ratio=2:seed=-1", "seed must be a non-negative integer, got '-1'");
  expect_refused("prob=0.5:ratio=2", "prob=P requires seed=S");
  expect_refused("every=10:ratio=2:seed=3", "seed applies to prob=P and dirichlet=A only");
  expect_refused("every=10", "ratio=R is required");
  expect_refused("ratio=2", "one of every=N or prob=P is required");
  expect_refused("every=2:prob=0.5:ratio=2:seed=1", "every and prob cannot both be given");
  expect_refused("every=2:every=3:ratio=2", "'every' is given twice");
  expect_refused("foo=1:ratio=2", "unknown key 'foo'");
  expect_refused("every=10:ratio=2:", "part '' is not of the form key=value");
  expect_refused("every10:ratio=2", "part 'every10' is not of the form key=value");
  expect_refused("always", "part 'always'");
}

// ---------------------------------------------------------------------------
// Schedule

TEST(ImbalanceSchedule, EveryNthStep) {
  const ImbalanceSpec s = ops::parse_imbalance("every=10:ratio=2");
  EXPECT_FALSE(ops::imbalance_active(s, 0));
  EXPECT_FALSE(ops::imbalance_active(s, -10));
  std::vector<std::int64_t> on;
  for (std::int64_t step = 1; step <= 35; ++step)
    if (ops::imbalance_active(s, step)) on.push_back(step);
  EXPECT_EQ(on, (std::vector<std::int64_t>{10, 20, 30}));
  const ImbalanceSpec one = ops::parse_imbalance("every=1:ratio=2");
  for (std::int64_t step = 1; step <= 20; ++step) EXPECT_TRUE(ops::imbalance_active(one, step));
}

TEST(ImbalanceSchedule, NoneNeverActive) {
  const ImbalanceSpec s = ops::parse_imbalance("none");
  for (std::int64_t step = 0; step <= 100; ++step) EXPECT_FALSE(ops::imbalance_active(s, step));
}

TEST(ImbalanceSchedule, ProbIsDeterministicAndNearP) {
  const ImbalanceSpec a = ops::parse_imbalance("prob=0.3:ratio=2:seed=42");
  const ImbalanceSpec b = ops::parse_imbalance("prob=0.3:ratio=2:seed=42");
  const ImbalanceSpec c = ops::parse_imbalance("prob=0.3:ratio=2:seed=43");
  const std::int64_t steps = 10000;
  std::int64_t on = 0, differ = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    const bool x = ops::imbalance_active(a, step);
    EXPECT_EQ(x, ops::imbalance_active(b, step));
    EXPECT_EQ(x, ops::imbalance_active(a, step));  // same answer when asked again
    on += x ? 1 : 0;
    differ += x != ops::imbalance_active(c, step) ? 1 : 0;
  }
  // sd of the fraction = sqrt(0.3*0.7/10000) ~ 0.0046; 0.02 is > 4 sd.
  EXPECT_NEAR(double(on) / double(steps), 0.3, 0.02);
  EXPECT_GT(differ, 1000);  // another seed gives another set (expected 4200 differences)
  EXPECT_FALSE(ops::imbalance_active(a, 0));

  const ImbalanceSpec all = ops::parse_imbalance("prob=1:ratio=2:seed=5");
  for (std::int64_t step = 1; step <= 1000; ++step) EXPECT_TRUE(ops::imbalance_active(all, step));
}

// ---------------------------------------------------------------------------
// Skew

std::vector<float> random_logits(std::int64_t n, std::int64_t E, std::uint64_t seed, double scale = 1.0) {
  std::vector<float> l(static_cast<std::size_t>(n * E));
  for (std::size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(scale * normal01(seed, 3, i));
  return l;
}

/// Routes logits with router_forward and returns the assignments per expert group.
std::vector<std::int64_t> group_loads(const std::vector<float>& logits, std::int64_t n, std::int64_t E,
                                      std::int64_t k, int groups) {
  std::vector<float> probs(static_cast<std::size_t>(n * E)), w(static_cast<std::size_t>(n * k));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n * k));
  ops::router_forward<float>(logits.data(), probs.data(), idx.data(), w.data(), n, E, k, false);
  std::vector<std::int64_t> load(static_cast<std::size_t>(groups), 0);
  const std::int64_t G = E / groups;
  for (std::int32_t e : idx) ++load[static_cast<std::size_t>(e / G)];
  return load;
}

struct SkewCase {
  std::int64_t n, E, k;
  int groups;
  double ratio;
};

class ImbalanceSkew : public ::testing::TestWithParam<SkewCase> {};

TEST_P(ImbalanceSkew, ReachesRatioInGroupZero) {
  const SkewCase tc = GetParam();
  const std::vector<float> orig = random_logits(tc.n, tc.E, 1000 + std::uint64_t(tc.E * 7 + tc.k));
  std::vector<float> logits = orig;
  const double achieved = ops::skew_router_logits(logits.data(), tc.n, tc.E, tc.k, tc.groups, tc.ratio);

  const std::vector<std::int64_t> load = group_loads(logits, tc.n, tc.E, tc.k, tc.groups);
  const double mean = double(tc.n * tc.k) / tc.groups;
  const double want = std::min(tc.ratio, ops::max_imbalance_ratio(tc.E, tc.k, tc.groups));
  const std::int64_t mx = *std::max_element(load.begin(), load.end());
  EXPECT_EQ(mx, load[0]) << "group 0 is the hot group";
  EXPECT_NEAR(double(load[0]) / mean, want, 1.0 / mean + 1e-12);
  EXPECT_DOUBLE_EQ(achieved, double(mx) / mean);

  // Deterministic: the same input gives the same bytes.
  std::vector<float> again = orig;
  EXPECT_DOUBLE_EQ(ops::skew_router_logits(again.data(), tc.n, tc.E, tc.k, tc.groups, tc.ratio), achieved);
  EXPECT_EQ(std::memcmp(again.data(), logits.data(), logits.size() * sizeof(float)), 0);

  // Only a prefix of tokens is touched, and only their group-0 logits.
  const std::int64_t G = tc.E / tc.groups;
  std::int64_t last_touched = -1;
  for (std::int64_t i = 0; i < tc.n; ++i)
    for (std::int64_t e = 0; e < tc.E; ++e)
      if (logits[i * tc.E + e] != orig[i * tc.E + e]) {
        EXPECT_LT(e, G) << "token " << i << " expert " << e << " outside group 0 changed";
        EXPECT_GT(logits[i * tc.E + e], orig[i * tc.E + e]);
        last_touched = i;
      }
  EXPECT_GE(last_touched, 0);
  EXPECT_LT(last_touched, tc.n);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ImbalanceSkew,
    ::testing::Values(SkewCase{256, 8, 2, 2, 1.5},      // EP 2
                      SkewCase{512, 16, 4, 4, 2.6},     // EP 4, the benchmark's spike
                      SkewCase{300, 64, 6, 4, 3.0},     // k < G
                      SkewCase{200, 8, 4, 4, 1.8},      // k > G (b = 2, max 2.0)
                      SkewCase{333, 12, 3, 3, 2.2},     // k < G, odd n
                      SkewCase{256, 8, 2, 8, 2.0},      // EP 1: groups = E, over experts
                      SkewCase{1000, 8, 1, 8, 5.0},     // EP 1, top-1
                      SkewCase{4096, 64, 8, 64, 4.0},   // EP 1, many experts
                      SkewCase{97, 32, 2, 32, 12.5}),   // EP 1, ratio near the max of 16
    [](const ::testing::TestParamInfo<SkewCase>& info) {
      const SkewCase& c = info.param;
      return "n" + std::to_string(c.n) + "_E" + std::to_string(c.E) + "_k" + std::to_string(c.k) + "_g" +
             std::to_string(c.groups) + "_r" + std::to_string(int(std::lround(c.ratio * 10)));
    });

TEST(ImbalanceSkewEdges, RatioOneLeavesLogitsUnchanged) {
  for (int groups : {2, 8}) {
    const std::vector<float> orig = random_logits(200, 8, 11);
    std::vector<float> logits = orig;
    const double achieved = ops::skew_router_logits(logits.data(), 200, 8, 2, groups, 1.0);
    EXPECT_EQ(std::memcmp(orig.data(), logits.data(), orig.size() * sizeof(float)), 0);
    const std::vector<std::int64_t> load = group_loads(orig, 200, 8, 2, groups);
    const double mean = 200.0 * 2 / groups;
    EXPECT_DOUBLE_EQ(achieved, double(*std::max_element(load.begin(), load.end())) / mean);
    EXPECT_GE(achieved, 1.0);
  }
}

TEST(ImbalanceSkewEdges, AboveMaxIsCapped) {
  struct C {
    std::int64_t n, E, k;
    int groups;
  };
  for (const C c : {C{128, 8, 2, 8}, C{128, 8, 2, 2}, C{100, 8, 4, 4}, C{64, 16, 1, 16}}) {
    const double mx = ops::max_imbalance_ratio(c.E, c.k, c.groups);
    std::vector<float> logits = random_logits(c.n, c.E, 21);
    const double achieved = ops::skew_router_logits(logits.data(), c.n, c.E, c.k, c.groups, 100.0);
    EXPECT_DOUBLE_EQ(achieved, mx) << "E=" << c.E << " k=" << c.k << " groups=" << c.groups;
    const std::vector<std::int64_t> load = group_loads(logits, c.n, c.E, c.k, c.groups);
    EXPECT_EQ(load[0], c.n * std::min(c.k, c.E / c.groups));
  }
  EXPECT_DOUBLE_EQ(ops::max_imbalance_ratio(8, 2, 8), 4.0);
  EXPECT_DOUBLE_EQ(ops::max_imbalance_ratio(8, 2, 2), 2.0);
  EXPECT_DOUBLE_EQ(ops::max_imbalance_ratio(8, 4, 4), 2.0);
  EXPECT_DOUBLE_EQ(ops::max_imbalance_ratio(64, 8, 4), 4.0);
}

TEST(ImbalanceSkewEdges, AlreadyHotGroupIsLeftAlone) {
  // Group 0 already receives well over 1.2x the mean: nothing to add.
  const std::int64_t n = 300, E = 8, k = 2;
  std::vector<float> orig = random_logits(n, E, 5);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t e = 0; e < 2; ++e) orig[i * E + e] += 2.0f;
  std::vector<float> logits = orig;
  const double achieved = ops::skew_router_logits(logits.data(), n, E, k, 4, 1.2);
  EXPECT_EQ(std::memcmp(orig.data(), logits.data(), orig.size() * sizeof(float)), 0);
  EXPECT_GE(achieved, 1.2);
}

TEST(ImbalanceSkewEdges, WideLogitsStillSkew) {
  // Logits with a large spread (scale 20) still reach the target.
  const std::int64_t n = 512, E = 16, k = 2;
  const int groups = 4;
  std::vector<float> logits = random_logits(n, E, 9, 20.0);
  const double achieved = ops::skew_router_logits(logits.data(), n, E, k, groups, 2.6);
  const double mean = double(n * k) / groups;
  EXPECT_NEAR(achieved, 2.6, 1.0 / mean + 1e-12);
  EXPECT_NEAR(double(group_loads(logits, n, E, k, groups)[0]) / mean, 2.6, 1.0 / mean + 1e-12);
}

TEST(ImbalanceSkewEdges, RefusesBadShapesAndHandlesEmpty) {
  std::vector<float> logits = random_logits(4, 8, 1);
  EXPECT_THROW(ops::skew_router_logits(logits.data(), 4, 8, 2, 3, 2.0), ConfigError);  // 8 % 3
  EXPECT_THROW(ops::skew_router_logits(logits.data(), 4, 8, 9, 2, 2.0), ConfigError);  // k > E
  EXPECT_THROW(ops::skew_router_logits(logits.data(), 4, 8, 2, 0, 2.0), ConfigError);
  EXPECT_DOUBLE_EQ(ops::skew_router_logits(logits.data(), 0, 8, 2, 2, 2.0), 1.0);
}

// ---------------------------------------------------------------------------
// Spike shapes

TEST(ImbalanceShapes, PresetsExpandAndKeysOverrideThem) {
  const ImbalanceSpec rot = ops::parse_imbalance("preset=rotating");
  EXPECT_EQ(rot.mode, ImbalanceSpec::Mode::every);
  EXPECT_EQ(rot.every_n, 1);
  EXPECT_EQ(rot.rotate, 2);
  EXPECT_DOUBLE_EQ(rot.ratio, 2.0);
  const ImbalanceSpec zr = ops::parse_imbalance("preset=zero-rank:zero=1:every=2");
  EXPECT_EQ(zr.shape, ImbalanceSpec::Shape::zero);
  EXPECT_EQ(zr.hot, 1);
  EXPECT_EQ(zr.every_n, 2);
  const ImbalanceSpec z = ops::parse_imbalance("preset=hot-rank:zipf=1.5");  // a shape key replaces the preset's
  EXPECT_EQ(z.shape, ImbalanceSpec::Shape::zipf);
  EXPECT_DOUBLE_EQ(z.shape_param, 1.5);
  for (const ops::ImbalancePreset& p : ops::kImbalancePresets) {
    const ImbalanceSpec a = ops::parse_imbalance(fmt::format("preset={}", p.name));
    const ImbalanceSpec b = ops::parse_imbalance(ops::format_imbalance(a));
    EXPECT_EQ(ops::format_imbalance(b), ops::format_imbalance(a)) << p.name;
  }
  EXPECT_THROW(ops::parse_imbalance("preset=nope"), ConfigError);
  EXPECT_THROW(ops::parse_imbalance("every=2:ratio=2:zero=1"), ConfigError);  // two shapes
  EXPECT_THROW(ops::parse_imbalance("every=2:dirichlet=0.5"), ConfigError);   // needs seed
  EXPECT_THROW(ops::parse_imbalance("every=2:balanced=1:rotate=2"), ConfigError);
  EXPECT_THROW(ops::parse_imbalance("every=2:ratio=2:level=node"), ConfigError);
}

TEST(ImbalanceShapes, HotGroupRotatesWithStepsAndLayers) {
  const ImbalanceSpec spec = ops::parse_imbalance("every=1:ratio=2:hot=1:rotate=3:per_layer=1");
  EXPECT_EQ(ops::skew_for(spec, 1, 0, 8, 4).hot, 1);
  EXPECT_EQ(ops::skew_for(spec, 3, 0, 8, 4).hot, 1);
  EXPECT_EQ(ops::skew_for(spec, 4, 0, 8, 4).hot, 2);
  EXPECT_EQ(ops::skew_for(spec, 4, 3, 8, 4).hot, 1);  // (1 + 1 + 3) mod 4
  EXPECT_EQ(ops::skew_for(ops::parse_imbalance("every=1:ratio=2:level=expert"), 1, 0, 8, 2).groups, 8);
  EXPECT_THROW(ops::skew_for(ops::parse_imbalance("every=1:ratio=2:hot=4"), 1, 0, 8, 4), ConfigError);
  // The rotated hot group reaches the ratio where group 0 would have.
  const std::int64_t n = 256, E = 8, k = 2;
  std::vector<float> logits = random_logits(n, E, 77);
  ops::RouterSkew skew = ops::skew_for(spec, 4, 0, E, 4);
  ops::skew_router_logits(logits.data(), n, E, k, skew);
  const std::vector<std::int64_t> load = group_loads(logits, n, E, k, 4);
  EXPECT_EQ(load[2], std::llround(2.0 * double(n * k) / 4));
  EXPECT_EQ(std::max_element(load.begin(), load.end()) - load.begin(), 2);
}

TEST(ImbalanceShapes, SharesAreMetExactly) {
  const std::int64_t n = 300, E = 8, k = 2;
  for (const char* text : {"every=1:zero=3", "every=1:zipf=1.2:hot=2", "every=1:balanced=1",
                           "every=1:dirichlet=0.7:seed=5"}) {
    const ops::RouterSkew skew = ops::skew_for(ops::parse_imbalance(text), 2, 1, E, 4);
    std::vector<float> logits = random_logits(n, E, 91);
    ops::skew_router_logits(logits.data(), n, E, k, skew);
    const std::vector<std::int64_t> load = group_loads(logits, n, E, k, 4);
    std::int64_t total = 0;
    for (int g = 0; g < 4; ++g) {
      total += load[std::size_t(g)];
      EXPECT_NEAR(double(load[std::size_t(g)]), skew.shares[std::size_t(g)] * double(n * k), 1.0) << text << " g" << g;
    }
    EXPECT_EQ(total, n * k);
  }
  const ops::RouterSkew zero = ops::skew_for(ops::parse_imbalance("every=1:zero=3"), 1, 0, E, 4);
  std::vector<float> logits = random_logits(n, E, 92);
  ops::skew_router_logits(logits.data(), n, E, k, zero);
  EXPECT_EQ(group_loads(logits, n, E, k, 4)[3], 0);  // the zero-token group gets none
  EXPECT_DOUBLE_EQ(ops::target_imbalance(ops::parse_imbalance("every=1:zero=3"), 1, 2, E, 4), 4.0 / 3.0);
}

/// A loads.jsonl line (moeflex train's format) of dp 2, ep 2, 2 micro-batches and MoE
/// layers 1 and 2, with `received` [MoE layer][micro-batch][rank]; each rank kept 40.
nlohmann::json loads_line(int step, const std::vector<std::vector<std::vector<std::int64_t>>>& received) {
  const std::vector<std::vector<std::vector<std::int64_t>>> kept(2, {{40, 40}, {40, 40}});
  return {{"step", step}, {"dp", 2}, {"ep", 2}, {"microbatches", 2}, {"moe_layers", {1, 2}},
          {"received", received}, {"kept", kept}, {"step_cpu_seconds", {0.1, 0.1}}};
}

/// A model of 3 layers whose first is dense (MoE layers 1 and 2), 8 experts, top-2.
ModelConfig replay_model() {
  ModelConfig m;
  m.num_hidden_layers = 3;
  m.first_k_dense_replace = 1;
  return m;
}

/// A run directory whose loads.jsonl holds two recorded steps.
std::filesystem::path recorded_run(const std::string& tag) {
  const auto dir = scratch_dir("moeflex_test_", tag);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "loads.jsonl") << loads_line(1, {{{30, 10}, {20, 20}}, {{0, 40}, {10, 30}}}).dump() << "\n"
                                     << loads_line(2, {{{40, 0}, {40, 0}}, {{20, 20}, {20, 20}}}).dump() << "\n";
  return dir;
}

TEST(ImbalanceShapes, ReplayGivesTheRecordedSharesPerStepAndLayer) {
  const auto dir = recorded_run("replay-shares");
  ImbalanceSpec spec = ops::parse_imbalance("replay=" + dir.string());
  EXPECT_EQ(spec.mode, ImbalanceSpec::Mode::every);  // every step unless told otherwise
  EXPECT_EQ(spec.every_n, 1);
  EXPECT_EQ(ops::format_imbalance(spec), "every=1:replay=" + dir.string());
  EXPECT_EQ(ops::parse_imbalance("prob=0.5:seed=3:replay=x").mode, ImbalanceSpec::Mode::prob);
  EXPECT_THROW(ops::skew_for(spec, 1, 1, 8, 2), ConfigError);  // the shares are not loaded yet
  load_replay_shares(spec, replay_model(), 2);
  // Shares: received rows of EP rank g summed over the micro-batches, over the layer's total.
  const std::vector<std::vector<std::vector<double>>> want = {
      {{}, {50.0 / 80, 30.0 / 80}, {10.0 / 80, 70.0 / 80}}, {{}, {1.0, 0.0}, {0.5, 0.5}}};
  for (int step = 1; step <= 5; ++step)  // steps 3 and 5 replay recorded step 1, step 4 step 2
    for (int layer = 0; layer < 3; ++layer) {
      const ops::RouterSkew skew = ops::skew_for(spec, step, layer, 8, 2);
      const std::vector<double>& w = want[std::size_t((step - 1) % 2)][std::size_t(layer)];
      ASSERT_EQ(skew.shares.size(), w.size()) << "step " << step << " layer " << layer;
      for (std::size_t g = 0; g < w.size(); ++g) EXPECT_DOUBLE_EQ(skew.shares[g], w[g]) << step << " " << layer;
      EXPECT_EQ(skew.active(), layer > 0);  // the dense layer is not skewed
    }
  // injected_imbalance: the largest share times the groups, the most over the layers.
  EXPECT_DOUBLE_EQ(ops::target_imbalance(spec, 1, 3, 8, 2), 1.75);
  EXPECT_DOUBLE_EQ(ops::target_imbalance(spec, 2, 3, 8, 2), 2.0);
  EXPECT_DOUBLE_EQ(ops::target_imbalance(spec, 3, 3, 8, 2), 1.75);
  // The skew meets them exactly where share x n x k is whole: 128 assignments, 80 and 48.
  const std::int64_t n = 64, E = 8, k = 2;
  std::vector<float> logits = random_logits(n, E, 93);
  ops::skew_router_logits(logits.data(), n, E, k, ops::skew_for(spec, 3, 1, E, 2));
  EXPECT_EQ(group_loads(logits, n, E, k, 2), (std::vector<std::int64_t>{80, 48}));
  // A file path works as well as its run directory.
  ImbalanceSpec file = ops::parse_imbalance("every=2:replay=" + (dir / "loads.jsonl").string());
  load_replay_shares(file, replay_model(), 2);
  EXPECT_EQ(file.replay_shares, spec.replay_shares);
}

/// The message of the error of type E that fn throws ("" and a failure if none).
template <class E, class F>
std::string error_of(F fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

TEST(ImbalanceShapes, ReplayRefusesAnotherLayoutAndBadFiles) {
  const auto dir = recorded_run("replay-refusals");
  const std::string file = (dir / "loads.jsonl").string();
  auto load = [&](const std::string& path, const ModelConfig& model, int ep) {
    ImbalanceSpec spec = ops::parse_imbalance("replay=" + path);
    load_replay_shares(spec, model, ep);
  };
  std::string m = error_of<ConfigError>([&] { load(dir.string(), replay_model(), 4); });
  EXPECT_NE(m.find("replay=" + file + ": the recording has EP size 2 and this run 4"), std::string::npos) << m;
  m = error_of<ConfigError>([&] { load(dir.string(), replay_model(), 1); });
  EXPECT_NE(m.find("EP size 2 and this run 1"), std::string::npos) << m;
  ModelConfig deeper = replay_model();
  deeper.num_hidden_layers = 4;
  m = error_of<ConfigError>([&] { load(dir.string(), deeper, 2); });
  EXPECT_NE(m.find("the recording has 2 MoE layers and this model 3"), std::string::npos) << m;
  m = error_of<ConfigError>([&] { load((dir / "nope").string(), replay_model(), 2); });
  EXPECT_NE(m.find("nope: no such file or directory"), std::string::npos) << m;
  // A malformed line and a missing field are named with the file and line.
  { std::ofstream(file, std::ios::app) << "{\"dp\": 2, oops\n"; }
  m = error_of<DataError>([&] { load(file, replay_model(), 2); });
  EXPECT_NE(m.find(file + ":3: not valid JSON"), std::string::npos) << m;
  nlohmann::json no_kept = loads_line(1, {{{30, 10}, {20, 20}}, {{0, 40}, {10, 30}}});
  no_kept.erase("kept");
  std::ofstream(file) << no_kept.dump() << "\n";
  m = error_of<DataError>([&] { load(file, replay_model(), 2); });
  EXPECT_NE(m.find(file + ":1: 'kept' must be 2 layers x 2 micro-batches x 2 ranks"), std::string::npos) << m;
  EXPECT_THROW(ops::parse_imbalance("replay="), ConfigError);
  EXPECT_THROW(ops::parse_imbalance("replay=x:ratio=2"), ConfigError);  // two shapes
  EXPECT_THROW(ops::parse_imbalance("replay=x:rotate=2"), ConfigError);
  EXPECT_THROW(ops::parse_imbalance("replay=x:level=expert"), ConfigError);
}

TEST(ImbalanceLoad, CountsGroups) {
  // E = 4, groups = 2, k = 2: loads group0 = 3, group1 = 1 -> 3 / 2.
  const std::vector<std::int32_t> idx{0, 1, 1, 3};
  EXPECT_DOUBLE_EQ(ops::group_load_imbalance(idx.data(), 2, 4, 2, 2), 1.5);
  EXPECT_DOUBLE_EQ(ops::group_load_imbalance(idx.data(), 2, 4, 2, 4), 2.0);  // over experts: 0:1 1:2 3:1
  EXPECT_DOUBLE_EQ(ops::group_load_imbalance(idx.data(), 0, 4, 2, 2), 1.0);
  const std::vector<std::int32_t> bad{0, 4};
  EXPECT_THROW(ops::group_load_imbalance(bad.data(), 1, 4, 2, 2), Error);
}

}  // namespace
}  // namespace moeflex::test
