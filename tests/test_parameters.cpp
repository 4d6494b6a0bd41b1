// The model's parameter list (model/parameters): what the engine allocates is the
// list, tensor for tensor; the list adds up to ModelConfig::num_params (an
// independent formula) for multi-head, grouped-query and MLA attention, dense and
// MoE layers, tied and untied heads; tensor parallelism divides it as
// Megatron-Core does (whole key/value heads a rank).
#include <gtest/gtest.h>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/model/model.h"
#include "moeflex/model/parameters.h"
#include "moeflex/sim/simulation.h"

namespace moeflex {
namespace {

double listed_params(const ModelConfig& cfg, int tp) {
  double n = embedding_parameter(cfg).numel_per_rank(cfg, tp) + final_norm_parameter(cfg).numel_per_rank(cfg, tp);
  if (!cfg.tie_word_embeddings) n += lm_head_parameter(cfg).numel_per_rank(cfg, tp);
  for (int l = 0; l < cfg.num_hidden_layers; ++l)
    for (const ParamSpec& p : layer_parameters(cfg, l, cfg.num_experts)) n += p.numel_per_rank(cfg, tp);
  return n;
}

ModelConfig gqa_config() {
  ModelConfig c = test::small_moe_config(3, 1, 4, false);
  c.num_key_value_heads = 2;
  c.head_dim_override = 16;
  return c;
}

TEST(Parameters, TheEngineAllocatesTheList) {
  for (bool tied : {true, false}) {
    const ModelConfig cfg = test::small_moe_config(3, 1, 4, tied);
    Arena arena;
    MoEModel model(cfg, arena);
    std::vector<ParamSpec> want = {embedding_parameter(cfg)};
    for (int l = 0; l < cfg.num_hidden_layers; ++l)
      for (const ParamSpec& p : layer_parameters(cfg, l, cfg.num_experts)) want.push_back(p);
    want.push_back(final_norm_parameter(cfg));
    if (!tied) want.push_back(lm_head_parameter(cfg));
    ASSERT_EQ(model.params().size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(model.params()[i].name, want[i].name);
      EXPECT_EQ(model.params()[i].w.shape(), want[i].shape) << want[i].name;
      EXPECT_EQ(model.params()[i].no_decay, want[i].no_decay) << want[i].name;
      EXPECT_EQ(model.params()[i].expert, want[i].expert) << want[i].name;
    }
  }
}

TEST(Parameters, TheEnginesShapesAreTheModelsOwn) {
  // Literal shapes (docs/model.md) for a layer of each kind: q, k, v, o [d, d] for
  // multi-head attention, stacked experts [E, f, d] and [E, d, f].
  const ModelConfig cfg = test::small_moe_config(2, 1, 4, true);
  const std::int64_t d = cfg.hidden_size, f = cfg.moe_intermediate_size, E = cfg.num_experts;
  Arena arena;
  MoEModel model(cfg, arena);
  using V = std::vector<std::int64_t>;
  EXPECT_EQ(model.param("model.layers.0.self_attn.k_proj.weight").w.shape(), (V{d, d}));
  EXPECT_EQ(model.param("model.layers.0.mlp.down_proj.weight").w.shape(), (V{d, cfg.intermediate_size}));
  EXPECT_EQ(model.param("model.layers.1.mlp.experts.up_proj.weight").w.shape(), (V{E, f, d}));
  EXPECT_EQ(model.param("model.layers.1.mlp.experts.down_proj.weight").w.shape(), (V{E, d, f}));
  EXPECT_EQ(model.param("model.layers.1.mlp.shared_experts.gate_proj.weight").w.shape(), (V{cfg.shared_width(), d}));
  EXPECT_TRUE(model.param("model.layers.1.mlp.experts.gate_proj.weight").expert);
  EXPECT_TRUE(model.param("model.layers.1.post_attention_layernorm.weight").no_decay);
}

/// The simulator's per-rank parameter count as closed forms: each layer's norms,
/// attention (tp over heads, whole kv heads a rank; MLA's down projections whole),
/// router, experts over ep, shared expert or dense MLP over tp; embedding and head.
double closed_form(const ModelConfig& cfg, int tp, int ep, bool embedding, bool head) {
  const double d = double(cfg.hidden_size), H = double(cfg.num_attention_heads);
  double n = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    n += 2 * d;
    if (cfg.mla()) {
      const double ql = double(cfg.q_lora_rank), kl = double(cfg.kv_lora_rank), qk = double(cfg.qk_head_dim());
      n += ql > 0 ? d * ql + ql + ql * H * qk / tp : d * H * qk / tp;
      n += d * (kl + double(cfg.qk_rope_head_dim)) + kl + kl * H * double(cfg.qk_nope_head_dim + cfg.v_head_dim) / tp;
      n += H * double(cfg.v_head_dim) * d / tp;
    } else {
      n += 2 * d * double(cfg.q_width()) / tp + 2 * d * double(cfg.kv_heads_per_rank(tp) * cfg.head_dim());
    }
    if (cfg.is_moe_layer(l))
      n += double(cfg.num_experts) * d + 3 * double(cfg.num_experts / ep) * double(cfg.moe_intermediate_size) * d +
           3 * double(cfg.shared_width()) * d / tp;
    else
      n += 3 * double(cfg.intermediate_size) * d / tp;
  }
  const double vocab = double(cfg.vocab_size) * d / tp;
  if (embedding) n += vocab;
  if (head) n += d + (!cfg.tie_word_embeddings || !embedding ? vocab : 0);
  return n;
}

TEST(Parameters, TheSimulatorCountsWhatOneRankHolds) {
  const ModelConfig mla = test::small_mla_moe_config(2, 0), mla_q = test::small_mla_moe_config(2, 12);
  for (const ModelConfig& cfg : {test::small_moe_config(3, 1, 4, true), gqa_config(), mla, mla_q})
    for (int tp : {1, 2, 4})
      for (int ep : {1, 2})
        for (bool ends : {true, false}) {
          sim::ParallelSpec par;
          par.tp = tp;
          par.ep = ep;
          double n = 0;
          sim::for_each_param_tensor(cfg, par, {{0, int(cfg.num_hidden_layers)}}, ends, true,
                                     [&](double numel, bool) { n += numel; });
          EXPECT_EQ(n, closed_form(cfg, tp, ep, ends, true)) << "tp " << tp << " ep " << ep;
        }
}

TEST(Parameters, TheListAddsUpToTheConfigsCount) {
  const ModelConfig mla = test::small_mla_moe_config(2, 0), mla_q = test::small_mla_moe_config(2, 12);
  for (const ModelConfig& cfg : {test::small_moe_config(3, 1, 4, true), test::small_moe_config(2, 0, 8, false),
                                 gqa_config(), mla, mla_q})
    EXPECT_EQ(listed_params(cfg, 1), double(cfg.num_params()));
}

TEST(Parameters, TensorParallelismSplitsHeadsAndWidths) {
  const ModelConfig cfg = gqa_config();  // 4 heads of 16, 2 key/value heads
  const auto layer = layer_parameters(cfg, 0, cfg.num_experts);  // a dense layer
  auto find = [&](const std::string& suffix) {
    for (const ParamSpec& p : layer)
      if (p.name.ends_with(suffix)) return p;
    throw std::runtime_error(suffix);
  };
  const double d = double(cfg.hidden_size);
  EXPECT_EQ(find("q_proj.weight").numel_per_rank(cfg, 2), 2 * 16 * d);
  EXPECT_EQ(find("k_proj.weight").numel_per_rank(cfg, 2), 1 * 16 * d);
  EXPECT_EQ(find("k_proj.weight").numel_per_rank(cfg, 4), 1 * 16 * d);  // a whole head each, replicated
  EXPECT_EQ(find("input_layernorm.weight").numel_per_rank(cfg, 4), d);
  EXPECT_EQ(find("mlp.down_proj.weight").numel_per_rank(cfg, 2), d * double(cfg.intermediate_size) / 2);
}

}  // namespace
}  // namespace moeflex
