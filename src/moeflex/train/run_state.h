// Internal to run_training (trainer.cpp) and the files it is split into: the state
// one phase of a run hands on to the next. RunContext is what the set-up fixes (the
// config, the ranks, the run folder, the device, the data); RunRecord what the run
// reports and its error handling reads; Training the model, optimizer and
// checkpointing state of the training phase, whose methods are the phases of a step.
//   run_folder.cpp   the run folder: foreign files, in-use locks, a new run's checks
//   resume.cpp       checkpoint discovery, trainer_state checks, restore and save
//   run_setup.cpp    config, ranks and layout, threads, device, data, model chunks
//   step_loop.cpp    the training loop and the restart after an OOM
//   run_summary.cpp  summary.json, op_times.json, the error reports
#pragma once
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/layout.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/profile/op_profiler.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/provision/planner.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/checkpoint_writer.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/optimizer.h"
#include "moeflex/train/progress.h"
#include "moeflex/train/replica.h"
#include "moeflex/train/slow_rank.h"
#include "moeflex/train/trace.h"
#include "moeflex/train/trainer.h"

namespace moeflex::run {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

/// Seconds since `t0`.
double seconds_since(Clock::time_point t0);

/// Rank 0's advisory lock on RUN/.moeflex.lock for the whole run (released by the
/// kernel when the process ends, however it ends).
struct RunLock {
  int fd = -1;
  RunLock() = default;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();
};

/// What the set-up of a run fixes before any model is built. Members are declared
/// in the order the set-up creates them (and go in the reverse order).
struct RunContext {
  explicit RunContext(const TrainOptions& o) : opts(o), cfg(o.config) {}
  const TrainOptions& opts;
  RunConfig cfg;                  ///< the run's config, resolved (a resume: the run's own)
  fs::path run_dir;               ///< --out, or the folder --resume continues
  std::optional<fs::path> ckpt;   ///< the checkpoint a resume starts from
  std::string progress_note_pending;  ///< a resume's note, printed once the progress line exists
  std::unique_ptr<comm::Communicator> world;
  int rank = 0, world_size = 1;
  bool rank0 = true;
  std::optional<comm::ParallelLayout> layout;
  comm::ParallelGroups groups;
  int dp = 1, dp_rank = 0;
  fs::path ckpt_root;             ///< this rank's checkpoints (its rank folder with several ranks)
  std::optional<Progress> progress;
  ops::DeviceContext device;
  fs::path corpus, data_dir;      ///< the corpus and its tokenized cache
  DatasetInfo info;
  std::optional<TokenDataset> data;
  RunLock run_lock;

