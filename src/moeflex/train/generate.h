// Sampling from a trained run (moeflex generate).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace moeflex {

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
std::string generate_text(const GenerateOptions& opts);

}  // namespace moeflex
