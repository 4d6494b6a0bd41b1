// Provisioning policies change where activations live, never the maths: every
// static policy and many random per-activation assignments must give gradients
// bit-identical to saving everything (STYLE habit 2), under skewed routing too,
// with and without the zero-bubble B/W split; recomputation must lower the peak.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "moeflex/core/rng.h"
#include "moeflex/model/model.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/policies.h"
#include "model_fixtures.h"

using namespace moeflex;

namespace {


struct PolicyRun {
  std::vector<std::vector<float>> grads;
  Bytes activation_peak = 0;
  ActivationStash::Counters counters;
  double loss = 0;
  std::int64_t compactions = 0, evictions = 0, stitches = 0, stitched_extents = 0;
  Bytes peak = 0;  // the arena's peak over the run (every category)
  Bytes wgrad_evicted = 0;  // of it, what queued weight-gradient work reads
};

// Two micro-batches of skewed tokens (low ids dominate: uneven routing).
// With `stress`, a bounded arena compacts (or evicts every saved tensor and
// compacts) before every allocation. With `budget` > 0, the arena holds exactly
// that many bytes. The order is F0 B0 W0 F1 B1 W1, or with `late_w` F0 B0 F1 B1
// W0 W1 (as a zero-bubble schedule does: with the split backward, what W0 reads
// stays held across F1 and B1).
PolicyRun run(const ModelConfig& cfg, const ProvisionPolicy& policy, bool split_backward = false,
              Arena::Stress stress = Arena::Stress::off, double skew = 0.0, Bytes budget = 0, bool late_w = false) {
  Arena arena(budget > 0 ? budget : stress == Arena::Stress::off ? Arena::kUnlimited : Bytes(64) << 20);
  arena.set_stress(stress);
  MoEModel model(cfg, arena);
  model.init_weights(13);
  model.stash().set_policy(policy);
  model.set_router_skew(skew);
  const std::int64_t B = 2, S = 8, n = B * S;
  constexpr int kMicrobatches = 2;
  // Per micro-batch: a queued W (the embedding's scatter) reads its ids.
  std::vector<std::vector<std::int32_t>> ids(kMicrobatches, std::vector<std::int32_t>(std::size_t(n))), tg = ids;
  for (int mb = 0; mb < kMicrobatches; ++mb)
    for (std::int64_t i = 0; i < n; ++i) {
      const double u = uniform01(5, std::uint64_t(mb), std::uint64_t(i));
      ids[std::size_t(mb)][std::size_t(i)] = std::int32_t(u * u * u * double(cfg.vocab_size));
      tg[std::size_t(mb)][std::size_t(i)] =
          std::int32_t(uniform01(6, std::uint64_t(mb), std::uint64_t(i)) * double(cfg.vocab_size));
    }
  PolicyRun r;
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    const std::size_t m = std::size_t(mb);
    r.loss += model.forward_train(ids[m].data(), tg[m].data(), B, S, mb).total;
    r.activation_peak = std::max(r.activation_peak, arena.stat(MemCategory::activations).current);
    model.set_defer_weight_grads(split_backward);
    model.backward(ids[m].data(), tg[m].data(), B, S, mb, 0.5);
    model.set_defer_weight_grads(false);
    if (!late_w) model.backward_weight(mb);
  }
  if (late_w)
    for (int mb = 0; mb < kMicrobatches; ++mb) model.backward_weight(mb);
  r.peak = arena.peak();
  r.counters = model.stash().counters();
  r.compactions = arena.compactions();
  r.evictions = arena.evictions();
  r.stitches = arena.stitches();
  r.stitched_extents = arena.stitched_extents();
  r.wgrad_evicted = model.weight_grad_bytes_evicted();
  for (auto& p : model.params()) r.grads.emplace_back(p.g.f32(), p.g.f32() + p.g.numel());
  EXPECT_EQ(arena.stat(MemCategory::activations).current, 0) << "activations leaked";
  return r;
}

