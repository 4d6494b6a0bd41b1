// The memory program (model/memory_plan) against the engine: the activations it
// lists are the ones the stash records, byte for byte, and its replayed peak equals
// the arena's measured peak over whole steps (exactly),
// for every static policy, random save/recompute mixes, skewed routing, dense and
// MoE layers with a shared expert, and several micro-batches in flight; and the
// planner's projection (project_block) equals an exact walk, phase by phase.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/model.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/policies.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/schedule/plan.h"

namespace moeflex {
namespace {

constexpr std::int64_t kB = 2, kS = 8;

/// The rows of each MoE layer of the last forward, as the walk wants them.
std::vector<MoERows> rows_of(const MoEModel& m, std::size_t from) {
  std::vector<MoERows> rows(std::size_t(m.config().num_hidden_layers));
  const auto& rs = m.routing();
  for (std::size_t i = from; i < rs.size(); ++i) {
    const std::int64_t kept = std::accumulate(rs[i].tokens_per_expert.begin(), rs[i].tokens_per_expert.end(), std::int64_t(0));
    rows[std::size_t(rs[i].layer)] = {kept, rs[i].received_rows};
  }
  return rows;
}

struct StepResult {
  Bytes measured = 0, predicted = 0;
};

/// Runs forwards of `M` micro-batches then their backwards (GPipe order) under
/// `policy`, and replays the same on a MemoryWalk.
StepResult run_step(const ModelConfig& cfg, const ProvisionPolicy& policy, int M, double skew, std::uint64_t seed,
                    bool split = false) {
  Arena arena;
  MoEModel model(cfg, arena);
  model.init_weights(seed);
  model.stash().set_policy(policy);
  model.set_router_skew(skew);
  const std::int64_t n = kB * kS;
  std::vector<std::vector<std::int32_t>> ids(static_cast<std::size_t>(M), std::vector<std::int32_t>(static_cast<std::size_t>(n)));
  auto tg = ids;
  for (int mb = 0; mb < M; ++mb) test::skewed_batch(std::int64_t(seed) * 10 + mb, n, cfg.vocab_size, ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data());

  arena.reset_peaks();
  MemoryWalk walk(cfg, kB, kS, arena.in_use());
  StageSpec stage{0, int(cfg.num_hidden_layers), true, true, 1};
  for (int mb = 0; mb < M; ++mb) {
    const std::size_t before = model.routing().size();
    model.forward_train(ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data(), kB, kS, mb);
    walk.forward(mb, stage, rows_of(model, before), policy);
    EXPECT_EQ(walk.in_use(), arena.in_use()) << "after forward " << mb;
    EXPECT_EQ(walk.held(mb) , [&] {
      Bytes h = 0;
      for (const auto& e : model.stash().entries())
        if (e.microbatch == mb) h += Arena::round_up(std::max<Bytes>(1, e.bytes));
      return h;
    }()) << "held bytes of micro-batch " << mb;
  }
  model.set_defer_weight_grads(split);  // zero-bubble B: weight gradients wait for W
  for (int mb = 0; mb < M; ++mb) {
    model.backward(ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data(), kB, kS, mb, 1.0 / M);
    walk.backward(mb, stage, split);
    EXPECT_EQ(walk.in_use(), arena.in_use()) << "after backward " << mb;
    // What the planner is told this B leaves for its W: the queue's, measured.
    if (split) EXPECT_EQ(model.weight_grad_bytes(mb), walk.retained(mb, stage)) << "held for the W of " << mb;
  }
  model.set_defer_weight_grads(false);
  for (int mb = 0; split && mb < M; ++mb) {
    model.backward_weight(mb);
    walk.weight(mb, stage);
    EXPECT_EQ(walk.in_use(), arena.in_use()) << "after W " << mb;
  }
  return {arena.peak(), walk.peak()};
}

/// bf16: the mixed-precision engine (activations of 2 bytes, fp32 rstd, router
/// tensors and master weights), whose program the walk must replay as exactly.
ModelConfig config_with_dense_and_shared(bool bf16) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = bf16;
  return cfg;
}

/// The memory program's tests run on the fp32 and the bf16 engine alike.
class MemoryPlanPrecision : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(MemoryPlan, MemoryPlanPrecision, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "bf16" : "fp32"; });

