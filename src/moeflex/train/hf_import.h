// Hugging Face checkpoints in: a published checkpoint's weights as a run's initial
// state (`moeflex train --init-from DIR`), in the layouts export-hf writes
// (hf_export.h: qwen3_moe, olmoe, mixtral). DIR holds config.json and either
// model.safetensors or the shards model.safetensors.index.json maps ("weight_map":
// tensor -> file, as transformers writes them). Tensors may be F32, BF16, F16 or F64;
// they are widened to the fp32 master weights. Every tensor the model needs must be
// there with its shape, and every tensor there must be one the model uses (rotary
// inv_freq buffers aside): a missing, unknown or misshapen tensor is a DataError
// naming it and its file.
#pragma once
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moeflex/model/config.h"
#include "moeflex/train/safetensors.h"

namespace moeflex {

class MoEModel;

/// A Hugging Face checkpoint folder, read tensor by tensor (one shard in memory at a time).
class HfCheckpoint {
 public:
  /// Opens `dir`: its safetensors index or single file. Throws DataError when neither
  /// is there, the index is malformed, or a file it names is missing.
  explicit HfCheckpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  /// Every tensor name the checkpoint holds, sorted.
  std::vector<std::string> names() const;
  /// Copies tensor `name` of shape `shape` into dst (fp32). Throws DataError naming
  /// the tensor and its file when it is missing or of another shape.
  void read(const std::string& name, const std::vector<std::int64_t>& shape, float* dst);

 private:
  const train::SafetensorsFile& shard(const std::string& file);

  std::filesystem::path dir_;
  std::map<std::string, std::string> file_of_;  ///< tensor -> its file (relative to dir_)
  std::string open_name_;                       ///< the shard held in memory
  std::optional<train::SafetensorsFile> open_;
};

/// The tensors (Hugging Face names, with their shapes) of the whole of `cfg` in
/// architecture `arch` (hf_architecture): one per expert where moeflex stacks them.
std::map<std::string, std::vector<std::int64_t>> hf_tensor_shapes(const ModelConfig& cfg, const std::string& arch);

/// Checks that `ckpt` holds exactly the tensors of `cfg` in `arch` (a transformers
/// rotary inv_freq buffer aside) and that its config.json describes `cfg`'s shape.
/// Throws DataError naming the first missing, unknown or misshapen tensor, or
/// ConfigError naming the config field that differs.
void check_hf_checkpoint(HfCheckpoint& ckpt, const ModelConfig& cfg, const std::string& arch);

/// Overwrites the parameters `model` holds (its stages, its EP shard of the experts)
/// with the checkpoint's, and refreshes the working copies. Call check_hf_checkpoint first.
void load_hf_weights(HfCheckpoint& ckpt, const std::string& arch, MoEModel& model);

}  // namespace moeflex