void expect_same_grads(const PolicyRun& a, const PolicyRun& b, const std::string& what) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  EXPECT_EQ(a.loss, b.loss) << what;
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_EQ(0, std::memcmp(a.grads[i].data(), b.grads[i].data(), a.grads[i].size() * sizeof(float)))
        << what << ": gradient " << i << " differs";
}

/// The provisioning tests that run on the fp32 and the bf16 engine alike: a bf16
/// recompute rounds exactly as the forward did, so gradients stay bit-identical.
class ProvisionPrecision : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Provision, ProvisionPrecision, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "bf16" : "fp32"; });

}  // namespace

TEST_P(ProvisionPrecision, EveryStaticPolicyGivesBitIdenticalGradients) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = GetParam();
  const PolicyRun base = run(cfg, {});
  EXPECT_GT(base.counters.saved, 0);
  EXPECT_EQ(base.counters.recomputed, 0);
  for (const auto& name : static_policy_names()) {
    const PolicyRun r = run(cfg, make_static_policy(name));
    expect_same_grads(base, r, name);
    if (name != "none") {
      EXPECT_GT(r.counters.recomputed, 0) << name;
    }
    if (name != "none") {
      EXPECT_LT(r.activation_peak, base.activation_peak) << name << " must hold fewer activations";
    }
  }
}

TEST(Provision, FullRecomputeHoldsLessThanMoeFullThanNone) {
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  const PolicyRun none = run(cfg, {}), moe = run(cfg, make_static_policy("moe-full")), full = run(cfg, make_static_policy("full"));
  EXPECT_LT(full.activation_peak, moe.activation_peak);
  EXPECT_LT(moe.activation_peak, none.activation_peak);
}

TEST_P(ProvisionPrecision, RandomAssignmentsGiveBitIdenticalGradients) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = GetParam();
  const PolicyRun base = run(cfg, {});
  for (std::uint64_t seed = 0; seed < 16; ++seed) {
    // Each (micro-batch, layer, activation) independently saved or recomputed.
    ProvisionPolicy random = [seed](const LedgerEntry& e) {
      std::uint64_t h = seed * 1000003u + std::uint64_t(e.layer) * 7919u + std::uint64_t(e.microbatch) * 31u;
      for (char c : e.name) h = h * 131u + std::uint64_t(c);
      const double u = uniform01(h, 1, 2);
      return u < 0.33 ? Provision::recompute : u < 0.66 ? Provision::offload : Provision::save;
    };
    expect_same_grads(base, run(cfg, random, /*split_backward=*/seed % 2 == 1), "random assignment " + std::to_string(seed));
  }
}

// The experts' FFN in chunks of 5 received rows (32 rows: 7 chunks, boundaries
// inside experts' groups), with routing skewed so that one expert takes most rows:
// every static policy and random save/recompute/offload mixes, fused and split
// backwards, give the gradients of saving everything bit for bit; and chunking
// changes only the order of the weight gradients' sums (close to unchunked).
TEST_P(ProvisionPrecision, ChunkedExpertsGiveBitIdenticalGradientsForEveryMix) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = GetParam();
  cfg.expert_chunk_rows = 5;
  for (const double skew : {0.0, 3.0}) {
    const PolicyRun base = run(cfg, {}, false, Arena::Stress::off, skew);
    for (const auto& name : static_policy_names()) {
      const PolicyRun r = run(cfg, make_static_policy(name), false, Arena::Stress::off, skew);
      expect_same_grads(base, r, name + " chunked, skew " + std::to_string(skew));
      if (name == "moe-full") {
        EXPECT_LT(r.activation_peak, base.activation_peak) << "chunked moe-full holds less";
      }
    }
    for (std::uint64_t seed = 0; seed < 8; ++seed) {
      ProvisionPolicy random = [seed](const LedgerEntry& e) {
        std::uint64_t h = seed * 7727u + std::uint64_t(e.layer) * 104729u + std::uint64_t(e.microbatch) * 31u;
        for (char c : e.name) h = h * 131u + std::uint64_t(c);
        const double u = uniform01(h, 3, 4);
        return u < 0.4 ? Provision::recompute : u < 0.7 ? Provision::offload : Provision::save;
      };
      expect_same_grads(base, run(cfg, random, seed % 2 == 1, Arena::Stress::off, skew),
                        "chunked random " + std::to_string(seed) + ", skew " + std::to_string(skew));
    }
    // The zero-bubble split computes the experts' weight gradients of more than one
    // chunk in B: the same bits as the fused backward.
    expect_same_grads(base, run(cfg, {}, true, Arena::Stress::off, skew), "chunked split backward");
    // Against the unchunked FFN: the same maths, sums in another order.
    ModelConfig whole = cfg;
    whole.expert_chunk_rows = 0;
    const PolicyRun ref = run(whole, {}, false, Arena::Stress::off, skew);
    EXPECT_NEAR(ref.loss, base.loss, 1e-5 * std::abs(ref.loss));
    for (std::size_t i = 0; i < ref.grads.size(); ++i) {
      double diff = 0, norm = 0;
      for (std::size_t j = 0; j < ref.grads[i].size(); ++j) {
        diff += std::pow(double(ref.grads[i][j]) - double(base.grads[i][j]), 2);
        norm += std::pow(double(ref.grads[i][j]), 2);
      }
      EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm) + 1e-12) << "gradient " << i << " chunked vs whole";
    }
  }
}

