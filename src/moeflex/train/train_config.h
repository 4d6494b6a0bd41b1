// RunConfig: everything a training run needs, read from TOML ([model], [train],
// [data], [device]) over the embedded defaults, then overridden by command-line flags.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/model/config.h"

namespace moeflex {

/// The most micro-batches per step train.grad_accum / --grad-accum take (every one is
/// an action of the step plan, held in memory).
inline constexpr std::int64_t kMaxGradAccum = 65536;

struct TrainConfig {
  std::int64_t steps = 300;            ///< optimizer steps
  std::int64_t micro_batch_size = 8;   ///< sequences per micro-batch (B)
  std::int64_t seq_len = 128;          ///< tokens per sequence (S)
  std::int64_t grad_accum = 1;         ///< micro-batches per step (M)
  double lr = 2e-3;                    ///< peak learning rate
  double min_lr = 2e-4;                ///< learning rate at the end of the cosine
  std::int64_t warmup_steps = 20;      ///< linear warm-up steps
  double weight_decay = 0.1;           ///< AdamW decoupled weight decay
  double beta1 = 0.9;                  ///< AdamW beta1
  double beta2 = 0.95;                 ///< AdamW beta2
  double grad_clip = 1.0;              ///< global-norm clip threshold; 0 = off
  std::uint64_t seed = 1234;           ///< seeds init and data order
  std::int64_t eval_every = 50;        ///< steps between validation evaluations; 0 = end only
  std::int64_t eval_batches = 8;       ///< validation micro-batches per evaluation
  std::int64_t checkpoint_every = 100; ///< steps between checkpoints; 0 = end only; -1 = none (benchmarks)
  std::int64_t keep_checkpoints = 2;   ///< newest checkpoints kept
  /// "async" (flash checkpoints: the state copied to a host snapshot, persisted by a
  /// background thread while training goes on) or "sync" (written before the next step).
  std::string checkpoint_mode = "async";
  /// async: a checkpoint due while the previous one still persists "wait"s for it or is "skip"ped.
  std::string checkpoint_when_busy = "wait";
  std::string policy = "auto";         ///< activation provisioning: auto (adaptive with a budget, else none), none, full, selective, moe-light, moe-medium, moe-full, threshold[=R], adaptive
  std::int64_t trace_steps = 3;        ///< steps recorded in trace.json (Chrome trace format); 0 = none
  std::string inject_imbalance;        ///< routing spikes on demand: "every=N:ratio=R" or "prob=P:ratio=R:seed=S"
  std::string on_oom = "fail";         ///< a step out of device memory: "fail" (typed error, exit 3) or "restart" (reload the newest checkpoint)
  std::int64_t max_restarts = 3;       ///< on_oom = restart: restarts allowed at one step before the run fails
  double restart_seconds = 0;          ///< on_oom = restart: seconds charged per restart (a real cold restart: minutes)
  /// Slow-rank detection (train/slow_rank.h): steps between the ranks' exchanges of
  /// their phase times; 0 = off.
  std::int64_t slow_rank_every = 5;
  double slow_rank_threshold = 1.2;    ///< a rank this many times slower than its peers in a phase is named
  /// What is measured: 0 the step's phases; 2 also every communication call, with its
  /// bytes and peer, in each rank's comm_calls.jsonl (1, per op kind, is --profile-ops).
  std::int64_t slow_rank_level = 0;
  /// One rank made slower in one phase, for tests and demonstrations:
  /// "rank=R:phase=P:factor=F[:from=S]" (train/slow_rank.h parse_slowdown).
  std::string inject_slowdown;
};

struct DataConfig {
  std::string path;            ///< corpus file or folder; empty = the prepared Brown corpus
  double val_fraction = 0.05;  ///< share of documents held out for validation
  /// A flat token file's end-of-document id (documents end after it); -1: the file has
  /// none, and is cut into kFlatPieces equal pieces for the validation split.
  std::int64_t eos_id = -1;
};

/// How the run is split over ranks. Sizes multiply to the world size.
struct ParallelConfig {
  int pp = 1;                      ///< pipeline-parallel size
  int dp = 0;                      ///< data-parallel size; 0 = world size / pp
  int ep = 1;                      ///< expert-parallel size, carved out of dp
  int vpp = 1;                     ///< virtual stages per pipeline rank
  std::string schedule = "1f1b";   ///< pipeline schedule
  bool pad_layers = false;         ///< pad with empty layers up to a multiple of pp x vpp (61 -> 64)
  std::vector<int> stage_layers;   ///< optional uneven split: layers per virtual stage (pp x vpp entries)
};

/// The first line of a run folder's config.toml: how a new run tells moeflex's own
/// leftover from a user's file it must not overwrite.
inline constexpr const char* kRunConfigHeader = "# Resolved moeflex run config";
/// The TOML beside a Hugging Face config.json that gives a run its [train], [data],
/// [device] and [parallel] tables (and moeflex's own model keys).
inline constexpr const char* kHfRunToml = "moeflex.toml";

struct RunConfig {
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  ParallelConfig parallel;
  Bytes device_memory = -1;  ///< device-memory budget in bytes; -1 = unlimited
  std::string device = "cpu";  ///< where the run computes: "cpu" or "cuda" (one GPU; [device] kind)

  /// Throws ConfigError naming the field and the rule.
  void validate() const;
  /// The embedded default (configs/default.toml).
  static RunConfig defaults();
  /// Parses TOML text over the defaults; `origin` names the source in errors.
  static RunConfig from_toml_text(const std::string& text, const std::string& origin);
  /// A TOML run config, or a Hugging Face config.json (ModelConfig::from_hf_json,
  /// refused where the engine does not run the model) whose run fields come from
  /// kHfRunToml beside it or the defaults.
  static RunConfig from_file(const std::string& path);
  /// The resolved config as TOML (written to the run directory as config.toml), its
  /// first line kRunConfigHeader.
  std::string to_toml() const;
};

}  // namespace moeflex
