// ModelConfig: the model's shape, with Hugging Face field names (docs/model.md).
// One typed config, validated in one place (STYLE habit 8).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace toml {
inline namespace v3 {
class table;
}
}  // namespace toml

namespace moeflex {

/// Shortest round-trip text of a double that TOML reads back as a float ("1e-05", "10000.0").
std::string toml_float(double v);
/// A TOML basic string literal with quotes, backslashes and control characters escaped.
std::string toml_string(const std::string& v);

struct ModelConfig {
  std::int64_t vocab_size = 4096;              ///< tokens in the vocabulary
  std::int64_t hidden_size = 256;              ///< d, model width
  std::int64_t num_hidden_layers = 4;          ///< L
  std::int64_t num_attention_heads = 4;        ///< H; head_dim = d / H unless head_dim is given, even
  std::int64_t head_dim_override = 0;          ///< HF head_dim (TOML/JSON key "head_dim"); 0: d / H
  std::int64_t num_key_value_heads = 0;        ///< GQA key/value heads, dividing H; 0: H (multi-head)
  /// RMSNorm of q and k after their projections, before RoPE (moeflex's key; Hugging
  /// Face implies it by model_type): "none"; "head", one weight [head_dim] over each
  /// head (Qwen3-MoE's q_norm/k_norm); "full", one over all of q [q_width] and of k
  /// [kv_width] (OLMoE's).
  std::string qk_norm = "none";
  /// Multi-head latent attention (MLA, DeepSeek-V2/V3; the HF fields of the same
  /// names), on when kv_lora_rank > 0: q = W_uq rmsnorm(W_dq x) (W_q x without
  /// q_lora_rank), [c_kv, k_rope] = W_dkv x, [k_nope, v] = W_ukv rmsnorm(c_kv); q and k
  /// heads are qk_nope_head_dim + qk_rope_head_dim wide (RoPE on the last part; k_rope
  /// shared by the heads), v and the attention output v_head_dim. Simulator only.
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  std::int64_t max_position_embeddings = 256;  ///< longest sequence
  double rope_theta = 10000.0;                 ///< RoPE base
  double rms_norm_eps = 1e-5;                  ///< RMSNorm epsilon
  std::int64_t num_experts = 8;                ///< E routed experts per MoE layer
  std::int64_t num_experts_per_tok = 2;        ///< top-k
  std::int64_t moe_intermediate_size = 512;    ///< f, width of each routed expert
  std::int64_t n_shared_experts = 0;           ///< shared experts (0 = none)
  std::int64_t shared_expert_intermediate_size = 0;  ///< fs; 0 means n_shared_experts * f
  std::int64_t first_k_dense_replace = 0;      ///< leading layers with a dense MLP
  /// Qwen2/3-MoE's decoder_sparse_step: of the layers from first_k_dense_replace on,
  /// layer l is MoE when (l + 1) % decoder_sparse_step == 0, else dense (1: all MoE).
  std::int64_t decoder_sparse_step = 1;
  /// Qwen2/3-MoE's mlp_only_layers: layers (0-based) with a dense MLP whatever
  /// decoder_sparse_step says.
  std::vector<std::int64_t> mlp_only_layers;
  std::int64_t intermediate_size = 1024;       ///< width of those dense MLPs
  /// Group-limited routing (DeepSeek-V2/V3's "device/node-limited routing"; HF n_group
  /// and topk_group): the experts form n_group equal groups, and a token's top-k
  /// experts come from the topk_group groups it scores best (topk_method says how a
  /// group is scored). 1 and 1: no limit. The simulator's DeepEP dispatcher prices
  /// the fewer nodes a token's experts then span.
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  /// The router's scores (HF scoring_func): "softmax" over the experts (Mixtral, Qwen,
  /// OLMoE, DeepSeek-V2) or "sigmoid" of each logit (DeepSeek-V3, Kimi K2).
  std::string scoring_func = "softmax";
  /// How the top-k is chosen (HF topk_method): "greedy", the k best scores of all
  /// experts; "group_limited_greedy" (DeepSeek-V2), from the topk_group groups of best
  /// maximum score; "noaux_tc" (DeepSeek-V3), by the scores plus a per-expert bias
  /// (e_score_correction_bias, a buffer updated from the load: Wang et al. 2024,
  /// "Auxiliary-Loss-Free Load Balancing"), from the groups of best top-2 sum.
  std::string topk_method = "greedy";
  bool norm_topk_prob = true;                  ///< renormalise top-k weights to sum 1
  double routed_scaling_factor = 1.0;          ///< the top-k weights' factor (after renormalising)
  /// noaux_tc: after each optimizer step each expert's bias moves by this toward
  /// balance, b_e += rate * sign(mean load - load_e), the loads summed over the step's
  /// micro-batches and data-parallel ranks (DeepSeek-V3's gamma, Megatron-Core's
  /// moe_router_bias_update_rate; moeflex's name).
  double router_bias_update_rate = 1e-3;
  double router_aux_loss_coef = 0.01;          ///< Switch load-balancing loss coefficient
  double router_z_loss_coef = 0.0;             ///< router z-loss coefficient
  bool tie_word_embeddings = true;             ///< LM head shares the embedding matrix
  double capacity_factor = 0.0;                ///< <= 0: dropless; else rows per expert = ceil(cf*n*k/E)
  double initializer_range = 0.02;             ///< std of the normal init of matrices
  /// Rows of received tokens the routed experts' FFN processes at a time (moeflex,
  /// not Hugging Face): FC1, SwiGLU and their gradients are [chunk, f] transients,
  /// so the most memory-saving provision's working set is bounded whatever the
  /// routing (DESIGN.md, "Routing-independent floor"). 0 = off (one chunk of all
  /// rows). Chunk boundaries are a function of the rows alone (never of the
  /// provisioning), so every provision gives the same bits.
  std::int64_t expert_chunk_rows = 2048;
  /// Mixed precision (moeflex, not Hugging Face; Megatron's --bf16): activations and
  /// the working copy of the weights in bf16, with fp32 master weights, fp32
  /// gradients, fp32 optimizer state and fp32 accumulation in every op
  /// (ops/backend.h). RMSNorm's rstd, the router's probabilities and top-k weights
  /// and the per-token losses stay fp32. false: everything fp32.
  bool bf16 = false;
  /// Bytes of one activation element: 2 with bf16, else 4.
  std::int64_t activation_bytes() const { return bf16 ? 2 : 4; }
  /// Rows per chunk for `rows` received rows: the fewest chunks of at most
  /// expert_chunk_rows, as even as can be (ceil(rows / ceil(rows / expert_chunk_rows))
  /// each, the last one the rest), so no chunk is a sliver; all rows when off.
  std::int64_t expert_chunk(std::int64_t rows) const {
    if (expert_chunk_rows <= 0 || rows <= expert_chunk_rows) return rows;
    const std::int64_t chunks = (rows + expert_chunk_rows - 1) / expert_chunk_rows;
    return (rows + chunks - 1) / chunks;
  }

