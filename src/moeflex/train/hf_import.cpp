// Hugging Face checkpoints in (hf_import.h).
#include "moeflex/train/hf_import.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/model/model.h"
#include "moeflex/model/parameters.h"
#include "moeflex/ops/backend.h"
#include "moeflex/train/hf_export.h"

namespace moeflex {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// Buffers transformers keeps in some checkpoints that are recomputed, not weights.
bool ignored_tensor(const std::string& name) { return name.ends_with(".rotary_emb.inv_freq"); }

/// The parameters of the whole model (every layer, every expert), as MoEModel names them.
std::vector<ParamSpec> whole_model_parameters(const ModelConfig& cfg) {
  std::vector<ParamSpec> v{embedding_parameter(cfg)};
  for (int l = 0; l < cfg.num_hidden_layers; ++l)
    for (ParamSpec& p : layer_parameters(cfg, l, cfg.num_experts)) v.push_back(std::move(p));
  v.push_back(final_norm_parameter(cfg));
  if (!cfg.tie_word_embeddings) v.push_back(lm_head_parameter(cfg));
  return v;
}

/// The config.json fields that fix the tensors' shapes, and what `cfg` says of each.
void check_config_matches(const fs::path& dir, const ModelConfig& cfg) {
  const fs::path path = dir / "config.json";
  if (!fs::is_regular_file(path))
    throw DataError(fmt::format("--init-from: '{}' has no config.json", dir.string()));
  const std::vector<char> bytes = read_file_bytes(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("--init-from: '{}' is not JSON: {}", path.string(), e.what()));
  }
  const ModelConfig hf = ModelConfig::from_hf_json(j, path.string());
  const std::pair<const char*, std::pair<double, double>> fields[] = {
      {"vocab_size", {double(hf.vocab_size), double(cfg.vocab_size)}},
      {"hidden_size", {double(hf.hidden_size), double(cfg.hidden_size)}},
      {"num_hidden_layers", {double(hf.num_hidden_layers), double(cfg.num_hidden_layers)}},
      {"num_attention_heads", {double(hf.num_attention_heads), double(cfg.num_attention_heads)}},
      {"num_key_value_heads", {double(hf.kv_heads()), double(cfg.kv_heads())}},
      {"head_dim", {double(hf.head_dim()), double(cfg.head_dim())}},
      {"num_experts", {double(hf.num_experts), double(cfg.num_experts)}},
      {"num_experts_per_tok", {double(hf.num_experts_per_tok), double(cfg.num_experts_per_tok)}},
      {"moe_intermediate_size", {double(hf.moe_intermediate_size), double(cfg.moe_intermediate_size)}},
      {"decoder_sparse_step", {double(hf.decoder_sparse_step), double(cfg.decoder_sparse_step)}},
      {"norm_topk_prob", {double(hf.norm_topk_prob), double(cfg.norm_topk_prob)}},
      {"tie_word_embeddings", {double(hf.tie_word_embeddings), double(cfg.tie_word_embeddings)}},
      {"rms_norm_eps", {hf.rms_norm_eps, cfg.rms_norm_eps}},
      {"rope_theta", {hf.rope_theta, cfg.rope_theta}}};
  for (const auto& [name, v] : fields)
    if (v.first != v.second)
      throw ConfigError(fmt::format("--init-from: the checkpoint's config.json has {} = {} but the run's model has {} "
                                    "(train with --config {})", name, v.first, v.second, path.string()));
  if (hf.has_dense_layers() && hf.intermediate_size != cfg.intermediate_size)
    throw ConfigError(fmt::format("--init-from: the checkpoint's config.json has intermediate_size = {} but the run's "
                                  "model has {}", hf.intermediate_size, cfg.intermediate_size));
  if (hf.mlp_only_layers != cfg.mlp_only_layers)
    throw ConfigError(fmt::format("--init-from: the checkpoint's config.json has mlp_only_layers = {} but the run's "
                                  "model has {}", nlohmann::json(hf.mlp_only_layers).dump(),
                                  nlohmann::json(cfg.mlp_only_layers).dump()));
  if (hf.qk_norm != cfg.qk_norm)
    throw ConfigError(fmt::format("--init-from: the checkpoint is {} (qk_norm \"{}\") but the run's model has qk_norm "
                                  "\"{}\"", j.value("model_type", std::string("?")), hf.qk_norm, cfg.qk_norm));
}

}  // namespace

