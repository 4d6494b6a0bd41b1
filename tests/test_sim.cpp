// The simulator: layer times against the cost model's primitives, the plan
// executor against schedule/simulate and the closed-form bubbles, collectives
// against their formulas, memory against MemoryWalk and the real arena, OOMs and
// their restart cost exactly at the memory limit, and the presets' parameter counts.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/model.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/schedule/simulate.h"
#include "moeflex/sim/cluster.h"
#include "moeflex/sim/presets.h"
#include "moeflex/sim/simulator.h"
#include "sim_fixtures.h"
#include "moeflex/train/optimizer.h"

using namespace moeflex;
using namespace moeflex::sim;

namespace {

constexpr FlopsPerSecond kRate = test::kGemmOnlyRate;

/// The bytes of the activation named `name` among `acts`, -1 if absent.
Bytes activation_bytes(const std::vector<ActivationSpec>& acts, const char* name) {
  for (const auto& a : acts)
    if (a.name == name) return a.bytes;
  return Bytes(-1);
}
using test::gemm_only_profile;

ClusterSpec test_cluster() {
  ClusterSpec c;
  c.name = "test";
  c.gpus_per_node = 8;
  c.device_memory = 1 * kGiB;
  c.intra_node = {1e-6, 100e9};
  c.inter_node = {5e-6, 10e9};
  c.element_bytes = 4;
  c.param_bytes = 8;
  c.optimizer_bytes = 8;
  c.peak_flops = kRate;
  c.profile = gemm_only_profile();
  return c;
}

// A dense-first MLA model: hidden 64, 4 heads, q_lora 32, kv_lora 16, q/k heads of
// 16 + 8 (rope), v heads of 12.
ModelConfig small_mla_config() {
  ModelConfig m = test::small_moe_config(1, 1, 4, true);
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.q_lora_rank = 32;
  m.kv_lora_rank = 16;
  m.qk_nope_head_dim = 16;
  m.qk_rope_head_dim = 8;
  m.v_head_dim = 12;
  m.validate();
  return m;
}

SimOptions small_options(const std::string& schedule, int pp, int m) {
  SimOptions o;
  o.model = test::small_moe_config(4, 1, 8, true);
  o.cluster = test_cluster();
  o.parallel.pp = pp;
  o.schedule = schedule;
  o.micro_batch_size = 2;
  o.seq_len = 16;
  o.global_batch = 2 * m;
  o.loads.constant = 1.0;
  return o;
}

}  // namespace

TEST(LayerCost, TimesAreTheGemmFlopsOverTheRate) {
  const CostModel cost(gemm_only_profile());
  ModelConfig cfg = test::small_moe_config(2, 1, 8, false);
  const std::int64_t B = 2, S = 16, n = B * S;
  for (int l = 0; l < 2; ++l) {
    LayerWork w;
    w.B = B;
    w.S = S;
    w.rows = MoERows::balanced(cfg, n);
    const LayerCost lc = layer_cost(cost, cfg, l, w);
    const double flops = layer_forward_flops(cfg, l, B, S);
    EXPECT_NEAR(lc.forward, flops / kRate, 1e-9 * flops / kRate) << "layer " << l;
    // backward = dx and dW of every GEMM: twice the forward's FLOPs
    EXPECT_NEAR(lc.backward(), 2 * flops / kRate, 1e-9 * flops / kRate) << "layer " << l;
    EXPECT_GT(lc.backward_weight, 0.3 * lc.backward());
    EXPECT_EQ(lc.a2a_send_bytes, 0);
  }
  LayerWork w;
  w.B = B;
  w.S = S;
  const LayerCost head = head_cost(cost, cfg, w);
  EXPECT_NEAR(head.forward, head_forward_flops(cfg, B, S) / kRate, 1e-12);
}

TEST(LayerCost, PricesTheRecomputeOfEveryRecomputableLedgerEntry) {
  // A new ledger entry with a lineage must get a price: the planner would take a
  // missing one (0 s) as a free recompute.
  HardwareProfile p = gemm_only_profile();
  p.memory_bandwidth = 1e9;
  p.launch_overhead = 1e-6;
  const CostModel cost(p);
  ModelConfig mla_moe = small_mla_config();  // its layer 1 an MoE layer
  mla_moe.num_hidden_layers = 2;
  for (const ModelConfig& cfg : {test::small_moe_config(2, 1, 8, true), mla_moe}) {
    LayerWork w;
    w.B = 2;
    w.S = 16;
    w.rows = MoERows::balanced(cfg, 32);
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const LayerCost lc = layer_cost(cost, cfg, l, w);
      for (const auto& a : layer_activations(cfg, l, 2, 16, w.rows, false))
        if (a.recomputable) EXPECT_GT(lc.recompute_seconds(a.name), 0) << "layer " << l << " " << a.name;
    }
    const LayerCost head = head_cost(cost, cfg, w);
    for (const auto& a : head_activations(cfg, 2, 16))
      if (a.recomputable) EXPECT_GT(head.recompute_seconds(a.name), 0) << "head " << a.name;
  }
}

TEST(LayerCost, RecomputeTimesAreTheLineagesOps) {
  HardwareProfile p = gemm_only_profile();
  p.memory_bandwidth = 1e9;
  p.launch_overhead = 1e-6;
  const CostModel cost(p);
  const ModelConfig cfg = test::small_moe_config(2, 0, 8, true);
  LayerWork w;
  w.B = 2;
  w.S = 16;
  w.rows = MoERows::balanced(cfg, 32);
  const LayerCost lc = layer_cost(cost, cfg, 0, w);
  const std::int64_t d = cfg.hidden_size, H = cfg.num_attention_heads, hd = cfg.head_dim();
  EXPECT_DOUBLE_EQ(lc.recompute_seconds("attn.probs"), cost.attention_forward(2, 16, H, hd));
  EXPECT_DOUBLE_EQ(lc.recompute_seconds("attn.q"), cost.linear_forward(32, d, d) + cost.rope(2, 16, H, hd));
  EXPECT_DOUBLE_EQ(lc.recompute_seconds("experts.act"), cost.swiglu_forward(w.rows.received * cfg.moe_intermediate_size));
  EXPECT_DOUBLE_EQ(lc.recompute_seconds("attn_norm.in"), 0);  // a layer input: no lineage
  // Every recomputable activation of the ledger has a time.
  for (const auto& a : layer_activations(cfg, 0, 2, 16, w.rows, false))
    if (a.recomputable) {
      EXPECT_GT(lc.recompute_seconds(a.name), 0) << a.name;
    }
  // Twice the rows received: the expert GEMMs cost twice as much.
  LayerWork hot = w;
  hot.ep = 2;
  hot.rows.received *= 2;
  LayerWork cold = w;
  cold.ep = 2;
  const LayerCost a = layer_cost(cost, cfg, 0, cold), b = layer_cost(cost, cfg, 0, hot);
  EXPECT_NEAR(b.recompute_seconds("experts.gate_out"), 2 * a.recompute_seconds("experts.gate_out"), 1e-12);
  EXPECT_EQ(b.a2a_recv_bytes, 2 * a.a2a_recv_bytes);
  EXPECT_EQ(a.a2a_send_bytes, w.rows.permuted / 2 * d * 4);  // half the rows stay local with ep 2
}

TEST(Sim, UnitCostBubbleEqualsTheScheduleSimulatorAndClosedForms) {
  struct Case {
    std::string name;
    int p, m, v;
  };
  for (const Case& c : {Case{"gpipe", 4, 8, 1}, Case{"1f1b", 4, 8, 1}, Case{"interleaved", 4, 8, 2},
                        Case{"zb-h1", 4, 8, 1}, Case{"dualpipev", 4, 10, 1}}) {
    const StepPlan plan = make_schedule(c.name, c.p, c.m, c.v);
    const SimResult ref = simulate(plan, Costs{});
    const PlanTimeline tl = run_plan(
        plan,
        [](int, const Action& a) -> ActionCost { return {a.kind == ActionKind::Backward ? 2.0 : 1.0, 0, 0, {}}; },
        [](const Action&) { return 0.0; });
    EXPECT_DOUBLE_EQ(tl.makespan, ref.makespan) << c.name;
    for (int r = 0; r < c.p; ++r) EXPECT_DOUBLE_EQ(tl.idle[std::size_t(r)], ref.ranks[std::size_t(r)].idle) << c.name;
    // unit per-action costs: interleaved's (p-1)(f+b+w) is per chunk
    EXPECT_DOUBLE_EQ(tl.idle[0], closed_form_bubble(c.name, c.p, Costs{})) << c.name;
  }
}

TEST(Sim, MessageLatencyAddsToTheGpipeBubble) {
  const StepPlan plan = make_schedule("gpipe", 4, 6, 1);
  const double c = 0.25;
  const PlanTimeline tl = run_plan(
      plan, [](int, const Action& a) -> ActionCost { return {a.kind == ActionKind::Backward ? 2.0 : 1.0, 0, 0, {}}; },
      [&](const Action&) { return c; });
  EXPECT_DOUBLE_EQ(tl.idle[0], 3 * (3 + 2 * c));  // docs/schedules.md: (p-1)(F+B+W+2c)
}