TEST_P(MemoryPlanPrecision, ActivationsMatchTheStashLedger) {
  for (bool shared : {false, true}) {
    ModelConfig cfg = config_with_dense_and_shared(GetParam());
    if (!shared) cfg.n_shared_experts = 0;
    cfg.capacity_factor = shared ? 1.0 : 0.0;  // dropping changes the permuted rows
    Arena arena;
    MoEModel model(cfg, arena);
    model.init_weights(3);
    model.set_router_skew(2.0);
    const std::int64_t n = kB * kS;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
    test::skewed_batch(5, n, cfg.vocab_size, ids.data(), tg.data());
    model.forward_train(ids.data(), tg.data(), kB, kS, 0);
    const auto rows = rows_of(model, 0);
    std::map<std::pair<int, std::string>, LedgerEntry> ledger;
    for (const auto& e : model.stash().entries()) ledger[{e.layer, e.name}] = e;
    std::size_t listed = 0;
    for (int l = 0; l < cfg.num_hidden_layers; ++l)
      for (const auto& a : layer_activations(cfg, l, kB, kS, rows[std::size_t(l)], false)) {
        auto it = ledger.find({l, a.name});
        ASSERT_NE(it, ledger.end()) << "layer " << l << " " << a.name << " is not in the stash";
        EXPECT_EQ(it->second.bytes, a.bytes) << a.name;
        EXPECT_EQ(it->second.recomputable, a.recomputable) << a.name;
        EXPECT_EQ(it->second.op, a.op) << a.name;
        ++listed;
      }
    for (const auto& a : head_activations(cfg, kB, kS)) {
      auto it = ledger.find({kHeadLayer, a.name});
      ASSERT_NE(it, ledger.end()) << a.name;
      EXPECT_EQ(it->second.bytes, a.bytes) << a.name;
      ++listed;
    }
    EXPECT_EQ(listed, ledger.size()) << "the stash holds activations the memory plan does not list";
  }
}

TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaForEveryStaticPolicy) {
  const ModelConfig cfg = config_with_dense_and_shared(GetParam());
  for (const std::string& name : static_policy_names()) {
    for (double skew : {0.0, 2.5}) {
      const StepResult r = run_step(cfg, make_static_policy(name), 2, skew, 7);
      EXPECT_EQ(r.predicted, r.measured) << "policy " << name << " skew " << skew;
    }
  }
  // threshold decides from the routing context the walk hands the policy.
  const StepResult r = run_step(cfg, make_static_policy("threshold=1.1"), 3, 3.0, 8);
  EXPECT_EQ(r.predicted, r.measured) << "threshold=1.1";
}

// Grouped-query attention with a head_dim of its own (2 kv heads for 4 query heads of
// 12 on hidden 32): narrower k and v, a wider q and attention output; the walk must
// replay them exactly, saved and recomputed, with and without the zero-bubble split.
TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaWithGroupedQueryAttention) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());
  cfg.num_key_value_heads = 2;
  cfg.head_dim_override = 12;
  for (const char* name : {"none", "full", "selective", "moe-medium"})
    for (bool split : {false, true}) {
      const StepResult r = run_step(cfg, make_static_policy(name), 2, 2.0, 11, split);
      EXPECT_EQ(r.predicted, r.measured) << "policy " << name << (split ? " split" : "");
    }
}

