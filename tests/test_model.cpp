// Whole-model tests: the golden file from the independent PyTorch reference,
// a directional finite-difference check, skewed routing, memory accounting and
// determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstring>
#include <numeric>
#include <nlohmann/json.hpp>

#include "moeflex/core/rng.h"
#include "moeflex/model/model.h"
#include "moeflex/train/safetensors.h"
#include "model_fixtures.h"

using namespace moeflex;

namespace {

const std::string kRefDir = std::string(MOEFLEX_SOURCE_DIR) + "/tests/reference/";



std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t V, std::uint64_t stream) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) t[std::size_t(i)] = std::int32_t(uniform01(7, stream, std::uint64_t(i)) * double(V));
  return t;
}

/// The golden file's case through the engine; `patch` may restate its config in other
/// fields that mean the same model.
void check_golden(const std::string& file, const std::function<void(nlohmann::json&)>& patch = {}) {
  auto st = train::SafetensorsFile::open(kRefDir + file);
  ASSERT_EQ(st.metadata().at("magic"), "moeflex-golden");
  ASSERT_EQ(st.metadata().at("version"), "1");
  auto cj = nlohmann::json::parse(st.metadata().at("config"));
  if (patch) patch(cj);
  ModelConfig cfg = ModelConfig::from_hf_json(cj);
  const std::int64_t B = cj.at("batch_size"), S = cj.at("seq_len"), n = B * S, V = cfg.vocab_size;
  Arena arena;
  MoEModel model(cfg, arena);
  for (auto& p : model.params()) st.read_f32("param." + p.name, p.w.f32(), p.w.numel());
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
  st.read_i32("input.ids", ids.data(), n);
  st.read_i32("input.targets", tg.data(), n);

  // Last-position logits of each sequence against the reference's.
  std::vector<float> last(std::size_t(B * V));
  LossParts eval = model.forward_eval(ids.data(), tg.data(), B, S, last.data());
  std::vector<double> ref_logits(std::size_t(n * V));
  st.read_f64("out.logits", ref_logits.data(), n * V);
  for (std::int64_t b = 0; b < B; ++b)
    EXPECT_LT(test::rel_norm_err(last.data() + b * V, ref_logits.data() + ((b + 1) * S - 1) * V, V), 1e-5) << "seq " << b;

  model.zero_grads();
  LossParts lp = model.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
  const double ref_loss = std::stod(st.metadata().at("loss"));
  EXPECT_NEAR(lp.total, ref_loss, 1e-5 * std::abs(ref_loss));
  EXPECT_NEAR(lp.ce, std::stod(st.metadata().at("ce_loss")), 1e-5 * std::abs(ref_loss));
  EXPECT_NEAR(lp.aux, std::stod(st.metadata().at("aux_loss")), 1e-6);
  EXPECT_NEAR(lp.z, std::stod(st.metadata().at("z_loss")), 1e-6);
  EXPECT_DOUBLE_EQ(eval.total, lp.total) << "eval and train forwards differ";
  int checked = 0;
  for (auto& p : model.params()) {
    std::vector<double> ref(std::size_t(p.g.numel()));
    st.read_f64("grad." + p.name, ref.data(), p.g.numel());
    const double err = test::rel_norm_err(p.g.f32(), ref.data(), p.g.numel());
    EXPECT_LT(err, 1e-4) << "gradient of " << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, int(model.params().size()));
}

}  // namespace

TEST(Golden, DroplessMatchesPyTorchReference) { check_golden("golden_v1.safetensors"); }

TEST(Golden, CapacityTiedMatchesPyTorchReference) { check_golden("golden_v1_capacity.safetensors"); }

// Grouped-query attention (4 query heads over 2 kv heads) with head_dim 12, not
// hidden 32 / 4 heads: q and o_proj are 48 wide, k and v 24.
TEST(Golden, GqaMatchesPyTorchReference) { check_golden("golden_v1_gqa.safetensors"); }

// QK-norm: per head over GQA heads of 12 (Qwen3-MoE), and over all of q and k (OLMoE).
TEST(Golden, QkNormPerHeadMatchesPyTorchReference) { check_golden("golden_v1_qk_norm_head.safetensors"); }
TEST(Golden, QkNormOverTheWholeWidthMatchesPyTorchReference) { check_golden("golden_v1_qk_norm_full.safetensors"); }

// Dense and MoE layers alternating (decoder_sparse_step 2 after a dense first layer).
TEST(Golden, AlternatingDenseAndMoeLayersMatchPyTorchReference) { check_golden("golden_v1_sparse_step.safetensors"); }
// The same layers named by Qwen's mlp_only_layers instead: dense 0 and 2, MoE 1 and 3.
TEST(Golden, MlpOnlyLayersMatchTheAlternatingReference) {
  check_golden("golden_v1_sparse_step.safetensors", [](nlohmann::json& c) {
    ASSERT_EQ(c.at("decoder_sparse_step"), 2);
    ASSERT_EQ(c.at("first_k_dense_replace"), 1);
    c["decoder_sparse_step"] = 1;
    c["first_k_dense_replace"] = 0;
    c["mlp_only_layers"] = {0, 2};
  });
}