// Processes time-sharing cores (CoreSharing): enough cores change nothing; one
// core shared by every rank is work-conserving (with instant messages some rank
// can always run, so the makespan is the total work); and a group of processes
// whose demand is below p x T (imbalanced replicas) takes max(T, D / its cores).
TEST(Sim, CoreSharingStretchesByTheCoresEachProcessGets) {
  auto unit = [](int, const Action& a) -> ActionCost { return {a.kind == ActionKind::Backward ? 2.0 : 1.0, 0, 0, {}}; };
  auto instant = [](const Action&) { return 0.0; };
  for (const std::string name : {"gpipe", "1f1b", "zb-h1", "interleaved"}) {
    const StepPlan plan = make_schedule(name, 4, 8, name == "interleaved" ? 2 : 1);
    const PlanTimeline own = run_plan(plan, unit, instant);
    const PlanTimeline roomy = run_plan(plan, unit, instant, false, CoreSharing{8, 2});
    EXPECT_DOUBLE_EQ(roomy.makespan, own.makespan) << name;
    double work = 0;
    for (int r = 0; r < 4; ++r) work += own.busy[std::size_t(r)];
    const PlanTimeline one = run_plan(plan, unit, instant, false, CoreSharing{1, 1});
    EXPECT_NEAR(one.makespan, work, 1e-9 * work) << name;
    EXPECT_GT(one.makespan, own.makespan) << name;
    for (int r = 0; r < 4; ++r) EXPECT_NEAR(one.busy[std::size_t(r)] + one.idle[std::size_t(r)], one.makespan, 1e-9);
  }
  // One pipeline rank of 2 processes on 1 core: each process gets half a core.
  const StepPlan plan = make_schedule("1f1b", 1, 3, 1);
  const double m = 3;
  EXPECT_DOUBLE_EQ(run_plan(plan, unit, instant, false, CoreSharing{1, 2}).makespan, 2 * m * 3.0);
  // Imbalanced replicas: the cold one needs half of the hot one's time (D = 1.5 T).
  auto imbalanced = [](int, const Action& a) -> ActionCost {
    const double T = a.kind == ActionKind::Backward ? 2.0 : 1.0;
    return {T, 0, 1.5 * T, {}};
  };
  EXPECT_NEAR(run_plan(plan, imbalanced, instant, false, CoreSharing{1, 2}).makespan, m * 1.5 * 3.0, 1e-9);
  // With two cores each process has its own: the hot one decides (T).
  EXPECT_DOUBLE_EQ(run_plan(plan, imbalanced, instant, false, CoreSharing{2, 2}).makespan, m * 3.0);
  // Time slicing's loss (HardwareProfile::time_sharing_efficiency) stretches only an
  // oversubscribed group: 2 processes on 1 core at 80% take 1 / 0.8 of the work; on
  // 2 cores, nothing changes.
  EXPECT_NEAR(run_plan(plan, unit, instant, false, CoreSharing{1, 2, 0, 0.8}).makespan, 2 * m * 3.0 / 0.8, 1e-9);
  EXPECT_DOUBLE_EQ(run_plan(plan, imbalanced, instant, false, CoreSharing{2, 2, 0, 0.8}).makespan, m * 3.0);
}

// Processes doing different work between two synchronisations (the expert rows of
// EP ranks) under processor sharing: 4 processes of 1, 1, 1 and 2 s on 2 cores all
// run at half speed until the short ones end (2 s), then the long one alone (1 s).
TEST(Sim, UnevenProcessesShareTheCoresFairly) {
  ActionCost::Segment g{2.0, 5.0, {1.0, 1.0, 1.0, 2.0}};
  EXPECT_DOUBLE_EQ(segment_time(g, 2.0), 3.0);              // max(T, D / cores) would be 2.5
  EXPECT_DOUBLE_EQ(segment_time(g, 4.0), 2.0);              // a core each: the slowest
  EXPECT_DOUBLE_EQ(segment_time(g, 1.0), 5.0);              // one core: all the work
  EXPECT_NEAR(segment_time(g, 3.0), 4.0 / 3 + 1.0, 1e-12);  // all 4 at 3/4 until 4/3 s, then the last alone
  // Alike processes (no per-process times): max(T, D / cores) as before.
  EXPECT_DOUBLE_EQ(segment_time({2.0, 8.0, {}}, 2.0), 4.0);
  EXPECT_DOUBLE_EQ(segment_time({2.0, 8.0, {}}, 8.0), 2.0);
  // Through run_plan: one pipeline rank of 4 such processes on 2 cores, one forward
  // and one backward each made of that segment.
  const StepPlan plan = make_schedule("1f1b", 1, 1, 1);
  auto uneven = [&](int, const Action&) -> ActionCost { return {2.0, 0, 5.0, {g}}; };
  auto instant = [](const Action&) { return 0.0; };
  EXPECT_DOUBLE_EQ(run_plan(plan, uneven, instant, false, CoreSharing{2, 4}).makespan, 2 * 3.0);
  EXPECT_THROW(segment_time(g, 0.0), Error);
  EXPECT_THROW(segment_time({2.0, 5.0, {2.0, 1.0}}, 2.0), Error);  // each must be sorted
}

// The cores a group gets change partway through an uneven segment: GPipe over 2 stages
// of 2 processes each on 2 cores, every forward 1 s per process except stage 0's
// second, whose processes need 1 s and 3 s; backwards take nothing. Stage 0's F0
// has both cores (0-1 s). Then its F1 shares them with stage 1's F0: a core per stage,
// so both of F1's processes run at half speed and stage 1's F0 ends at 3 s, when F1's
// short process ends too (1 s of work each) and its long one has 2 s left. Alone from
// then on with 2 cores, it runs at full speed until 5 s; stage 1's F1 follows, 5-6 s.
// (Charging F1 as a fraction of its whole time would end it at 4.5 s: 1/2 of the 4 s it
// takes on 1 core, then the rest at the 3 s it takes on 2.)
TEST(Sim, ProcessorSharingFollowsTheCoresAGroupGetsAsTheyChange) {
  const StepPlan plan = make_schedule("gpipe", 2, 2, 1);
  auto cost = [](int rank, const Action& a) -> ActionCost {
    if (a.kind != ActionKind::Forward) return {};
    if (rank == 0 && a.microbatch == 1) return {3.0, 0, 4.0, {{3.0, 4.0, {1.0, 3.0}}}};
    return {1.0, 0, 2.0, {}};
  };
  auto instant = [](const Action&) { return 0.0; };
  const PlanTimeline tl = run_plan(plan, cost, instant, false, CoreSharing{2, 2});
  EXPECT_NEAR(tl.makespan, 6.0, 1e-9);
  // Processes done with their part leave the cores to everyone: 4 processes a stage on
  // 4 cores, stage 0's F1 of 0, 0, 0 and 3 s. From 1 s, its one live process and stage
  // 1's four share the 4 cores at 4/5 each: stage 1's F0 (1 s each) ends at 2.25 s, when
  // the long process has done 1 s; alone, it ends at 4.25 s; stage 1's F1 at 5.25 s.
  auto freed = [](int rank, const Action& a) -> ActionCost {
    if (a.kind != ActionKind::Forward) return {};
    if (rank == 0 && a.microbatch == 1) return {3.0, 0, 3.0, {{3.0, 3.0, {0.0, 0.0, 0.0, 3.0}}}};
    return {1.0, 0, 4.0, {}};
  };
  EXPECT_NEAR(run_plan(plan, freed, instant, false, CoreSharing{4, 4}).makespan, 5.25, 1e-9);
}

// A napping process (comm/wait_policy.h) costs the computing ones nap_cost a nap:
// nap_cost / (nap + overshoot) of a core, the nap growing with the wait.
TEST(Sim, NapShareFollowsTheCommunicatorsNaps) {
  CoreSharing sh{1, 1, 0, 1.0, 25e-6, 75e-6};
  Seconds end = 0;
  EXPECT_DOUBLE_EQ(nap_share(sh, 0, &end), 25.0 / 175);  // the shortest nap, 100 us
  EXPECT_DOUBLE_EQ(end, 2e-3);
  EXPECT_DOUBLE_EQ(nap_share(sh, 1.9e-3, &end), 25.0 / 175);
  // 2-4 ms: the nap of 2.83 ms waited (its geometric middle), a twentieth.
  EXPECT_NEAR(nap_share(sh, 3e-3, &end), 25e-6 / (std::sqrt(8e-6) / 20 + 75e-6), 1e-12);
  EXPECT_DOUBLE_EQ(end, 4e-3);
  EXPECT_NEAR(nap_share(sh, 17e-3, &end), 25e-6 / (std::sqrt(16e-3 * 20e-3) / 20 + 75e-6), 1e-12);
  EXPECT_DOUBLE_EQ(end, 20e-3);  // the last growing piece ends where the nap reaches 1 ms
  EXPECT_DOUBLE_EQ(nap_share(sh, 25e-3, &end), 25.0 / 1075);
  EXPECT_TRUE(std::isinf(end));
  // At a piece's end exactly, the next piece (the event loop stops there).
  EXPECT_NEAR(nap_share(sh, 2e-3, &end), 25e-6 / (std::sqrt(8e-6) / 20 + 75e-6), 1e-12);
  sh.nap_cost = 0;
  EXPECT_EQ(nap_share(sh, 0, &end), 0.0);
}