// QK-norm (per head with GQA, and over the whole width): the norms' inputs and rstds
// are saved beside q and k, q and k are rebuilt from them, and the backward's norm
// gradients come and go; the walk replays it exactly, static policies and random
// save/recompute mixes, with and without the zero-bubble split.
TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaWithQkNorm) {
  for (const char* kind : {"head", "full"}) {
    ModelConfig cfg = config_with_dense_and_shared(GetParam());
    cfg.qk_norm = kind;
    cfg.num_key_value_heads = 2;
    for (const char* name : {"none", "full", "selective", "moe-medium"})
      for (bool split : {false, true}) {
        const StepResult r = run_step(cfg, make_static_policy(name), 2, 2.0, 11, split);
        EXPECT_EQ(r.predicted, r.measured) << kind << " policy " << name << (split ? " split" : "");
      }
    for (std::uint64_t trial = 0; trial < 6; ++trial) {
      auto policy = [trial](const LedgerEntry& e) {
        const double u = uniform01(trial + 300, std::uint64_t(e.layer * 131 + e.microbatch), std::hash<std::string>{}(e.name));
        return u < 0.5 ? Provision::save : Provision::recompute;
      };
      const StepResult r = run_step(cfg, policy, 1 + int(trial % 3), trial % 2 ? 3.0 : 0.0, trial + 60, trial % 3 == 2);
      EXPECT_EQ(r.predicted, r.measured) << kind << " trial " << trial;
    }
  }
}

// Dense and MoE layers alternating (decoder_sparse_step 2): the walk follows the
// engine's kind of each layer, saved, recomputed and split.
TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaWithAlternatingLayers) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());
  cfg.first_k_dense_replace = 0;
  cfg.num_hidden_layers = 4;
  cfg.decoder_sparse_step = 2;
  ASSERT_TRUE(cfg.has_dense_layers() && cfg.has_moe_layers());
  for (const char* name : {"none", "full", "selective", "moe-medium"})
    for (bool split : {false, true}) {
      const StepResult r = run_step(cfg, make_static_policy(name), 2, 2.0, 13, split);
      EXPECT_EQ(r.predicted, r.measured) << "policy " << name << (split ? " split" : "");
    }
}

// The zero-bubble split: what the deferred weight gradients read stays until W.
TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaWithTheZeroBubbleSplit) {
  const ModelConfig cfg = config_with_dense_and_shared(GetParam());
  for (const char* name : {"none", "full", "moe-medium", "selective"}) {
    const StepResult r = run_step(cfg, make_static_policy(name), 2, 2.5, 9, true);
    EXPECT_EQ(r.predicted, r.measured) << "policy " << name;
  }
  ModelConfig no_shared = cfg;
  no_shared.n_shared_experts = 0;
  const StepResult r = run_step(no_shared, make_static_policy("none"), 3, 0.0, 10, true);
  EXPECT_EQ(r.predicted, r.measured) << "no shared expert";
}

TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaForRandomMixes) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());
  cfg.capacity_factor = 1.25;
  for (std::uint64_t trial = 0; trial < 12; ++trial) {
    auto policy = [trial](const LedgerEntry& e) {
      // A pure function of the entry, so the engine and the walk see the same choice.
      const double u = uniform01(trial, std::uint64_t(e.layer * 131 + e.microbatch), std::hash<std::string>{}(e.name));
      return u < 0.5 ? Provision::save : Provision::recompute;
    };
    const StepResult r = run_step(cfg, policy, 1 + int(trial % 3), trial % 2 ? 3.0 : 0.0, trial + 20);
    EXPECT_EQ(r.predicted, r.measured) << "trial " << trial;
  }
}

// The experts' FFN in chunks (model.expert_chunk_rows = 5: the 32 received rows
// of a micro-batch in 7 chunks, the last one shorter) under skewed routing: the
// walk's peak is the arena's for every static policy, random save/recompute mixes,
// and the zero-bubble split (whose expert weight gradients run in B over several
// chunks, and wait for W when the rows make one chunk).
TEST_P(MemoryPlanPrecision, PeakEqualsTheArenaWithChunkedExperts) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());
  cfg.expert_chunk_rows = 5;
  for (const std::string& name : static_policy_names()) {
    const StepResult r = run_step(cfg, make_static_policy(name), 2, 3.0, 7);
    EXPECT_EQ(r.predicted, r.measured) << "chunked, policy " << name;
  }
  for (std::uint64_t trial = 0; trial < 8; ++trial) {
    auto policy = [trial](const LedgerEntry& e) {
      const double u = uniform01(trial + 100, std::uint64_t(e.layer * 131 + e.microbatch), std::hash<std::string>{}(e.name));
      return u < 0.5 ? Provision::save : Provision::recompute;
    };
    const StepResult r = run_step(cfg, policy, 1 + int(trial % 3), trial % 2 ? 3.0 : 0.0, trial + 40, trial % 4 == 3);
    EXPECT_EQ(r.predicted, r.measured) << "chunked, trial " << trial;
  }
  for (const char* name : {"none", "moe-full"})
    for (const std::int64_t chunk : {std::int64_t(5), std::int64_t(64)}) {  // several chunks, or one
      ModelConfig c = cfg;
      c.expert_chunk_rows = chunk;
      const StepResult r = run_step(c, make_static_policy(name), 2, 2.5, 9, true);
      EXPECT_EQ(r.predicted, r.measured) << "split, chunk " << chunk << ", policy " << name;
    }
  // Chunking bounds the floor's transient: recomputing the experts holds less.
  ModelConfig whole = cfg;
  whole.expert_chunk_rows = 0;
  EXPECT_LT(run_step(cfg, make_static_policy("moe-full"), 1, 3.0, 7).measured,
            run_step(whole, make_static_policy("moe-full"), 1, 3.0, 7).measured);
}