// DeepSeek-V3's router: sigmoid scores, an expert bias that changes some tokens'
// experts, 2 of 4 groups by their top-2 sum, weights renormalised and scaled by 2.5.
TEST(Golden, NoauxTcRoutingMatchesPyTorchReference) { check_golden("golden_v1_noaux_tc.safetensors"); }
// DeepSeek-V2's: softmax, top-3 from 2 of 4 groups by their best score, not renormalised, scaled by 1.5.
TEST(Golden, GroupLimitedRoutingMatchesPyTorchReference) { check_golden("golden_v1_group_limited.safetensors"); }

// d loss along random directions vs central differences of the float model, without
// and with QK-norm (per head over GQA heads, or over the whole width).
class DirectionalFiniteDifferences : public ::testing::TestWithParam<const char*> {};

TEST_P(DirectionalFiniteDifferences, MatchTheGradient) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  cfg.first_k_dense_replace = 1;
  cfg.num_hidden_layers = 3;
  cfg.qk_norm = GetParam();
  if (cfg.qk_norm == "head") cfg.num_key_value_heads = 2;
  Arena arena;
  MoEModel model(cfg, arena);
  model.init_weights(3);
  const std::int64_t B = 2, S = 8, n = B * S;
  auto ids = random_tokens(n, cfg.vocab_size, 1), tg = random_tokens(n, cfg.vocab_size, 2);
  model.zero_grads();
  model.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
  for (int dir = 0; dir < 4; ++dir) {
    // dir 0: all params; 1: router gates only; 2: routed experts only; 3: attention only.
    auto selected = [&](const std::string& name) {
      if (dir == 0) return true;
      if (dir == 1) return name.find("mlp.gate.weight") != std::string::npos;
      if (dir == 2) return name.find("mlp.experts.") != std::string::npos;
      return name.find("self_attn") != std::string::npos;
    };
    std::vector<std::vector<float>> v;
    double gv = 0, vv = 0;
    for (auto& p : model.params()) {
      v.emplace_back(std::size_t(p.w.numel()), 0.0f);
      if (!selected(p.name)) continue;
      for (std::int64_t i = 0; i < p.w.numel(); ++i) {
        float r = float(2 * uniform01(11, std::uint64_t(dir), std::uint64_t(vv * 1e3) + std::uint64_t(i)) - 1);
        v.back()[std::size_t(i)] = r;
        gv += double(r) * p.g.f32()[i];
      }
      vv += 1;
    }
    // Per-element step, small enough that no top-k choice flips: QK-norm magnifies a
    // step of q_proj/k_proj (their tiny outputs are normed to unit RMS), so half of it.
    const double eps = cfg.has_qk_norm() ? 1e-4 : 2e-4;
    auto loss_at = [&](double t) {
      std::size_t j = 0;
      std::vector<std::vector<float>> saved;
      for (auto& p : model.params()) {
        saved.emplace_back(p.w.f32(), p.w.f32() + p.w.numel());
        for (std::int64_t i = 0; i < p.w.numel(); ++i) p.w.f32()[i] += float(t) * v[j][std::size_t(i)];
        ++j;
      }
      double l = model.forward_eval(ids.data(), tg.data(), B, S).total;
      j = 0;
      for (auto& p : model.params()) std::memcpy(p.w.f32(), saved[j++].data(), sizeof(float) * std::size_t(p.w.numel()));
      return l;
    };
    const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
    EXPECT_NEAR(numeric, gv, 2e-2 * std::abs(gv) + 2e-3) << "direction " << dir;
  }
}

INSTANTIATE_TEST_SUITE_P(Model, DirectionalFiniteDifferences, ::testing::Values("none", "head", "full"));

