#include "moeflex/train/checkpoint.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <set>
#include <utility>

#include "moeflex/core/error.h"
#include "moeflex/train/safetensors.h"

namespace moeflex::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStepPrefix = "step_";
constexpr const char* kTmpSuffix = ".tmp";

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

/// The step of a directory named exactly step_<digits>, or nullopt.
std::optional<std::int64_t> step_of_dir_name(const std::string& name) {
  const std::string prefix = kStepPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  std::string digits = name.substr(prefix.size());
  if (digits.size() > 18) return std::nullopt;
  for (char c : digits)
    if (c < '0' || c > '9') return std::nullopt;
  return std::stoll(digits);
}

/// step_* directories under <run_dir>/checkpoints, newest first.
std::vector<std::pair<std::int64_t, fs::path>> step_dirs(const fs::path& ckpts) {
  std::vector<std::pair<std::int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(ckpts, ec)) return out;
  for (const auto& entry : fs::directory_iterator(ckpts, ec)) {
    if (!entry.is_directory(ec)) continue;
    if (auto step = step_of_dir_name(entry.path().filename().string())) out.emplace_back(*step, entry.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

void check_buffers(const std::vector<NamedBuffer>& buffers, const char* what) {
  std::set<std::string> seen;
  for (const NamedBuffer& b : buffers) {
    if (!seen.insert(b.name).second)
      throw Error(fmt::format("The {} buffers name tensor '{}' twice.", what, b.name));
    for (std::int64_t d : b.shape)
      if (d < 0) throw Error(fmt::format("The {} tensor '{}' has a negative extent in shape {}.", what, b.name,
                                         shape_text(b.shape)));
    if (numel_of(b.shape) > 0 && b.data == nullptr)
      throw Error(fmt::format("The {} tensor '{}' has shape {} but no data.", what, b.name, shape_text(b.shape)));
  }
}

WrittenFile write_buffers(const fs::path& path, const std::vector<NamedBuffer>& buffers, std::int64_t step,
                          const char* role) {
  SafetensorsWriter w;
  for (const NamedBuffer& b : buffers) w.add(b.name, StDType::F32, b.shape, b.data);
  // "format": "pt" lets the Python safetensors/transformers tools open the file.
  return w.write(path, {{"format", "pt"}, {"moeflex_step", std::to_string(step)}, {"moeflex_role", role}});
}

/// Reads a file listed in a manifest, checking its size and SHA-256 against it.
SafetensorsFile open_verified(const fs::path& path, const nlohmann::json& record) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw DataError(fmt::format("Checkpoint file '{}' is missing.", path.string()));
  const Bytes expected = record.at("bytes").get<Bytes>();
  const std::string expected_sha = record.at("sha256").get<std::string>();
  std::vector<char> bytes = read_file_bytes(path);
  const Bytes actual = static_cast<Bytes>(bytes.size());
  if (actual < expected)
    throw DataError(fmt::format("Checkpoint file '{}' is truncated: it has {} bytes but the manifest records {} bytes.",
                                path.string(), actual, expected));
  if (actual > expected)
    throw DataError(fmt::format("Checkpoint file '{}' has the wrong size: it has {} bytes but the manifest records "
                                "{} bytes.",
                                path.string(), actual, expected));
  const std::string sha = sha256_hex(bytes.data(), bytes.size());
  if (sha != expected_sha)
    throw DataError(fmt::format("Checkpoint file '{}' is corrupted: its SHA-256 is {} but the manifest records {}.",
                                path.string(), sha, expected_sha));
  return SafetensorsFile::from_bytes(std::move(bytes), path.string());
}

/// Checks that `file` holds exactly the tensors of `buffers`, with their shapes
/// and a floating-point dtype. Writes nothing.
void check_matches(const SafetensorsFile& file, const std::vector<NamedBuffer>& buffers, const char* what) {
  check_buffers(buffers, what);
  std::set<std::string> wanted;
  for (const NamedBuffer& b : buffers) {
    wanted.insert(b.name);
    if (!file.contains(b.name))
      throw DataError(fmt::format("'{}' has no tensor '{}', which the {} needs.", file.source(), b.name, what));
    const TensorInfo& info = file.info(b.name);
    if (info.shape != b.shape)
      throw DataError(fmt::format("Tensor '{}' in '{}' has shape {}, but the {} expects shape {}.", b.name,
                                  file.source(), shape_text(info.shape), what, shape_text(b.shape)));
    if (info.dtype != StDType::F32 && info.dtype != StDType::F64)
      throw DataError(fmt::format("Tensor '{}' in '{}' has dtype {}; the {} needs F32 or F64.", b.name, file.source(),
                                  st_dtype_name(info.dtype), what));
  }
  for (const std::string& name : file.names())
    if (!wanted.count(name))
      throw DataError(fmt::format("'{}' holds tensor '{}', which the {} does not have; the checkpoint belongs to a "
                                  "different configuration.",
                                  file.source(), name, what));
}

void fill(const SafetensorsFile& file, const std::vector<NamedBuffer>& buffers) {
  for (const NamedBuffer& b : buffers) file.read_f32(b.name, b.data, numel_of(b.shape));
}

/// Deletes all but the newest `keep_last` step directories, never `keep`.
void rotate(const fs::path& ckpts, const fs::path& keep, int keep_last) {
  if (keep_last <= 0) return;
  int kept = 1;  // `keep` itself
  for (const auto& [step, dir] : step_dirs(ckpts)) {
    if (dir == keep) continue;
    if (kept < keep_last) {
      ++kept;
      continue;
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec)
      throw DataError(fmt::format("Cannot delete old checkpoint '{}': {}.", dir.string(), ec.message()));
  }
}

/// Moves the complete directory `tmp` to `final_dir`. When `final_dir` exists
/// already, the two are exchanged atomically and the old one is deleted, so
/// `final_dir` is never seen partially written.
void publish(const fs::path& tmp, const fs::path& final_dir) {
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(final_dir.parent_path());
      fs::remove_all(tmp, ec);  // now holds the replaced checkpoint
      return;
    }
    if (errno != EINVAL && errno != ENOSYS)
      throw DataError(fmt::format("Cannot replace checkpoint '{}' with '{}': {}.", final_dir.string(), tmp.string(),
                                  std::strerror(errno)));
    // No atomic exchange on this file system: move the old one aside first.
    // Meanwhile latest_checkpoint sees the previous step, never a partial one.
    fs::path old = final_dir;
    old += ".old" + std::string(kTmpSuffix);
    fs::remove_all(old, ec);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fsync_directory(final_dir.parent_path());
    fs::remove_all(old, ec);
    return;
  }
  fs::rename(tmp, final_dir);
  fsync_directory(final_dir.parent_path());
}

}  // namespace

