// The simulator's per-step work beyond the plan's actions ("step time
// within 5%"): the measured optimizer_step table (zero_grads, norm, clip, AdamW)
// priced by parameters held, and `moeflex calibrate` measuring it; the replay of a
// run's loads taking the run's batch shape, and the refusals of flags that a
// replay would ignore.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/sim/loads.h"
#include "moeflex/sim/simulator.h"
#include "sim_fixtures.h"
#include "moeflex/profile/calibrate.h"

using namespace moeflex;
using namespace moeflex::sim;

namespace {

constexpr FlopsPerSecond kRate = test::kGemmOnlyRate;
using test::gemm_only_profile;

SimOptions one_rank_options() {
  SimOptions o;
  o.model = test::small_moe_config(4, 1, 8, /*tied=*/false);
  o.cluster.name = "test";
  o.cluster.gpus_per_node = 8;
  o.cluster.device_memory = 1 * kGiB;
  o.cluster.intra_node = {1e-6, 100e9};
  o.cluster.inter_node = {5e-6, 10e9};
  o.cluster.peak_flops = kRate;
  o.cluster.profile = gemm_only_profile();
  o.micro_batch_size = 2;
  o.seq_len = 16;
  o.global_batch = 2 * 4;
  o.loads.constant = 1.0;
  return o;
}

std::filesystem::path write_loads(std::int64_t kept) { return test::write_loads_jsonl(kept, "steptime"); }

}  // namespace

// The table is interpolated linearly in 4 x parameters bytes and extrapolated at its
// last point's rate; without it, streaming passes at the elementwise rate.
TEST(SimStepTime, OptimizerStepTableIsUsedAndScalesWithParameters) {
  HardwareProfile p = gemm_only_profile();
  p.memory_bandwidth = 10e9;
  const CostModel plain(p);
  // 16 B per parameter held + 28 B per parameter updated, at 10 GB/s.
  EXPECT_NEAR(optimizer_step_time(plain, 1e6, 1e6), 44e6 / 10e9, 1e-12);
  EXPECT_NEAR(optimizer_step_time(plain, 1e6, 0.5e6), 30e6 / 10e9, 1e-12);
  p.op_tables[kOptimizerStepOp] = {{4'000'000, 3e-3}, {16'000'000, 9e-3}};
  const CostModel measured(p);
  EXPECT_NEAR(optimizer_step_time(measured, 1e6, 1e6), 3e-3, 1e-12);          // the first point
  EXPECT_NEAR(optimizer_step_time(measured, 2.5e6, 2.5e6), 6e-3, 1e-12);      // halfway to the second
  EXPECT_NEAR(optimizer_step_time(measured, 8e6, 8e6), 9e-3 * 2, 1e-12);      // the last point's rate
}

// simulate() adds exactly the table's time at the rank's parameter count to the step.
TEST(SimStepTime, StepGrowsByTheOptimizerTableAtTheRanksParameters) {
  SimOptions o = one_rank_options();
  const SimReport without = simulate(o);
  constexpr double kSecondsPerByte = 2.5e-9;  // a table through the origin: time = bytes x this
  o.cluster.profile.op_tables[kOptimizerStepOp] = {{1'000'000, 1'000'000 * kSecondsPerByte}};
  const SimReport with = simulate(o);
  const double params = double(o.model.num_params());
  EXPECT_NEAR(with.optimizer_time, 4 * params * kSecondsPerByte, 1e-12);
  EXPECT_NEAR(with.step_time - without.step_time, with.optimizer_time - without.optimizer_time, 1e-12);
  EXPECT_GT(with.optimizer_time, without.optimizer_time);  // the elementwise rate here is free
}

// The CPU engine reduces gradients one tensor at a time: each of the real model's
// parameter tensors pays its own ring latency 2(n-1) alpha, the bytes cost the same
// on the link, and the ordered all-reduce's local sum adds (3n - 1) / n passes.
TEST(SimStepTime, PerTensorGradientReduceAddsALatencyPerTensor) {
  SimOptions o = one_rank_options();
  o.parallel.dp = 2;
  o.global_batch = 2 * 2 * 4;
  o.cluster.intra_node = {20e-6, 5e9};
  o.cluster.profile.memory_bandwidth = 10e9;
  const SimReport bucketed = simulate(o);
  o.cluster.per_tensor_gradient_reduce = true;
  const SimReport per_tensor = simulate(o);
  Arena arena;
  MoEModel model(o.model, arena, ModelParallel{});
  int dense = 0, expert = 0;
  std::int64_t numel = 0;
  for (const Param& p : model.params()) (p.expert ? expert : dense) += 1, numel += p.w.numel();
  ASSERT_GT(expert, 0);
  // dp 2 (ep 1): both kinds reduce over 2 ranks, 2 alpha each; bytes / beta once.
  EXPECT_NEAR(bucketed.dp_reduce_time, 2 * 2 * 20e-6 + double(4 * numel) / 5e9, 1e-12);
  const double sum = 2.5 * double(4 * numel) / 10e9;  // n = 2: 2.5 bytes per byte reduced
  EXPECT_NEAR(per_tensor.dp_reduce_time, (dense + expert) * 2 * 20e-6 + double(4 * numel) / 5e9 + sum, 1e-12);
  EXPECT_NEAR(per_tensor.step_time - bucketed.step_time, (dense + expert - 2) * 2 * 20e-6 + sum, 1e-12);
  EXPECT_NEAR(ordered_sum_time(CostModel(o.cluster.profile), 4, 4'000'000), 11e6 / 10e9, 1e-15);
}