// Two ranks on one core, GPipe over 2 stages, one micro-batch, a 1 ms forward and
// free backwards: while one rank computes, the other naps and takes 1/7 of the core
// (25 us a 175 us nap), so each forward takes 8/7 ms. A 10 ms forward outlasts the
// shortest naps: the waiting rank's share falls piece by piece (2, 4, 8, 16 ms).
// Two processes of one rank that finish unevenly: the one done naps beside the other.
TEST(Sim, NappingRanksTakeTheirShareOfTheCores) {
  const StepPlan plan = make_schedule("gpipe", 2, 1, 1);
  auto instant = [](const Action&) { return 0.0; };
  const CoreSharing sh{1, 1, 0, 1.0, 25e-6, 75e-6};
  auto forward = [](Seconds f) {
    return [f](int, const Action& a) -> ActionCost { return {a.kind == ActionKind::Forward ? f : 0.0, 0, 0, {}}; };
  };
  CoreSharing free_naps = sh;
  free_naps.nap_cost = 0;
  EXPECT_NEAR(run_plan(plan, forward(1e-3), instant, false, free_naps).makespan, 2e-3, 1e-15);
  EXPECT_NEAR(run_plan(plan, forward(1e-3), instant, false, sh).makespan, 2 * 8e-3 / 7, 1e-15);
  // Time slicing's loss is not charged for a napper beside one computing process
  // (its nap_cost is what it costs): the same with an efficiency of 0.8.
  CoreSharing lossy = sh;
  lossy.efficiency = 0.8;
  EXPECT_NEAR(run_plan(plan, forward(1e-3), instant, false, lossy).makespan, 2 * 8e-3 / 7, 1e-15);
  // Work at 1 / (1 + share) while the other waits: 2 ms, then 2 ms, 4 ms, 8 ms, 4 ms,
  // then 1 ms naps (25 us a 1,075 us nap). 100 s is long enough for t - since to round
  // below a piece's end (the event loop must still move on).
  auto share = [](Seconds lo, Seconds hi) { return 25e-6 / (std::sqrt(lo * hi) / 20 + 75e-6); };
  auto makespan = [&](double work) {
    double left = work, t = 0;
    const double bounds[] = {0, 2e-3, 4e-3, 8e-3, 16e-3, 20e-3, 1e300};
    for (int k = 0; k < 6 && left > 0; ++k) {
      const double s = k == 0 ? 25.0 / 175 : k == 5 ? 25.0 / 1075 : share(bounds[k], bounds[k + 1]);
      const double span = bounds[k + 1] - bounds[k], done = span / (1 + s);
      if (done >= left) {
        t += left * (1 + s);
        left = 0;
      } else {
        t += span;
        left -= done;
      }
    }
    return 2 * t;
  };
  EXPECT_NEAR(run_plan(plan, forward(10e-3), instant, false, sh).makespan, makespan(10e-3), 1e-12);
  EXPECT_NEAR(run_plan(plan, forward(100.0), instant, false, sh).makespan, makespan(100.0), 1e-9);
  // One rank of 2 processes on 1 core, of 1 and 3 ms: both at half speed until 2 ms,
  // then the long one at 7/8 while the other naps (until its wait reaches 2 ms:
  // 1.75 ms of work), and its last 0.25 ms at 1 / (1 + the 2-4 ms share).
  const StepPlan one = make_schedule("1f1b", 1, 1, 1);
  auto uneven = [](int, const Action& a) -> ActionCost {
    if (a.kind != ActionKind::Forward) return {};
    return {3e-3, 0, 4e-3, {{3e-3, 4e-3, {1e-3, 3e-3}}}};
  };
  const CoreSharing two{1, 2, 0, 1.0, 25e-6, 75e-6};
  EXPECT_NEAR(run_plan(one, uneven, instant, false, two).makespan, 4e-3 + 0.25e-3 * (1 + share(2e-3, 4e-3)), 1e-12);
}

// Group-limited routing: a token's experts come from Gk of G groups, so with whole
// groups on each node it reaches fewer nodes, each with more of its rows.
TEST(Cluster, GroupLimitedRoutingCrossesToFewerNodes) {
  // 16 experts in 4 groups of 4, one expert a GPU, 4-GPU nodes (a group a node),
  // top-2 from 1 group: the token stays in one node, remote with chance 3/4.
  const GroupPlacement g = place_group(16, 1, 4);
  const RemoteNodeTraffic one = remote_node_traffic(g, 16, 2, 4, 1);
  EXPECT_NEAR(one.copies, 3 * 0.25, 1e-12);
  // Unlimited: each of the 3 remote nodes with 1 - C(12, 2) / C(16, 2) = 0.45.
  EXPECT_NEAR(remote_node_traffic(g, 16, 2).copies, 3 * (1 - 66.0 / 120), 1e-12);
  // Gk = G is no limit at all.
  EXPECT_NEAR(remote_node_traffic(g, 16, 2, 4, 4).copies, remote_node_traffic(g, 16, 2).copies, 1e-12);
  // The rows a node receives are the same k c / n either way: copies x rows per copy.
  EXPECT_NEAR(one.forwards, 0.25 * 3 * std::min(2.0 * 4 / 16 / 0.25, 4.0) * 3.0 / 4, 1e-12);
  // DeepSeek-V3, EP 64 on 8-GPU nodes (a group of 32 experts a node), top-8 from 4 of 8
  // groups: a remote node is hit when its group is chosen (1/2) and holds one of the
  // 8 drawn from the 128 experts of the chosen groups.
  double miss = 1;
  for (int i = 0; i < 8; ++i) miss *= (96.0 - i) / (128.0 - i);
  const GroupPlacement ep64 = place_group(64, 1, 8);
  const double limited = remote_node_traffic(ep64, 256, 8, 8, 4).copies;
  EXPECT_NEAR(limited, 7 * 0.5 * (1 - miss), 1e-12);
  EXPECT_LT(limited, 0.75 * remote_node_traffic(ep64, 256, 8).copies);  // about 31% fewer copies
  EXPECT_LE(limited, 4.0);                                              // at most 4 nodes a token
  // Two groups a node (EP 32: 64 experts a node), 4 of 8 groups: j of the node's 2 groups chosen.
  const GroupPlacement ep32 = place_group(32, 1, 8);
  double m1 = 1, m2 = 1;
  for (int i = 0; i < 8; ++i) m1 *= (96.0 - i) / (128.0 - i), m2 *= (64.0 - i) / (128.0 - i);
  const double h0 = 15.0 / 70, h1 = 2 * 20.0 / 70, h2 = 15.0 / 70;  // C(2,j) C(6,4-j) / C(8,4)
  EXPECT_NEAR(remote_node_traffic(ep32, 256, 8, 8, 4).copies, 3 * (1 - (h0 + h1 * m1 + h2 * m2)), 1e-12);
  // The dispatcher prices it: fewer copies over the NIC, a shorter dispatch.
  ClusterSpec c = test_cluster();
  c.intra_node.bandwidth = 1e18;
  const Bytes b = 64 * kMiB;
  EXPECT_LT(dedup_all_to_all_time(c, ep64, b, b, 256, 8, 8, 4), dedup_all_to_all_time(c, ep64, b, b, 256, 8));
  // Many groups: the hypergeometric stays finite (C(1024, 512) overflows a double) and
  // below the unlimited case (2 experts a group, 512 of 1024 groups a token).
  const double many = remote_node_traffic(ep64, 2048, 8, 1024, 512).copies;
  EXPECT_TRUE(std::isfinite(many));
  EXPECT_LE(many, remote_node_traffic(ep64, 2048, 8).copies + 1e-9);
  EXPECT_GT(many, 0.5 * remote_node_traffic(ep64, 2048, 8).copies);
  // Bad groupings are refused.
  EXPECT_THROW(remote_node_traffic(g, 16, 2, 3, 1), ConfigError);  // 3 does not divide 16
  EXPECT_THROW(remote_node_traffic(g, 16, 2, 4, 5), ConfigError);  // 5 of 4 groups
  EXPECT_THROW(remote_node_traffic(g, 16, 8, 4, 1), ConfigError);  // top-8 from one group of 4
}

namespace {

/// What each worst-placed member of an EP group sees, found rank by rank: groups of n
/// consecutive ranks tile a world of gpn-GPU nodes, member i holds experts
/// [i E / n, (i + 1) E / n); for every member whose node holds the fewest of its group,
/// the expert range [lo, hi) of each other node its group touches.
std::vector<std::vector<std::pair<int, int>>> worst_members_remote_nodes(int n, int gpn, int E) {
  struct View {
    int on_node;
    std::vector<std::pair<int, int>> remote;
  };
  std::vector<View> views;
  for (int q = 0; q < gpn; ++q) {           // group starts q n: their offsets in a node repeat within gpn groups
    std::vector<std::pair<int, int>> runs;  // members [first, last) per node, in order
    for (int i = 0; i < n; ++i) {
      if (i == 0 || (q * n + i) / gpn != (q * n + i - 1) / gpn) runs.push_back({i, i});
      runs.back().second = i + 1;
    }
    for (std::size_t a = 0; a < runs.size(); ++a) {
      View v{runs[a].second - runs[a].first, {}};
      for (std::size_t b = 0; b < runs.size(); ++b)
        if (b != a) v.remote.push_back({runs[b].first * E / n, runs[b].second * E / n});
      views.push_back(v);
    }
  }
  int fewest = n;
  for (const View& v : views) fewest = std::min(fewest, v.on_node);
  std::vector<std::vector<std::pair<int, int>>> worst;
  for (const View& v : views)
    if (v.on_node == fewest) worst.push_back(v.remote);
  return worst;
}

/// Copies by brute force: every choice of `chosen` of the E / per groups, then of k of
/// their experts, equally likely; the mean number of `nodes` holding one of the k.
double brute_force_copies(int E, int groups, int chosen, int k, const std::vector<std::pair<int, int>>& nodes) {
  const int per = E / groups;
  double sum = 0;
  int group_sets = 0;
  for (unsigned A = 0; A < (1u << groups); ++A) {
    if (__builtin_popcount(A) != chosen) continue;
    unsigned pool = 0;
    for (int g = 0; g < groups; ++g)
      if (A >> g & 1) pool |= ((1u << per) - 1) << (g * per);
    double hits = 0;
    int draws = 0;
    for (unsigned S = pool;; S = (S - 1) & pool) {  // every subset of the pool
      if (__builtin_popcount(S) == k) {
        ++draws;
        for (const auto& [lo, hi] : nodes) hits += (S >> lo & ((1u << (hi - lo)) - 1)) != 0 ? 1 : 0;
      }
      if (S == 0) break;
    }
    sum += hits / draws;
    ++group_sets;
  }
  return sum / group_sets;
}

}  // namespace