  Arena& arena() const { return *device.arena; }
};

/// What a run reports (summary.json, the TrainResult) and the flags its error
/// handling reads: kept outside the training phase, which an exception ends.
struct RunRecord {
  explicit RunRecord(const RunContext& ctx) : summary_path(ctx.run_dir / "summary.json") {}
  TrainResult res;
  fs::path summary_path;
  json history = json::array();     ///< val_loss_history
  json rank_peaks = json::array();  ///< peak_device_bytes_per_rank
  Bytes my_run_peak = 0;            ///< this rank's peak over the steps so far
  fs::path summary_path_override;   ///< where a rank other than 0 records an OOM
  /// --resume of a run already at its last step: nothing trains, and its summary.json
  /// (the statistics of the steps that did) stays as it is.
  bool already_complete = false;
  Clock::time_point t_start;
  bool state_placed = false;           ///< weights, gradients and optimizer state are in the arena
  bool restart_limit_reached = false;  ///< on_oom = restart gave up: every rank throws at the same step
  std::int64_t running_step = -1;      ///< the step in progress (0-based), for an OOM's message
  json slow_ranks = json::array();     ///< every slow-rank report of the run (summary.json)
};

// ---- set-up (run_setup.cpp) ------------------------------------------------------------

/// The run's config: a resume's own, the policy "auto" resolved, the hardware profile
/// and (on a resume) the tokenizer checked. Refuses a folder another process trains in.
void resolve_config(RunContext& ctx);
/// The world, its layout and groups, after the checks that need the rank count (the
/// machine's RAM, a resume's rank count, pp dividing the world).
void join_ranks(RunContext& ctx);
/// Threads per rank, the host's oversubscription, the progress line and its first notes.
void set_threads_and_progress(RunContext& ctx);
/// The run's device and its arena; a device that cannot be had fails here.
void open_device(RunContext& ctx);
/// Tokenizes (rank 0) or reuses the corpus, and opens it on every rank.
void open_data(RunContext& ctx);

// ---- the run folder (run_folder.cpp) ---------------------------------------------------

/// Whether a moeflex process is training in `run_dir` now (it holds the folder's lock).
bool folder_in_use(const fs::path& run_dir);
/// The refusal of a folder another process trains in.
std::string folder_in_use_message(const fs::path& run_dir, bool resume);
/// Refuses a new run into a folder that holds a run, another command's output, or
/// files no moeflex run wrote.
void check_new_run_folder(const RunContext& ctx);
/// Takes the folder's lock (rank 0), writes a new run's config.toml and
/// tokenizer.model or checks a resumed run's tokenizer; every rank refuses together.
void claim_run_folder(RunContext& ctx);

// ---- resume (resume.cpp) ---------------------------------------------------------------

/// The pieces of a tokenizer.model, or -1 when it cannot be read.
std::int64_t tokenizer_pieces(const fs::path& model);
/// Refuses a resume on another rank count than the run trained on, or of a run
/// without any checkpoint.
void check_resume_ranks(const RunContext& ctx);
/// ctx.ckpt: this rank's newest checkpoint, agreed on by every rank (the newest step
/// every rank completed). Collective with several ranks.
void find_resume_checkpoint(RunContext& ctx);

// ---- the end of a run (run_summary.cpp) ------------------------------------------------

/// Writes summary.json (rank 0, or any rank with `any_rank`; nothing for a run that
/// was already complete).
void write_summary(const RunContext& ctx, const RunRecord& rec, double wall, bool any_rank = false);
/// Every rank's peak device bytes over the run (collective), for the summary.
void gather_rank_peaks(const RunContext& ctx, RunRecord& rec);
/// The handling of an OutOfMemoryError that ended the run: counted, summarised, and
/// rethrown (as a ConfigError when not a step but the model state ran out).
[[noreturn]] void report_out_of_memory(const RunContext& ctx, RunRecord& rec, const OutOfMemoryError& oom);
/// The handling of another Error that ended the run: no trace left by a run refused
/// before its first step; the job ends on every rank. Rethrows.
[[noreturn]] void report_error(const RunContext& ctx, const RunRecord& rec, const Error& e);

/// Whether SIGINT or SIGTERM asked the run to stop after the current step (trainer.cpp).
bool stop_requested();

// ---- the training phase ----------------------------------------------------------------

/// The model, optimizers and checkpointing state of the training phase; its methods
/// are the phases of the run and of a step. Members are declared in the order they
/// are created, so that they go in the reverse order (the trace before the replica
/// its copy engines observe, the replica before the op profiler it runs through).
struct Training {
  /// Builds the op profiler, the model replica, the trace, the planner or static
  /// policy and the optimizers, and checks an adaptive budget's feasibility
  /// (run_setup.cpp).
  Training(RunContext& ctx, RunRecord& rec);
  /// Restores the checkpoint a resume starts from, or evaluates the initial model,
  /// then opens metrics.jsonl and loads.jsonl (resume.cpp).
  void start();
  /// The training loop up to the last step, a stop request or --stop-after, then
  /// op_times.json (step_loop.cpp).
  void run_steps();

  /// What one step carries from one of its phases to the next (step_loop.cpp).
  struct StepRecord;

  // run_setup.cpp
  void start_op_profiling();
  void build_replica();
  /// The initial weights: the seed's random init, or the --init-from checkpoint's.
  void initialize_weights();
  bool weights_noted = false;  ///< the --init-from note was printed
  void choose_provisioning();
  void check_feasibility();
  // resume.cpp: the training state a checkpoint holds (weights, AdamW moments and
  // step, tokens, losses), shared by --resume and by the restart after an OOM.
  std::vector<train::NamedBuffer> model_bufs();
  std::vector<train::NamedBuffer> opt_bufs();
  std::vector<train::NamedBuffer> stage(std::vector<train::NamedBuffer> bufs, bool download);
  void unstage(const std::vector<train::NamedBuffer>& on_device, const std::vector<train::NamedBuffer>& host);
  json restore_checkpoint(const fs::path& dir);
  void resume_from(const fs::path& dir);
  void restore_initial_state();
  /// Checkpoints `step`; a periodic one (`may_skip`) is skipped under
  /// checkpoint_when_busy = "skip" while the previous one persists; the last never is.
  void save(std::int64_t step, bool may_skip = false);
  /// Waits for the checkpoint persist in flight, counts it and rotates the old ones
  /// (every rank, at the same step).
  void finish_persist();
  // step_loop.cpp
  double evaluate();
  void begin_step(std::int64_t step, StepRecord& s);
  bool restarted_after_oom(std::int64_t& step, const StepRecord& s);
  std::int64_t restart_after_oom(std::int64_t step, int oom_rank, double step_seconds);
  void optimizer_step(std::int64_t step, StepRecord& s);
  void gather_step_stats(StepRecord& s);
  void record_step(std::int64_t step, StepRecord& s);
  void finish_trace(std::int64_t step, const StepRecord& s);
  void report_progress(std::int64_t step, const StepRecord& s);
  /// Slow-rank detection: adds the step's phase times; every slow_rank_every steps
  /// the ranks exchange and score them (collective); new reports are noted, the
  /// slow ranks of now go into the step's metrics line.
  void watch_ranks(std::int64_t step, StepRecord& s);
  void start_slow_rank_watch();
  /// Records new slow-rank reports (summary.json) and says them (rank 0; under --quiet too).
  void note_slow_ranks(const std::vector<train::SlowRankReport>& made);
  bool checkpoint_or_stop(std::int64_t step, StepRecord& s);
  // run_summary.cpp
  void finish_op_times();