// All tokens routed to experts 0 and 1; the others receive none.
TEST(Model, SkewedRoutingAllTokensToTwoExperts) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  cfg.num_experts = 8;
  Arena arena;
  MoEModel model(cfg, arena);
  model.init_weights(5);
  float* emb = model.param("model.embed_tokens.weight").w.f32();
  for (std::int64_t v = 0; v < cfg.vocab_size; ++v) emb[v * cfg.hidden_size] = 20.0f;
  for (int l = 0; l < 2; ++l) {
    float* g = model.param("model.layers." + std::to_string(l) + ".mlp.gate.weight").w.f32();
    std::memset(g, 0, sizeof(float) * std::size_t(cfg.num_experts * cfg.hidden_size));
    g[0 * cfg.hidden_size] = 5.0f;
    g[1 * cfg.hidden_size] = 4.0f;
  }
  const std::int64_t B = 2, S = 8, n = B * S;
  auto ids = random_tokens(n, cfg.vocab_size, 3), tg = random_tokens(n, cfg.vocab_size, 4);
  model.zero_grads();
  LossParts lp = model.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
  ASSERT_TRUE(std::isfinite(lp.total));
  ASSERT_EQ(model.routing().size(), 2u);
  for (auto& r : model.routing()) {
    EXPECT_EQ(r.tokens_per_expert[0], n);
    EXPECT_EQ(r.tokens_per_expert[1], n);
    for (int e = 2; e < 8; ++e) EXPECT_EQ(r.tokens_per_expert[std::size_t(e)], 0);
    EXPECT_DOUBLE_EQ(r.imbalance, 4.0);  // E / k
  }
  const float* g1 = model.param("model.layers.0.mlp.experts.gate_proj.weight").g.f32();
  const std::int64_t per = cfg.moe_intermediate_size * cfg.hidden_size;
  double used = 0, unused = 0;
  for (std::int64_t i = 0; i < per; ++i) used += std::abs(g1[i]);
  for (std::int64_t i = 2 * per; i < 8 * per; ++i) unused += std::abs(g1[i]);
  EXPECT_GT(used, 0.0);
  EXPECT_EQ(unused, 0.0);
  // The grouped-GEMM path equals the sequential-experts reference.
  const double grouped = model.forward_eval(ids.data(), tg.data(), B, S).total;
  model.set_expert_impl(ExpertImpl::sequential_reference);
  const double seq = model.forward_eval(ids.data(), tg.data(), B, S).total;
  EXPECT_NEAR(grouped, seq, 1e-5 * std::abs(seq));
}

// noaux_tc's expert bias: no gradient reaches it, the optimizer leaves it, and each
// update moves every expert's bias by exactly the rate toward balance (a hot expert
// down, the idle ones up), which evens out a skewed router's load over the updates.
TEST(Model, ExpertBiasMovesTowardBalanceByItsRule) {
  const ModelConfig cfg = test::with_deepseek_routing(test::small_moe_config(2, 0, 4, false), 2, 1, 0.05);
  Arena arena;
  MoEModel model(cfg, arena);
  model.init_weights(5);
  const std::int64_t B = 2, S = 16, n = B * S, E = cfg.num_experts;
  auto ids = random_tokens(n, cfg.vocab_size, 3), tg = random_tokens(n, cfg.vocab_size, 4);
  model.set_router_skew(3.0);  // expert 0 gets 3x its mean load
  auto imbalance = [&] {
    double worst = 0;
    for (const RoutingStats& r : model.routing()) worst = std::max(worst, r.imbalance);
    return worst;
  };
  const Param& bias = model.param("model.layers.0.mlp.gate.e_score_correction_bias");
  double first = 0, last = 0;
  for (int round = 0; round < 12; ++round) {
    model.clear_routing();
    model.zero_grads();
    model.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
    std::vector<double> load(std::size_t(E), 0.0);
    for (const RoutingStats& r : model.routing())
      if (r.layer == 0)
        for (std::int64_t e = 0; e < E; ++e) load[std::size_t(e)] += r.tokens_per_expert[std::size_t(e)];
    const double mean = std::accumulate(load.begin(), load.end(), 0.0) / double(E);
    const std::vector<float> before(bias.w.f32(), bias.w.f32() + E);
    for (std::int64_t e = 0; e < E; ++e) EXPECT_EQ(bias.g.f32()[e], 0.0f) << "a gradient reached the bias";
    if (round == 0) first = imbalance();
    last = imbalance();
    model.update_expert_bias(nullptr);
    for (std::int64_t e = 0; e < E; ++e) {
      const float step = load[std::size_t(e)] < mean ? 0.05f : load[std::size_t(e)] > mean ? -0.05f : 0.0f;
      EXPECT_EQ(bias.w.f32()[e], before[std::size_t(e)] + step) << "expert " << e << " round " << round;
    }
    if (round == 0) {
      EXPECT_LT(bias.w.f32()[0], 0.0f) << "the hot expert's bias must fall";
    }
  }
  EXPECT_LT(last, first - 0.3) << "the bias did not even out the skewed load";
}