// The smallest feasible budget (the floor with worst-case routing) with the experts
// chunked is lower than without, when the worst case dominates: 4 EP ranks, 8
// experts, top-2 (worst case 16 x the balanced rows of a rank).
TEST_P(MemoryPlanPrecision, ChunkedExpertsLowerTheMinimumBudget) {
  ModelConfig cfg = test::small_moe_config(3, 1, 8, true);
  cfg.bf16 = GetParam();
  cfg.moe_intermediate_size = 64;
  const std::int64_t B = 4, S = 16;
  auto minimum = [&](std::int64_t chunk) {
    ModelConfig c = cfg;
    c.expert_chunk_rows = chunk;
    StepProgram program;
    program.stages = {StageSpec{0, int(c.num_hidden_layers), true, true, 4}};
    for (int mb = 0; mb < 2; ++mb) {
      program.actions.push_back({WalkAction::Kind::forward, mb, 0});
      program.actions.push_back({WalkAction::Kind::backward, mb, 0});
    }
    return minimum_budget(c, B, S, program, 0);
  };
  const MoERows worst = MoERows::worst_case(cfg, B * S, 4), balanced = MoERows::balanced(cfg, B * S);
  ASSERT_EQ(worst.received, 4 * B * S * 2);                     // 4 senders x 64 tokens x 2 local experts
  ASSERT_EQ(worst.received, 16 * (balanced.received / 4));      // 16 x a rank's balanced rows
  const Bytes off = minimum(0), chunked = minimum(16);
  std::printf("minimum budget (activations, EP 4, worst case %lld rows): %lld B unchunked, %lld B in chunks of 16 rows\n",
              static_cast<long long>(worst.received), static_cast<long long>(off), static_cast<long long>(chunked));
  EXPECT_LT(chunked, off);
  // Each of the six f-wide transients ([rows, f]: three rebuilt, three gradients) of
  // the floor's backward shrinks from the worst case's rows to a chunk's; the rest of
  // the walk is the same.
  const Bytes a = cfg.activation_bytes();
  const Bytes fwide = Arena::round_up(worst.received * cfg.moe_intermediate_size * a) -
                      Arena::round_up(16 * cfg.moe_intermediate_size * a);
  EXPECT_GE(off - chunked, 3 * fwide);
  EXPECT_EQ(minimum(worst.received), off) << "a chunk of all the rows is no chunking";
}

struct AdaptiveRun {
  Bytes budget = 0, peak = 0, predicted = 0;
  std::int64_t infeasible = 0, decisions = 0;
  std::vector<std::vector<float>> grads;
  Bytes recomputed = 0;
};

