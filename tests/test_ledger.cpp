// The activation ledger (model/ledger): its table is well formed (unique names per
// layer, every lineage input in the same layer, save groups in forward order), its
// entries follow the config (dense/MoE layers, shared expert, MLA's latents), its
// declared dtypes and formulas add up to the block totals recomputed by hand (the
// engine checks every save against them; test_memory_plan compares the stash with
// the sized table entry by entry), and the
// planner's choices read it (decision points, lineage under EP, rebuild bytes).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <regex>
#include <set>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/model/ledger.h"
#include "moeflex/model/memory_plan.h"

namespace moeflex {
namespace {

ModelConfig mla_config(std::int64_t q_lora_rank) { return test::small_mla_moe_config(2, q_lora_rank); }

std::vector<std::string> names_of(const ModelConfig& cfg, int layer) {
  std::vector<std::string> v;
  for (const SavedTensor* e : layer_entries(cfg, layer)) v.emplace_back(e->name);
  return v;
}

bool has(const std::vector<std::string>& v, const std::string& name) {
  return std::find(v.begin(), v.end(), name) != v.end();
}

TEST(Ledger, EveryLayerKindIsWellFormed) {
  ModelConfig plain = test::small_moe_config(3, 1, 4, true);
  plain.n_shared_experts = 0;
  for (const ModelConfig& cfg : {test::small_moe_config(3, 1, 4, true), plain, mla_config(0), mla_config(16)}) {
    for (int layer : {0, 1, kHeadLayer}) {
      const auto entries = layer_entries(cfg, layer);
      ASSERT_FALSE(entries.empty());
      std::set<std::string> seen;
      int last_group = -1;
      const auto names = names_of(cfg, layer);
      for (const SavedTensor* e : entries) {
        EXPECT_TRUE(seen.insert(e->name).second) << e->name << " twice in layer " << layer;
        // (Not necessarily earlier: the FFN norm is saved last and read by the router's lineage.)
        for (const char* in : e->inputs)
          if (in) EXPECT_TRUE(has(names, in)) << e->name << " reads " << in << ", which layer " << layer << " does not keep";
        EXPECT_EQ(e->lineage == Lineage::none, !e->inputs[0]) << e->name << ": a lineage names its inputs";
        // MLA's latents sit between the norm and the projections they feed but are
        // saved after the attention group: all other groups come in forward order.
        if (e->group != SaveGroup::mla_latents) {
          EXPECT_GE(int(e->group), last_group) << e->name << " is saved before an earlier group";
          last_group = int(e->group);
        }
        EXPECT_GT(e->shape(LedgerDims::of(cfg, 2, 8, MoERows::balanced(cfg, 16), false)).numel(), 0) << e->name;
      }
    }
  }
}

TEST(Ledger, EntriesFollowTheConfig) {
  const ModelConfig cfg = test::small_moe_config(2, 1, 4, true);  // layer 0 dense, layer 1 MoE with a shared expert
  const auto dense = names_of(cfg, 0), moe = names_of(cfg, 1);
  EXPECT_TRUE(has(dense, "dense.act") && !has(dense, "experts.in") && !has(dense, "shared.act"));
  EXPECT_TRUE(has(moe, "experts.in") && has(moe, "shared.act") && !has(moe, "dense.act"));
  EXPECT_TRUE(has(dense, "ffn_norm.in") && has(moe, "ffn_norm.in"));
  EXPECT_FALSE(has(moe, "attn.kv_latent"));
  ModelConfig no_shared = cfg;
  no_shared.n_shared_experts = 0;
  EXPECT_FALSE(has(names_of(no_shared, 1), "shared.act"));
  // MLA: kv's latent always, q's only with q_lora_rank; k and v are rebuilt from kv's latent.
  for (std::int64_t q_lora : {0, 16}) {
    const ModelConfig m = mla_config(q_lora);
    const auto v = names_of(m, 0);
    EXPECT_TRUE(has(v, "attn.kv_latent"));
    EXPECT_EQ(has(v, "attn.q_latent"), q_lora > 0);
    for (const SavedTensor* e : layer_entries(m, 0)) {
      if (std::string(e->name) == "attn.k") EXPECT_STREQ(e->inputs[0], "attn.kv_latent");
      if (std::string(e->name) == "attn.q") EXPECT_STREQ(e->inputs[0], q_lora > 0 ? "attn.q_latent" : "attn_norm.out");
    }
  }
  EXPECT_EQ(names_of(cfg, kHeadLayer),
            (std::vector<std::string>{"final_norm.in", "final_norm.out", "final_norm.rstd", "lm_head.probs"}));
}

TEST(Ledger, DecisionPointsAndLineagesAreThePlannersRules) {
  const SavedTensor* shared = ledger_entry("shared.act");
  const SavedTensor* norm = ledger_entry("ffn_norm.out");
  const SavedTensor* xe = ledger_entry("experts.in");
  const SavedTensor* combined = ledger_entry("moe.combined");
  const SavedTensor* idx = ledger_entry("router.topk_idx");
  ASSERT_TRUE(shared && norm && xe && combined && idx);
  EXPECT_FALSE(shared->planner_decides(true));
  EXPECT_TRUE(norm->planner_decides(true));
  EXPECT_FALSE(norm->planner_decides(false));  // a dense layer's FFN norm is saved
  EXPECT_TRUE(xe->recomputable(false));
  EXPECT_FALSE(xe->recomputable(true));  // an all-to-all's output: no lineage under EP
  EXPECT_FALSE(combined->recomputable(true));
  EXPECT_FALSE(idx->recomputable(false));
  EXPECT_EQ(xe->point, SavePoint::moe);
  EXPECT_EQ(ledger_entry("dense.act")->point, SavePoint::dense_ffn);
  EXPECT_EQ(ledger_entry("lm_head.probs")->point, SavePoint::head);
  EXPECT_EQ(ledger_entry("no.such"), nullptr);
  // planner_decides on a stash entry reads the same table.
  const ModelConfig cfg = test::small_moe_config(2, 1, 4, true);
  LedgerEntry e;
  e.name = "ffn_norm.in";
  e.layer = 0;
  EXPECT_FALSE(planner_decides(cfg, e));
  e.layer = 1;
  EXPECT_TRUE(planner_decides(cfg, e));
  e.name = "shared.gate_out";
  EXPECT_FALSE(planner_decides(cfg, e));
}

TEST(Ledger, RebuildExtraBytesAreTheLineagesOtherOutputs) {
  ModelConfig cfg = test::small_moe_config(2, 1, 4, true);
  cfg.bf16 = true;
  const std::int64_t B = 2, S = 8, n = B * S;
  auto r = [](std::int64_t bytes) { return Arena::round_up(bytes); };
  EXPECT_EQ(rebuild_extra_bytes(cfg, B, S, "attn_norm.rstd"), r(n * cfg.hidden_size * 2));
  EXPECT_EQ(rebuild_extra_bytes(cfg, B, S, "ffn_norm.out"), r(n * 4));
  EXPECT_EQ(rebuild_extra_bytes(cfg, B, S, "attn.out"), r(B * cfg.num_attention_heads * S * S * 2));
  EXPECT_EQ(rebuild_extra_bytes(cfg, B, S, "router.topk_w"), r(n * cfg.num_experts * 4) + r(n * 2 * 4));
  EXPECT_EQ(rebuild_extra_bytes(cfg, B, S, "attn.q"), 0);
}

/// The report's "<title> (<bytes> B)" figure.
Bytes report_total(const std::string& report, const std::string& title) {
  std::smatch m;
  if (!std::regex_search(report, m, std::regex(" " + title + " \\(([0-9]+) B,"))) return -1;
  return std::stoll(m[1]);
}

TEST(Ledger, ReportAddsUpEachBlockAtBalancedRouting) {
  for (bool bf16 : {false, true}) {
    ModelConfig cfg = test::small_moe_config(2, 1, 4, true);
    cfg.bf16 = bf16;
    const std::int64_t B = 2, S = 8, n = B * S, d = cfg.hidden_size, a = bf16 ? 2 : 4;
    const std::int64_t E = cfg.num_experts, k = cfg.num_experts_per_tok, R = n * k, f = cfg.moe_intermediate_size;
    const std::string rep = ledger_report(cfg, B, S, false, bf16);  // (the entries listed or not)
    // By hand: the norm's input and output and fp32 rstd, q, k, v, the probabilities, the output.
    EXPECT_EQ(report_total(rep, "attention block"), 2 * n * d * a + 4 * n + 3 * n * d * a +
                                                        B * cfg.num_attention_heads * S * S * a + n * d * a)
        << rep;
    const std::int64_t norm = 2 * n * d * a + 4 * n;
    EXPECT_EQ(report_total(rep, "dense FFN block"), 3 * n * cfg.intermediate_size * a + norm) << rep;
    const std::int64_t experts = R * d * a + 3 * R * f * a + R * d * a;
    const std::int64_t shared_expert = 3 * n * cfg.shared_width() * a;
    const std::int64_t router = n * E * a + n * E * 4 + 2 * n * k * 4 + (E + 1) * 4 + n * k * 4;
    EXPECT_EQ(report_total(rep, "MoE FFN block"), experts + shared_expert + router + norm) << rep;
    EXPECT_EQ(report_total(rep, "head"), 2 * n * d * a + 4 * n + n * cfg.vocab_size * a) << rep;
  }
}

}  // namespace
}  // namespace moeflex