TEST(Model, ActivationsAreFreedAndAccountedExactly) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  Arena arena(64 * kMiB);
  MoEModel model(cfg, arena);
  model.init_weights(1);
  const Bytes weights = arena.stat(MemCategory::weights).current;
  std::int64_t expect = 0;
  for (auto& p : model.params()) expect += Arena::round_up(p.w.nbytes());
  EXPECT_EQ(weights, expect);
  const std::int64_t B = 2, S = 8, n = B * S;
  auto ids = random_tokens(n, cfg.vocab_size, 1), tg = random_tokens(n, cfg.vocab_size, 2);
  model.forward_train(ids.data(), tg.data(), B, S, 0);
  const Bytes held = arena.stat(MemCategory::activations).current;
  EXPECT_GT(held, 0);
  // The stash's ledger adds up to what the arena holds (up to alignment rounding).
  Bytes ledger = 0;
  for (auto& e : model.stash().entries()) ledger += Arena::round_up(e.bytes);
  EXPECT_EQ(ledger, held);
  model.backward(ids.data(), tg.data(), B, S, 0, 1.0);
  EXPECT_EQ(arena.stat(MemCategory::activations).current, 0);
  EXPECT_EQ(arena.stat(MemCategory::workspace).current, 0);
  EXPECT_EQ(model.stash().bytes(), 0);
}

TEST(Model, BudgetTooSmallThrowsTypedOOM) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  Arena arena(256 * kKiB);
  try {
    MoEModel model(cfg, arena);
    model.init_weights(1);
    const std::int64_t B = 8, S = 16, n = B * S;
    auto ids = random_tokens(n, cfg.vocab_size, 1), tg = random_tokens(n, cfg.vocab_size, 2);
    model.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.budget, 256 * kKiB);
    EXPECT_GT(e.requested, e.largest_free_block);
    EXPECT_FALSE(e.op.empty());
    EXPECT_NE(std::string(e.what()).find(e.op), std::string::npos);
  }
}

TEST(Model, BitIdenticalAcrossRuns) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  const std::int64_t B = 2, S = 8, n = B * S;
  auto ids = random_tokens(n, cfg.vocab_size, 1), tg = random_tokens(n, cfg.vocab_size, 2);
  std::vector<std::vector<float>> grads[2];
  for (int run = 0; run < 2; ++run) {
    Arena arena;
    MoEModel model(cfg, arena);
    model.init_weights(9);
    model.forward_backward(ids.data(), tg.data(), B, S, 0, 0.5);
    model.forward_backward(ids.data(), tg.data(), B, S, 1, 0.5);
    for (auto& p : model.params()) grads[run].emplace_back(p.g.f32(), p.g.f32() + p.g.numel());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (std::size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_EQ(0, std::memcmp(grads[0][i].data(), grads[1][i].data(), grads[0][i].size() * sizeof(float)));
}

// Zero-bubble split: B now, W later gives the same gradients bit for bit, and
// before W the weight-gradient GEMMs have not touched the matrices' gradients.
TEST(Model, DeferredWeightGradientsMatchFusedBackward) {
  ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  cfg.first_k_dense_replace = 1;
  cfg.num_hidden_layers = 3;
  const std::int64_t B = 2, S = 8, n = B * S;
  auto ids = random_tokens(n, cfg.vocab_size, 5), tg = random_tokens(n, cfg.vocab_size, 6);
  Arena a1, a2;
  MoEModel fused(cfg, a1), split(cfg, a2);
  fused.init_weights(4);
  split.init_weights(4);
  fused.forward_backward(ids.data(), tg.data(), B, S, 0, 1.0);
  split.set_defer_weight_grads(true);
  split.forward_train(ids.data(), tg.data(), B, S, 0);
  split.backward(ids.data(), tg.data(), B, S, 0, 1.0);
  EXPECT_GT(split.pending_weight_grads(0), 10u);
  for (auto& p : split.params()) {
    double s = 0;
    for (std::int64_t i = 0; i < p.g.numel(); ++i) s += std::abs(p.g.f32()[i]);
    const bool matrix_of_linear = p.name.find("_proj") != std::string::npos ||
                                  p.name.find("mlp.gate.") != std::string::npos || p.name == "lm_head.weight" ||
                                  p.name == "model.embed_tokens.weight";
    if (matrix_of_linear) EXPECT_EQ(s, 0.0) << p.name << " written before W";
    else EXPECT_GT(s, 0.0) << p.name << " (norm weights are part of B)";
  }
  EXPECT_GT(a2.stat(MemCategory::activations).current + a2.stat(MemCategory::workspace).current, 0);
  split.backward_weight(0);
  EXPECT_EQ(split.pending_weight_grads(0), 0u);
  EXPECT_EQ(a2.stat(MemCategory::activations).current, 0);
  EXPECT_EQ(a2.stat(MemCategory::workspace).current, 0);
  for (auto& p : fused.params()) {
    Param& q = split.param(p.name);
    EXPECT_EQ(0, std::memcmp(p.g.f32(), q.g.f32(), std::size_t(p.g.nbytes()))) << p.name;
  }
}