std::string rank_folder_name(int rank) { return fmt::format("rank{:05d}", rank); }

bool is_rank_folder_name(const std::string& name) {
  return name.size() == 9 && name.starts_with("rank") &&
         std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int run_rank_count(const fs::path& run_dir) {
  std::set<int> ranks;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory(ec) && is_rank_folder_name(name)) ranks.insert(std::stoi(name.substr(4)));
  }
  if (ranks.empty()) return 0;
  const int n = *ranks.rbegin() + 1;
  for (int r = 0; r < n; ++r)
    if (!ranks.count(r))
      throw DataError(fmt::format("run '{}' has rank folders up to {} but no {}: a rank's checkpoints are missing",
                                  run_dir.string(), rank_folder_name(n - 1), rank_folder_name(r)));
  return n;
}

fs::path checkpoint_dir(const fs::path& run_dir, std::int64_t step) {
  return run_dir / "checkpoints" / fmt::format("{}{:08d}", kStepPrefix, step);
}

void save_checkpoint(const fs::path& run_dir, std::int64_t step, const std::vector<NamedBuffer>& model,
                     const std::vector<NamedBuffer>& optimizer, const nlohmann::json& trainer_state, int keep_last) {
  if (step < 0) throw Error(fmt::format("Cannot save a checkpoint for negative step {}.", step));
  check_buffers(model, "model");
  check_buffers(optimizer, "optimizer");
  const fs::path final_dir = checkpoint_dir(run_dir, step);
  const fs::path ckpts = final_dir.parent_path();
  fs::path tmp = final_dir;
  tmp += kTmpSuffix;
  try {
    bool created = fs::create_directories(ckpts);
    if (created) fsync_directory(ckpts.parent_path());
    fs::remove_all(tmp);  // a leftover of a crash while saving this step
    fs::create_directory(tmp);

    nlohmann::json files = nlohmann::json::object();
    auto record = [&](const char* name, const WrittenFile& w) {
      files[name] = {{"bytes", w.bytes}, {"sha256", w.sha256}};
    };
    record(kModelFileName, write_buffers(tmp / kModelFileName, model, step, "model"));
    record(kOptimizerFileName, write_buffers(tmp / kOptimizerFileName, optimizer, step, "optimizer"));
    nlohmann::json manifest = {{"format", kCheckpointFormat},
                               {"version", kCheckpointVersion},
                               {"step", step},
                               {"files", files},
                               {"trainer_state", trainer_state}};
    // Written last: a directory with a valid manifest has all its files.
    write_file_atomically(tmp / kManifestFileName, manifest.dump(2) + "\n");
    publish(tmp, final_dir);
  } catch (const fs::filesystem_error& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw DataError(fmt::format("Saving checkpoint '{}' failed: {}.", final_dir.string(), e.what()));
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // no half-written step_<N>.tmp left behind
    throw;
  }
  rotate(ckpts, final_dir, keep_last);
}