// A budget of exactly the peak leaves no byte spare at the peak's moment, so every
// free byte must then be one block. The arena gathers free bytes by compaction and
// eviction only from what nobody holds: the forward and the backward must leave no
// free bytes under the blocks they hold (allocation order: longer-lived first, a
// lineage's returned tensor first). Every static policy, chunked (3 chunks) and
// unchunked experts, calm and skewed routing: the run fits its own peak, with the
// same gradients.
TEST(Provision, RunsFitABudgetOfExactlyTheirPeak) {
  for (const std::int64_t chunk : {std::int64_t(0), std::int64_t(12)}) {
    ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
    cfg.expert_chunk_rows = chunk;
    for (const double skew : {0.0, 3.0})
      for (const auto& name : static_policy_names()) {
        const std::string what = name + ", chunk " + std::to_string(chunk) + ", skew " + std::to_string(skew);
        const PolicyRun free = run(cfg, make_static_policy(name), false, Arena::Stress::off, skew);
        PolicyRun tight;
        try {
          tight = run(cfg, make_static_policy(name), false, Arena::Stress::off, skew, free.peak);
        } catch (const OutOfMemoryError& e) {
          ADD_FAILURE() << what << ": " << e.what();
          continue;
        }
        EXPECT_LE(tight.peak, free.peak) << what;  // (lower when something was evicted)
        expect_same_grads(free, tight, what);
      }
  }
}

// The zero-bubble split (Qi et al. 2023): what the queued weight-gradient GEMMs read
// (copies of the output gradient, the GEMMs' input gradients, saved inputs the
// backward has released) stays held from B to W, here across the next
// micro-batch's F and B. Pinned, those blocks split the free bytes so that a budget
// of exactly the run's peak failed on fragmentation (10 of these 48 runs; e.g.
// moe-full bringing back an evicted 'attn.v' found 10 KiB free in holes of at most
// 1.9 KiB); the arena moves them, and evicts them to the host when moving is not
// enough (they come back before their W). Every static policy, chunked and
// unchunked experts, calm and skewed routing, W right after B or late: the run
// fits its own peak, with the same gradients.
TEST(Provision, ZeroBubbleRunsFitABudgetOfExactlyTheirPeak) {
  for (const std::int64_t chunk : {std::int64_t(0), std::int64_t(12)}) {
    ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
    cfg.expert_chunk_rows = chunk;
    for (const double skew : {0.0, 3.0})
      for (const bool late_w : {false, true})
        for (const auto& name : static_policy_names()) {
          const std::string what = fmt::format("{}, chunk {}, skew {}, late W {}", name, chunk, skew, late_w);
          const PolicyRun free = run(cfg, make_static_policy(name), true, Arena::Stress::off, skew, 0, late_w);
          PolicyRun tight;
          try {
            tight = run(cfg, make_static_policy(name), true, Arena::Stress::off, skew, free.peak, late_w);
          } catch (const OutOfMemoryError& e) {
            ADD_FAILURE() << what << ": " << e.what();
            continue;
          }
          EXPECT_LE(tight.peak, free.peak) << what;
          expect_same_grads(free, tight, what);
        }
  }
}

