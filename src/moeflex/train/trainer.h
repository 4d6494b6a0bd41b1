// The training run: data, model, optimizer, the step loop, evaluation, checkpoints,
// metrics.jsonl, summary.json and the progress bar.
#pragma once
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>

#include "moeflex/train/train_config.h"

namespace moeflex {

struct TrainOptions {
  RunConfig config;
  std::filesystem::path out_dir;                ///< the run directory
  std::optional<std::filesystem::path> resume;  ///< a run directory to continue
  /// A Hugging Face checkpoint folder (train/hf_import.h) whose weights a new run
  /// starts from instead of the random init (fine-tuning); not with `resume`.
  std::optional<std::filesystem::path> init_from;
  std::filesystem::path data_cache = "data/tokenized";  ///< where tokenized corpora are cached
  /// Stop (as if interrupted, after a checkpoint) after this step; -1 = never; 0 =
  /// before step 1, with a checkpoint of the initial state (moeflex import-hf).
  std::int64_t stop_after = -1;
  int threads = 0;               ///< OpenMP/BLAS threads; 0 = all cores
  bool progress = true;          ///< show the progress bar / log lines on stderr
  /// Time every backend op of each step and price it with the cost model
  /// (profile/op_profiler.h): op events in trace.json, op_times.json, and the errors
  /// in summary.json.
  bool profile_ops = false;
  std::filesystem::path hardware_profile;  ///< the profile pricing the ops; empty = kDefaultHardwareProfilePath
};

/// What a finished (or stopped) run reports; also written to summary.json.
struct TrainResult {
  std::int64_t steps = 0;
  std::int64_t tokens = 0;
  double initial_val_loss = std::numeric_limits<double>::quiet_NaN();  ///< NaN until evaluated
  double final_val_loss = std::numeric_limits<double>::quiet_NaN();
  std::int64_t final_val_step = 0;  ///< the step final_val_loss was evaluated after (0: before training)
  double final_train_loss = 0;
  double tokens_per_second = 0;
  std::int64_t peak_device_bytes = 0;
  std::int64_t oom_count = 0;
  std::int64_t bytes_recomputed = 0;  ///< activation bytes dropped in forward and rebuilt in backward
  std::int64_t bytes_offloaded = 0;   ///< activation bytes copied to host memory and back
  std::int64_t arena_compactions = 0;  ///< arena defragmentations (all ranks; Arena::compact)
  std::int64_t bytes_compacted = 0;    ///< bytes those compactions moved
  std::int64_t bytes_evicted = 0;      ///< activation bytes evicted to the host to make room (Arena::make_room)
  std::int64_t bytes_stitched = 0;     ///< bytes served by stitching free pages together (Arena::stitch)
  std::int64_t decisions = 0;         ///< adaptive planner layer decisions
  std::int64_t provisioned_steps = 0;  ///< steps that recomputed or offloaded any activation
  double decision_seconds_p99 = 0;    ///< 99th percentile of one layer decision's time
  double max_load_ratio = 1.0;        ///< largest expert-load imbalance seen (max / mean)
  std::int64_t predicted_peak_bytes = 0;  ///< the adaptive planner's largest projected peak (0 otherwise)
  // --on-oom=restart: a step that ran out of device memory on any rank is dropped and
  // the run goes back to its newest checkpoint (or the initial state), as a job would
  // that crashed and was relaunched.
  std::int64_t restarts = 0;     ///< checkpoint reloads after an OOM
  std::int64_t lost_steps = 0;   ///< completed steps rolled back by restarts (done twice); OOM steps not included
  std::int64_t steps_run = 0;    ///< forward/backward passes run: kept, lost and dropped (OOM) steps
  double restart_seconds = 0;    ///< charged for restarts: train.restart_seconds each + the measured reloads
  double checkpoint_blocking_seconds = 0;  ///< training's time in checkpoints (async: the snapshot copies)
  double checkpoint_persist_seconds = 0;   ///< the writing of them (async: on the background thread)
  std::int64_t checkpoints_skipped = 0;    ///< async with checkpoint_when_busy = "skip": due while one persisted
  /// Kept tokens / (seconds of every step run, lost and dropped ones included, + restart_seconds).
  double tokens_per_second_effective = 0;
  std::int64_t oom_peak_demand_bytes = 0;  ///< the most device memory a dropped (OOM) step used, heap overflow included
  std::string first_oom;                   ///< the first OutOfMemoryError's message (empty: none)
  /// What priced the adaptive planner's choices: the hardware profile's path, or
  /// "op family" without a usable one (empty: no planner).
  std::string planner_cost_model;
  /// profile_ops: time-weighted mean absolute op error, sum |predicted - measured| /
  /// sum measured over the ops of every step but the first (NaN without profiling).
  double time_model_op_error = std::numeric_limits<double>::quiet_NaN();
  /// profile_ops: the same judged on medians, time-weighted over (op kind, shape):
  /// |predicted median - measured median| / measured median (NaN without profiling).
  double time_model_op_median_error = std::numeric_limits<double>::quiet_NaN();
  /// profile_ops: the op error a model knowing every shape's measured median would
  /// have (the run's own op-to-op noise; NaN without profiling).
  double time_model_op_noise_floor = std::numeric_limits<double>::quiet_NaN();
  /// profile_ops: mean over steps and ranks of |predicted - measured| / measured step time
  /// (thread CPU time with one thread per rank, as the op error; else wall time).
  double time_model_step_error = std::numeric_limits<double>::quiet_NaN();
};

/// Runs (or resumes) a training run. Throws ConfigError / DataError on bad input and
/// OutOfMemoryError when a step does not fit the device budget (the summary with
/// oom_count = 1 is written first); with train.on_oom = "restart", only once one step
/// has run out of memory more than train.max_restarts times (the message names it).
TrainResult run_training(const TrainOptions& opts);

/// The default corpus location (prepared by `make data`).
std::filesystem::path default_corpus_path();

}  // namespace moeflex
