// moeflex export-hf (hf_export.h).
#include "moeflex/train/hf_export.h"

#include <fmt/format.h>

#include <unistd.h>

#include <string_view>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/model/model.h"
#include "moeflex/train/generate.h"
#include "moeflex/train/safetensors.h"
#include "moeflex/train/train_config.h"

namespace moeflex {

namespace fs = std::filesystem;

namespace {

void refuse(bool bad, const std::string& what) {
  if (bad) throw ConfigError(fmt::format("export-hf: {}", what));
}

}  // namespace

std::string hf_tensor_name(const std::string& arch, const std::string& name, std::int64_t e) {
  const std::string_view experts = ".mlp.experts.";
  const std::size_t at = name.find(experts);
  const bool mixtral = arch == "mixtral";
  if (at == std::string::npos) {
    const std::string gate = ".mlp.gate.weight";
    if (mixtral && name.size() > gate.size() && name.ends_with(gate))
      return name.substr(0, name.size() - gate.size()) + ".block_sparse_moe.gate.weight";
    return name;
  }
  const std::string layer = name.substr(0, at), proj = name.substr(at + experts.size());  // "gate_proj.weight"
  if (!mixtral) return fmt::format("{}.mlp.experts.{}.{}", layer, e, proj);
  const char* w = proj == "gate_proj.weight" ? "w1" : proj == "up_proj.weight" ? "w3" : "w2";
  return fmt::format("{}.block_sparse_moe.experts.{}.{}.weight", layer, e, w);
}

std::string hf_architecture(const ModelConfig& cfg) {
  refuse(cfg.mla(), "MLA (kv_lora_rank > 0) is not trained by moeflex");
  refuse(cfg.shared_width() > 0, "a shared expert has no Hugging Face layout among qwen3_moe, olmoe and mixtral "
                                 "(Qwen2-MoE's is sigmoid-gated, DeepSeek's comes with MLA)");
  refuse(cfg.first_k_dense_replace > 0, fmt::format("first_k_dense_replace = {}: a dense prefix has no field in "
                                                    "qwen3_moe, olmoe or mixtral", cfg.first_k_dense_replace));
  refuse(cfg.scoring_func != "softmax" || cfg.topk_method != "greedy" || cfg.routed_scaling_factor != 1.0,
         fmt::format("DeepSeek's routing (scoring_func \"{}\", topk_method \"{}\", routed_scaling_factor {}) has no "
                     "Hugging Face layout among qwen3_moe, olmoe and mixtral (DeepSeek's comes with MLA)",
                     cfg.scoring_func, cfg.topk_method, cfg.routed_scaling_factor));
  refuse(cfg.capacity_factor > 0, fmt::format("capacity_factor = {}: Hugging Face MoE layers are dropless, so the "
                                              "exported model would compute other logits", cfg.capacity_factor));
  if (cfg.qk_norm == "head") return "qwen3_moe";
  refuse(cfg.decoder_sparse_step != 1, fmt::format("decoder_sparse_step = {}: only Qwen3-MoE (qk_norm = \"head\") "
                                                   "alternates dense layers", cfg.decoder_sparse_step));
  refuse(!cfg.mlp_only_layers.empty(), "mlp_only_layers: only Qwen3-MoE (qk_norm = \"head\") has dense layers among "
                                       "the MoE ones");
  refuse(cfg.head_dim_override > 0 && cfg.head_dim_override * cfg.num_attention_heads != cfg.hidden_size,
         fmt::format("head_dim = {} (not hidden_size / heads) is Qwen3-MoE's (qk_norm = \"head\")", cfg.head_dim()));
  if (cfg.qk_norm == "full") return "olmoe";
  refuse(!cfg.norm_topk_prob, "norm_topk_prob = false without QK-norm: Mixtral always renormalises its top-k weights "
                              "(OLMoE, which may not, norms q and k: qk_norm = \"full\")");
  return "mixtral";
}

nlohmann::json hf_config_json(const ModelConfig& c, const std::string& arch) {
  nlohmann::json j = {{"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.kv_heads()},
                      {"hidden_act", "silu"},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", nullptr},
                      {"num_experts_per_tok", c.num_experts_per_tok},
                      {"router_aux_loss_coef", c.router_aux_loss_coef},
                      {"output_router_logits", false},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"initializer_range", c.initializer_range},
                      {"torch_dtype", "float32"},
                      {"use_cache", true}};
  if (arch == "qwen3_moe") {
    j.update({{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"}, {"head_dim", c.head_dim()},
              {"num_experts", c.num_experts}, {"moe_intermediate_size", c.moe_intermediate_size},
              {"intermediate_size", c.intermediate_size}, {"norm_topk_prob", c.norm_topk_prob},
              {"decoder_sparse_step", c.decoder_sparse_step}, {"mlp_only_layers", c.mlp_only_layers},
              {"attention_bias", false}, {"attention_dropout", 0.0}, {"use_sliding_window", false},
              {"sliding_window", nullptr}});
  } else if (arch == "olmoe") {  // OLMoE's experts are intermediate_size wide
    j.update({{"architectures", {"OlmoeForCausalLM"}}, {"model_type", "olmoe"}, {"num_experts", c.num_experts},
              {"intermediate_size", c.moe_intermediate_size}, {"norm_topk_prob", c.norm_topk_prob},
              {"attention_bias", false}, {"attention_dropout", 0.0}, {"clip_qkv", nullptr}});
  } else {  // Mixtral's experts are intermediate_size wide too
    j.update({{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
              {"num_local_experts", c.num_experts}, {"intermediate_size", c.moe_intermediate_size},
              {"head_dim", c.head_dim()}, {"sliding_window", nullptr}, {"attention_dropout", 0.0}});
  }
  return j;
}

std::string export_hf(const fs::path& run_dir, const fs::path& out_arg) {
  fs::path out = out_arg.lexically_normal();
  if (!out.empty() && out.filename().empty()) out = out.parent_path();  // "ckpt/" names ckpt
  if (out.empty() || out.filename() == "." || out.filename() == "..")
    throw ConfigError(fmt::format("export-hf: --out '{}' does not name a folder", out_arg.string()));
  if (!fs::is_regular_file(run_dir / "config.toml"))
    throw ConfigError(fmt::format("export-hf: '{}' is not a run directory (no config.toml)", run_dir.string()));
  if (fs::exists(out) && !(fs::is_directory(out) && fs::is_empty(out)))
    throw ConfigError(fmt::format("export-hf: '{}' exists and is not an empty folder: nothing is overwritten; "
                                  "name a new folder", out.string()));
  const RunConfig cfg = RunConfig::from_file((run_dir / "config.toml").string());
  const std::string arch = hf_architecture(cfg.model);
  Arena arena;
  MoEModel model(cfg.model, arena);
  load_run_weights(run_dir, cfg, model);
  train::SafetensorsWriter w;
  for (const Param& p : model.params()) {
    if (p.tied_copy) continue;
    const std::vector<std::int64_t>& shape = p.w.shape();
    if (!p.expert) {
      w.add(hf_tensor_name(arch, p.name, 0), train::StDType::F32, shape, p.w.f32());
      continue;
    }
    const std::int64_t per = p.w.numel() / shape[0];
    for (std::int64_t e = 0; e < shape[0]; ++e)
      w.add(hf_tensor_name(arch, p.name, e), train::StDType::F32, {shape[1], shape[2]}, p.w.f32() + e * per);
  }
  // Written whole in a folder of its own beside `out`, then renamed into place; a
  // folder of that name already there is someone's and is refused, never removed.
  const fs::path tmp = out.parent_path() / fmt::format(".{}.export-hf-{}", out.filename().string(), ::getpid());
  if (fs::exists(tmp))
    throw ConfigError(fmt::format("export-hf: '{}' exists: remove it (an interrupted export) and run again",
                                  tmp.string()));
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  fs::create_directory(tmp);
  w.write(tmp / "model.safetensors", {{"format", "pt"}});
  write_file_atomically(tmp / "config.json", hf_config_json(cfg.model, arch).dump(2) + "\n");
  if (fs::exists(out)) fs::remove(out);  // the empty folder
  fs::rename(tmp, out);
  return arch;
}

}  // namespace moeflex
