#include "moeflex/model/config.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>
#include <set>
#include <toml++/toml.h>

#include "moeflex/core/error.h"

namespace moeflex {

namespace {

// Visits every field once, so parsing, printing and JSON never drift apart.
template <typename F>
void for_each_field(ModelConfig& c, F&& f) {
  f("vocab_size", c.vocab_size);
  f("hidden_size", c.hidden_size);
  f("num_hidden_layers", c.num_hidden_layers);
  f("num_attention_heads", c.num_attention_heads);
  f("head_dim", c.head_dim_override);
  f("num_key_value_heads", c.num_key_value_heads);
  f("qk_norm", c.qk_norm);
  f("q_lora_rank", c.q_lora_rank);
  f("kv_lora_rank", c.kv_lora_rank);
  f("qk_nope_head_dim", c.qk_nope_head_dim);
  f("qk_rope_head_dim", c.qk_rope_head_dim);
  f("v_head_dim", c.v_head_dim);
  f("max_position_embeddings", c.max_position_embeddings);
  f("rope_theta", c.rope_theta);
  f("rms_norm_eps", c.rms_norm_eps);
  f("num_experts", c.num_experts);
  f("num_experts_per_tok", c.num_experts_per_tok);
  f("moe_intermediate_size", c.moe_intermediate_size);
  f("n_shared_experts", c.n_shared_experts);
  f("shared_expert_intermediate_size", c.shared_expert_intermediate_size);
  f("first_k_dense_replace", c.first_k_dense_replace);
  f("decoder_sparse_step", c.decoder_sparse_step);
  f("mlp_only_layers", c.mlp_only_layers);
  f("intermediate_size", c.intermediate_size);
  f("n_group", c.n_group);
  f("topk_group", c.topk_group);
  f("scoring_func", c.scoring_func);
  f("topk_method", c.topk_method);
  f("norm_topk_prob", c.norm_topk_prob);
  f("routed_scaling_factor", c.routed_scaling_factor);
  f("router_bias_update_rate", c.router_bias_update_rate);
  f("router_aux_loss_coef", c.router_aux_loss_coef);
  f("router_z_loss_coef", c.router_z_loss_coef);
  f("tie_word_embeddings", c.tie_word_embeddings);
  f("capacity_factor", c.capacity_factor);
  f("initializer_range", c.initializer_range);
  f("expert_chunk_rows", c.expert_chunk_rows);
  f("bf16", c.bf16);
}

void rule(bool ok, const char* field, const std::string& msg) {
  if (!ok) throw ConfigError(fmt::format("model.{}: {}", field, msg));
}

}  // namespace

std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(const std::string& v) {
  std::string out = "\"";
  for (unsigned char c : v) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\u{:04X}", unsigned(c));
    else out += char(c);
  }
  return out + "\"";
}