void rotate_checkpoints(const fs::path& run_dir, std::int64_t keep_step, int keep_last) {
  rotate(run_dir / "checkpoints", checkpoint_dir(run_dir, keep_step), keep_last);
}

nlohmann::json read_checkpoint_manifest(const fs::path& ckpt_dir) {
  const fs::path path = ckpt_dir / kManifestFileName;
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw DataError(fmt::format("Checkpoint '{}' has no {}; it is incomplete or not a checkpoint.", ckpt_dir.string(),
                                kManifestFileName));
  std::vector<char> bytes = read_file_bytes(path);
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("Checkpoint manifest '{}' is corrupt: it is not valid JSON ({}).", path.string(),
                                e.what()));
  }
  auto bad = [&](const std::string& what) {
    return DataError(fmt::format("Checkpoint manifest '{}' is invalid: {}.", path.string(), what));
  };
  if (!m.is_object()) throw bad("it is not a JSON object");
  if (m.value("format", nlohmann::json()) != kCheckpointFormat)
    throw bad(fmt::format("'format' should be \"{}\"", kCheckpointFormat));
  if (!m.contains("version") || !m["version"].is_number_integer())
    throw bad("'version' is missing");
  if (m["version"].get<int>() != kCheckpointVersion)
    throw bad(fmt::format("version {} is not supported (expected {})", m["version"].get<int>(), kCheckpointVersion));
  if (!m.contains("step") || !m["step"].is_number_integer() || m["step"].get<std::int64_t>() < 0)
    throw bad("'step' is missing or not a non-negative integer");
  if (!m.contains("trainer_state")) throw bad("'trainer_state' is missing");
  if (!m.contains("files") || !m["files"].is_object()) throw bad("'files' is missing");
  for (const char* name : {kModelFileName, kOptimizerFileName}) {
    auto it = m["files"].find(name);
    if (it == m["files"].end()) throw bad(fmt::format("it does not list {}", name));
    const nlohmann::json& r = *it;
    if (!r.is_object() || !r.contains("bytes") || !r["bytes"].is_number_integer() || r["bytes"].get<Bytes>() < 0 ||
        !r.contains("sha256") || !r["sha256"].is_string() || r["sha256"].get<std::string>().size() != 64)
      throw bad(fmt::format("the entry for {} needs 'bytes' and a 64-digit 'sha256'", name));
  }
  return m;
}

std::int64_t checkpoint_step(const fs::path& ckpt_dir) {
  return read_checkpoint_manifest(ckpt_dir)["step"].get<std::int64_t>();
}

