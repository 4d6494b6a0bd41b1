// The run folder of a training run: whether another process trains in it (its
// lock), whether it holds a run or files no moeflex run wrote, and taking it for this
// run (the lock, a new run's config.toml and tokenizer.model or tokens.json, a resumed
// run's tokenizer checked against the corpus's or its tokens.json against the data).
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moeflex/core/file_io.h"
#include "moeflex/train/run_state.h"

namespace moeflex::run {

namespace {

// What a run on pre-tokenized data was trained on (claim_for_pretokenized).
constexpr const char* kTokensJson = "tokens.json";

// The checkpoint roots a run folder may hold: the folder itself (one process) and
// its rank folders (several).
std::vector<fs::path> checkpoint_roots(const fs::path& run_dir) {
  std::vector<fs::path> roots = {run_dir};
  std::error_code ec;
  if (fs::is_directory(run_dir, ec))
    for (const auto& e : fs::directory_iterator(run_dir, ec))
      if (e.is_directory() && train::is_rank_folder_name(e.path().filename().string())) roots.push_back(e.path());
  return roots;
}

// The refusal of a new run into a folder that holds one with a checkpoint.
std::string holds_a_run_message(const fs::path& run_dir) {
  return fmt::format("run directory '{}' already holds a run; use --resume {} or another --out", run_dir.string(),
                     run_dir.string());
}

// Whether `run_dir` holds a complete checkpoint, on any number of ranks.
bool holds_a_checkpoint(const fs::path& run_dir) {
  for (const fs::path& root : checkpoint_roots(run_dir))
    if (train::latest_checkpoint(root)) return true;
  return false;
}

// Whether any rank's checkpoints folder exists in `run_dir`, complete or not.
bool has_checkpoints_folder(const fs::path& run_dir) {
  for (const fs::path& root : checkpoint_roots(run_dir))
    if (fs::exists(root / "checkpoints")) return true;
  return false;
}

// Whether `run_dir` holds a run that trained (whatever its rank count): its metrics,
// summary or checkpoints. A folder with only config.toml and tokenizer.model is a
// run refused before its first step, which a new run may take over.
bool holds_a_run(const fs::path& run_dir) {
  return fs::exists(run_dir / "summary.json") || fs::exists(run_dir / "metrics.jsonl") ||
         has_checkpoints_folder(run_dir);
}

// What a new run in `run_dir` would overwrite that no earlier moeflex run left: a
// config.toml moeflex did not write (its header), or a tokenizer.model, tokens.json, trace.json,
// loads.jsonl, phases.jsonl, comm_calls.jsonl or op_times.json beside no moeflex config.toml.
// "" when nothing.
std::string foreign_file_in(const fs::path& run_dir) {
  bool ours = false;
  if (std::ifstream in(run_dir / "config.toml"); in) {
    std::string first;
    std::getline(in, first);
    if (first != kRunConfigHeader) return (run_dir / "config.toml").string();
    ours = true;
  }
  if (ours) return "";
  for (const char* name :
       {"tokenizer.model", kTokensJson, "trace.json", "loads.jsonl", "phases.jsonl", "comm_calls.jsonl", "op_times.json"})
    if (fs::exists(run_dir / name)) return (run_dir / name).string();
  return "";
}

// A run on pre-tokenized data records what its tokens are in tokens.json (no tokenizer
// comes with them); a resumed one must find the same. The refusal, or "" when none.
std::string claim_for_pretokenized(const RunContext& ctx) {
  const fs::path& run_dir = ctx.run_dir;
  const TokenDataset& ds = *ctx.data;
  const fs::path record = run_dir / kTokensJson;
  if (!ctx.opts.resume) {
    write_file_atomically(run_dir / "config.toml", ctx.cfg.to_toml());
    const nlohmann::json j = {{"data", ds.dir().string()}, {"identity", ds.identity()}};
    write_file_atomically(record, j.dump(2) + "\n");
    return "";
  }
  if (!fs::exists(record))
    return fmt::format("--resume: the run '{}' has no {}, so it was not trained on the pre-tokenized data '{}' (or the "
                       "file was lost): resume it with the data it was trained on",
                       run_dir.string(), kTokensJson, ds.dir().string());
  std::string was;
  try {
    const std::vector<char> text = read_file_bytes(record);
    was = nlohmann::json::parse(text.begin(), text.end()).at("identity").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    return fmt::format("--resume: '{}' is malformed ({}); restore it", record.string(), e.what());
  }
  if (was != ds.identity())
    return fmt::format("--resume: the data '{}' differs from the data the run began with ({} says '{}', the data now "
                       "'{}'): resume with the data the run was trained on",
                       ds.dir().string(), record.string(), was, ds.identity());
  return "";
}

}  // namespace

// Whether a moeflex process is training in `run_dir` now: it holds the exclusive lock
// on RUN/.moeflex.lock (probed with a shared one, which probes do not contend for).
bool folder_in_use(const fs::path& run_dir) {
  const fs::path lock = run_dir / ".moeflex.lock";
  if (!fs::exists(lock)) return false;
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool busy = ::flock(fd, LOCK_SH | LOCK_NB) != 0;
  ::close(fd);
  return busy;
}

// The refusal of a folder another process trains in (folder_in_use, or a lock not had).
std::string folder_in_use_message(const fs::path& run_dir, bool resume) {
  return fmt::format("another moeflex process is training in '{}' (it holds {}); wait for it to end{}",
                     run_dir.string(), (run_dir / ".moeflex.lock").string(), resume ? "" : " or use another --out");
}

RunLock::~RunLock() {
  if (fd >= 0) ::close(fd);
}

void check_new_run_folder(const RunContext& ctx) {
  const fs::path& run_dir = ctx.run_dir;
  if (holds_a_run(run_dir)) {
    // Every training run writes its config.toml first; a summary without one is
    // another command's output (`moeflex simulate --out`), not a run to resume.
    if (!fs::exists(run_dir / "config.toml") && !has_checkpoints_folder(run_dir))
      throw ConfigError(
          fmt::format("'{}' holds another command's output (a summary.json or metrics.jsonl without a "
                      "run's config.toml, e.g. `moeflex simulate --out`), not a training run: use "
                      "another --out",
                      run_dir.string()));
    if (!holds_a_checkpoint(run_dir))  // it ended before its first checkpoint: nothing to resume
      throw ConfigError(
          fmt::format("run directory '{}' holds a run that ended before its first complete checkpoint "
                      "(it has metrics, a summary or a checkpoints folder); it cannot be resumed: use "
                      "another --out, or delete it to start over there",
                      run_dir.string()));
    throw ConfigError(holds_a_run_message(run_dir));
  }
  // Before any corpus work: a new run would overwrite files no moeflex run wrote.
  if (const std::string f = foreign_file_in(run_dir); !f.empty())
    throw ConfigError(
        fmt::format("--out '{}' holds '{}', which no moeflex run wrote and a new run would overwrite: "
                    "use another --out, or move it away",
                    run_dir.string(), f));
}

void claim_run_folder(RunContext& ctx) {
  const TrainOptions& opts = ctx.opts;
  const RunConfig& cfg = ctx.cfg;
  const fs::path& run_dir = ctx.run_dir;
  const std::unique_ptr<comm::Communicator>& world = ctx.world;
  const int world_size = ctx.world_size;
  const bool rank0 = ctx.rank0;
  const fs::path& corpus = ctx.corpus;
  const fs::path& data_dir = ctx.data_dir;
  std::string folder_error;
  // One process trains in a run folder at a time: rank 0 holds an advisory lock on
  // RUN/.moeflex.lock for the whole run (released by the kernel when the process ends,
  // however it ends).
  RunLock& run_lock = ctx.run_lock;
  if (rank0) {
    fs::create_directories(run_dir);
    run_lock.fd = ::open((run_dir / ".moeflex.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (run_lock.fd < 0 || ::flock(run_lock.fd, LOCK_EX | LOCK_NB) != 0)
      folder_error = folder_in_use_message(run_dir, bool(opts.resume));
    else if (!opts.resume && holds_a_run(run_dir))  // a run that began and ended since the check above
      folder_error = holds_a_run_message(run_dir);
    else  // the lock is ours: temporary files of an atomic write a killed process left are garbage
      for (const auto& e : fs::directory_iterator(run_dir))
        if (e.is_regular_file() && e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove(e.path());
  }
  if (rank0 && folder_error.empty() && ctx.data->pretokenized()) {
    folder_error = claim_for_pretokenized(ctx);
  } else if (rank0 && folder_error.empty()) {
    if (!opts.resume) {
      // Both written to a temporary file and renamed: a symlink in their place is
      // replaced, never followed (its target stays as it was).
      write_file_atomically(run_dir / "config.toml", cfg.to_toml());
      const std::vector<char> tok = read_file_bytes(data_dir / "tokenizer.model");
      write_file_atomically(run_dir / "tokenizer.model", std::string_view(tok.data(), tok.size()));
    } else if (!fs::exists(run_dir / "tokenizer.model")) {
      folder_error = fmt::format(
          "--resume: the run '{}' has no tokenizer.model, so its corpus cannot be checked against the one at '{}' "
          "(a changed corpus would give the model token ids it never learned). Restore the run's tokenizer.model",
          run_dir.string(), corpus.string());
    } else if (read_file_bytes(run_dir / "tokenizer.model") != read_file_bytes(data_dir / "tokenizer.model")) {
      // The corpus changed since the run began (its tokenizer was retrained): the
      // model's embeddings belong to the run's own tokenizer, which stays as it is.
      folder_error = fmt::format(
          "--resume: the corpus '{}' has changed since the run began: its tokenizer now differs from the run's "
          "tokenizer.model, so its token ids would not mean what the model learned. Resume with the corpus the run "
          "was trained on", corpus.string());
    }
  }
  if (world_size > 1) {  // every rank refuses together
    double bad = folder_error.empty() ? 0.0 : 1.0;
    world->all_reduce_max(&bad, 1);
    if (bad > 0 && folder_error.empty()) folder_error = "the run folder was refused on rank 0 (see its message)";
  }
  if (!folder_error.empty()) throw DataError(folder_error);
  world->barrier();
}

}  // namespace moeflex::run