// At the end of a zero-bubble B the planner keeps what its W reads on the device when
// the rest of the step fits under budget - margin that way, else offloads it; the
// step's predicted peak is the projection of the choice taken; an offload that
// still does not fit the budget less its reserve is infeasible.
TEST(Planner, KeepsTheWReadsWhenTheyFitElseOffloadsThem) {
  Arena arena(128 * kMiB);
  AdaptivePlanner planner(arena, kPlannerMarginFraction);  // limit 128 - 6.4 = 121.6 MiB
  std::vector<bool> asked;
  const auto projection = [&](Bytes keep, Bytes offload) {
    return [&asked, keep, offload](bool off) {
      asked.push_back(off);
      return off ? offload : keep;
    };
  };
  EXPECT_FALSE(planner.plan_weight_reads(projection(120 * kMiB, 100 * kMiB)));
  EXPECT_EQ(asked, std::vector<bool>{false});  // keeping fits: the offload is not even projected
  EXPECT_EQ(planner.predicted_step_peak(), 120 * kMiB);
  EXPECT_TRUE(planner.plan_weight_reads(projection(122 * kMiB, 110 * kMiB)));
  EXPECT_EQ(planner.predicted_step_peak(), 110 * kMiB);
  EXPECT_EQ(planner.infeasible(), 0);
  const Bytes hard = 128 * kMiB - Arena::placement_reserve(arena.budget());
  EXPECT_TRUE(planner.plan_weight_reads(projection(130 * kMiB, hard)));
  EXPECT_EQ(planner.infeasible(), 0);  // the floor within the budget less the reserve
  EXPECT_TRUE(planner.plan_weight_reads(projection(130 * kMiB, hard + 64)));
  EXPECT_EQ(planner.infeasible(), 1);
  EXPECT_EQ(planner.weight_read_decisions(), 4);
  EXPECT_EQ(planner.weight_read_offloads(), 3);
  Arena unlimited;  // no budget: always kept
  AdaptivePlanner free_planner(unlimited);
  EXPECT_FALSE(free_planner.plan_weight_reads(projection(Bytes(1) << 40, 0)));
}

// The arena's defragmentation moves saved activations and what queued weight-
// gradient work reads (compaction) and copies them to the host and back (eviction)
// behind the model's back: with either done before every allocation, every policy
// mix, with the zero-bubble split and W late, still gives bit-identical gradients,
// so no operator holds a pointer into a relocatable tensor across an allocation.
TEST_P(ProvisionPrecision, ArenaCompactionAndEvictionKeepGradientsBitIdentical) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = GetParam();
  const PolicyRun base = run(cfg, {});
  for (Arena::Stress stress : {Arena::Stress::compact, Arena::Stress::evict, Arena::Stress::stitch}) {
    const std::string what = stress == Arena::Stress::compact ? "compact"
                             : stress == Arena::Stress::evict ? "evict"
                                                              : "stitch";
    for (std::uint64_t seed = 0; seed < 4; ++seed) {
      ProvisionPolicy random = [seed](const LedgerEntry& e) {
        std::uint64_t h = seed * 7919u + std::uint64_t(e.layer) * 131u + std::uint64_t(e.microbatch) * 17u;
        for (char c : e.name) h = h * 31u + std::uint64_t(c);
        const double u = uniform01(h, 3, 4);
        return u < 0.33 ? Provision::recompute : u < 0.5 ? Provision::offload : Provision::save;
      };
      const bool split = seed % 2 == 1;
      const PolicyRun r = run(cfg, random, split, stress, 0.0, 0, /*late_w=*/seed == 3);
      expect_same_grads(base, r, what + " stress, random assignment " + std::to_string(seed));
      if (stress == Arena::Stress::compact) {
        EXPECT_GT(r.compactions, 0);
      }
      if (stress == Arena::Stress::stitch) {
        EXPECT_GT(r.stitches, 0);
        EXPECT_GT(r.stitched_extents, r.stitches) << "tensors of several pages, mapped page by page";
      }
      if (stress == Arena::Stress::evict) {
        EXPECT_GT(r.evictions, 0);
        EXPECT_GT(r.counters.evicted, 0);
        if (split) {
          EXPECT_GT(r.wgrad_evicted, 0) << "queued W reads evicted and brought back";
        } else {
          EXPECT_EQ(r.wgrad_evicted, 0);
        }
      }
    }
  }
}

