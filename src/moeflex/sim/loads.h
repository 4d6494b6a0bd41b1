// Expert loads for the simulator: the imbalance ratio (rows the most-loaded
// expert-parallel rank receives / the balanced share) of every (iteration,
// micro-batch, MoE layer), either sampled from a distribution or replayed from a
// `moeflex train` run: its loads.jsonl (every rank's rows per micro-batch and MoE
// layer, so that each rank's memory can be replayed exactly) or, from older runs,
// its metrics.jsonl (per step and layer, summed over micro-batches).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "moeflex/model/recorded_loads.h"

namespace moeflex::sim {

/// One rank's routing of one micro-batch through one MoE layer, as recorded.
using RecordedRows = moeflex::RecordedRows;

/// The default distribution follows BaGuaLu-2 (../shared/BACKGROUND.md): 97.1% of
/// iterations stay under 1.2x, 2.9% spike up to 2.6x. Per iteration, one
/// micro-batch (chosen uniformly) carries the iteration's ratio, drawn uniformly
/// in (1, calm_max] or, with spike_probability, in (calm_max, spike_max]; the other
/// micro-batches draw calm ratios. A ratio applies to every MoE layer of its
/// micro-batch (spikes come from the data, which all layers see).
class LoadModel {
 public:
  double calm_max = 1.2;            ///< calm iterations stay under this ratio
  double spike_max = 2.6;           ///< spikes reach up to this ratio
  double spike_probability = 0.029; ///< share of iterations that spike
  std::uint64_t seed = 1;
  /// > 0: every ratio is this value (no sampling); for scoring layouts at a fixed load.
  double constant = 0;

  /// Replays a run: per step, per MoE layer, max / mean of `ep_received_tokens`
  /// (1.0 for steps without it, e.g. runs without EP). Throws DataError naming
  /// the file and line.
  static LoadModel from_metrics(const std::filesystem::path& metrics_jsonl);
  /// Replays a run's loads.jsonl (written by `moeflex train`; format in
  /// train/step_loop.cpp's record_loads): every data-parallel rank's kept and received rows
  /// per step, micro-batch and MoE layer. ratio() is then, per micro-batch and
  /// layer, the largest max / mean of received rows over the EP groups. Parsed by
  /// read_recorded_loads (model/recorded_loads.h): DataError naming the file, line and field.
  static LoadModel from_loads(const std::filesystem::path& loads_jsonl);
  /// from_loads for a loads.jsonl (or a run directory holding one), from_metrics
  /// for any other file.
  static LoadModel from_file(const std::filesystem::path& path);
  /// Parses "calm=1.2:spike=2.6:p=0.029[:seed=S]" (any subset) over the defaults.
  /// Throws ConfigError naming the bad part.
  static LoadModel parse(const std::string& spec);
  /// The loads of `moeflex simulate --loads PATH --imbalance SPEC`: from_file(PATH)
  /// when a path is given, else parse(SPEC) (empty: the default distribution).
  /// ConfigError when both are given: a replay takes the run's recorded loads and
  /// would ignore the distribution.
  static LoadModel from_flags(const std::string& loads_path, const std::string& imbalance_spec);

  /// True when ratios come from a recorded run.
  bool replay() const { return !trace_.empty() || !rows_.empty(); }
  /// Steps of the recorded run (0 without a replay).
  std::size_t recorded_steps() const { return per_rank() ? rows_.size() : trace_.size(); }
  /// True when the recorded run gave every rank's rows (loads.jsonl).
  bool per_rank() const { return !rows_.empty(); }
  /// The recording's layout (per_rank() only): data-parallel and expert-parallel
  /// sizes, micro-batches per step, MoE layers.
  int recorded_dp() const { return rec_dp_; }
  int recorded_ep() const { return rec_ep_; }
  int recorded_microbatches() const { return rec_m_; }
  int recorded_moe_layers() const { return rec_layers_; }
  /// Rows of data-parallel rank `dp_rank` in (iteration, micro-batch, k-th MoE
  /// layer); per_rank() only. Iterations wrap around the recorded steps.
  RecordedRows rows(int iteration, int microbatch, int moe_layer, int dp_rank) const;
  /// Ratio of (iteration, micro-batch, k-th MoE layer) among m micro-batches; at
  /// least 1. Replayed traces wrap around; a metrics.jsonl replay gives the same
  /// ratio to every micro-batch of a step (it sums the micro-batches).
  double ratio(int iteration, int microbatch, int num_microbatches, int moe_layer) const;
  /// The largest ratio ratio() can return.
  double max_ratio() const;
  /// Probability that an iteration's ratio exceeds r (from the distribution, or
  /// the share of replayed steps).
  double probability_above(double r) const;
  std::string describe() const;

 private:
  std::vector<std::vector<double>> trace_;  ///< metrics.jsonl: per step, per MoE layer
  /// loads.jsonl: per step, [(layer x M + mb) x dp + dp rank]
  std::vector<std::vector<RecordedRows>> rows_;
  std::vector<std::vector<double>> mb_ratio_;  ///< loads.jsonl: per step, [layer x M + mb]
  int rec_dp_ = 0, rec_ep_ = 0, rec_m_ = 0, rec_layers_ = 0;
};

}  // namespace moeflex::sim
