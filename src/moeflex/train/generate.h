// Sampling from a trained run (moeflex generate).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeflex {

class MoEModel;
struct RunConfig;

/// Fills `model` (built from the run's config.toml, `cfg`) with the newest checkpoint
/// of the run `run`: its own, or every rank's shard of a multi-rank run gathered (the
/// newest step all ranks hold). Throws DataError when there is no complete checkpoint,
/// or one that does not match the config.
void load_run_weights(const std::filesystem::path& run, const RunConfig& cfg, MoEModel& model);

struct GenerateOptions {
  std::filesystem::path run_dir;  ///< a run directory with config.toml, tokenizer.model, checkpoints/
  std::string prompt;
  int max_new_tokens = 64;
  double temperature = 0.8;  ///< 0 = greedy
  int top_k = 40;            ///< 0 = the whole vocabulary
  std::uint64_t seed = 0;
};

/// Loads the newest checkpoint of the run and returns prompt + continuation.
/// The context is truncated to the model's max_position_embeddings (the newest tokens kept).
/// Throws DataError when the run has no tokenizer.model (pre-tokenized data, --init-from).
std::string generate_text(const GenerateOptions& opts);

/// The same for a prompt of token ids (opts.prompt unused), for runs without a
/// tokenizer: returns prompt_ids + the sampled ids. ConfigError for an id outside the vocabulary.
std::vector<std::int32_t> generate_ids(const GenerateOptions& opts, const std::vector<std::int32_t>& prompt_ids);

}  // namespace moeflex