TEST(Provision, CapacityDroppingAndSplitBackward) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.capacity_factor = 0.75;  // skewed tokens overflow the capacity
  const PolicyRun base = run(cfg, {});
  expect_same_grads(base, run(cfg, make_static_policy("full"), true), "full + B/W split + capacity");
  expect_same_grads(base, run(cfg, make_static_policy("moe-medium")), "moe-medium + capacity");
}

TEST_P(ProvisionPrecision, OffloadEverythingFreesTheDeviceAndGivesTheSameGradients) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = GetParam();
  const PolicyRun base = run(cfg, {});
  ProvisionPolicy offload_all = [](const LedgerEntry&) { return Provision::offload; };
  const PolicyRun off = run(cfg, offload_all);
  expect_same_grads(base, off, "offload everything");
  EXPECT_EQ(off.counters.offloaded, base.counters.saved);
  EXPECT_EQ(off.counters.saved, 0);
  // Once the copies have landed, no saved activation remains on the device.
  Arena arena;
  MoEModel model(cfg, arena);
  model.init_weights(13);
  model.stash().set_policy(offload_all);
  const std::int64_t B = 2, S = 8, n = B * S;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 3), tg(static_cast<std::size_t>(n), 5);
  model.forward_train(ids.data(), tg.data(), B, S, 0);
  model.stash().sync();
  EXPECT_EQ(arena.stat(MemCategory::activations).current, 0);
  EXPECT_GT(model.stash().host_bytes(), 0);
  model.backward(ids.data(), tg.data(), B, S, 0, 1.0);
  EXPECT_EQ(model.stash().host_bytes(), 0);
  EXPECT_EQ(arena.stat(MemCategory::activations).current, 0);
}

TEST(Provision, UnknownPolicyIsRefusedWithTheNames) {
  try {
    make_static_policy("fullest");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("moe-medium"), std::string::npos);
  }
}

// threshold=R decides after the router: skewed micro-batches recompute their MoE
// part, calm ones save everything; gradients stay bit-identical either way.
TEST(Provision, ThresholdRecomputesOnlySpikingLayers) {
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  const PolicyRun base = run(cfg, {});
  // Without EP the balanced load equals what the rank receives (n * k), so R < 1
  // makes every MoE layer a spike and R >= 1 none.
  const PolicyRun spiky = run(cfg, make_static_policy("threshold=0.5"));
  const PolicyRun calm = run(cfg, make_static_policy("threshold=1.0"));
  expect_same_grads(base, spiky, "threshold=0.5");
  expect_same_grads(base, calm, "threshold=1.0");
  EXPECT_GT(spiky.counters.recomputed, 0);
  EXPECT_EQ(calm.counters.recomputed, 0);
  EXPECT_THROW(make_static_policy("threshold=abc"), ConfigError);
}