// A tied embedding split over pipeline stages: the CPU engine sums the copies and
// all-reduces them over the pipeline group every step (sync_tied_embedding).
TEST(SimStepTime, TiedEmbeddingSyncOverThePipeline) {
  SimOptions o = one_rank_options();
  o.model = test::small_moe_config(4, 1, 8, /*tied=*/true);
  o.parallel.pp = 2;
  o.cluster.intra_node = {20e-6, 5e9};
  o.cluster.per_tensor_gradient_reduce = true;
  o.cluster.profile.memory_bandwidth = 10e9;
  const SimReport r = simulate(o);
  const double vd = double(o.model.vocab_size * o.model.hidden_size);
  // pp 2, dp 1: no data-parallel reduction; the sync is 2 alpha + 4 vd / beta, the
  // all-reduce's local sum (2.5 x 4 B), zero, add and copy back (24 B per element) at
  // the elementwise rate.
  EXPECT_NEAR(r.dp_reduce_time, 2 * 20e-6 + 4 * vd / 5e9 + (10 + 24) * vd / 10e9, 1e-9);
  o.model.tie_word_embeddings = false;
  EXPECT_EQ(simulate(o).dp_reduce_time, 0.0);
}

TEST(SimStepTime, LoadsAndImbalanceTogetherAreRefused) {
  const auto dir = write_loads(2 * 16 * 2);
  try {
    LoadModel::from_flags(dir.string(), "calm=1.1:spike=2");
    ADD_FAILURE() << "--loads with --imbalance was accepted";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--imbalance 'calm=1.1:spike=2'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--loads"), std::string::npos) << msg;
  }
  EXPECT_TRUE(LoadModel::from_flags(dir.string(), "").per_rank());
  EXPECT_DOUBLE_EQ(LoadModel::from_flags("", "calm=1.1").calm_max, 1.1);
  EXPECT_FALSE(LoadModel::from_flags("", "").replay());
  std::filesystem::remove_all(dir);
}

// Without --global-batch a replay takes the run's micro-batches (its grad_accum);
// a global batch or micro-batch that disagrees with the run is refused, naming both.
TEST(SimStepTime, ReplayTakesTheRunsBatchShape) {
  SimOptions o = one_rank_options();
  o.model = test::small_moe_config(3, 1, 8, true);  // layer 0 dense, layers 1 and 2 MoE
  o.parallel.dp = 2;
  o.parallel.ep = 2;
  const std::int64_t kept = o.micro_batch_size * o.seq_len * o.model.num_experts_per_tok;
  const auto dir = write_loads(kept);
  o.loads = LoadModel::from_file(dir);
  o.global_batch = 0;
  EXPECT_EQ(o.num_microbatches(), 3);  // the recording's, not 4 x pp
  EXPECT_EQ(simulate(o).num_microbatches, 3);
  o.global_batch = 2 * 2 * 4;  // 4 micro-batches of 2 on dp 2
  try {
    simulate(o);
    ADD_FAILURE() << "a global batch of 4 micro-batches replayed a run of 3";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("3 micro-batches"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global batch 16"), std::string::npos) << msg;
  }
  o.global_batch = 0;
  o.micro_batch_size = 4;  // twice the run's tokens per micro-batch
  try {
    simulate(o);
    ADD_FAILURE() << "a micro-batch of twice the run's tokens was accepted";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fmt::format("kept {} expert assignments", kept)), std::string::npos) << msg;
    EXPECT_NE(msg.find(fmt::format("keeps {}", 2 * kept)), std::string::npos) << msg;
  }
  std::filesystem::remove_all(dir);
}

// `moeflex calibrate` measures the table: a point per parameter count, each taking
// longer than a pure memset of the gradients would at the measured bandwidth, and
// growing with the count at no better than a linear rate's tolerance.
TEST(SimStepTime, CalibrateMeasuresTheOptimizerStepTable) {
  const HardwareProfile p = calibrate(1, 1.0);
  ASSERT_TRUE(p.op_tables.count(kOptimizerStepOp));
  const auto& t = p.op_tables.at(kOptimizerStepOp);
  ASSERT_EQ(t.size(), 2u);  // the coarse grid: 1 M and 4 M parameters
  EXPECT_EQ(t[0].bytes, 4 * (1 << 20));
  EXPECT_EQ(t[1].bytes, 4 * (1 << 22));
  for (const OpSample& s : t) EXPECT_GT(s.seconds, double(s.bytes) / p.memory_bandwidth) << s.bytes;
  EXPECT_GT(t[1].seconds, 2.0 * t[0].seconds);
  EXPECT_LT(t[1].seconds, 8.0 * t[0].seconds);
  // The kernels one call at a time (the op profiler's prices): two sizes each, an
  // attention projection's 256 x 256 floats and an expert bank's 8 x 384 x 256 (12x),
  // so between 3x and 24x the time; AdamW (7 streams and a sqrt and divide per float)
  // dearer than a scale (2 streams) of the same tensor.
  for (const char* k : {op_names::kAdamW, op_names::kSquareSum, op_names::kScale}) {
    ASSERT_TRUE(p.op_tables.count(k)) << k;
    const auto& kt = p.op_tables.at(k);
    ASSERT_EQ(kt.size(), 2u) << k;
    EXPECT_EQ(kt[0].bytes, 4 * 256 * 256) << k;
    EXPECT_EQ(kt[1].bytes, 12 * kt[0].bytes) << k;
    EXPECT_GT(kt[1].seconds, 3.0 * kt[0].seconds) << k;
    EXPECT_LT(kt[1].seconds, 24.0 * kt[0].seconds) << k;
  }
  EXPECT_GT(p.op_tables.at(op_names::kAdamW)[1].seconds, p.op_tables.at(op_names::kScale)[1].seconds);
}
