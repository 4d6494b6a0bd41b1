// The model's parameter list (parameters.h).
#include "moeflex/model/parameters.h"

#include <fmt/format.h>

namespace moeflex {

double ParamSpec::numel_per_rank(const ModelConfig& cfg, int tp) const {
  double n = 1;
  for (const std::int64_t x : shape) n *= double(x);
  switch (split) {
    case TpSplit::none: return n;
    case TpSplit::even: return n / double(std::max(tp, 1));
    case TpSplit::kv_heads:  // [kv_heads * head_dim, d] -> whole heads a rank
      return double(cfg.kv_heads_per_rank(tp) * cfg.head_dim()) * double(shape.back());
  }
  return n;
}

namespace {

void attention_parameters(const ModelConfig& cfg, const std::string& p, std::vector<ParamSpec>& v) {
  const std::int64_t d = cfg.hidden_size, H = cfg.num_attention_heads;
  const std::string a = p + "self_attn.";
  if (!cfg.mla()) {
    v.push_back({a + "q_proj.weight", {cfg.q_width(), d}, false, false, TpSplit::even});
    v.push_back({a + "k_proj.weight", {cfg.kv_width(), d}, false, false, TpSplit::kv_heads});
    v.push_back({a + "v_proj.weight", {cfg.kv_width(), d}, false, false, TpSplit::kv_heads});
    v.push_back({a + "o_proj.weight", {d, cfg.q_width()}, false, false, TpSplit::even});
    if (cfg.has_qk_norm()) {  // Qwen3-MoE's and OLMoE's names; counted whole on every tp rank (tiny)
      v.push_back({a + "q_norm.weight", {cfg.qk_norm_width(true)}, true});
      v.push_back({a + "k_norm.weight", {cfg.qk_norm_width(false)}, true});
    }
    return;
  }
  // MLA (DeepSeek-V2/V3): the down projections and latent norms whole on every tp rank.
  const std::int64_t ql = cfg.q_lora_rank, kl = cfg.kv_lora_rank, qk = cfg.qk_head_dim(), vd = cfg.v_head_dim;
  if (ql > 0) {
    v.push_back({a + "q_a_proj.weight", {ql, d}});
    v.push_back({a + "q_a_layernorm.weight", {ql}, true});
    v.push_back({a + "q_b_proj.weight", {H * qk, ql}, false, false, TpSplit::even});
  } else {
    v.push_back({a + "q_proj.weight", {H * qk, d}, false, false, TpSplit::even});
  }
  v.push_back({a + "kv_a_proj_with_mqa.weight", {kl + cfg.qk_rope_head_dim, d}});
  v.push_back({a + "kv_a_layernorm.weight", {kl}, true});
  v.push_back({a + "kv_b_proj.weight", {H * (cfg.qk_nope_head_dim + vd), kl}, false, false, TpSplit::even});
  v.push_back({a + "o_proj.weight", {d, H * vd}, false, false, TpSplit::even});
}

}  // namespace

std::vector<ParamSpec> layer_parameters(const ModelConfig& cfg, int layer, std::int64_t local_experts) {
  const std::int64_t d = cfg.hidden_size, f = cfg.moe_intermediate_size, fs = cfg.shared_width();
  const std::int64_t I = cfg.intermediate_size;
  const std::string p = fmt::format("model.layers.{}.", layer);
  std::vector<ParamSpec> v;
  v.push_back({p + "input_layernorm.weight", {d}, true});
  attention_parameters(cfg, p, v);
  v.push_back({p + "post_attention_layernorm.weight", {d}, true});
  if (cfg.is_moe_layer(layer)) {
    v.push_back({p + "mlp.gate.weight", {cfg.num_experts, d}});
    if (cfg.expert_bias()) v.push_back({p + "mlp.gate.e_score_correction_bias", {cfg.num_experts}, true, false,
                                        TpSplit::none, true});
    v.push_back({p + "mlp.experts.gate_proj.weight", {local_experts, f, d}, false, true});
    v.push_back({p + "mlp.experts.up_proj.weight", {local_experts, f, d}, false, true});
    v.push_back({p + "mlp.experts.down_proj.weight", {local_experts, d, f}, false, true});
    if (fs > 0) {
      v.push_back({p + "mlp.shared_experts.gate_proj.weight", {fs, d}, false, false, TpSplit::even});
      v.push_back({p + "mlp.shared_experts.up_proj.weight", {fs, d}, false, false, TpSplit::even});
      v.push_back({p + "mlp.shared_experts.down_proj.weight", {d, fs}, false, false, TpSplit::even});
    }
  } else {
    v.push_back({p + "mlp.gate_proj.weight", {I, d}, false, false, TpSplit::even});
    v.push_back({p + "mlp.up_proj.weight", {I, d}, false, false, TpSplit::even});
    v.push_back({p + "mlp.down_proj.weight", {d, I}, false, false, TpSplit::even});
  }
  return v;
}

ParamSpec embedding_parameter(const ModelConfig& cfg) {
  return {"model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size}, false, false, TpSplit::even};
}

ParamSpec final_norm_parameter(const ModelConfig& cfg) { return {"model.norm.weight", {cfg.hidden_size}, true}; }

ParamSpec lm_head_parameter(const ModelConfig& cfg) {
  return {"lm_head.weight", {cfg.vocab_size, cfg.hidden_size}, false, false, TpSplit::even};
}

}  // namespace moeflex