namespace moeflex {

// The worst case bounds every routing with at most its rows, the chunked expert
// transients included: the engine's chunk split is not monotone in the rows (with
// the default model at EP 2 and capacity factor 1.25, 2,560 rows run as two chunks
// of 1,280 while 2,048 run as one of 2,048), so the bound must not be the split of
// the most rows. Fails when worst_case's chunk is cfg.expert_chunk(received).
TEST(Ledger, WorstCaseChunkBoundsEveryRoutingWithinIt) {
  ModelConfig cfg;  // the default model's MoE sizes
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  cfg.expert_chunk_rows = 2048;
  const std::int64_t n = 8 * 128;
  for (const double cf : {0.0, 1.25, 2.0})
    for (const int ep : {1, 2, 4}) {
      cfg.capacity_factor = cf;
      const MoERows worst = MoERows::worst_case(cfg, n, ep);
      const std::int64_t most = worst.expert_rows(ep > 1);
      ASSERT_GT(most, 0);
      for (std::int64_t r = 1; r <= most; ++r) {
        MoERows actual{r, r};
        ASSERT_LE(actual.largest_chunk(cfg, ep > 1), worst.largest_chunk(cfg, ep > 1))
            << "cf " << cf << " ep " << ep << " rows " << r;
        if (actual.one_chunk(cfg, ep > 1)) ASSERT_TRUE(worst.one_chunk(cfg, ep > 1));
      }
      if (cf == 1.25 && ep == 2) {
        EXPECT_EQ(most, 2560);  // 2 senders x 4 local experts x ceil(1.25 * 1024 * 2 / 8) = 320
        EXPECT_EQ(cfg.expert_chunk(most), 1280);
        EXPECT_EQ(worst.largest_chunk(cfg, true), 2048);
      }
    }
}

}  // namespace moeflex