  /// Width of one attention head: the HF field head_dim when given (Qwen3: 128 with
  /// hidden 4096 and 64 heads), else hidden_size / num_attention_heads.
  std::int64_t head_dim() const {
    return head_dim_override > 0 ? head_dim_override : hidden_size / num_attention_heads;
  }
  /// Key/value heads (GQA): num_key_value_heads when given, else num_attention_heads (MHA).
  std::int64_t kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  /// True for multi-head latent attention (kv_lora_rank > 0).
  bool mla() const { return kv_lora_rank > 0; }
  /// Width of a q or k head: qk_nope_head_dim + qk_rope_head_dim with MLA, else head_dim.
  std::int64_t qk_head_dim() const { return mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim(); }
  /// Widths of q (heads x qk_head_dim) and, without MLA, of k and v (kv heads x head_dim).
  std::int64_t q_width() const { return num_attention_heads * qk_head_dim(); }
  std::int64_t kv_width() const { return kv_heads() * head_dim(); }
  /// Widths of k, of v and of the attention output (o_proj's input): kv_width,
  /// kv_width and q_width, or with MLA heads x qk_head_dim, heads x v_head_dim twice.
  std::int64_t k_width() const { return mla() ? num_attention_heads * qk_head_dim() : kv_width(); }
  std::int64_t v_width() const { return mla() ? num_attention_heads * v_head_dim : kv_width(); }
  std::int64_t attn_out_width() const { return mla() ? num_attention_heads * v_head_dim : q_width(); }
  /// Parameters of one layer's attention projections (norm weights of MLA's latents
  /// included, the layer's input norm not): q, k, v, o, or MLA's down and up projections.
  std::int64_t attention_params() const;
  /// Key/value heads on one of `tp` tensor-parallel ranks: kv_heads / tp, at least one
  /// (fewer kv heads than ranks are replicated).
  std::int64_t kv_heads_per_rank(int tp) const { return std::max<std::int64_t>(kv_heads() / std::max(tp, 1), 1); }
  /// True when q and k are normed (qk_norm "head" or "full").
  bool has_qk_norm() const { return qk_norm != "none"; }
  /// QK-norm's rows and width for q (`q`) or k over `n` tokens: n x heads rows of
  /// head_dim ("head") or n rows of q_width / kv_width ("full").
  std::int64_t qk_norm_rows(std::int64_t n, bool q) const {
    return qk_norm == "head" ? n * (q ? num_attention_heads : kv_heads()) : n;
  }
  std::int64_t qk_norm_width(bool q) const { return qk_norm == "head" ? head_dim() : q ? q_width() : kv_width(); }
  /// True for the attention moeflex's training engine runs: multi-head or grouped-query,
  /// any head_dim (the simulator also prices MLA).
  bool engine_attention() const { return !mla(); }
  std::int64_t shared_width() const {
    return shared_expert_intermediate_size > 0 ? shared_expert_intermediate_size
                                               : n_shared_experts * moe_intermediate_size;
  }
  bool is_moe_layer(std::int64_t l) const {
    return l >= first_k_dense_replace && (decoder_sparse_step <= 1 || (l + 1) % decoder_sparse_step == 0) &&
           std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
  }
  /// True when some layer has a dense MLP (a dense prefix or alternating layers).
  bool has_dense_layers() const {
    for (std::int64_t l = 0; l < num_hidden_layers; ++l)
      if (!is_moe_layer(l)) return true;
    return false;
  }
  /// True when some layer is MoE.
  bool has_moe_layers() const {
    for (std::int64_t l = 0; l < num_hidden_layers; ++l)
      if (is_moe_layer(l)) return true;
    return false;
  }
  /// True when a token's experts are limited to topk_group of n_group groups.
  bool group_limited() const { return n_group > 1 && topk_group < n_group; }
  /// True when each MoE layer's router has an e_score_correction_bias (noaux_tc).
  bool expert_bias() const { return topk_method == "noaux_tc"; }