// Group-limited routing when nodes straddle group boundaries: the copies equal a
// brute-force count over every (groups, experts) choice of a token, for the
// worst-placed member of the group that sends the most (aligned nodes: 4 experts a node
// in groups of 3 give nodes of 3 + 1, 2 + 2 and 1 + 3, which are hit unequally).
TEST(Cluster, GroupLimitedRoutingIsExactWhenNodesStraddleGroups) {
  // 12 experts in 4 groups of 3; EP groups of n ranks on gpn-GPU nodes: nodes of 5
  // experts (1 + 3 + 1 of groups), 4 (3 + 1, 2 + 2, ...), 8, 9 (3 whole groups) and 3
  // (one whole group: the closed form held there before).
  const int E = 12, G = 4;
  int straddling = 0;
  for (const auto& [n, gpn] : std::vector<std::pair<int, int>>{{12, 5}, {12, 4}, {6, 4}, {4, 3}, {12, 3}}) {
    const GroupPlacement g = place_group(n, 1, gpn);
    const auto worst = worst_members_remote_nodes(n, gpn, E);
    ASSERT_FALSE(worst.empty());
    for (const auto& nodes : worst)
      for (const auto& [lo, hi] : nodes) straddling += lo / 3 != (hi - 1) / 3 && (lo % 3 != 0 || hi % 3 != 0);
    for (int chosen = 1; chosen < G; ++chosen)
      for (int k = 1; k <= std::min(3, 3 * chosen); ++k) {
        // The member sending the most copies of those with the fewest peers on their node.
        double most = 0;
        for (const auto& nodes : worst) most = std::max(most, brute_force_copies(E, G, chosen, k, nodes));
        EXPECT_NEAR(remote_node_traffic(g, E, k, G, chosen).copies, most, 1e-12)
            << "ep " << n << " on " << gpn << "-GPU nodes, top-" << k << " from " << chosen << " of 4 groups";
      }
  }
  EXPECT_GT(straddling, 0);
  // (Nodes of 5 experts, top-2 from 2 of 4 groups: 1.4333 copies; spreading each
  // node's experts evenly over the groups it touches, the closed form used until
  // 2026-11-30, gave 1.4444.)
  EXPECT_NEAR(remote_node_traffic(place_group(12, 1, 5), E, 2, G, 2).copies, 43.0 / 30, 1e-12);

  // DeepSeek-V3 on 6-GPU nodes (EP 64: 4 experts a rank, 24 a node, groups of 32),
  // top-8 from 4 of 8 groups: the copies of each worst-placed member, summed node by
  // node over the 70 choices of groups, each a draw of 8 of the 128 chosen experts:
  // 4.60, where the even split gave 4.31 (and 1.83 against 1.37 with 1 of 8 groups).
  const auto worst = worst_members_remote_nodes(64, 6, 256);
  const double dsv3 = remote_node_traffic(place_group(64, 1, 6), 256, 8, 8, 4).copies;
  ASSERT_FALSE(worst.empty());
  for (const auto& nodes : worst) {  // members alone at either end of a group: mirror images
    double copies = 0;
    for (const auto& [lo, hi] : nodes) {
      double miss = 0;
      int sets = 0;
      for (unsigned A = 0; A < 256; ++A) {
        if (__builtin_popcount(A) != 4) continue;
        ++sets;
        int held = 0;
        for (int e = lo; e < hi; ++e) held += A >> (e / 32) & 1;
        double p = 1;
        for (int i = 0; i < 8; ++i) p *= std::max(0.0, (128.0 - held - i) / (128.0 - i));
        miss += p;
      }
      copies += 1 - miss / sets;
    }
    EXPECT_NEAR(dsv3, copies, 1e-9);
  }
  // The experts must split into whole experts a rank.
  EXPECT_THROW(remote_node_traffic(place_group(12, 1, 8), 16, 2, 4, 2), ConfigError);
}

TEST(Cluster, GroupsThatStraddleNodesCountByTheirWorstPlacedMember) {
  // Aligned groups: a node's worth each.
  EXPECT_EQ(place_group(16, 1, 8).ranks_per_node, 8);
  EXPECT_EQ(place_group(64, 2, 8).ranks_per_node, 4);  // dp 64 with tp 2: 4 a node
  EXPECT_EQ(place_group(4, 2, 8).ranks_per_node, 4);   // fits a node
  // ep 6 on 8-GPU nodes: groups 0-5, 6-11 (2 + 4), 12-17 (4 + 2), 18-23.
  const GroupPlacement six = place_group(6, 1, 8);
  EXPECT_EQ(six.ranks_per_node, 2);
  EXPECT_EQ(six.full_node, 6);
  EXPECT_EQ(place_group(3, 1, 8).ranks_per_node, 1);   // 6-8: 2 + 1
  EXPECT_EQ(place_group(12, 1, 8).ranks_per_node, 4);  // 0-11: 8 + 4
  // tp 3 x dp 4 on 8-GPU nodes: the dp group (stride 3) of tp rank 0 is 0, 3, 6 | 9.
  EXPECT_EQ(place_group(4, 3, 8).ranks_per_node, 1);
  // Beyond kExactPlacementSpan the aligned count stands.
  EXPECT_EQ(place_group(8192, 1, 8).ranks_per_node, 8);
  // A straddling group reduces over the inter-node link.
  const ClusterSpec c = test_cluster();
  EXPECT_DOUBLE_EQ(all_reduce_time(c, six, kMiB), 10 * 5e-6 + 10.0 / 6 * double(kMiB) / 10e9);
}

TEST(Cluster, NodeDeduplicatedDispatchSendsATokenOncePerRemoteNode) {
  // Two nodes of one expert each, top-1: the other node gets the token half the
  // time, and forwards it to the expert's GPU 7 times in 8.
  const RemoteNodeTraffic two = remote_node_traffic(place_group(16, 1, 8), 2, 1);
  EXPECT_DOUBLE_EQ(two.copies, 0.5);
  EXPECT_DOUBLE_EQ(two.forwards, 0.5 * 7.0 / 8);
  // Top-k of every expert: each of the G - 1 other nodes gets it once.
  EXPECT_DOUBLE_EQ(remote_node_traffic(place_group(32, 1, 8), 8, 8).copies, 3.0);
  // One node: nothing crosses.
  EXPECT_DOUBLE_EQ(remote_node_traffic(place_group(8, 1, 8), 128, 8).copies, 0.0);
  // Qwen3's 128 experts, top-8, over 4 nodes: 3 (1 - C(96, 8) / C(128, 8)).
  double miss = 1;
  for (int i = 0; i < 8; ++i) miss *= (96.0 - i) / (128.0 - i);
  EXPECT_NEAR(remote_node_traffic(place_group(32, 1, 8), 128, 8).copies, 3 * (1 - miss), 1e-12);
  // A straddling group (ep 12 on 8-GPU nodes, the member with 4 on its node): one
  // remote node of 8 members, holding 8/12 of the 24 experts.
  double miss12 = 1;
  for (int i = 0; i < 2; ++i) miss12 *= (24.0 - 16 - i) / (24.0 - i);
  EXPECT_NEAR(remote_node_traffic(place_group(12, 1, 8), 24, 2).copies, 1 - miss12, 1e-12);
  EXPECT_THROW(remote_node_traffic(place_group(16, 1, 8), 8, 9), ConfigError);  // top-9 of 8

  ClusterSpec c = test_cluster();
  const Bytes b = 64 * kMiB;
  const GroupPlacement g = place_group(32, 1, 8);
  // In one node it is the plain all-to-all.
  EXPECT_DOUBLE_EQ(dedup_all_to_all_time(c, place_group(8, 1, 8), b, b, 128, 8),
                   all_to_all_time(c, place_group(8, 1, 8), b, b));
  // One GPU a node: nothing to forward; top-1: nothing to deduplicate. The plain
  // all-to-all again, however slow NVLink is.
  ClusterSpec one = c;
  one.gpus_per_node = 1;
  one.intra_node.bandwidth = 1e9;
  EXPECT_NEAR(dedup_all_to_all_time(one, place_group(8, 1, 1), b, b, 8, 1),
              all_to_all_time(one, place_group(8, 1, 1), b, b), 1e-12);
  // Top-1 on 8-GPU nodes: the NIC carries what the plain all-to-all sends off the
  // node; with NVLink out of the way the times agree.
  c.intra_node.bandwidth = 1e18;
  EXPECT_NEAR(dedup_all_to_all_time(c, g, b, b, 128, 1), all_to_all_time(c, g, b, b), 1e-12);
  // Top-8 of 128 over 4 nodes: the NIC carries copies / (8 x 24 / 32) of it.
  const double plain_inter = all_to_all_time(c, g, b, b) - c.inter_node.latency;
  const double ratio = remote_node_traffic(g, 128, 8).copies / (8.0 * 24 / 32);
  EXPECT_NEAR(dedup_all_to_all_time(c, g, b, b, 128, 8) - c.inter_node.latency, ratio * plain_inter,
              1e-9 * plain_inter);
  EXPECT_LT(ratio, 0.5);
}