void ModelConfig::validate() const {
  rule(vocab_size >= 2 && vocab_size <= (1 << 24), "vocab_size",
       fmt::format("must be in [2, 16777216] (got {})", vocab_size));
  rule(num_hidden_layers <= 4096, "num_hidden_layers", fmt::format("must be at most 4096 (got {})", num_hidden_layers));
  rule(hidden_size <= (1 << 16), "hidden_size", fmt::format("must be at most 65536 (got {})", hidden_size));
  for (auto [name, v] : {std::pair<const char*, double>{"rope_theta", rope_theta}, {"rms_norm_eps", rms_norm_eps},
                         {"router_aux_loss_coef", router_aux_loss_coef}, {"router_z_loss_coef", router_z_loss_coef},
                         {"capacity_factor", capacity_factor}, {"initializer_range", initializer_range},
                         {"routed_scaling_factor", routed_scaling_factor},
                         {"router_bias_update_rate", router_bias_update_rate}})
    rule(std::isfinite(v), name, fmt::format("must be a finite number (got {})", v));
  rule(hidden_size >= 2, "hidden_size", fmt::format("must be at least 2 (got {})", hidden_size));
  rule(num_hidden_layers >= 1, "num_hidden_layers", fmt::format("must be at least 1 (got {})", num_hidden_layers));
  rule(head_dim_override >= 0 && head_dim_override <= (1 << 16), "head_dim",
       fmt::format("must be in [1, 65536], or 0 for hidden_size / num_attention_heads (got {})", head_dim_override));
  rule(num_attention_heads >= 1 && (head_dim_override > 0 || hidden_size % num_attention_heads == 0),
       "num_attention_heads",
       fmt::format("must divide hidden_size {} (got {}), unless head_dim is given", hidden_size, num_attention_heads));
  rule(head_dim() % 2 == 0, "num_attention_heads", fmt::format("head_dim = {} must be even for RoPE", head_dim()));
  rule(num_key_value_heads >= 0 && kv_heads() >= 1 && num_attention_heads % kv_heads() == 0, "num_key_value_heads",
       fmt::format("must divide num_attention_heads {}, or be 0 for multi-head attention (got {})", num_attention_heads,
                   num_key_value_heads));
  rule(qk_norm == "none" || qk_norm == "head" || qk_norm == "full", "qk_norm",
       fmt::format("must be \"none\", \"head\" (Qwen3-MoE) or \"full\" (OLMoE) (got \"{}\")", qk_norm));
  rule(!(has_qk_norm() && mla()), "qk_norm", "is for multi-head and grouped-query attention, not MLA (kv_lora_rank > 0)");
  rule(q_lora_rank >= 0 && kv_lora_rank >= 0, "kv_lora_rank",
       fmt::format("q_lora_rank {} and kv_lora_rank {} must not be negative", q_lora_rank, kv_lora_rank));
  if (mla()) {
    rule(qk_rope_head_dim >= 2 && qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
         fmt::format("must be even and at least 2 with kv_lora_rank > 0 (MLA; got {})", qk_rope_head_dim));
    rule(qk_nope_head_dim >= 0, "qk_nope_head_dim", fmt::format("must not be negative (got {})", qk_nope_head_dim));
    rule(v_head_dim >= 1, "v_head_dim",
         fmt::format("must be at least 1 with kv_lora_rank > 0 (MLA; got {})", v_head_dim));
  }
  rule(max_position_embeddings >= 2 && max_position_embeddings <= (1 << 24), "max_position_embeddings",
       fmt::format("must be in [2, 16777216] (got {})", max_position_embeddings));
  rule(rope_theta > 0, "rope_theta", "must be positive");
  rule(capacity_factor >= 0, "capacity_factor",
       fmt::format("must be >= 0, 0 meaning no capacity limit (got {})", capacity_factor));
  rule(rms_norm_eps > 0, "rms_norm_eps", "must be positive");
  rule(first_k_dense_replace >= 0 && first_k_dense_replace <= num_hidden_layers, "first_k_dense_replace",
       fmt::format("must be in [0, num_hidden_layers={}] (got {})", num_hidden_layers, first_k_dense_replace));
  for (std::size_t i = 0; i < mlp_only_layers.size(); ++i) {
    const std::int64_t l = mlp_only_layers[i];
    rule(l >= 0 && l < num_hidden_layers, "mlp_only_layers",
         fmt::format("{} is not a layer of the {} (0-based)", l, num_hidden_layers));
    rule(std::find(mlp_only_layers.begin(), mlp_only_layers.begin() + std::ptrdiff_t(i), l) ==
             mlp_only_layers.begin() + std::ptrdiff_t(i),
         "mlp_only_layers", fmt::format("lists layer {} twice", l));
  }
  rule(decoder_sparse_step >= 1 && decoder_sparse_step <= (1 << 12), "decoder_sparse_step",
       fmt::format("must be in [1, 4096] (1: every layer from first_k_dense_replace on is MoE; got {})",
                   decoder_sparse_step));
  if (has_moe_layers()) {
    rule(num_experts >= 1 && num_experts <= (1 << 20), "num_experts",
         fmt::format("must be in [1, 1048576] (got {})", num_experts));
    rule(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, "num_experts_per_tok",
         fmt::format("must be in [1, num_experts={}] (got {})", num_experts, num_experts_per_tok));
    rule(moe_intermediate_size >= 1, "moe_intermediate_size", "must be at least 1");
    rule(n_group >= 1 && num_experts % n_group == 0, "n_group",
         fmt::format("must divide num_experts {} into equal groups (got {})", num_experts, n_group));
    rule(topk_group >= 1 && topk_group <= n_group, "topk_group",
         fmt::format("must be in [1, n_group={}] (got {})", n_group, topk_group));
    if (group_limited())
      rule(num_experts_per_tok <= topk_group * (num_experts / n_group), "topk_group",
           fmt::format("{} groups of {} experts hold fewer than num_experts_per_tok = {}", topk_group,
                       num_experts / n_group, num_experts_per_tok));
    rule(scoring_func == "softmax" || scoring_func == "sigmoid", "scoring_func",
         fmt::format("must be \"softmax\" or \"sigmoid\" (got \"{}\")", scoring_func));
    rule(topk_method == "greedy" || topk_method == "group_limited_greedy" || topk_method == "noaux_tc",
         "topk_method",
         fmt::format("must be \"greedy\", \"group_limited_greedy\" (DeepSeek-V2) or \"noaux_tc\" (DeepSeek-V3) "
                     "(got \"{}\")", topk_method));
    rule(!(group_limited() && topk_method == "greedy"), "topk_method",
         fmt::format("\"greedy\" picks from all experts, so n_group {} and topk_group {} limit nothing: set "
                     "topk_method = \"group_limited_greedy\" or \"noaux_tc\", or both to 1",
                     n_group, topk_group));
    rule(!(group_limited() && expert_bias() && num_experts / n_group < 2), "n_group",
         fmt::format("noaux_tc scores a group by its two best experts, but n_group {} leaves one expert a group",
                     n_group));
    rule(routed_scaling_factor > 0, "routed_scaling_factor",
         fmt::format("must be positive (got {})", routed_scaling_factor));
    rule(router_bias_update_rate >= 0, "router_bias_update_rate",
         fmt::format("must not be negative (got {})", router_bias_update_rate));
    rule(n_shared_experts >= 0, "n_shared_experts", "must not be negative");
    rule(shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size", "must not be negative");
  }
  if (has_dense_layers()) rule(intermediate_size >= 1, "intermediate_size", "must be at least 1 for dense layers");
  rule(router_aux_loss_coef >= 0, "router_aux_loss_coef", "must not be negative");
  rule(router_z_loss_coef >= 0, "router_z_loss_coef", "must not be negative");
  rule(initializer_range > 0, "initializer_range", "must be positive");
  rule(expert_chunk_rows >= 0 && expert_chunk_rows <= (std::int64_t(1) << 40), "expert_chunk_rows",
       fmt::format("must be 0 (off) or a positive row count (got {})", expert_chunk_rows));
}

std::int64_t ModelConfig::attention_params() const {
  const std::int64_t d = hidden_size;
  if (!mla())  // q, o; k, v; QK-norm's weights
    return 2 * d * (q_width() + kv_width()) + (has_qk_norm() ? qk_norm_width(true) + qk_norm_width(false) : 0);
  const std::int64_t q = q_lora_rank > 0 ? d * q_lora_rank + q_lora_rank + q_lora_rank * q_width() : d * q_width();
  const std::int64_t kv = d * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank +
                          kv_lora_rank * num_attention_heads * (qk_nope_head_dim + v_head_dim);
  return q + kv + attn_out_width() * d;
}

std::int64_t ModelConfig::num_params() const {
  const std::int64_t d = hidden_size, attn = attention_params();
  std::int64_t p = vocab_size * d * (tie_word_embeddings ? 1 : 2) + d;
  for (std::int64_t l = 0; l < num_hidden_layers; ++l) {
    p += 2 * d + attn;
    if (is_moe_layer(l)) p += num_experts * d + num_experts * 3 * d * moe_intermediate_size + 3 * d * shared_width();
    else p += 3 * d * intermediate_size;
  }
  return p;
}

std::int64_t ModelConfig::num_active_params() const {
  const std::int64_t d = hidden_size, attn = attention_params();
  std::int64_t p = vocab_size * d * (tie_word_embeddings ? 1 : 2) + d;
  for (std::int64_t l = 0; l < num_hidden_layers; ++l) {
    p += 2 * d + attn;
    if (is_moe_layer(l))
      p += num_experts * d + num_experts_per_tok * 3 * d * moe_intermediate_size + 3 * d * shared_width();
    else p += 3 * d * intermediate_size;
  }
  return p;
}

ModelConfig ModelConfig::from_toml(const toml::table& t) {
  ModelConfig c;
  std::set<std::string> known;
  for_each_field(c, [&](const char* key, auto& field) {
    known.insert(key);
    const toml::node* n = t.get(key);
    if (!n) return;
    using F = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<F, std::vector<std::int64_t>>) {
      const toml::array* a = n->as_array();
      rule(a != nullptr, key, "must be a list of integers");
      field.clear();
      for (const toml::node& e : *a) {
        rule(e.is_integer(), key, "must be a list of integers");
        field.push_back(*e.value<std::int64_t>());
      }
    } else if constexpr (std::is_same_v<F, std::string>) {
      auto v = n->value_exact<std::string>();
      rule(v.has_value(), key, "must be a string");
      field = *v;
    } else if constexpr (std::is_same_v<F, bool>) {
      auto v = n->value_exact<bool>();
      rule(v.has_value(), key, "must be true or false");
      field = *v;
    } else if constexpr (std::is_integral_v<F>) {
      auto v = n->value<std::int64_t>();
      rule(v.has_value() && n->is_integer(), key, "must be an integer");
      field = *v;
    } else {
      auto v = n->value<double>();
      rule(v.has_value(), key, "must be a number");
      field = *v;
    }
  });
  for (auto&& [k, v] : t)
    if (!known.count(std::string(k.str())))
      throw ConfigError(fmt::format("model: unknown field '{}'", k.str()));
  return c;
}