  /// Throws ConfigError naming the field and the rule broken.
  void validate() const;
  /// Total parameters, and those active per token (top-k experts + shared + dense).
  std::int64_t num_params() const;
  std::int64_t num_active_params() const;

  /// Reads the fields present in `t` over the defaults; unknown keys are an error.
  static ModelConfig from_toml(const toml::table& t);
  /// Reads a Hugging Face config.json (Mixtral, Qwen-MoE, DeepSeek field variants).
  /// The shape fields (vocab, width, layers, heads; expert count, top-k and widths
  /// where the layers need them) are required; a field of the wrong type is refused.
  /// Throws ConfigError naming `source` (the file) and the field.
  static ModelConfig from_hf_json(const nlohmann::json& j, const std::string& source = "config.json");
  /// Throws ConfigError naming `source` and the field when a Hugging Face config.json
  /// asks for what the training engine does not run (the simulator prices some of it):
  /// attention or MLP biases, an activation other than SiLU, RoPE scaling, sliding
  /// windows, clipped qkv, sigmoid scoring, routed scaling, expert bias or
  /// group-limited top-k, Qwen2-MoE, MLA, a model_type other than qwen3_moe, olmoe and
  /// mixtral (none: moeflex's own field names).
  static void refuse_engine_unsupported_hf(const nlohmann::json& j, const std::string& source);
  /// Renders the [model] table as TOML text.
  std::string to_toml() const;
  nlohmann::json to_json() const;
};

}  // namespace moeflex