/// M micro-batches (forward then backward each) under `budget` (0: unlimited, no
/// planner), with skewed routing; the planner predicts each step's peak.
AdaptiveRun run_adaptive(const ModelConfig& cfg, Bytes budget, int M, int steps) {
  AdaptiveRun out;
  Arena arena(budget > 0 ? budget : Arena::kUnlimited);
  MoEModel model(cfg, arena);
  model.init_weights(11);
  model.set_router_skew(2.5);
  AdaptivePlanner planner(arena);
  if (budget > 0) model.set_planner(&planner);
  const std::int64_t n = kB * kS;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
  for (int step = 0; step < steps; ++step) {
    arena.reset_peaks();
    for (int mb = 0; mb < M; ++mb) {
      test::skewed_batch(step * 10 + mb, n, cfg.vocab_size, ids.data(), tg.data());
      model.forward_backward(ids.data(), tg.data(), kB, kS, mb, 1.0 / M);
    }
    if (budget > 0) {
      EXPECT_EQ(planner.predicted_step_peak(), arena.peak()) << "step " << step;
      out.infeasible += planner.infeasible();
      planner.end_step();
    }
    out.peak = std::max(out.peak, arena.peak());
  }
  out.decisions = planner.decisions();
  out.recomputed = model.stash().counters().recomputed + model.stash().counters().offloaded;
  for (auto& p : model.params()) out.grads.emplace_back(p.g.f32(), p.g.f32() + p.g.numel());
  return out;
}

// The adaptive planner under a budget between its feasibility minimum and what
// saving everything needs: it never runs out of memory, keeps every decision
// feasible, predicts each step's peak exactly, drops something, and gives the
// gradients of the unbudgeted run bit for bit.
TEST_P(MemoryPlanPrecision, AdaptivePlannerFitsPredictsAndKeepsGradients) {
  const ModelConfig cfg = config_with_dense_and_shared(GetParam());
  const int M = 2, steps = 3;
  const AdaptiveRun free_run = run_adaptive(cfg, 0, M, steps);
  // The smallest feasible budget, from the same walk the trainer uses.
  Arena probe;
  MoEModel m(cfg, probe);
  StepProgram program;
  program.stages = {StageSpec{0, int(cfg.num_hidden_layers), true, true, 1}};
  for (int mb = 0; mb < M; ++mb) {
    program.actions.push_back({WalkAction::Kind::forward, mb, 0});
    program.actions.push_back({WalkAction::Kind::backward, mb, 0});
  }
  const Bytes minimum = minimum_budget(cfg, kB, kS, program, probe.in_use());
  // The walk's floor is the minimum less the placement reserve; a third of the way up from it.
  const Bytes floor = minimum - Arena::placement_reserve(minimum);
  ASSERT_LT(floor, free_run.peak) << "the test needs room between the floor and saving everything";
  const Bytes budget = Arena::round_up(minimum + (free_run.peak - floor) / 3);
  const AdaptiveRun r = run_adaptive(cfg, budget, M, steps);
  EXPECT_LE(r.peak, budget);
  EXPECT_EQ(r.infeasible, 0);
  EXPECT_GT(r.recomputed, 0) << "the budget should force drops";
  EXPECT_EQ(r.decisions, steps * M * (2 * cfg.num_hidden_layers + 1));  // attention + FFN per layer, and the head
  ASSERT_EQ(r.grads.size(), free_run.grads.size());
  for (std::size_t i = 0; i < r.grads.size(); ++i) EXPECT_EQ(r.grads[i], free_run.grads[i]) << "param " << i;
}

TEST_P(MemoryPlanPrecision, WorstCaseRowsBoundTheReceivedRows) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());  // 4 experts, top-2
  const std::int64_t n = 100;
  EXPECT_EQ(MoERows::worst_case(cfg, n, 1).received, n * 2);
  // EP 2: 2 local experts, each sender can put both of a token's picks here.
  EXPECT_EQ(MoERows::worst_case(cfg, n, 2).received, 2 * n * 2);
  // EP 4: one local expert, at most one pick per token.
  EXPECT_EQ(MoERows::worst_case(cfg, n, 4).received, 4 * n);
  cfg.capacity_factor = 1.0;  // capacity ceil(1.0 * 100 * 2 / 4) = 50 rows per expert per sender
  EXPECT_EQ(MoERows::worst_case(cfg, n, 4).received, 4 * 50);
  EXPECT_EQ(MoERows::balanced(cfg, n).received, n * 2);
}