ModelConfig ModelConfig::from_hf_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw ConfigError(fmt::format("{}: a Hugging Face config.json must be a JSON object", source));
  ModelConfig c;
  // A present field of the wrong type is an error; null reads as absent (Python's None).
  auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  auto bad = [&](const char* k, const char* want) {
    return ConfigError(fmt::format("{}: field '{}' must be {} (got {})", source, k, want, j[k].dump()));
  };
  auto get_i = [&](const char* k, std::int64_t& f) {
    if (!has(k)) return false;
    const auto& v = j[k];
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max())) throw bad(k, "an integer below 2^63");
    if (v.is_number_integer()) f = v.get<std::int64_t>();
    else if (v.is_number_float() && std::isfinite(v.get<double>()) && v.get<double>() == std::floor(v.get<double>()) &&
             std::abs(v.get<double>()) < 9.2e18)
      f = std::int64_t(v.get<double>());  // 4096.0
    else throw bad(k, "an integer");
    return true;
  };
  auto get_d = [&](const char* k, double& f) {
    if (!has(k)) return false;
    if (!j[k].is_number()) throw bad(k, "a number");
    f = j[k].get<double>();
    return true;
  };
  auto get_b = [&](const char* k, bool& f) {
    if (!has(k)) return false;
    if (!j[k].is_boolean()) throw bad(k, "true or false");
    f = j[k].get<bool>();
    return true;
  };
  auto get_s = [&](const char* k, std::string& f) {
    if (!has(k)) return false;
    if (!j[k].is_string()) throw bad(k, "a string");
    f = j[k].get<std::string>();
    return true;
  };
  auto get_list = [&](const char* k, std::vector<std::int64_t>& f) {
    if (!has(k)) return;
    if (!j[k].is_array()) throw bad(k, "a list of integers");
    f.clear();
    for (const auto& e : j[k]) {
      if (!e.is_number_integer()) throw bad(k, "a list of integers");
      f.push_back(e.get<std::int64_t>());
    }
  };
  for_each_field(c, [&](const char* key, auto& field) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<F, std::vector<std::int64_t>>) get_list(key, field);
    else if constexpr (std::is_same_v<F, std::string>) get_s(key, field);
    else if constexpr (std::is_same_v<F, bool>) get_b(key, field);
    else if constexpr (std::is_integral_v<F>) get_i(key, field);
    else get_d(key, field);
  });
  // Field variants across families.
  const bool mixtral = get_i("num_local_experts", c.num_experts);  // Mixtral
  const bool deepseek = get_i("n_routed_experts", c.num_experts);  // DeepSeek-V2/V3
  std::string model_type;
  get_s("model_type", model_type);
  // Mixtral's and OLMoE's experts are intermediate_size wide (and every layer is MoE).
  const bool expert_width_is_intermediate = mixtral || model_type == "olmoe";
  if (expert_width_is_intermediate && !has("moe_intermediate_size"))
    get_i("intermediate_size", c.moe_intermediate_size);
  get_d("aux_loss_alpha", c.router_aux_loss_coef);  // DeepSeek
  // transformers 5 keeps the RoPE base in rope_parameters.
  if (!has("rope_theta") && has("rope_parameters") && j["rope_parameters"].is_object() &&
      j["rope_parameters"].contains("rope_theta")) {
    const auto& v = j["rope_parameters"]["rope_theta"];
    if (!v.is_number()) throw bad("rope_parameters", "an object whose rope_theta is a number");
    c.rope_theta = v.get<double>();
  }
  // QK-norm is implied by the architecture: per head in Qwen3-MoE, over q and k whole in OLMoE.
  if (!has("qk_norm") && model_type == "qwen3_moe") c.qk_norm = "head";
  if (!has("qk_norm") && model_type == "olmoe") c.qk_norm = "full";
  if (!has("tie_word_embeddings")) c.tie_word_embeddings = false;  // HF default
  // Hugging Face's greedy top-k ignores n_group and topk_group (DeepSeek-V2-Lite sets them anyway).
  if (c.topk_method == "greedy") c.n_group = c.topk_group = 1;
  // DeepSeek's moe_layer_freq (an MoE layer every N from first_k_dense_replace on,
  // at l % N == 0) is another pattern than decoder_sparse_step's: refused, not guessed.
  if (std::int64_t step = 1; get_i("moe_layer_freq", step) && step != 1)
    throw ConfigError(fmt::format("{}: moe_layer_freq = {} (an MoE layer every {} layers) is not supported: "
                                  "moeflex alternates layers by decoder_sparse_step",
                                  source, step, step));

  // The shape has no sensible default: a missing field would silently give the
  // embedded toy model's value. The rest (RoPE, norms, router losses, shared
  // experts, dense prefix) have the architectures' usual defaults.
  auto require = [&](bool ok, const std::string& what) {
    if (!ok) throw ConfigError(fmt::format("{}: missing field {}", source, what));
  };
  for (const char* k : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"})
    require(has(k), fmt::format("'{}'", k));
  if (c.has_moe_layers()) {
    require(mixtral || deepseek || has("num_experts"),
            "'num_experts' (or 'num_local_experts', 'n_routed_experts'): the routed expert count");
    require(has("num_experts_per_tok"), "'num_experts_per_tok'");
    require(has("moe_intermediate_size") || (expert_width_is_intermediate && has("intermediate_size")),
            expert_width_is_intermediate ? "'intermediate_size' (the experts' width)" : "'moe_intermediate_size'");
  }
  if (c.has_dense_layers()) require(has("intermediate_size"), "'intermediate_size' (the dense layers' width)");
  return c;
}

