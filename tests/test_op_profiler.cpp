// The op profiler (profile/op_profiler.h): its aggregates, its coverage of a real
// step's ops, their labels, the trace events and the predictions it records.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "model_fixtures.h"
#include "profiled_step.h"
#include "moeflex/comm/layout.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/policies.h"
#include "moeflex/train/distributed.h"
#include "moeflex/profile/op_profiler.h"
#include "moeflex/train/replica.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

OpRecord rec(const std::string& kind, double cpu, double wall, double predicted, std::int64_t step = 2) {
  OpRecord r;
  r.kind = kind;
  r.cpu = cpu;
  r.wall = wall;
  r.predicted = predicted;
  r.step = step;
  return r;
}

/// A profile with distinct rates per GEMM layout, so that a wrong layout changes
/// the price, and tables for a few op families.
HardwareProfile small_profile() {
  HardwareProfile p;
  p.name = "test";
  p.threads = 1;
  for (std::int64_t m : {8, 32, 128})
    for (std::int64_t n : {8, 32, 128})
      for (std::int64_t k : {8, 32, 128}) {
        p.gemm.push_back({m, n, k, 1e9 + 1e7 * double(m + n), GemmLayout::nt});
        p.gemm.push_back({m, n, k, 2e9 + 1e7 * double(m + k), GemmLayout::nn});
        p.gemm.push_back({m, n, k, 3e9 + 1e7 * double(n + k), GemmLayout::tn});
      }
  p.memory_bandwidth = 1e10;
  p.launch_overhead = 1e-6;
  p.h2d_bandwidth = 5e9;
  p.d2h_bandwidth = 4e9;
  p.copy_latency = 2e-6;
  p.op_tables[op_names::kRmsnormForward] = {{1000, 3e-6}, {100000, 2e-5}};
  p.op_tables[op_names::kAttentionForward] = {{256, 5e-6}, {4096, 4e-5}};
  return p;
}

/// One training step of a 2-layer MoE (one dense layer) with 2 micro-batches under
/// 1F1B on one rank, through the profiler; `policy` provisions the activations.
struct TinyRun {
  ModelConfig cfg = test::small_moe_config(2, 1, 4, true);
  CostModel cost{small_profile()};
  Arena arena;
  ProfilingBackend profiler{ops::backend_of(arena), cost, 0};
  StepPlan plan;
  std::int64_t B = 2, S = 8, M = 2;

  void run(const std::string& policy, train::TraceWriter* trace) {
    plan = test::run_profiled_step(cfg, "1f1b", policy, arena, profiler, M, B, S, trace);
  }
};

}  // namespace

TEST(OpProfiler, SummaryAggregatesMediansAndErrors) {
  // kind a: measured (cpu) 1, 2, 3, 4 against predicted 1, 1, 3, 5; kind b: one op.
  std::vector<OpRecord> r = {rec("a", 1, 10, 1), rec("a", 2, 10, 1), rec("a", 3, 10, 3), rec("a", 4, 10, 5),
                             rec("b", 10, 20, 5)};
  const OpTimeSummary s = summarize_op_times(r, /*use_cpu=*/true);
  ASSERT_EQ(s.kinds.size(), 2u);
  // Both kinds measured 10 s in total (a tie): look them up by name.
  std::map<std::string, OpKindSummary> k;
  for (const auto& x : s.kinds) k[x.kind] = x;
  EXPECT_EQ(k["a"].count, 4);
  EXPECT_DOUBLE_EQ(k["a"].measured_median, 2.5);
  EXPECT_DOUBLE_EQ(k["a"].predicted_median, 2.0);
  EXPECT_DOUBLE_EQ(k["a"].mean_abs_rel_error, (0.0 + 0.5 + 0.0 + 0.25) / 4);
  EXPECT_DOUBLE_EQ(k["a"].measured_total, 10);
  EXPECT_DOUBLE_EQ(k["a"].predicted_total, 10);
  EXPECT_DOUBLE_EQ(k["b"].measured_median, 10);
  EXPECT_DOUBLE_EQ(k["b"].mean_abs_rel_error, 0.5);
  EXPECT_EQ(s.count, 5);
  // sum |p - m| = 0 + 1 + 0 + 1 + 5 = 7 over sum m = 20; net (15 - 20) / 20.
  EXPECT_DOUBLE_EQ(s.weighted_error, 7.0 / 20.0);
  EXPECT_DOUBLE_EQ(s.total_error, -0.25);
  // The wall clock: a measured 10 x 4 (total 40, sorted first), b 20.
  const OpTimeSummary w = summarize_op_times(r, false);
  EXPECT_EQ(w.kinds[0].kind, "a");
  EXPECT_DOUBLE_EQ(w.kinds[0].measured_median, 10);
  EXPECT_DOUBLE_EQ(w.kinds[1].measured_median, 20);
  EXPECT_DOUBLE_EQ(w.weighted_error, (9 + 9 + 7 + 5 + 15) / 60.0);
}