/// A planner context on rank 0 of a 2-stage pipeline (`schedule`, 4 micro-batches,
/// EP `ep` as a stage property): the decision at `point` of `layer` during the
/// forward of the last warm-up micro-batch, with the earlier micro-batches'
/// activations held under random provisions (some offloads still copying).
BlockContext pipeline_context(const ModelConfig& cfg, StepProgram& program, const std::string& schedule, int ep,
                              int layer, SavePoint point, std::mt19937_64& rng) {
  const StepPlan plan = make_schedule(schedule, 2, 4);
  std::vector<std::size_t> walk_at;
  program.actions = walk_actions(plan, 0, &walk_at);
  const int L = int(cfg.num_hidden_layers);
  const StageSpec stage{0, L / 2 + 1, true, false, ep};
  program.stages = {stage};
  int mb = 0;  // the last forward before the first backward
  for (std::size_t i = 0; i < plan.actions[0].size(); ++i) {
    const Action& a = plan.actions[0][i];
    if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) break;
    if (a.kind == ActionKind::Forward) {
      mb = a.microbatch;
      program.current = walk_at[i];
    }
  }
  BlockContext ctx;
  ctx.microbatch = mb;
  ctx.layer = layer;
  ctx.point = point;
  ctx.B = kB;
  ctx.S = kS;
  ctx.stage = stage;
  ctx.program = &program;
  const MoERows worst = MoERows::worst_case(cfg, kB * kS, ep);
  ctx.rows = {worst.permuted, ep > 1 ? 1 + std::int64_t(rng() % std::uint64_t(worst.received)) : worst.permuted};
  ctx.in_use = 3 * kMiB;
  auto hold = [&](int m, int l, bool attention_only) {
    for (const ActivationSpec& a : layer_activations(cfg, l, kB, kS, MoERows::balanced(cfg, kB * kS), ep > 1)) {
      if (attention_only && !a.name.starts_with("attn")) continue;
      LedgerEntry e{a.name, a.op, l, m, a.bytes, a.recomputable};
      const int r = int(rng() % 3);
      e.provision = !planner_decides(cfg, e) || r == 0           ? Provision::save
                    : r == 1 && a.recomputable                   ? Provision::recompute
                                                                 : Provision::offload;
      ctx.ledger.push_back({e, e.provision == Provision::save || (e.provision == Provision::offload && rng() % 2)});
    }
  };
  for (int m = 0; m < mb; ++m)
    for (int l = stage.first_layer; l < stage.last_layer; ++l) hold(m, l, false);
  for (int l = stage.first_layer; l < layer; ++l) hold(mb, l, false);
  if (point != SavePoint::attention) hold(mb, layer, true);
  program.pending_weight_bytes.clear();
  if (schedule == "zb-h1") program.pending_weight_bytes[{0, stage.first_layer}] = {3 * kMiB, 2 * kMiB};  // a W still queued
  for (const ActivationSpec& a : layer_activations(cfg, layer, kB, kS, ctx.rows, ep > 1)) {
    const bool attn = a.name.starts_with("attn");
    if (point == SavePoint::attention ? attn
                                      : !attn && !a.name.starts_with("shared.") && !a.name.starts_with("ffn_norm."))
      ctx.candidates.push_back(a.name);
  }
  return ctx;
}

/// The block's candidates as MoEModel::plan_saves describes them (bytes, lineage,
/// saved first, and the chunked experts' per-chunk bytes), for the closed form.
std::vector<SaveCandidate> candidates_of(const ModelConfig& cfg, const BlockContext& ctx) {
  std::vector<SaveCandidate> v;
  const bool ep = ctx.stage.ep();
  const std::int64_t Rr = ep ? ctx.rows.received : ctx.rows.permuted;
  for (const ActivationSpec& a : layer_activations(cfg, ctx.layer, kB, kS, ctx.rows, ep)) {
    if (std::find(ctx.candidates.begin(), ctx.candidates.end(), a.name) == ctx.candidates.end()) continue;
    SaveCandidate c{a.name, a.op, a.bytes, a.recomputable};
    c.rebuild_extra = rebuild_extra_bytes(cfg, kB, kS, a.name);
    c.saved_first = ctx.point != SavePoint::moe || a.name.starts_with("experts.") || a.name == "moe.combined";
    if (ctx.point == SavePoint::moe &&
        (a.name == "experts.gate_out" || a.name == "experts.up_out" || a.name == "experts.act") && Rr > 0)
      c.chunk_bytes = Arena::round_up(cfg.expert_chunk(Rr) * cfg.moe_intermediate_size * 4);
    v.push_back(c);
  }
  return v;
}