void ModelConfig::refuse_engine_unsupported_hf(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) return;  // from_hf_json names it
  auto field = [&](const char* k) -> const nlohmann::json* {
    return j.contains(k) && !j[k].is_null() ? &j[k] : nullptr;
  };
  auto refuse = [&](const char* k, const std::string& what) {
    throw ConfigError(fmt::format("{}: {} = {}: {} is not in moeflex's training engine", source, k, j[k].dump(),
                                  what));
  };
  for (const char* k : {"attention_bias", "qkv_bias", "mlp_bias"})
    if (const auto* v = field(k); v && v->is_boolean() && v->get<bool>()) refuse(k, "a bias in the projections");
  if (const auto* v = field("hidden_act"); v && *v != "silu" && *v != "swish")
    refuse("hidden_act", "an MLP activation other than SiLU (SwiGLU)");
  if (field("rope_scaling")) refuse("rope_scaling", "RoPE scaling (YaRN, linear, dynamic)");
  if (const auto* v = field("use_sliding_window"); v && v->is_boolean() && v->get<bool>())
    refuse("use_sliding_window", "sliding-window attention");
  if (field("clip_qkv")) refuse("clip_qkv", "clipping q, k and v");
  const auto* mt = field("model_type");
  if (mt && *mt == "qwen2_moe" && field("shared_expert_intermediate_size") &&
      j["shared_expert_intermediate_size"].is_number() && j["shared_expert_intermediate_size"].get<double>() > 0)
    refuse("shared_expert_intermediate_size", "Qwen2-MoE's sigmoid-gated shared expert");
  if (const auto* v = field("kv_lora_rank"); v && v->is_number() && v->get<double>() > 0)
    refuse("kv_lora_rank", "multi-head latent attention (MLA; the simulator prices it)");
  if (const auto* v = field("rope_parameters"); v && v->is_object()) {  // transformers 5's RoPE fields
    const std::string type = v->value("rope_type", v->value("type", std::string("default")));
    if (type != "default") refuse("rope_parameters", "RoPE scaling (YaRN, linear, dynamic)");
  }
  if (mt && *mt == "mixtral" && field("sliding_window")) refuse("sliding_window", "sliding-window attention");
  if (mt && *mt == "qwen2_moe") refuse("model_type", "Qwen2-MoE (biases in q, k and v, a sigmoid-gated shared expert)");
  // Architectures the checks above know; another model_type may hold what they cannot see.
  if (mt && *mt != "qwen3_moe" && *mt != "olmoe" && *mt != "mixtral")
    refuse("model_type", "an architecture other than qwen3_moe, olmoe and mixtral (moeflex's own field names "
                         "need no model_type)");
}

std::string ModelConfig::to_toml() const {
  std::string s;
  auto c = *this;
  for_each_field(c, [&](const char* key, auto& field) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<F, std::vector<std::int64_t>>) {
      std::string list;
      for (std::int64_t v : field) list += (list.empty() ? "" : ", ") + std::to_string(v);
      s += fmt::format("{} = [{}]\n", key, list);
    } else if constexpr (std::is_same_v<F, std::string>) s += fmt::format("{} = {}\n", key, toml_string(field));
    else if constexpr (std::is_same_v<F, bool>) s += fmt::format("{} = {}\n", key, field ? "true" : "false");
    else if constexpr (std::is_integral_v<F>) s += fmt::format("{} = {}\n", key, field);
    else s += fmt::format("{} = {}\n", key, toml_float(field));
  });
  return s;
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j;
  auto c = *this;
  for_each_field(c, [&](const char* key, auto& field) { j[key] = field; });
  return j;
}

}  // namespace moeflex