TEST(OpProfiler, MedianErrorAndNoiseFloorAreJudgedPerShape) {
  // Kind a at shape [1]: measured 1, 2, 3 (median 2), predicted 2: its medians agree,
  // its ops scatter by 1 + 0 + 1 around the median. Shape [2]: measured 4, 4,
  // predicted 6: medians 50% apart, no scatter. Step 1 is left out (first_step 2).
  std::vector<OpRecord> r = {rec("a", 1, 1, 2), rec("a", 2, 2, 2), rec("a", 3, 3, 2), rec("a", 4, 4, 6),
                             rec("a", 4, 4, 6), rec("a", 100, 100, 1, /*step=*/1)};
  for (int i = 0; i < 3; ++i) r[std::size_t(i)].shape = {1};
  for (int i = 3; i < 6; ++i) r[std::size_t(i)].shape = {2};
  const fs::path dir = fs::temp_directory_path() / "moeflex_op_profiler_median";
  fs::create_directories(dir);
  write_op_times_part(dir / "part0.json", r, {});
  const nlohmann::json doc = summarize_op_time_parts({dir / "part0.json"}, 2, /*use_cpu=*/true);
  fs::remove_all(dir);
  // Weights: the shapes' measured totals, 6 and 8 s.
  EXPECT_DOUBLE_EQ(doc.at("op_median_error").get<double>(), (6 * 0.0 + 8 * 0.5) / 14);
  EXPECT_DOUBLE_EQ(doc.at("op_noise_floor").get<double>(), 2.0 / 14);
  // The per-op error counts both: |2-1| + 0 + |2-3| + 2 + 2 over 14.
  EXPECT_DOUBLE_EQ(doc.at("op_error").get<double>(), 6.0 / 14);
}

TEST(OpProfiler, StepErrorIsTheMeanRelativeErrorOverSteps) {
  std::vector<StepTimeRecord> s(2);
  s[0].measured_wall = 2.0, s[0].measured_cpu = 1.0, s[0].predicted = 1.5;
  s[1].measured_wall = 4.0, s[1].measured_cpu = 5.0, s[1].predicted = 5.0;
  EXPECT_DOUBLE_EQ(step_time_error(s, false), (0.25 + 0.25) / 2);
  EXPECT_DOUBLE_EQ(step_time_error(s, true), (0.5 + 0.0) / 2);
  EXPECT_DOUBLE_EQ(step_time_error({}, false), 0.0);
}

TEST(OpProfiler, RecordsEveryOpOfEveryPlanActionWithItsLabels) {
  TinyRun t;
  t.run("none", nullptr);
  const auto& recs = t.profiler.records();
  ASSERT_FALSE(recs.empty());
  // Every compute action of the rank's plan ran ops, and every op belongs to one.
  const auto& actions = t.plan.actions[0];
  std::set<int> compute, seen;
  for (std::size_t i = 0; i < actions.size(); ++i)
    if (is_compute(actions[i].kind)) compute.insert(int(i));
  EXPECT_EQ(compute.size(), std::size_t(2 * t.M));  // 1F1B on one rank: F and B per micro-batch
  for (const OpRecord& r : recs) {
    ASSERT_GE(r.action, 0) << r.kind;
    seen.insert(r.action);
    const Action& a = actions[std::size_t(r.action)];
    EXPECT_EQ(r.microbatch, a.microbatch);
    EXPECT_EQ(r.stage, a.stage);
    if (a.kind == ActionKind::Forward) {
      EXPECT_EQ(r.phase, OpPhase::forward) << r.kind;
    } else {
      EXPECT_TRUE(r.phase == OpPhase::backward_input || r.phase == OpPhase::backward_weight) << r.kind;
    }
    EXPECT_EQ(r.step, 1);
    EXPECT_GE(r.cpu, 0.0);
    EXPECT_GE(r.wall, 0.0);
  }
  EXPECT_EQ(seen, compute);
  // Each micro-batch's forward ran the embedding, both layers and the head, and its
  // backward ran them again; the same ops in both micro-batches.
  std::map<std::tuple<int, OpPhase, int>, int> per;  // (mb, phase, layer) -> ops
  for (const OpRecord& r : recs) per[{r.microbatch, r.phase, r.layer}] += 1;
  for (int mb = 0; mb < t.M; ++mb) {
    for (int layer : {kOpLayerEmbedding, 0, 1, kHeadLayer})
      EXPECT_GT((per[{mb, OpPhase::forward, layer}]), 0) << "mb " << mb << " layer " << layer;
    for (int layer : {0, 1, kHeadLayer}) {
      EXPECT_GT((per[{mb, OpPhase::backward_input, layer}]), 0) << "mb " << mb << " layer " << layer;
      EXPECT_GT((per[{mb, OpPhase::backward_weight, layer}]), 0) << "mb " << mb << " layer " << layer;
    }
    EXPECT_EQ((per[{mb, OpPhase::backward_weight, kOpLayerEmbedding}]), 1);  // the gradient scatter
  }
  for (const auto& [key, n] : per) {
    if (std::get<0>(key) == 1) {
      EXPECT_EQ(n, (per[{0, std::get<1>(key), std::get<2>(key)}])) << "layer " << std::get<2>(key);
    }
  }
  // Weight-gradient GEMMs are W, input-gradient ones B, whatever the fused action.
  for (const OpRecord& r : recs) {
    if (r.kind == "linear_backward_dw" || r.kind == "grouped_linear_backward_dw") {
      EXPECT_EQ(r.phase, OpPhase::backward_weight);
    }
    if (r.kind == "linear_backward_dx") {
      EXPECT_EQ(r.phase, OpPhase::backward_input);
    }
  }
  // The step record sums its ops.
  ASSERT_EQ(t.profiler.steps().size(), 1u);
  double pred = 0;
  for (const OpRecord& r : recs) pred += r.predicted;
  EXPECT_NEAR(t.profiler.steps()[0].predicted, pred, 1e-12);
  EXPECT_EQ(t.profiler.steps()[0].ops, std::int64_t(recs.size()));
}

