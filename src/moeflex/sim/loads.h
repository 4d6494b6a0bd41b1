// Expert loads for the simulator: the imbalance ratio (rows the most-loaded
// expert-parallel rank receives / the balanced share) of every (iteration,
// micro-batch, MoE layer), either sampled from a distribution or replayed from a
// `moeflex train` run's metrics.jsonl.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeflex::sim {

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
  /// Parses "calm=1.2:spike=2.6:p=0.029[:seed=S]" (any subset) over the defaults.
  /// Throws ConfigError naming the bad part.
  static LoadModel parse(const std::string& spec);

  /// True when ratios come from a recorded run.
  bool replay() const { return !trace_.empty(); }
  /// Ratio of (iteration, micro-batch, k-th MoE layer) among m micro-batches; at
  /// least 1. Replayed traces wrap around; their ratio is the same for every
  /// micro-batch of a step (metrics.jsonl sums the micro-batches).
  double ratio(int iteration, int microbatch, int num_microbatches, int moe_layer) const;
  /// The largest ratio ratio() can return.
  double max_ratio() const;
  /// Probability that an iteration's ratio exceeds r (from the distribution, or
  /// the share of replayed steps).
  double probability_above(double r) const;
  std::string describe() const;

 private:
  std::vector<std::vector<double>> trace_;  ///< per step, per MoE layer
};

}  // namespace moeflex::sim