  RunContext& ctx;
  RunRecord& rec;
  TrainResult& res;
  const TrainConfig& t;
  // The run context by the names the phases use.
  const TrainOptions& opts;
  const RunConfig& cfg;
  const fs::path& run_dir;
  const std::unique_ptr<comm::Communicator>& world;
  const int rank, world_size;
  const bool rank0;
  const comm::ParallelLayout& layout;
  comm::ParallelGroups& groups;
  const int dp, dp_rank;
  const fs::path& ckpt_root;
  Progress& progress;
  ops::DeviceContext& device;
  Arena& arena;
  const DatasetInfo& info;
  TokenDataset& data;
  const int B, S;
  const std::int64_t M;
  // --profile-ops (profile/op_profiler.h): wraps the arena's backend while the run lives.
  std::optional<CostModel> op_cost;
  std::unique_ptr<ProfilingBackend> op_profiler;
  std::optional<ScopedBackendOverride> op_override;
  std::unique_ptr<Replica> replica;
  ops::ImbalanceSpec imbalance;
  /// What skewed step `step` (1-based) aims at (ops::target_imbalance): metrics.jsonl's
  /// injected_imbalance.
  double injected_imbalance(std::int64_t step) const;
  fs::path trace_path;
  bool trace_on = false;
  std::unique_ptr<train::TraceWriter> trace;
  struct DetachTrace {  // the copy engines' observers point at `trace`: detached before it goes
    explicit DetachTrace(Replica& r) : replica(r) {}
    Replica& replica;
    ~DetachTrace() { replica.set_trace(nullptr); }
  };
  std::optional<DetachTrace> detach_trace;
  bool trace_finished = false;
  std::unique_ptr<AdaptivePlanner> planner;
  std::optional<CostModel> cost_model;  ///< what the planner prices its choices with
  std::vector<double> all_decision_seconds;
  std::vector<std::unique_ptr<AdamW>> opts_;
  std::vector<std::int32_t> in, tg;  ///< a validation batch
  std::int64_t start_step = 0;
  double elapsed_before = 0;
  std::int64_t decisions_before = 0;  ///< the planner's decisions before a resume
  /// On a device, checkpoint files are written from and read into host copies.
  std::vector<std::vector<float>> staging;
  /// Writes checkpoints (train.checkpoint_mode); its destructor flushes the persist in flight.
  std::unique_ptr<train::CheckpointWriter> ckpt_writer;
  /// What the step's metrics line says of checkpoints (the one taken, the one persisted).
  json last_checkpoint = json::object();
  std::ofstream metrics;
  std::ofstream loads_out;  ///< loads.jsonl (record_loads)
  double train_seconds = 0;
  double last_val = 0;
  const bool restart_on_oom;
  std::map<std::int64_t, std::int64_t> restarts_at;  ///< 1-based step -> restarts caused by it
  /// Arena fragmentation handling so far on this rank: compactions, bytes moved,
  /// evicted, stitched.
  double defrag_seen[4] = {0, 0, 0, 0};
  /// Bytes of zero-bubble W reads the planner offloaded so far on this rank (all chunks).
  double weight_reads_offloaded_seen = 0;
  /// Slow-rank detection (train.slow_rank_every > 0).
  std::optional<train::SlowRankMonitor> slow_ranks;
  fs::path comm_calls_path;  ///< slow_rank_level 2: this rank's comm_calls.jsonl
};

}  // namespace moeflex::run