// The planner's projection (project_block: later layers replayed from memoized
// summaries, phases around the block) against a plain exact walk of the same rest
// of the step: each phase's peak is the exact walk's, and together they are its
// peak, for blocks kept whole and random choices, fused and zero-bubble backwards,
// with and without EP.
TEST_P(MemoryPlanPrecision, ProjectionEqualsAnExactWalkOfTheRestOfTheStep) {
  ModelConfig cfg = config_with_dense_and_shared(GetParam());  // layer 0 dense, 1-2 MoE
  std::mt19937_64 rng(5);
  int cases = 0;
  for (const std::int64_t chunk : {std::int64_t(0), std::int64_t(3)})  // the experts whole, or in chunks of 3 rows
  for (const std::string schedule : {"1f1b", "zb-h1"})
    for (const int ep : {1, 2})
      for (const auto& [layer, point] : {std::pair{0, SavePoint::attention}, {0, SavePoint::dense_ffn},
                                         {1, SavePoint::attention}, {1, SavePoint::moe}})
        for (int trial = 0; trial < 3; ++trial) {
          StepProgram program;
          cfg.expert_chunk_rows = chunk;
          const BlockContext ctx = pipeline_context(cfg, program, schedule, ep, layer, point, rng);
          BlockChoice choice;
          for (const ActivationSpec& a : layer_activations(cfg, layer, kB, kS, ctx.rows, ep > 1))
            if (std::find(ctx.candidates.begin(), ctx.candidates.end(), a.name) != ctx.candidates.end())
              if (const int r = int(rng() % 3); r > 0)
                choice[a.name] = r == 1 && a.recomputable ? Provision::recompute : Provision::offload;
          for (const BlockChoice* c : std::vector<const BlockChoice*>{nullptr, &choice}) {
            const BlockProjection p = project_block(cfg, ctx, c);
            // The same walk, exact, deciding through a ProvisionFn.
            MemoryWalk w(cfg, kB, kS, ctx.in_use);
            for (const auto& [e, on] : ctx.ledger) w.adopt(e, on, ep);
            w.adopt_pending_weights(program);
            w.set_offload_weight_reads(true);  // later Bs' W reads at their floor, as the projection takes them
            const ProvisionFn decide = [&](const LedgerEntry& e) {
              if (e.microbatch == ctx.microbatch && e.layer == layer &&
                  std::find(ctx.candidates.begin(), ctx.candidates.end(), e.name) != ctx.candidates.end()) {
                if (!c) return Provision::save;
                auto it = c->find(e.name);
                return it != c->end() ? it->second : Provision::save;
              }
              return most_memory_saving(cfg, e);
            };
            const int L = int(cfg.num_hidden_layers) / 2 + 1;
            const MoERows worst = MoERows::worst_case(cfg, kB * kS, ep);
            std::vector<MoERows> own(std::size_t(L), worst);
            if (point == SavePoint::moe) own[std::size_t(layer)] = ctx.rows;
            w.watch(ctx.microbatch, layer, point);
            w.finish_forward(ctx.microbatch, ctx.stage, layer, point, own, decide);
            w.run(program.actions, program.current + 1, program.stages,
                  [&](int, const StageSpec&) { return std::vector<MoERows>(std::size_t(L), worst); }, decide);
            const std::string what = fmt::format("{} ep {} layer {} point {} trial {} choice {} chunk {}", schedule, ep,
                                                 layer, int(point), trial, c ? c->size() : 0, chunk);
            using P = MemoryWalk;
            EXPECT_EQ(p.compute, w.phase_peak(P::kCompute)) << what;
            if (point == SavePoint::moe) {
              EXPECT_GT(p.compute, 0) << what;
              // The closed form bounds the exact walk of the choice from the block kept
              // whole (after the decision: the walk's peak also holds the use it starts from).
              if (c) {
                const Bytes bound = project_block(cfg, ctx, nullptr).evaluate(candidates_of(cfg, ctx), *c);
                EXPECT_LE(w.peak(), std::max(bound, ctx.in_use)) << what;
              }
            }
            EXPECT_EQ(p.tail, w.phase_peak(P::kTail)) << what;
            EXPECT_EQ(p.landing, w.phase_peak(P::kLanding)) << what;
            EXPECT_EQ(p.held, w.phase_peak(P::kHeld)) << what;
            EXPECT_EQ(p.prefetched, w.phase_peak(P::kPrefetched)) << what;
            EXPECT_EQ(p.backward, w.phase_peak(P::kBackward)) << what;
            EXPECT_EQ(p.backward_rest, w.phase_peak(P::kBackwardRest)) << what;
            EXPECT_EQ(p.after, w.phase_peak(P::kAfter)) << what;
            EXPECT_EQ(p.peak(), w.peak()) << what;
            ++cases;
          }
        }
  EXPECT_EQ(cases, 2 * 2 * 2 * 4 * 3 * 2);
}