// The closed form of a block's projection: drops lower the phases before the
// layer's backward, offloads only until their prefetch, recomputes add their
// lineage's extra outputs to the backward.
TEST(Planner, ProjectionEvaluatesChoicesInClosedForm) {
  const std::vector<SaveCandidate> c = {{"a", "swiglu", 4 * kMiB, true, 0, 1 * kMiB, true},
                                        {"b", "grouped_gemm", 8 * kMiB, true, 0, 0, false},
                                        {"c", "combine", 2 * kMiB, false, 0, 0, true}};
  // tail, landing (offloads still copying), held, prefetched, backward, backward_rest, after
  const BlockProjection p{100 * kMiB, 104 * kMiB, 120 * kMiB, 110 * kMiB, 105 * kMiB, 100 * kMiB, 90 * kMiB};
  EXPECT_EQ(p.evaluate(c, {}), 120 * kMiB);
  EXPECT_EQ(p.evaluate(c, {{"b", Provision::recompute}}), 112 * kMiB);  // held 112, prefetched 102
  // offloading c frees it only from the next decision until the prefetch: prefetched 110 stays.
  EXPECT_EQ(p.evaluate(c, {{"b", Provision::recompute}, {"c", Provision::offload}}), 110 * kMiB);
  // all three: tail 100-4 (a: saved first), landing 104-12, held 120-14, prefetched 110-12,
  // backward 105+1, rest 100, after 90.
  EXPECT_EQ(p.evaluate(c, {{"a", Provision::recompute}, {"b", Provision::recompute}, {"c", Provision::offload}}),
            106 * kMiB);
}

// The planner keeps everything when it fits, drops the cheapest bytes to rebuild
// first when it does not (and puts back what then fits), offloads what has no
// lineage, and counts a decision whose every choice is over the budget.
TEST(Planner, DecidesFromTheProjectionAndBudget) {
  Arena arena(128 * kMiB);
  void* held = arena.allocate(80 * kMiB, MemCategory::weights, "weights");
  EXPECT_EQ(AdaptivePlanner(arena).margin(), Arena::placement_reserve(arena.budget()));  // a host arena stitches
  AdaptivePlanner planner(arena, kPlannerMarginFraction);  // margin: 5% = 6.4 MiB (as without stitching)
  EXPECT_EQ(planner.margin(), Bytes(128 * kMiB * kPlannerMarginFraction));
  const std::vector<SaveCandidate> layer = {{"experts.act", "swiglu", 4 * kMiB, true},
                                            {"experts.gate_out", "grouped_gemm", 4 * kMiB, true},
                                            {"moe.combined", "grouped_gemm", 4 * kMiB, false}};
  auto entry = [](int layer, const char* name) { return LedgerEntry{name, "", layer, 0, 0, true}; };
  // A walk whose peak falls while the block is held: every drop counts fully.
  auto flat = [](Bytes peak) {
    return [peak](const BlockChoice* c) {
      Bytes p = peak;
      if (c)
        for (auto& [name, prov] : *c) p -= prov == Provision::save ? 0 : 4 * kMiB;
      return BlockProjection{p, p, p, 0, 0, 0, 0};
    };
  };
  int calls = 0;
  planner.plan_block(0, 1, layer, [&](const BlockChoice* c) { ++calls; return flat(115 * kMiB)(c); }, {1});  // fits: keep all
  EXPECT_EQ(planner.decide(entry(1, "experts.act")), Provision::save);
  EXPECT_EQ(planner.decide(entry(1, "moe.combined")), Provision::save);
  planner.plan_block(0, 1, layer, [&](const BlockChoice* c) { ++calls; return flat(115 * kMiB)(c); }, {1});  // same situation: cached
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(planner.cache_hits(), 1);
  // Limit 128 - 6.4 = 121.6 MiB.
  planner.plan_block(0, 2, layer, flat(125 * kMiB), {2});  // 3.4 MiB over: the cheapest per byte goes
  EXPECT_EQ(planner.decide(entry(2, "experts.act")), Provision::recompute);  // elementwise
  EXPECT_EQ(planner.decide(entry(2, "experts.gate_out")), Provision::save);  // a GEMM output: dearer
  EXPECT_EQ(planner.decide(entry(2, "moe.combined")), Provision::save);
  planner.plan_block(0, 3, layer, flat(130 * kMiB), {3});  // everything goes: the all-to-all output to host
  EXPECT_EQ(planner.decide(entry(3, "experts.gate_out")), Provision::recompute);
  EXPECT_EQ(planner.decide(entry(3, "moe.combined")), Provision::offload);
  EXPECT_EQ(planner.infeasible(), 0);
  // 128 less the placement reserve after dropping all 12: over the margin's soft
  // target but within the budget less the reserve: the floor, feasible.
  const Bytes hard = 140 * kMiB - Arena::placement_reserve(arena.budget());
  planner.plan_block(0, 4, layer, flat(hard), {4});
  EXPECT_EQ(planner.infeasible(), 0);
  EXPECT_EQ(planner.decide(entry(4, "experts.act")), Provision::recompute);
  EXPECT_EQ(planner.decide(entry(4, "moe.combined")), Provision::offload);
  planner.plan_block(0, 4, layer, flat(hard + 64), {});  // 64 B into the reserve: infeasible
  EXPECT_EQ(planner.infeasible(), 1);
  EXPECT_EQ(planner.decide(entry(4, "experts.act")), Provision::recompute);
  EXPECT_EQ(planner.decisions(), 6);
  EXPECT_EQ(planner.decide(entry(5, "experts.act")), Provision::save);  // undecided layers save
  EXPECT_EQ(planner.static_level_choices(), 0);  // one candidate per family: greedy is the cheapest
  arena.deallocate(held, 80 * kMiB, MemCategory::weights);
}