TEST(Cluster, CollectivesFollowTheirFormulas) {
  const ClusterSpec c = test_cluster();
  const Bytes b = 64 * kMiB;
  // 16 ranks, 8 per node: 7/15 of the bytes over NVLink, 8/15 over the NIC, at once.
  const GroupPlacement g = place_group(16, 1, 8);
  EXPECT_EQ(g.ranks_per_node, 8);
  const double expect = 5e-6 + std::max(double(b) * 7 / 15 / 100e9, double(b) * 8 / 15 / 10e9);
  EXPECT_DOUBLE_EQ(all_to_all_time(c, g, b, b / 2), expect);
  // Within a node only NVLink.
  EXPECT_DOUBLE_EQ(all_to_all_time(c, place_group(8, 1, 8), b, b), 1e-6 + double(b) / 100e9);
  // A stride of a node: every peer is remote.
  EXPECT_EQ(place_group(4, 8, 8).ranks_per_node, 1);
  // Ring all-reduce: 2(n-1) alpha + 2(n-1)/n bytes / beta over the slowest link.
  EXPECT_DOUBLE_EQ(all_reduce_time(c, place_group(4, 1, 8), b), 6 * 1e-6 + 1.5 * double(b) / 100e9);
  EXPECT_DOUBLE_EQ(all_reduce_time(c, place_group(4, 8, 8), b), 6 * 5e-6 + 1.5 * double(b) / 10e9);
  EXPECT_DOUBLE_EQ(all_gather_time(c, place_group(4, 1, 8), b), 3 * 1e-6 + 0.75 * double(b) / 100e9);
  EXPECT_EQ(all_reduce_time(c, place_group(1, 1, 8), b), 0);
}

TEST(Sim, PeakEqualsMemoryWalkAndPersistentEqualsTheArena) {
  // fp32, and a --bf16 run's config on this 4-byte cluster: the bf16 engine's state
  // (with the working copies) and its activation program, exactly.
  for (const bool bf16 : {false, true}) {
    SimOptions o = small_options("1f1b", 1, 3);
    o.model.bf16 = bf16;
    const SimReport r = simulate(o);
    ASSERT_EQ(r.ranks.size(), 1u);
    Arena arena;
    MoEModel model(o.model, arena, ModelParallel{});
    AdamW opt(model.params(), arena, AdamWConfig{});
    EXPECT_EQ(r.ranks[0].persistent_bytes, arena.in_use()) << (bf16 ? "bf16" : "fp32");
    MemoryWalk w(o.model, o.micro_batch_size, o.seq_len, r.ranks[0].persistent_bytes);
    const StageSpec st{0, int(o.model.num_hidden_layers), true, true, 1};
    std::vector<MoERows> rows(std::size_t(o.model.num_hidden_layers), MoERows::balanced(o.model, 32));
    for (int mb = 0; mb < 3; ++mb) {
      w.forward(mb, st, rows, {});
      w.backward(mb, st);
    }
    EXPECT_EQ(r.peak_bytes, w.peak()) << (bf16 ? "bf16" : "fp32");
    // A policy that recomputes lowers it.
    o.policy = "full";
    EXPECT_LT(simulate(o).peak_bytes, r.peak_bytes) << (bf16 ? "bf16" : "fp32");
  }
}

TEST(Sim, ShortenedWalkKeepsThePeak) {
  for (const std::string s : {"1f1b", "zb-h1", "interleaved", "1f1b-overlap", "dualpipev"}) {
    SimOptions o = small_options(s, 2, 24);
    if (schedule_takes_vpp(s)) o.parallel.vpp = 2;
    const Bytes shortened = simulate(o).peak_bytes;  // walks 2 pp x chunks + 2 micro-batches of 24
    const int chunks = schedule_takes_vpp(s) || s == "dualpipev" ? 2 : 1;
    o.global_batch = 2 * (2 * 2 * chunks + 2);        // a step that short, walked whole
    EXPECT_EQ(simulate(o).peak_bytes, shortened) << s;
  }
}

TEST(Sim, CombinedOneFOneBHidesThePairsAllToAllsForOneMoreMicroBatch) {
  // Megatron-Core's EP overlap (1f1b-overlap) against interleaved, same layout:
  // pp 2 x vpp 2, dp 2 folded into ep 2, expert all-to-alls over a slow link so
  // that they matter.
  auto options = [](const std::string& schedule, bool overlap) {
    SimOptions o = small_options(schedule, 2, 8);
    o.model.hidden_size *= 4;  // compute of the order of the all-to-alls
    o.model.intermediate_size *= 4;
    o.model.moe_intermediate_size *= 4;
    o.parallel = {1, 2, 2, 2, 2};  // tp, pp, vpp, ep, dp
    o.global_batch = 2 * 2 * 8;    // 8 micro-batches per dp rank
    o.cluster.gpus_per_node = 1;   // every all-to-all crosses nodes
    o.cluster.inter_node = {1e-6, 2e9};
    o.overlap_pair_comm = overlap;
    return o;
  };
  const SimReport in = simulate(options("interleaved", true));
  const SimReport paired = simulate(options("1f1b-overlap", true));
  const SimReport drawn = simulate(options("1f1b-overlap", false));  // pairs at full cost
  // The all-to-alls' exposed part (exposed_comm less the data-parallel reduction).
  const Seconds a2a_in = in.exposed_comm - in.dp_reduce_time, a2a_paired = paired.exposed_comm - paired.dp_reduce_time;
  ASSERT_GT(a2a_in, 0.1 * in.step_time);
  EXPECT_LT(a2a_paired, 0.5 * a2a_in);
  EXPECT_LT(paired.step_time, in.step_time);
  EXPECT_LT(paired.step_time, drawn.step_time);
  // Without the overlap a pair is its F then its B: the step is interleaved's,
  // give or take the pair's sends, which wait for both halves.
  EXPECT_NEAR(drawn.step_time, in.step_time, 0.1 * in.step_time);
  // One more micro-batch in flight: a higher peak, on the same per-micro-batch bytes.
  EXPECT_GT(paired.peak_bytes, in.peak_bytes);
  EXPECT_EQ(paired.peak_bytes, drawn.peak_bytes);
}

TEST(Sim, APairHidesOnlyItsAllToAllsEachUnderTheOtherHalfsCompute) {
  ActionCost f{1.0, 3.0, 0, {}}, b{5.0, 1.0, 0, {}};
  f.overlappable = 2.0;  // of f's 3 s of comm, 2 are all-to-alls; 1 tensor-parallel
  b.overlappable = 1.0;
  EXPECT_DOUBLE_EQ(pair_exposed_comm(f, b, false), 4.0);
  EXPECT_DOUBLE_EQ(pair_exposed_comm(f, b, true), 1.0);  // the tp second stays; both all-to-alls hide
  // A forward's all-to-alls hide under the backward's compute only, not under their own half's.
  ActionCost f2{1.0, 2.0, 0, {}}, b2{0.5, 0.0, 0, {}};
  f2.overlappable = 2.0;
  EXPECT_DOUBLE_EQ(pair_exposed_comm(f2, b2, true), 1.5);  // a pooled rule would give 2 - 1.5 = 0.5
  // What a half may hide is part of its comm: an overlappable above it is clamped.
  ActionCost f3{1.0, 1.0, 0, {}}, b3{5.0, 0.0, 0, {}};
  f3.overlappable = 2.0;
  EXPECT_DOUBLE_EQ(pair_exposed_comm(f3, b3, true), 0.0);
  // Through the simulator: without expert parallelism, a bf16 pair hides nothing.
  SimOptions o = small_options("interleaved", 2, 8);
  o.parallel = {2, 2, 2, 1, 1};  // tp 2 (its collectives priced), ep 1
  o.overlap_pair_comm = true;
  o.global_batch = 2 * 8;
  const SimReport in = simulate(o);
  ASSERT_GT(in.exposed_comm, 0);
  o.schedule = "1f1b-overlap";
  const SimReport paired = simulate(o);
  EXPECT_GE(paired.step_time, in.step_time - 1e-12);
  EXPECT_NEAR(paired.exposed_comm, in.exposed_comm, 1e-12);
}

TEST(Sim, OomAndRestartCostExactlyWhenTheWalkExceedsMemory) {
  SimOptions o = small_options("1f1b", 2, 4);
  o.iterations = 5;
  o.checkpoint_interval = 2;
  o.restart_seconds = 100;
  const SimReport fits = simulate(o);
  EXPECT_EQ(fits.ooms, 0);
  EXPECT_DOUBLE_EQ(fits.effective_tgs, fits.tgs);
  o.memory_limit = fits.peak_bytes;  // exactly the peak: still fits
  EXPECT_EQ(simulate(o).ooms, 0);
  o.memory_limit = fits.peak_bytes - 1;
  const SimReport oom = simulate(o);
  EXPECT_EQ(oom.ooms, 5);
  // Every iteration fails (constant loads): none completes, so nothing is rolled
  // back, each attempt costs a restart and the failed step, and there is no
  // progress (test_sim_inputs.cpp covers OOMs on some iterations only).
  EXPECT_EQ(oom.lost_iterations, 0);
  EXPECT_NEAR(oom.restart_time, 5 * (100 + oom.step_time), 1e-9);
  EXPECT_EQ(oom.effective_tgs, 0.0);
  // The adaptive policy recomputes instead and does not fail.
  o.policy = "adaptive";
  const SimReport ad = simulate(o);
  EXPECT_EQ(ad.ooms, 0);
  EXPECT_LE(ad.peak_bytes, o.memory_limit);
  EXPECT_GT(ad.recompute_time, 0);
}