bool checkpoint_complete(const fs::path& ckpt_dir, std::int64_t step) {
  try {
    nlohmann::json m = read_checkpoint_manifest(ckpt_dir);
    if (m["step"].get<std::int64_t>() != step) return false;
    for (const auto& [name, record] : m["files"].items()) {
      std::error_code ec;
      auto size = fs::file_size(ckpt_dir / name, ec);
      if (ec || static_cast<Bytes>(size) != record["bytes"].get<Bytes>()) return false;
    }
    return true;
  } catch (const Error&) {
    return false;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

std::string checkpoint_damage(const fs::path& ckpt_dir, std::int64_t step) {
  try {
    const nlohmann::json m = read_checkpoint_manifest(ckpt_dir);
    if (m["step"].get<std::int64_t>() != step)
      return fmt::format("Its manifest records step {}, not {}.", m["step"].get<std::int64_t>(), step);
    for (const auto& [name, record] : m["files"].items()) open_verified(ckpt_dir / name, record);
    return {};
  } catch (const Error& e) {
    return e.what();
  } catch (const nlohmann::json::exception& e) {
    return fmt::format("Its manifest cannot be read: {}.", e.what());
  }
}

std::optional<fs::path> newest_intact_checkpoint(const fs::path& run_dir, std::vector<DamagedCheckpoint>& damaged) {
  for (const auto& [step, dir] : step_dirs(run_dir / "checkpoints")) {
    std::string why = checkpoint_damage(dir, step);
    if (why.empty()) return dir;
    damaged.push_back({dir, step, std::move(why)});
  }
  return std::nullopt;
}

fs::path move_checkpoint_aside(const fs::path& dir) {
  fs::path to = dir.string() + ".damaged";
  std::error_code ec;
  for (int k = 2; fs::exists(to, ec); ++k) to = fmt::format("{}.damaged.{}", dir.string(), k);
  fs::rename(dir, to, ec);
  if (ec)
    throw DataError(fmt::format("Cannot move the damaged checkpoint '{}' aside to '{}': {}.", dir.string(),
                                to.string(), ec.message()));
  return to;
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  for (const auto& [step, dir] : step_dirs(run_dir / "checkpoints"))
    if (checkpoint_complete(dir, step)) return dir;  // else not usable: try an older one
  return std::nullopt;
}

nlohmann::json load_checkpoint(const fs::path& ckpt_dir, const std::vector<NamedBuffer>& model,
                               const std::vector<NamedBuffer>& optimizer) {
  nlohmann::json manifest = read_checkpoint_manifest(ckpt_dir);
  SafetensorsFile model_file = open_verified(ckpt_dir / kModelFileName, manifest["files"][kModelFileName]);
  SafetensorsFile optim_file = open_verified(ckpt_dir / kOptimizerFileName, manifest["files"][kOptimizerFileName]);
  check_matches(model_file, model, "model");
  check_matches(optim_file, optimizer, "optimizer");
  // Everything is verified: from here on nothing can fail half-way.
  fill(model_file, model);
  fill(optim_file, optimizer);
  return manifest["trainer_state"];
}

SafetensorsFile open_checkpoint_model(const fs::path& ckpt_dir) {
  const nlohmann::json manifest = read_checkpoint_manifest(ckpt_dir);
  auto it = manifest["files"].find(kModelFileName);
  if (it == manifest["files"].end())
    throw DataError(
        fmt::format("Checkpoint manifest '{}' lists no {}.", (ckpt_dir / kManifestFileName).string(), kModelFileName));
  return open_verified(ckpt_dir / kModelFileName, *it);
}

void load_model_weights(const fs::path& path, const std::vector<NamedBuffer>& model) {
  std::error_code ec;
  fs::path file = fs::is_directory(path, ec) ? path / kModelFileName : path;
  const fs::path manifest_path = file.parent_path() / kManifestFileName;
  std::optional<SafetensorsFile> st;
  if (fs::exists(manifest_path, ec)) {
    nlohmann::json manifest = read_checkpoint_manifest(file.parent_path());
    auto it = manifest["files"].find(file.filename().string());
    if (it != manifest["files"].end()) st = open_verified(file, *it);
  }
  if (!st) st = SafetensorsFile::open(file);
  check_matches(*st, model, "model");
  fill(*st, model);
}

}  // namespace moeflex::train
