// The simulator's priced op stream against the engine's: one real training step
// through the op profiler (profile/op_profiler.h: every backend op the engine runs,
// priced by the cost model) and `simulate --breakdown` of the same step must agree
// op kind by op kind (calls and seconds) and phase by phase, under every static
// policy (their recomputes, the expert FFN's rebuilt twice without a kept
// activation) and the zero-bubble split; and the step's busy time is that stream.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "model_fixtures.h"
#include "profiled_step.h"
#include "moeflex/comm/layout.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/provision/policies.h"
#include "moeflex/sim/simulator.h"
#include "moeflex/train/distributed.h"
#include "moeflex/profile/op_profiler.h"
#include "moeflex/train/replica.h"

using namespace moeflex;

namespace {

/// GEMMs at one rate (so that a grouped GEMM's time depends on its total rows only,
/// not on how the routing split them), every other op streaming with a launch
/// overhead (so that each call counts).
HardwareProfile stream_profile() {
  HardwareProfile p;
  p.name = "stream";
  p.gemm = {{64, 64, 64, 1e10}};
  p.memory_bandwidth = 1e10;
  p.launch_overhead = 1e-6;
  p.h2d_bandwidth = p.d2h_bandwidth = 5e9;
  p.copy_latency = 2e-6;
  return p;
}

constexpr std::int64_t kB = 2, kS = 8, kM = 2;

/// The op records of one engine step on one rank, priced by `profile`.
std::vector<OpRecord> engine_records(const ModelConfig& cfg, const std::string& schedule, const std::string& policy,
                                     const HardwareProfile& profile) {
  const CostModel cost(profile);
  Arena arena;
  ProfilingBackend profiler{ops::backend_of(arena), cost, 0};
  test::run_profiled_step(cfg, schedule, policy, arena, profiler, kM, kB, kS);
  return profiler.records();
}

/// (phase, kind) -> calls and predicted seconds of one engine step on one rank.
OpBreakdown engine_step(const ModelConfig& cfg, const std::string& schedule, const std::string& policy,
                        const HardwareProfile& profile = stream_profile()) {
  OpBreakdown out;
  for (const OpRecord& r : engine_records(cfg, schedule, policy, profile)) {
    OpTally& t = out[{to_string(r.phase), r.kind}];
    t.count += 1;
    t.seconds += r.predicted;
  }
  return out;
}

sim::SimReport simulated_step(const ModelConfig& cfg, const std::string& schedule, const std::string& policy,
                              int pp = 1, const HardwareProfile& profile = stream_profile()) {
  sim::SimOptions o;
  o.model = cfg;
  o.cluster.name = "test";
  o.cluster.gpus_per_node = 8;
  o.cluster.device_memory = kGiB;
  o.cluster.intra_node = {1e-6, 100e9};
  o.cluster.inter_node = {5e-6, 10e9};
  o.cluster.profile = profile;
  o.cluster.host_cores = 0;
  o.parallel.pp = pp;
  o.schedule = schedule;
  o.policy = policy;
  o.micro_batch_size = kB;
  o.seq_len = kS;
  o.global_batch = kB * kM;
  o.loads.constant = 1.0;
  o.breakdown = true;
  return sim::simulate(o);
}

/// The kinds the engine records by phase, from a breakdown (the optimizer, Tensor::zero
/// and the all-to-all's memcpy are no profiled backend ops).
OpBreakdown profiled_only(const OpBreakdown& b) {
  OpBreakdown out;
  for (const auto& [key, t] : b)
    if (key.first != "optimizer" && key.second != "zero" && key.second != "a2a_local_copy") out[key] = t;
  return out;
}

}  // namespace

TEST(SimOpStream, EveryPolicysOpsMatchTheEnginesKindByKindAndPhaseByPhase) {
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);  // a dense layer, 2 MoE layers, shared experts
  for (const std::string schedule : {"1f1b", "zb-h1"})
    for (const std::string& policy : static_policy_names()) {
      if (schedule == "zb-h1" && policy != "none" && policy != "full") continue;  // the split's copies, either way
      SCOPED_TRACE(schedule + " " + policy);
      const OpBreakdown eng = engine_step(cfg, schedule, policy);
      const sim::SimReport rep = simulated_step(cfg, schedule, policy);
      const OpBreakdown sim = profiled_only(rep.ops);
      ASSERT_FALSE(eng.empty());
      std::set<std::pair<std::string, std::string>> keys;
      for (const auto& [k, t] : eng) keys.insert(k);
      for (const auto& [k, t] : sim) keys.insert(k);
      for (const auto& k : keys) {
        const OpTally e = eng.count(k) ? eng.at(k) : OpTally{}, s = sim.count(k) ? sim.at(k) : OpTally{};
        EXPECT_DOUBLE_EQ(s.count, e.count) << k.first << " " << k.second;
        EXPECT_NEAR(s.seconds, e.seconds, 1e-9 * e.seconds + 1e-15) << k.first << " " << k.second;
      }
      // The busy time of the one rank is its priced ops (the zero fills included).
      Seconds ops = 0;
      for (const auto& [k, t] : rep.ops)
        if (k.first != "optimizer") ops += t.seconds;
      EXPECT_NEAR(rep.ranks[0].busy, ops, 1e-9 * ops);
    }
}