TEST(Sim, SpikesRaiseTheHotRanksPeakAndStepTime) {
  SimOptions o = small_options("1f1b", 2, 4);
  o.parallel.dp = 2;
  o.parallel.ep = 2;
  o.global_batch = 2 * 2 * 4;
  const SimReport calm = simulate(o);
  o.loads.constant = 1.8;
  const SimReport hot = simulate(o);
  EXPECT_GT(hot.peak_bytes, calm.peak_bytes);
  EXPECT_GT(hot.step_time, calm.step_time);
  EXPECT_GT(hot.exposed_comm, calm.exposed_comm);
  EXPECT_EQ(hot.ranks[0].peak_balanced_bytes, calm.ranks[0].peak_balanced_bytes);
}

// A recorded loads.jsonl (moeflex train's format) in which the hottest EP rank
// changes from layer to layer and micro-batch to micro-batch: replayed per rank, each data-parallel
// rank's peak is exactly MemoryWalk's at that rank's own rows, and the reported
// peak (their max) lies below the old bound that gives one rank every micro-batch's
// hottest load.
TEST(Sim, PerRankReplayPeakIsEachRanksOwnWalk) {
  SimOptions o = small_options("1f1b", 1, 3);
  o.model = test::small_moe_config(3, 1, 8, true);  // layer 0 dense, layers 1 and 2 MoE
  o.parallel.dp = 2;
  o.parallel.ep = 2;
  o.global_batch = 2 * 2 * 3;
  const std::int64_t n = o.micro_batch_size * o.seq_len, kept = n * o.model.num_experts_per_tok;  // 64
  const auto& received = test::kLoadsReceived;  // [MoE layer][mb][dp rank]
  const auto dir = test::write_loads_jsonl(kept, "loads");
  const nlohmann::json line = nlohmann::json::parse(std::ifstream(dir / "loads.jsonl"));  // its one step
  o.loads = LoadModel::from_file(dir);  // a run directory: its loads.jsonl
  ASSERT_TRUE(o.loads.per_rank());
  EXPECT_EQ(o.loads.recorded_steps(), 1u);  // `simulate --loads` replays that many iterations by default
  EXPECT_EQ(LoadModel{}.recorded_steps(), 0u);
  EXPECT_DOUBLE_EQ(o.loads.ratio(0, 0, 3, 0), 100.0 / 64.0);  // max / mean of the group
  EXPECT_DOUBLE_EQ(o.loads.ratio(0, 2, 3, 1), 120.0 / 64.0);
  const SimReport r = simulate(o);
  ASSERT_EQ(r.ranks.size(), 1u);
  ASSERT_EQ(r.ranks[0].dp_rank_peak_bytes.size(), 2u);

  const StageSpec st{0, 3, true, true, 2};
  auto walk_at = [&](auto rows_of) {
    MemoryWalk w(o.model, o.micro_batch_size, o.seq_len, r.ranks[0].persistent_bytes);
    for (int mb = 0; mb < 3; ++mb) {
      std::vector<MoERows> rows = {MoERows::balanced(o.model, n)};
      for (int k = 0; k < 2; ++k) rows.push_back(MoERows{kept, rows_of(k, mb)});
      w.forward(mb, st, rows, {});
      w.backward(mb, st);
    }
    return w.peak();
  };
  Bytes exact_max = 0;
  for (int q = 0; q < 2; ++q) {
    const Bytes own = walk_at([&](int k, int mb) { return received[std::size_t(k)][std::size_t(mb)][std::size_t(q)]; });
    EXPECT_EQ(r.ranks[0].dp_rank_peak_bytes[std::size_t(q)], own) << "dp rank " << q;
    exact_max = std::max(exact_max, own);
  }
  EXPECT_NE(r.ranks[0].dp_rank_peak_bytes[0], r.ranks[0].dp_rank_peak_bytes[1]);
  EXPECT_EQ(r.peak_bytes, exact_max);
  const Bytes bound = walk_at([&](int k, int mb) {
    return std::max(received[std::size_t(k)][std::size_t(mb)][0], received[std::size_t(k)][std::size_t(mb)][1]);
  });
  EXPECT_LT(r.peak_bytes, bound);
  // The sampled mode at the largest recorded ratio keeps the upper-bound walk.
  SimOptions sampled = o;
  sampled.loads = LoadModel{};
  sampled.loads.constant = 120.0 / 64.0;
  EXPECT_GE(simulate(sampled).peak_bytes, bound);
  // A replay needs the run's own layout.
  SimOptions other = o;
  other.parallel.dp = 4;
  other.global_batch = 2 * 4 * 3;
  EXPECT_THROW(simulate(other), ConfigError);
  // A table of the wrong shape is refused, naming the field.
  {
    nlohmann::json bad = line;
    bad["received"][0].erase(0);  // layer 0 loses a micro-batch
    std::ofstream(dir / "loads.jsonl") << bad.dump() << "\n";
    try {
      LoadModel::from_file(dir / "loads.jsonl");
      ADD_FAILURE() << "a short 'received' table was accepted";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("'received'"), std::string::npos) << e.what();
    }
  }
  // The format follows the content, not the name: a renamed loads.jsonl replays
  // per rank, and a file that is neither format is refused.
  std::ofstream(dir / "renamed.jsonl") << line.dump() << "\n";
  const LoadModel renamed = LoadModel::from_file(dir / "renamed.jsonl");
  EXPECT_TRUE(renamed.per_rank());
  EXPECT_DOUBLE_EQ(renamed.ratio(0, 2, 3, 1), 120.0 / 64.0);
  std::ofstream(dir / "junk.jsonl") << "{}\n";
  EXPECT_THROW(LoadModel::from_file(dir / "junk.jsonl"), DataError);
  std::filesystem::remove_all(dir);
}

TEST(Sim, InvalidLayoutsAreRefusedWithTheRule) {
  SimOptions o = small_options("1f1b", 1, 2);
  o.parallel.dp = 4;
  o.parallel.ep = 3;  // does not divide dp 4
  o.global_batch = 8;
  EXPECT_THROW(simulate(o), ConfigError);
  o = small_options("interleaved", 2, 3);  // m % p != 0
  o.parallel.vpp = 2;
  EXPECT_THROW(simulate(o), ConfigError);
}

TEST(Presets, ModelsHaveTheirPublishedParameterCounts) {
  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  struct P {
    const char* name;
    double params;
    double tol;  // relative; GQA, head_dim and MLA are modelled
  };
  for (const P& p :
       {P{"deepseek-v3", 671e9, 0.001}, P{"mixtral-8x7b", 46.7e9, 0.001}, P{"mixtral-8x22b", 141e9, 0.005},
        P{"qwen3-30b-a3b", 30.5e9, 0.002}, P{"qwen3-235b-a22b", 235e9, 0.001}, P{"kimi-k2-1t", 1.04e12, 0.02}}) {
    const ModelConfig c = load_model(p.name, root);
    EXPECT_NEAR(double(c.num_params()), p.params, p.tol * p.params) << p.name;
  }
  EXPECT_EQ(load_model("deepseek-v3", root).num_experts, 256);
  EXPECT_EQ(load_model("mixtral-8x7b", root).moe_intermediate_size, 14336);
  // GQA and Qwen3's explicit head_dim (64 heads of 128 on hidden 4096, 4 kv heads).
  const ModelConfig q = load_model("qwen3-235b-a22b", root);
  EXPECT_EQ(q.head_dim(), 128);
  EXPECT_EQ(q.kv_heads(), 4);
  EXPECT_EQ(q.q_width(), 8192);
  EXPECT_TRUE(q.engine_attention());  // GQA with wide heads: the engine trains it
  EXPECT_EQ(load_model("mixtral-8x7b", root).kv_width(), 8 * 128);
  EXPECT_NEAR(double(q.num_active_params()), 22e9, 0.01 * 22e9);
  EXPECT_THROW(load_model("no-such-model", root), ConfigError);
}

TEST(Presets, ClustersLoad) {
  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  const ClusterSpec h100 = load_cluster("h100", root), h200 = load_cluster("h200", root);
  EXPECT_EQ(h100.gpus_per_node, 8);
  EXPECT_EQ(h100.peak_flops, 989e12);
  EXPECT_GT(h200.usable_memory(), h100.usable_memory());
  // The derived GEMM rate reaches the stated efficiency on a large GEMM.
  const CostModel cm(h100.profile);
  EXPECT_NEAR(cm.gemm_rate(16384, 16384, 16384), 0.72 * 989e12, 0.01 * 989e12);
  EXPECT_LT(cm.gemm_rate(64, 64, 64), 0.1 * 989e12);
  const ClusterSpec g = load_cluster("generic-64g", root);
  EXPECT_EQ(g.device_memory, 64 * kGiB);
  EXPECT_THROW(load_cluster("no-such-cluster", root), ConfigError);
}