/// The smallest budget of `schedule` on a 2-stage pipeline (4 micro-batches), the
/// larger of the two ranks', activations only; `offload_w`: zero-bubble W reads at
/// their floor (minimum_budget), else kept on the device from B to W.
Bytes pipeline_minimum(const ModelConfig& cfg, const std::string& schedule, bool offload_w) {
  const StepPlan plan = make_schedule(schedule, 2, 4);
  const int L = int(cfg.num_hidden_layers);
  Bytes most = 0;
  for (int rank = 0; rank < 2; ++rank) {
    StepProgram program;
    program.actions = walk_actions(plan, rank);
    program.stages = {rank == 0 ? StageSpec{0, L / 2, true, false, 1} : StageSpec{L / 2, L, false, true, 1}};
    Bytes need = minimum_budget(cfg, kB, kS, program, 0);
    if (!offload_w) {
      MemoryWalk w(cfg, kB, kS, 0);
      w.run(program.actions, 0, program.stages,
            [&](int, const StageSpec& st) {
              return std::vector<MoERows>(std::size_t(st.last_layer - st.first_layer),
                                          MoERows::worst_case(cfg, kB * kS, 1));
            },
            [&](const LedgerEntry& e) { return most_memory_saving(cfg, e); });
      need = Arena::budget_with_reserve(w.peak());
    }
    most = std::max(most, need);
  }
  return most;
}

// What the zero-bubble W queue holds from B to W is a planner choice: at its floor
// (each layer's reads offloaded once the B is past it, back just before that
// layer's W GEMMs) zb-h1's smallest budget is far lower than with the reads kept on
// the device, and above 1F1B's (the sweep's model: 1.04x, tests/minimum_sweep.py).
TEST_P(MemoryPlanPrecision, ZeroBubbleMinimumOffloadsTheWReads) {
  ModelConfig cfg = test::small_moe_config(4, 1, 4, true);
  cfg.bf16 = GetParam();
  const Bytes one_f_one_b = pipeline_minimum(cfg, "1f1b", true);
  for (const std::string schedule : {"zb-h1"}) {  // (DualPipeV: in tests/minimum_sweep.py)
    const Bytes offloaded = pipeline_minimum(cfg, schedule, true), kept = pipeline_minimum(cfg, schedule, false);
    std::printf("%s minimum (activations, pp 2): %lld B with the W reads offloaded, %lld B kept; 1f1b %lld B\n",
                schedule.c_str(), static_cast<long long>(offloaded), static_cast<long long>(kept),
                static_cast<long long>(one_f_one_b));
    EXPECT_LT(offloaded, kept) << schedule;
    EXPECT_LT(double(offloaded), 0.5 * double(kept)) << schedule;
    EXPECT_GE(offloaded, one_f_one_b) << schedule;  // (a layer's reads wait for its W GEMMs)
  }
}
}  // namespace
}  // namespace moeflex