// Greedy by cost per byte can miss the cheapest set: freeing 5.5 MiB, it drops q (1 MiB
// for 1 s), k (4 MiB, 4.2 s) and v (4 MiB, 4.4 s), then puts q back: 8.6 s. The
// `selective` policy's part of the block, attn.probs alone (6 MiB, 7.2 s), frees as
// much for less, and the planner takes it; when its bytes do not suffice, greedy stands.
TEST(Planner, TakesAStaticPolicysPartWhenItIsCheaper) {
  Arena arena(128 * kMiB);
  void* held = arena.allocate(64 * kMiB, MemCategory::weights, "weights");
  AdaptivePlanner planner(arena);
  const std::vector<SaveCandidate> block = {{"attn.q", "linear", 1 * kMiB, true, 1.0},
                                            {"attn.k", "linear", 4 * kMiB, true, 4.2},
                                            {"attn.v", "linear", 4 * kMiB, true, 4.4},
                                            {"attn.probs", "attention", 6 * kMiB, true, 7.2}};
  auto flat = [&block](Bytes peak) {
    return [peak, &block](const BlockChoice* c) {
      Bytes p = peak;
      if (c)
        for (const auto& cand : block)
          if (c->count(cand.name) && c->at(cand.name) != Provision::save) p -= cand.bytes;
      return BlockProjection{p, p, p, 0, 0, 0, 0};
    };
  };
  auto entry = [](int layer, const char* name) { return LedgerEntry{name, "", layer, 0, 0, true}; };
  // The limit is the budget less the margin; the cache bucket's slack (under 0.5 MiB)
  // adds to every projection.
  const Bytes limit = 128 * kMiB - planner.margin();
  planner.plan_block(0, 1, block, flat(limit + 11 * kMiB / 2), {});  // 5.5 MiB (+ slack) over
  EXPECT_EQ(planner.decide(entry(1, "attn.probs")), Provision::recompute);
  for (const char* kept : {"attn.q", "attn.k", "attn.v"}) EXPECT_EQ(planner.decide(entry(1, kept)), Provision::save);
  EXPECT_EQ(planner.static_level_choices(), 1);
  planner.plan_block(0, 2, block, flat(limit + 13 * kMiB / 2), {});  // 6.5 MiB over: attn.probs alone is short
  EXPECT_EQ(planner.decide(entry(2, "attn.probs")), Provision::save);
  EXPECT_EQ(planner.decide(entry(2, "attn.q")), Provision::save);  // put back
  for (const char* dropped : {"attn.k", "attn.v"}) EXPECT_EQ(planner.decide(entry(2, dropped)), Provision::recompute);
  EXPECT_EQ(planner.static_level_choices(), 1);
  arena.deallocate(held, 64 * kMiB, MemCategory::weights);
}
