// Crash-safe training checkpoints.
//
// A checkpoint is the directory <run_dir>/checkpoints/step_<NNNNNNNN>/ holding
//   model.safetensors      the parameters (F32)
//   optimizer.safetensors  the optimizer state, e.g. AdamW moments (F32)
//   manifest.json          {"format": "moeflex-checkpoint", "version": 1, "step": N,
//                           "files": {"<name>": {"bytes": B, "sha256": "<hex>"}},
//                           "trainer_state": <the caller's JSON>}
//
// Saving writes step_<N>.tmp/, fsyncs every file, writes the manifest last and
// only then renames the directory into place (and fsyncs its parent), so a crash
// leaves either the previous state or a complete checkpoint, never a partial
// step_<N>. Loading verifies sizes, checksums, tensor names and shapes of both
// files before it writes into any buffer: a refused checkpoint changes nothing.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/train/safetensors.h"

namespace moeflex::train {

/// A named float tensor owned by the caller (a parameter, a moment, ...).
struct NamedBuffer {
  std::string name;                 ///< unique within its file, e.g. "layers.0.attn.wq"
  std::vector<std::int64_t> shape;  ///< row-major extents
  float* data;                      ///< not owned; numel(shape) floats
};

inline constexpr const char* kCheckpointFormat = "moeflex-checkpoint";
inline constexpr int kCheckpointVersion = 1;
inline constexpr const char* kModelFileName = "model.safetensors";
inline constexpr const char* kOptimizerFileName = "optimizer.safetensors";
inline constexpr const char* kManifestFileName = "manifest.json";

/// <run_dir>/checkpoints/step_<step, 8 digits>.
std::filesystem::path checkpoint_dir(const std::filesystem::path& run_dir, std::int64_t step);

/// Saves a checkpoint of `step` (see the file comment), then deletes the oldest
/// step_* directories so that `keep_last` remain, never the one just written;
/// keep_last <= 0 keeps all. Re-saving an existing step swaps the complete new
/// directory in atomically. Throws DataError on I/O failure, Error on bad buffers.
/// Ranks that each save their own checkpoints pass keep_last = 0 and call
/// rotate_checkpoints once every rank has saved: a rank that dies while saving then
/// leaves the others a step it also holds.
void save_checkpoint(const std::filesystem::path& run_dir, std::int64_t step, const std::vector<NamedBuffer>& model,
                     const std::vector<NamedBuffer>& optimizer, const nlohmann::json& trainer_state,
                     int keep_last = 3);

/// Deletes the oldest step_* directories under <run_dir>/checkpoints so that
/// `keep_last` remain, never that of `keep_step`; keep_last <= 0 keeps all. Throws
/// DataError when one cannot be deleted.
void rotate_checkpoints(const std::filesystem::path& run_dir, std::int64_t keep_step, int keep_last);

/// The name of rank r's folder in a multi-rank run: rank<r, 5 digits>.
std::string rank_folder_name(int rank);

/// Whether `name` is a rank folder's: "rank" and five digits, nothing else.
bool is_rank_folder_name(const std::string& name);

/// The number of ranks a run folder's rank folders (rank00000, ...; exactly that
/// name) say it trained on: 0 when it has none (a single process, or no checkpoint
/// yet). Throws DataError naming a missing folder when they are not rank00000 up to
/// the highest without a gap.
int run_rank_count(const std::filesystem::path& run_dir);

/// Whether `ckpt_dir` is a usable checkpoint of `step`: a valid manifest of that step
/// listing files present with the recorded sizes (checksums: load_checkpoint).
bool checkpoint_complete(const std::filesystem::path& ckpt_dir, std::int64_t step);

/// The newest step_* directory under <run_dir>/checkpoints whose manifest is
/// valid, matches the directory's step and lists files present with the
/// recorded sizes; `.tmp` directories and directories without a valid manifest
/// are skipped. Checksums are verified by load_checkpoint, not here.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

/// Why `ckpt_dir` cannot be resumed from as a checkpoint of `step` (its manifest,
/// and every file it lists: present, of the recorded size and SHA-256), as the
/// error's own sentence; empty when it is intact. Reads every file.
std::string checkpoint_damage(const std::filesystem::path& ckpt_dir, std::int64_t step);

/// A checkpoint newer than the one a resume found intact, and what is wrong with it.
struct DamagedCheckpoint {
  std::filesystem::path dir;
  std::int64_t step = 0;
  std::string why;
};

/// The newest step_* directory under <run_dir>/checkpoints that checkpoint_damage
/// finds intact; every newer one goes into `damaged` (newest first), with why.
std::optional<std::filesystem::path> newest_intact_checkpoint(const std::filesystem::path& run_dir,
                                                              std::vector<DamagedCheckpoint>& damaged);

/// Renames a damaged checkpoint folder aside, to <dir>.damaged (or .damaged.2, ...:
/// never over another), so that no later save writes over it and no resume picks
/// it. Returns the new path; throws DataError naming both paths if it cannot.
std::filesystem::path move_checkpoint_aside(const std::filesystem::path& dir);

/// Reads and validates <ckpt_dir>/manifest.json (format, version, step, files,
/// trainer_state). Throws DataError naming the file and the problem.
nlohmann::json read_checkpoint_manifest(const std::filesystem::path& ckpt_dir);

/// The step recorded in a checkpoint's manifest.
std::int64_t checkpoint_step(const std::filesystem::path& ckpt_dir);

/// Fills the buffers from a checkpoint and returns its trainer_state. Every
/// file's size and SHA-256, and every buffer's tensor (present, same shape) are
/// checked first; the files must hold no tensor the buffers lack. Throws
/// DataError naming the file or tensor ("truncated", "corrupted", missing, shape)
/// and leaves every buffer untouched when it does.
nlohmann::json load_checkpoint(const std::filesystem::path& ckpt_dir, const std::vector<NamedBuffer>& model,
                               const std::vector<NamedBuffer>& optimizer);

/// The model.safetensors of a checkpoint directory, its size and SHA-256 verified
/// against the manifest: for readers of a shard (a rank's slice of the model) that
/// check shapes themselves. Throws DataError naming the file and the problem.
SafetensorsFile open_checkpoint_model(const std::filesystem::path& ckpt_dir);

/// Fills model buffers from a model.safetensors file, or from a checkpoint
/// directory's model.safetensors. When a manifest.json beside the file lists
/// it, its size and checksum are verified too. Same checks as load_checkpoint.
void load_model_weights(const std::filesystem::path& path, const std::vector<NamedBuffer>& model);

}  // namespace moeflex::train