// An in-situ profile (`calibrate --from-run`) prices each exact kind at the shapes a
// run recorded: the simulator must ask for the very shapes the engine's ops record,
// or the run's own times would never reach it. Every exact kind the step runs gets a
// time far from the stream profile's, and both sides must take it, call for call.
TEST(SimOpStream, InSituTimesReachTheSimulatorAtTheEnginesShapes) {
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  const std::set<std::string> exact(std::begin(kInSituExactKinds), std::end(kInSituExactKinds));
  HardwareProfile p = stream_profile();
  std::set<std::pair<std::string, std::vector<std::int64_t>>> seen;
  std::set<std::string> kinds;
  for (const OpRecord& r : engine_records(cfg, "1f1b", "full", p))
    if (exact.count(r.kind) && seen.insert({r.kind, r.shape}).second) {
      p.in_situ_ops.push_back({r.kind, r.shape, 1e-3 * double(p.in_situ_ops.size() + 1)});
      kinds.insert(r.kind);
    }
  // The step runs every exact kind but the fused linear backward (dx and dw are timed
  // apart) and cross entropy's own (the head is a tied embedding's): a kind added to
  // the list without a price at its recorded shape shows here.
  for (const char* k : {"rope_forward", "rope_backward", "add_inplace", "embedding_forward", "embedding_backward",
                        "aux_loss_forward", "aux_loss_backward", "z_loss_forward", "z_loss_backward", "rmsnorm_forward",
                        "attention_backward", "permute_forward", "linear_backward_dw"})
    EXPECT_TRUE(kinds.count(k)) << k << " did not run";
  const OpBreakdown base = engine_step(cfg, "1f1b", "full");
  const OpBreakdown eng = engine_step(cfg, "1f1b", "full", p);
  const OpBreakdown sim = profiled_only(simulated_step(cfg, "1f1b", "full", 1, p).ops);
  for (const auto& [k, e] : eng) {
    if (!exact.count(k.second)) continue;
    // Every call at a listed shape: well above the stream profile's microseconds.
    EXPECT_GE(e.seconds, 1e-3 * e.count) << k.first << " " << k.second;
    EXPECT_GT(e.seconds, 10 * base.at(k).seconds) << k.first << " " << k.second;
    const OpTally s = sim.count(k) ? sim.at(k) : OpTally{};
    EXPECT_DOUBLE_EQ(s.count, e.count) << k.first << " " << k.second;
    EXPECT_NEAR(s.seconds, e.seconds, 1e-9 * e.seconds) << k.first << " " << k.second;
  }
}

TEST(SimOpStream, MoeFullRebuildsTheExpertFfnOnce) {
  // moe-full without EP drops moe.combined and the expert FFN's tensors: the
  // backward's chunk loop rebuilds FC1 (gate, up) and the activation once, for its
  // own gradients, and takes the combine's input from them: the down projection
  // once more and the top-k weights' dot products (after zeroing their gradient).
  // The engine's calls are checked against this stream, call for call, above.
  const ModelConfig cfg = test::small_moe_config(2, 0, 4, true);
  const CostModel cost(stream_profile());
  LayerWork w{kB, kS, MoERows::balanced(cfg, kB * kS)};
  const LayerCost lc = layer_cost(cost, cfg, 0, w);
  const std::int64_t n = kB * kS, k = cfg.num_experts_per_tok, d = cfg.hidden_size, f = cfg.moe_intermediate_size,
                     R = w.rows.received;
  ASSERT_EQ(cfg.expert_chunk(R), R) << "one chunk";
  const std::vector<std::int64_t> groups = even_groups(R, cfg.num_experts);
  const Seconds fc1 = cost.grouped_linear_forward(groups, d, f), fc2 = cost.grouped_linear_forward(groups, f, d);
  const Seconds act = cost.swiglu_forward(R * f);
  const Seconds combine = cost.elementwise(n * k * kActivationBytes) + fc2 + cost.combine_topk_grad(n, k, d, R);
  auto moe_full = [](const std::string& n) { return static_policy_recomputes("moe-full", n); };
  const std::set<std::string> ffn = {"experts.gate_out", "experts.up_out", "experts.act", "moe.combined"};
  Seconds other = 0;  // router, norm, permutation and shared-expert rebuilds, once each
  for (const auto& [name, s] : lc.recompute)
    if (moe_full(name) && !ffn.count(name)) other += s;
  EXPECT_GT(other, 0);
  EXPECT_NEAR(lc.recompute_total(moe_full), other + (2 * fc1 + act) + combine, 1e-15);
  // Keeping the activation (moe-light's complement): the loop rebuilds FC1 alone, and
  // the combine's rows come from the kept activation.
  auto fc1_only = [](const std::string& n) { return n == "experts.gate_out" || n == "experts.up_out" || n == "moe.combined"; };
  EXPECT_NEAR(lc.recompute_total(fc1_only), 2 * fc1 + combine, 1e-15);
  // Dropping the combine's input costs far less than rebuilding the FFN for it.
  EXPECT_LT(lc.recompute_seconds("moe.combined"), 2 * fc1 + act + fc2);
}

TEST(SimOpStream, PipelineStagesCopyTheirInputsAndGradients) {
  // pp 2: the second stage copies its received input (F) and its input gradient
  // out (B); the first copies the received output gradient in (B): 3 copies of
  // [B*S, d] per micro-batch, none on one stage.
  const ModelConfig cfg = test::small_moe_config(4, 1, 4, true);
  const sim::SimReport one = simulated_step(cfg, "1f1b", "none", 1), two = simulated_step(cfg, "1f1b", "none", 2);
  auto copies = [](const sim::SimReport& r) {
    OpTally t;
    for (const auto& [k, x] : r.ops)
      if (k.second == "copy") {
        t.count += x.count;
        t.seconds += x.seconds;
      }
    return t;
  };
  EXPECT_EQ(copies(one).count, 0);
  EXPECT_EQ(copies(two).count, 3 * kM);
  const CostModel cost(stream_profile());
  EXPECT_NEAR(copies(two).seconds, 3 * kM * cost.elementwise(2 * kB * kS * cfg.hidden_size * 4), 1e-15);
}