// Routed experts are whole on each tensor-parallel rank (ETP 1: each tp rank runs its
// own tokens through them), so their gradients are reduced, and their optimizer state
// sharded, over tp x dp / ep ranks: doubling tp halves the expert optimizer state.
TEST(Sim, ExpertOptimizerStateIsShardedOverTensorTimesDataParallelOverEp) {
  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  const ClusterSpec cl = load_cluster("h100", root);
  ASSERT_TRUE(cl.optimizer_sharded);
  ModelConfig few = load_model("mixtral-8x7b", root), many = few;
  many.num_experts = 2 * few.num_experts;
  const int L = few.num_hidden_layers;
  // Bytes the extra experts (and their router rows) add to a rank holding every layer.
  auto extra = [&](const char* layout) {
    const ParallelSpec par = ParallelSpec::parse(layout);
    return double(persistent_bytes(many, cl, par, {{0, L}}, false, false) -
                  persistent_bytes(few, cl, par, {{0, L}}, false, false));
  };
  const int dp = 8, ep = 4;
  // The extra expert weights on a rank: 3 matrices of (E / ep) x f x d per layer.
  const double n =
      3.0 * L * (double(few.num_experts) / ep) * double(few.moe_intermediate_size) * double(few.hidden_size);
  const double ob = cl.optimizer_bytes;  // the m and v tensors together
  // tp 1 -> 2: the weights, gradients and the router's rows are unchanged; the expert
  // optimizer state goes from n ob / (dp / ep) to n ob / (2 dp / ep).
  const double want = n * ob / (double(dp) / ep) - n * ob / (2.0 * dp / ep);
  EXPECT_NEAR(extra("tp=1,ep=4,dp=8") - extra("tp=2,ep=4,dp=8"), want, 1e-6 * want);
  // And with tp 2, ep 8 over dp 8: tp x dp / ep = 2 ranks hold each shard.
  EXPECT_NEAR(extra("tp=2,ep=8,dp=8"), n / 2 * (cl.param_bytes + ob / 2), 1e-3 * n * cl.param_bytes);
}

TEST(Sim, ExpertParallelismFoldsOverTensorTimesDataParallel) {
  // Megatron-Core's rank order for expert layers with expert tensor parallelism 1 is
  // tp-ep-dp-pp over the tp x dp ranks of a stage: an EP group is ep consecutive
  // ranks, its expert-data-parallel peers are ep apart.
  const ParallelSpec qwen = ParallelSpec::parse("tp=4,pp=8,ep=8,dp=8");
  EXPECT_EQ(expert_parallel_placement(qwen, 8).size, 8);
  EXPECT_EQ(expert_parallel_placement(qwen, 8).ranks_per_node, 8);  // one node, not 4 (stride tp)
  EXPECT_EQ(expert_data_parallel_placement(qwen, 8).size, 4);
  EXPECT_EQ(expert_data_parallel_placement(qwen, 8).ranks_per_node, 1);
  const ParallelSpec folded = ParallelSpec::parse("tp=2,pp=8,ep=32,dp=16");  // ep > dp
  EXPECT_EQ(expert_parallel_placement(folded, 8).size, 32);
  EXPECT_EQ(expert_parallel_placement(folded, 8).ranks_per_node, 8);
  EXPECT_EQ(expert_data_parallel_placement(folded, 8).size, 1);

  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  SimOptions o;
  o.model = load_model("qwen3-30b-a3b", root);
  o.cluster = load_cluster("h100", root);
  o.schedule = "1f1b";
  o.global_batch = 16;
  o.seq_len = 4096;
  o.loads.constant = 1.0;
  // The layers' blocking collectives (exposed communication less the gradient reduction).
  auto layer_comm = [&](const char* layout, double inter_node_scale) {
    SimOptions q = o;
    q.parallel = ParallelSpec::parse(layout);
    q.cluster.inter_node.bandwidth *= inter_node_scale;
    const SimReport r = simulate(q);
    return r.exposed_comm - r.dp_reduce_time;
  };
  // 16 ranks on 2 nodes. ep 8 over tp 2 x dp 8 stays in a node: a 100x slower
  // inter-node link leaves the all-to-alls alone.
  const double in_node = layer_comm("tp=2,ep=8,dp=8", 1.0);
  EXPECT_GT(in_node, 0);
  EXPECT_NEAR(layer_comm("tp=2,ep=8,dp=8", 0.01), in_node, 1e-9 * in_node);
  // ep 16 > dp 8 folds over both nodes: it runs, and its all-to-alls cross them.
  const double across = layer_comm("tp=2,ep=16,dp=8", 1.0);
  EXPECT_GT(across, in_node);
  EXPECT_GT(layer_comm("tp=2,ep=16,dp=8", 0.01), 10 * across);
  // The routed experts split 16 ways: each rank holds half of ep 8's expert weights.
  const ModelConfig& cfg = o.model;
  auto persist = [&](const char* layout) {
    return double(persistent_bytes(cfg, o.cluster, ParallelSpec::parse(layout), {{0, 1}}, false, false));
  };
  const double expert_numel =
      3.0 * double(cfg.num_experts) * double(cfg.moe_intermediate_size) * double(cfg.hidden_size);
  // Weights and gradients (param_bytes) per expert element; the optimizer state is
  // sharded over tp x dp / ep = 2 (ep 8) and 1 (ep 16) ranks.
  ASSERT_TRUE(cfg.is_moe_layer(0));
  ASSERT_TRUE(o.cluster.optimizer_sharded);
  auto per_element = [&](double shard) { return o.cluster.param_bytes + o.cluster.optimizer_bytes / shard; };
  const double per_el8 = per_element(2) / 8, per_el16 = per_element(1) / 16;
  EXPECT_NEAR(persist("tp=2,ep=8,dp=8") - persist("tp=2,ep=16,dp=8"), expert_numel * (per_el8 - per_el16),
              1e-3 * expert_numel * per_el8);
  // The deepep dispatcher sends each token once per node: ep 16 over 2 nodes gets
  // cheaper, ep 8 in one node does not change; an unknown dispatcher is refused.
  {
    SimOptions d = o;
    d.dispatcher = "deepep";
    d.parallel = ParallelSpec::parse("tp=2,ep=16,dp=8");
    const SimReport r = simulate(d);
    EXPECT_LT(r.exposed_comm - r.dp_reduce_time, across);
    d.parallel = ParallelSpec::parse("tp=2,ep=8,dp=8");
    const SimReport r8 = simulate(d);
    EXPECT_NEAR(r8.exposed_comm - r8.dp_reduce_time, in_node, 1e-9 * in_node);
    d.dispatcher = "nccl";
    EXPECT_THROW(simulate(d), ConfigError);
  }
  // ep must divide tp x dp: the error names both.
  SimOptions bad = o;
  bad.parallel = ParallelSpec::parse("tp=2,ep=32,dp=8");
  try {
    (void)simulate(bad);
    FAIL() << "ep 32 over tp 2 x dp 8 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tp 2 x dp 8 = 16"), std::string::npos) << e.what();
  }
}

TEST(Sim, DeepSeekV3OnALargeClusterRuns) {
  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  SimOptions o;
  o.model = load_model("deepseek-v3", root);
  o.cluster = load_cluster("h100", root);
  o.parallel = ParallelSpec::parse("tp=2,pp=8,vpp=4,ep=64,dp=64");
  o.schedule = "interleaved";
  o.global_batch = 1024;
  o.seq_len = 4096;
  o.loads.constant = 1.1;
  const SimReport r = simulate(o);
  EXPECT_EQ(r.ranks.size(), 8u);
  EXPECT_GT(r.mfu, 0.05);
  EXPECT_LT(r.mfu, 0.7);
  EXPECT_GT(r.exposed_comm, 0);
  EXPECT_NEAR(r.tgs * r.step_time * 1024, 1024.0 * 4096, 1e-6 * 1024 * 4096);
}

TEST(LayerCost, GroupedQueryAttentionAndWideHeadsAreWhatTheyCompute) {
  // A dense layer of hidden 64 with 8 heads of 16 (q and o 128 wide) and 2 kv heads (k, v 32 wide).
  ModelConfig m = test::small_moe_config(1, 1, 4, true);
  m.hidden_size = 64;
  m.num_attention_heads = 8;
  m.head_dim_override = 16;
  m.num_key_value_heads = 2;
  m.validate();
  const std::int64_t B = 2, S = 32, n = B * S, d = 64;
  const double attn = 2.0 * n * d * (2 * 128 + 2 * 32) + 4.0 * B * 8 * S * S * 16;
  EXPECT_DOUBLE_EQ(layer_forward_flops(m, 0, B, S), attn + 6.0 * n * d * m.intermediate_size);
  // Activations: q and the attention output n x 128, k and v n x 32.
  const auto bytes = [acts = layer_activations(m, 0, B, S, MoERows{}, false)](const char* name) {
    return activation_bytes(acts, name);
  };
  EXPECT_EQ(bytes("attn.q"), n * 128 * 4);
  EXPECT_EQ(bytes("attn.k"), n * 32 * 4);
  EXPECT_EQ(bytes("attn.v"), n * 32 * 4);
  EXPECT_EQ(bytes("attn.out"), n * 128 * 4);
  // The GEMMs: q 64 -> 128 and k, v 64 -> 32 in the forward, o 128 -> 64.
  const CostModel c(gemm_only_profile());
  const LayerCost lc = layer_cost(c, m, 0, LayerWork{B, S, {}, 1, 1, false, 4});
  ModelConfig mha = m;
  mha.num_key_value_heads = 0;
  const LayerCost full = layer_cost(c, mha, 0, LayerWork{B, S, {}, 1, 1, false, 4});
  EXPECT_NEAR(full.forward - lc.forward, 2 * (c.linear_forward(n, d, 128) - c.linear_forward(n, d, 32)), 1e-15);
  // The engine builds the same layer: its parameters add up to the config's count.
  Arena arena;
  MoEModel engine(m, arena, ModelParallel{});
  std::int64_t engine_params = 0;
  for (const Param& p : engine.params()) engine_params += p.w.numel();
  EXPECT_EQ(engine_params, m.num_params());
  // Multi-head latent attention stays the simulator's only.
  Arena mla_arena;
  EXPECT_THROW(MoEModel(small_mla_config(), mla_arena, ModelParallel{}), ConfigError);
  m.num_key_value_heads = 3;  // does not divide 8 heads
  EXPECT_THROW(m.validate(), ConfigError);
}

