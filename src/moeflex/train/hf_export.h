// moeflex export-hf: a trained run as a Hugging Face checkpoint (config.json and
// model.safetensors, F32) in the layout of the architecture its model matches, so that
// transformers or vLLM load it:
//   qk_norm "head"  -> Qwen3MoeForCausalLM (model_type qwen3_moe): self_attn.q_norm /
//                      k_norm [head_dim], mlp.gate, mlp.experts.{e}.{gate,up,down}_proj,
//                      dense layers by decoder_sparse_step (mlp.{gate,up,down}_proj);
//   qk_norm "full"  -> OlmoeForCausalLM (olmoe): q_norm / k_norm over q and k whole,
//                      every layer MoE;
//   qk_norm "none"  -> MixtralForCausalLM (mixtral): block_sparse_moe.gate,
//                      block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down),
//                      every layer MoE.
// moeflex stacks a layer's routed experts ([E, out, in]); the export writes one tensor
// per expert. A model no architecture matches (a shared expert, a dense prefix outside
// Qwen3-MoE, a capacity factor, OLMoE or Mixtral with a head_dim of its own) is refused.
#pragma once
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "moeflex/model/config.h"

namespace moeflex {

/// The Hugging Face architecture `cfg` is exported as: "qwen3_moe", "olmoe" or
/// "mixtral". Throws ConfigError naming what no architecture holds.
std::string hf_architecture(const ModelConfig& cfg);

/// The Hugging Face name of moeflex parameter `name` in architecture `arch`; for a
/// routed-expert tensor (moeflex stacks them, [E, out, in]) the name of expert `e`'s.
std::string hf_tensor_name(const std::string& arch, const std::string& name, std::int64_t e);

/// The config.json of `cfg` in architecture `arch` (hf_architecture): the fields
/// transformers reads for it, so that ModelConfig::from_hf_json gives `cfg`'s shape back.
nlohmann::json hf_config_json(const ModelConfig& cfg, const std::string& arch);

/// Writes `out`/config.json and `out`/model.safetensors from the newest checkpoint of
/// `run_dir` (gathered over ranks). `out` must not exist or be an empty folder: files
/// already there are never overwritten (ConfigError). The folder is written beside
/// `out` (.<name>.export-hf-<pid>) and renamed into place whole. Returns the
/// architecture written.
std::string export_hf(const std::filesystem::path& run_dir, const std::filesystem::path& out);

}  // namespace moeflex