TEST(OpProfiler, RecomputesAreLabelledWithTheirLayer) {
  TinyRun t;
  t.run("full", nullptr);
  std::set<int> layers;
  for (const OpRecord& r : t.profiler.records())
    if (r.phase == OpPhase::recompute) layers.insert(r.layer);
  EXPECT_EQ(layers, (std::set<int>{0, 1, kHeadLayer}));
  TinyRun none;
  none.run("none", nullptr);
  for (const OpRecord& r : none.profiler.records()) EXPECT_NE(r.phase, OpPhase::recompute);
  EXPECT_GT(t.profiler.records().size(), none.profiler.records().size());
}

TEST(OpProfiler, PredictionIsTheCostModelsTimeForTheShape) {
  TinyRun t;
  t.run("none", nullptr);
  std::set<std::string> checked;
  for (const OpRecord& r : t.profiler.records()) {
    const auto& s = r.shape;
    double want = -1;
    if (r.kind == "linear_forward") want = t.cost.linear_forward(s[0], s[1], s[2]);
    if (r.kind == "linear_backward_dx") want = t.cost.linear_backward(s[0], s[1], s[2], true, false);
    if (r.kind == "linear_backward_dw") want = t.cost.linear_backward(s[0], s[1], s[2], false, true);
    if (r.kind == "gemm_nt") want = t.cost.gemm(s[0], s[1], s[2], GemmLayout::nt);
    if (r.kind == "attention_forward") want = t.cost.attention_forward(s[0], s[1], s[2], s[3]);
    if (r.kind == "rmsnorm_forward") want = t.cost.rmsnorm_forward(s[0], s[1]);
    if (r.kind == "grouped_linear_forward") {
      const std::vector<std::int64_t> rows(s.begin(), s.end() - 2);
      want = t.cost.grouped_linear_forward(rows, s[s.size() - 2], s[s.size() - 1]);
    }
    if (want < 0) continue;
    EXPECT_DOUBLE_EQ(r.predicted, want) << r.kind;
    EXPECT_GT(r.predicted, 0.0) << r.kind;
    checked.insert(r.kind);
  }
  EXPECT_EQ(checked.size(), 7u);
  // The layouts are priced apart: the dx and dW GEMMs of one linear differ.
  EXPECT_NE(t.cost.linear_backward(16, 32, 32, true, false), t.cost.linear_backward(16, 32, 32, false, true));
}

TEST(OpProfiler, WritesOneTraceEventPerOpOnTheOpsTrack) {
  const fs::path dir = fs::temp_directory_path() / "moeflex_test_op_profiler";
  fs::remove_all(dir);
  fs::create_directories(dir);
  TinyRun t;
  {
    train::TraceWriter trace(dir / "trace.json", 0, true);
    t.run("none", &trace);
    trace.close();
  }
  std::ifstream in(dir / "trace.json");
  const auto doc = nlohmann::json::parse(in);
  int ops_tid = -1;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("args").at("name") == "ops") ops_tid = e.at("tid");
  ASSERT_GE(ops_tid, 0);
  std::size_t events = 0;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("tid") == ops_tid) {
      ++events;
      EXPECT_TRUE(e.at("args").contains("predicted_us"));
      EXPECT_TRUE(e.at("args").contains("layer"));
    }
  EXPECT_EQ(events, t.profiler.records().size());
  // The part file round-trips through the summary.
  write_op_times_part(dir / "part.json", t.profiler.records(), t.profiler.steps());
  const auto sum = summarize_op_time_parts({dir / "part.json"}, 1, true);
  EXPECT_EQ(sum.at("ops").at("count").get<std::size_t>(), t.profiler.records().size());
  EXPECT_EQ(sum.at("steps").size(), 1u);
  fs::remove_all(dir);
}

TEST(OpProfiler, OutsideAStepOpsAreForwardedNotRecorded) {
  TinyRun t;
  ScopedBackendOverride over(&t.profiler);
  Arena arena;
  EXPECT_EQ(&ops::backend_of(arena), &t.profiler);
  MoEModel m(t.cfg, arena);
  m.init_weights(1);
  std::vector<std::int32_t> ids(16, 1), tg(16, 2);
  m.forward_eval(ids.data(), tg.data(), 2, 8);
  EXPECT_TRUE(t.profiler.records().empty());
}