// Multi-head latent attention (DeepSeek-V2/V3): parameters, activation widths, FLOPs
// and the priced ops of a dense layer with hidden 64, 4 heads, q_lora 32, kv_lora 16,
// q/k heads of 16 + 8 (rope), v heads of 12.
TEST(LayerCost, MultiHeadLatentAttentionIsWhatItComputes) {
  ModelConfig m = small_mla_config();
  EXPECT_TRUE(m.mla());
  EXPECT_FALSE(m.engine_attention());
  EXPECT_EQ(m.q_width(), 96);
  EXPECT_EQ(m.k_width(), 96);
  EXPECT_EQ(m.v_width(), 48);
  EXPECT_EQ(m.attn_out_width(), 48);
  // q: 64x32 down, its norm 32, 32x96 up; kv: 64x(16+8) down, norm 16, 16x(4 x (16+12)) up; o 48x64.
  const std::int64_t params = 64 * 32 + 32 + 32 * 96 + 64 * 24 + 16 + 16 * 4 * 28 + 48 * 64;
  EXPECT_EQ(m.attention_params(), params);
  const std::int64_t B = 2, S = 32, n = B * S, d = 64;
  EXPECT_DOUBLE_EQ(layer_forward_flops(m, 0, B, S),
                   2.0 * n * (params - 48) + 2.0 * B * 4 * S * S * (24 + 12) + 6.0 * n * d * m.intermediate_size);
  const auto bytes = [acts = layer_activations(m, 0, B, S, MoERows{}, false)](const char* name) {
    return activation_bytes(acts, name);
  };
  EXPECT_EQ(bytes("attn.q"), n * 96 * 4);
  EXPECT_EQ(bytes("attn.k"), n * 96 * 4);
  EXPECT_EQ(bytes("attn.v"), n * 48 * 4);
  EXPECT_EQ(bytes("attn.out"), n * 48 * 4);
  // The latents: q's normed and pre-norm [n, 32], kv's [n, 16] twice and the rope key [n, 8].
  EXPECT_EQ(bytes("attn.q_latent"), n * 2 * 32 * 4);
  EXPECT_EQ(bytes("attn.kv_latent"), n * (2 * 16 + 8) * 4);
  for (const auto& a : layer_activations(m, 0, B, S, MoERows{}, false)) {
    const std::vector<std::string> want = a.name == "attn.q" ? std::vector<std::string>{"attn.q_latent"}
                                          : a.name == "attn.k" || a.name == "attn.v"
                                              ? std::vector<std::string>{"attn.kv_latent"}
                                          : a.name.ends_with("_latent") ? std::vector<std::string>{"attn_norm.out"}
                                                                        : a.inputs;
    EXPECT_EQ(a.inputs, want) << a.name;
  }
  // The forward's GEMMs: the MLP's (the same as in a multi-head layer of the same FFN)
  // and MLA's five; the core priced at (24 + 12) / 2-wide heads; the latents' 2 norms.
  const CostModel c(gemm_only_profile());
  const LayerWork w{B, S, {}, 1, 1, false, 4, true};
  const LayerCost mla = layer_cost(c, m, 0, w);
  ModelConfig mha = m;
  mha.kv_lora_rank = mha.q_lora_rank = 0;
  mha.validate();
  const LayerCost plain = layer_cost(c, mha, 0, w);
  const std::pair<std::string, std::string> lf{"forward", "linear_forward"};
  const Seconds mlp = plain.ops.at(lf).seconds - 3 * c.linear_forward(n, d, 64) - c.linear_forward(n, 64, d);
  const Seconds five = c.linear_forward(n, d, 32) + c.linear_forward(n, 32, 96) + c.linear_forward(n, d, 24) +
                       c.linear_forward(n, 16, 112) + c.linear_forward(n, 48, d);
  EXPECT_NEAR(mla.ops.at(lf).seconds, mlp + five, 1e-12 * (mlp + five));
  EXPECT_DOUBLE_EQ(mla.ops.at({"forward", "attention_forward"}).seconds, c.attention_forward(B, S, 4, 18));
  EXPECT_EQ(mla.ops.at({"forward", "rmsnorm_forward"}).count, plain.ops.at({"forward", "rmsnorm_forward"}).count + 2);
  // Rebuilds: a head from its latent (up projection, rope), a latent from the input
  // (down projection, norm); rebuilding both is the whole projection once.
  auto rebuilt = [&](std::set<std::string> names) {
    return mla.recompute_total([&](const std::string& x) { return names.count(x) > 0; });
  };
  EXPECT_DOUBLE_EQ(rebuilt({"attn.q"}), c.linear_forward(n, 32, 96) + c.rope(B, S, 4, 8));
  EXPECT_DOUBLE_EQ(rebuilt({"attn.q_latent"}), c.linear_forward(n, d, 32) + c.rmsnorm_forward(n, 32));
  EXPECT_DOUBLE_EQ(rebuilt({"attn.kv_latent"}), c.linear_forward(n, d, 24) + c.rmsnorm_forward(n, 16));
  // kv's up projection [16 -> 4 x (16 + 12)] is k's nope part and v: each rebuilds its share.
  EXPECT_DOUBLE_EQ(rebuilt({"attn.k"}), c.linear_forward(n, 16, 64) + c.rope(B, S, 1, 8));
  EXPECT_DOUBLE_EQ(rebuilt({"attn.v"}), c.linear_forward(n, 16, 48));
  // The simulator walks the latents under every policy: a step holds them (none), or
  // rebuilds them (full), and costs more memory than without them.
  {
    SimOptions o = small_options("1f1b", 1, 2);
    o.model = m;
    o.cluster.element_bytes = 4;
    const SimReport none = simulate(o);
    o.policy = "full";
    const SimReport full = simulate(o);
    EXPECT_LT(full.peak_bytes, none.peak_bytes);
    o.policy = "adaptive";
    EXPECT_NO_THROW(simulate(o));
    o.policy = "selective";
    EXPECT_NO_THROW(simulate(o));
  }
  // Only the simulator runs it.
  Arena arena;
  EXPECT_THROW(MoEModel(m, arena, ModelParallel{}), ConfigError);
  m.qk_rope_head_dim = 7;  // RoPE needs an even width
  EXPECT_THROW(m.validate(), ConfigError);
}

// The walk's per-thread memos key on the latents' sizes: two MLA models with the same
// head widths but other latents walk their own (a review found the second reusing the
// first's lists: a wrong peak, or an activation missing).
TEST(Sim, MlaVariantsWithTheSameHeadWidthsWalkTheirOwnLatents) {
  ModelConfig a = small_mla_config();
  a.num_hidden_layers = 2;  // a layer for each of the 2 stages
  ModelConfig b = a, q0 = a;
  b.kv_lora_rank = 64;
  q0.q_lora_rank = 0;
  for (const std::string policy : {"none", "full"}) {
    SimOptions o = small_options("zb-h1", 2, 4);  // a split backward too
    o.model = a;
    o.policy = policy;
    const Bytes pa = simulate(o).peak_bytes;
    for (const ModelConfig& m : {b, q0}) {
      o.model = m;
      Bytes after = 0, fresh = 0;
      EXPECT_NO_THROW(after = simulate(o).peak_bytes) << policy;
      std::thread([&] { fresh = simulate(o).peak_bytes; }).join();  // its own memos
      EXPECT_EQ(after, fresh) << policy << " kv " << m.kv_lora_rank << " q " << m.q_lora_rank;
    }
    o.model = b;
    if (policy == "none") {
      EXPECT_GT(simulate(o).peak_bytes, pa);  // larger latents held
    }
  }
}

// Group-limited routing (HF n_group, topk_group): read from DeepSeek-V3's config,
// validated, and run by the engine's router (golden files in test_model.cpp).
TEST(LayerCost, GroupLimitedRoutingIsReadAndValidated) {
  const std::filesystem::path root = MOEFLEX_SOURCE_DIR;
  const ModelConfig ds = load_model("deepseek-v3", root);
  EXPECT_EQ(ds.n_group, 8);
  EXPECT_EQ(ds.topk_group, 4);
  EXPECT_TRUE(ds.group_limited());
  EXPECT_EQ(ds.topk_method, "noaux_tc");
  EXPECT_EQ(ds.scoring_func, "sigmoid");
  EXPECT_FALSE(load_model("kimi-k2-1t", root).group_limited());  // 1 group of 1
  ModelConfig c = test::small_moe_config(2, 1, 4, true);         // 4 experts, top-2
  c.n_group = 2;
  c.topk_group = 1;
  EXPECT_THROW(c.validate(), ConfigError);  // greedy top-k would ignore the groups
  c.topk_method = "group_limited_greedy";
  EXPECT_NO_THROW(c.validate());
  Arena arena;
  EXPECT_NO_THROW(MoEModel(c, arena, ModelParallel{}));
  c.n_group = 3;  // does not divide 4 experts
  EXPECT_THROW(c.validate(), ConfigError);
  c.n_group = 2;
  c.topk_group = 3;  // more groups than there are
  EXPECT_THROW(c.validate(), ConfigError);
  c.n_group = 4;
  c.topk_group = 1;  // top-2 from one group of 1 expert
  EXPECT_THROW(c.validate(), ConfigError);
}