HfCheckpoint::HfCheckpoint(const fs::path& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) throw DataError(fmt::format("--init-from: '{}' is not a folder", dir.string()));
  if (fs::is_regular_file(dir / kIndex)) {
    const std::vector<char> bytes = read_file_bytes(dir / kIndex);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(bytes.begin(), bytes.end());
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("--init-from: '{}' is not JSON: {}", (dir / kIndex).string(), e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw DataError(fmt::format("--init-from: '{}' has no \"weight_map\" object (tensor name -> file)",
                                  (dir / kIndex).string()));
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        throw DataError(fmt::format("--init-from: '{}' maps '{}' to {}, not a file name in the folder",
                                    (dir / kIndex).string(), name, file.dump()));
      if (!fs::is_regular_file(dir / file.get<std::string>()))
        throw DataError(fmt::format("--init-from: '{}' puts '{}' in '{}', which is missing", (dir / kIndex).string(),
                                    name, file.get<std::string>()));
      file_of_[name] = file.get<std::string>();
    }
    return;
  }
  if (!fs::is_regular_file(dir / kSingle))
    throw DataError(fmt::format("--init-from: '{}' has neither {} nor {}", dir.string(), kSingle, kIndex));
  for (const std::string& name : shard(kSingle).names()) file_of_[name] = kSingle;
}

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : file_of_) out.push_back(name);
  return out;
}

const train::SafetensorsFile& HfCheckpoint::shard(const std::string& file) {
  if (!open_ || open_name_ != file) {
    open_.reset();  // one shard in memory at a time
    open_.emplace(train::SafetensorsFile::open(dir_ / file));
    open_name_ = file;
  }
  return *open_;
}

void HfCheckpoint::read(const std::string& name, const std::vector<std::int64_t>& shape, float* dst) {
  const auto it = file_of_.find(name);
  if (it == file_of_.end()) throw DataError(fmt::format("--init-from: '{}' has no tensor '{}'", dir_.string(), name));
  const train::SafetensorsFile& f = shard(it->second);
  if (!f.contains(name))
    throw DataError(fmt::format("--init-from: the index puts '{}' in '{}', which does not hold it", name, it->second));
  if (f.info(name).shape != shape)
    throw DataError(fmt::format("--init-from: tensor '{}' in '{}' is {}, the model's is {}", name,
                                (dir_ / it->second).string(), shape_text(f.info(name).shape), shape_text(shape)));
  std::int64_t n = 1;
  for (std::int64_t x : shape) n *= x;
  f.read_f32(name, dst, n);
}

std::map<std::string, std::vector<std::int64_t>> hf_tensor_shapes(const ModelConfig& cfg, const std::string& arch) {
  std::map<std::string, std::vector<std::int64_t>> out;
  for (const ParamSpec& p : whole_model_parameters(cfg)) {
    if (!p.expert) {
      out[hf_tensor_name(arch, p.name, 0)] = p.shape;
      continue;
    }
    for (std::int64_t e = 0; e < p.shape[0]; ++e) out[hf_tensor_name(arch, p.name, e)] = {p.shape[1], p.shape[2]};
  }
  return out;
}

void check_hf_checkpoint(HfCheckpoint& ckpt, const ModelConfig& cfg, const std::string& arch) {
  check_config_matches(ckpt.dir(), cfg);
  const auto want = hf_tensor_shapes(cfg, arch);
  const std::vector<std::string> have = ckpt.names();
  for (const std::string& name : have)
    if (!want.count(name) && !ignored_tensor(name))
      throw DataError(fmt::format("--init-from: '{}' holds tensor '{}', which a {} model of this shape does not have",
                                  ckpt.dir().string(), name, arch));
  for (const auto& [name, shape] : want)
    if (!std::binary_search(have.begin(), have.end(), name))
      throw DataError(fmt::format("--init-from: '{}' has no tensor '{}' ({} of the {} layout)", ckpt.dir().string(),
                                  name, shape_text(shape), arch));
}

void load_hf_weights(HfCheckpoint& ckpt, const std::string& arch, MoEModel& model) {
  ops::Backend& be = ops::backend_of(model.arena());
  std::vector<float> staging;
  for (Param& p : model.params()) {
    const std::vector<std::int64_t>& shape = p.w.shape();
    staging.resize(std::size_t(p.w.numel()));
    if (!p.expert) {
      ckpt.read(hf_tensor_name(arch, p.name, 0), shape, staging.data());
    } else {  // this rank's experts: init_offset is where its shard starts in the stack
      const std::int64_t per = shape[1] * shape[2], first = p.init_offset / per;
      for (std::int64_t e = 0; e < shape[0]; ++e)
        ckpt.read(hf_tensor_name(arch, p.name, first + e), {shape[1], shape[2]}, staging.data() + e * per);
    }
    be.copy_from_host(p.w.f32(), staging.data(), p.w.nbytes());
  }
  model.sync_working_weights();
}

}  // namespace moeflex
