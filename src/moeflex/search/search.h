// Auto search (MXMACA's "Auto Search", BACKGROUND.md): enumerate TP x PP x VPP x
// EP x DP x micro-batch size x schedule x provisioning policy for a model on N
// GPUs, drop what does not validate or fit, score the rest with the simulator
// (sim/), and return the best.
//
// Pruning, cheapest first:
// 1. arithmetic: tp | heads and tp <= GPUs per node, pp x vpp stages of layers
//    (padded), ep | dp and ep | experts, the global batch splits into micro-batches
//    the schedule accepts (interleaved: m % pp == 0; dualpipev: m >= 2 pp);
// 2. memory lower bound: the persistent bytes of the most loaded pipeline rank
//    (weights, gradients, optimizer state) must fit;
// 3. times only (no memory walk) at the calm load give each candidate's TGS, an
//    upper bound of what it scores after its memory is known;
// 4. candidates are then walked (MemoryWalk, calm loads plus a spike on one
//    micro-batch) in descending TGS order until no remaining upper bound can
//    enter the top K (branch and bound). A static policy whose spike does not fit
//    pays the expected OOM cost; a layout whose calm load does not fit is dropped.
//    Candidates that differ only in policy and whose walked results are identical
//    (adaptive with a budget that lets it save everything is `none`) share one row.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/model/config.h"
#include "moeflex/sim/simulator.h"

namespace moeflex::search {

struct SearchOptions {
  ModelConfig model;
  sim::ClusterSpec cluster;
  int gpus = 8;
  int top = 10;
  std::string objective = "tgs";          ///< "tgs" (effective TGS, highest first) or "memory" (peak, lowest first)
  std::int64_t seq_len = 4096;
  std::int64_t global_batch = 0;  ///< sequences per iteration; 0: 2 x gpus (global_batch_or_default)
  /// The global batch the search uses: global_batch, or 2 x gpus.
  std::int64_t global_batch_or_default() const { return global_batch > 0 ? global_batch : 2 * std::int64_t(gpus); }
  std::vector<int> micro_batch_sizes = {1, 2, 4};
  std::vector<int> tps = {1, 2, 4, 8};    ///< tp sizes tried ({1} on a CPU-engine cluster: per_tensor_gradient_reduce)
  std::vector<int> vpps = {2, 4};         ///< for interleaved, and 1f1b-overlap with pp > 1
  std::vector<std::string> schedules = {"gpipe", "1f1b", "interleaved", "1f1b-overlap", "zb-h1", "dualpipev"};
  std::vector<std::string> policies = {"none", "selective", "moe-full", "full", "adaptive"};
  sim::LoadModel loads;                   ///< spike ratio and probability for the OOM risk
  Seconds restart_seconds = 284;
  int checkpoint_interval = 50;
  /// Threads for the timing pass (independent simulations); 0: every core.
  /// The token dispatcher every candidate is simulated with (SimOptions::dispatcher).
  std::string dispatcher = "alltoall";
  int threads = 0;
  /// Called with a progress line (phase, candidates done / total) at most every
  /// progress_seconds while the search runs; empty: silent.
  std::function<void(const std::string&)> progress;
  Seconds progress_seconds = 5;
};

/// One scored layout.
struct Candidate {
  sim::ParallelSpec parallel;
  std::string schedule, policy;
  int micro_batch_size = 1;
  int num_microbatches = 0;
  Seconds step_time = 0;
  double tgs = 0;            ///< at the calm load, no restarts
  double effective_tgs = 0;  ///< with the expected OOM cost of spikes
  double mfu = 0;
  double bubble = 0;
  Bytes peak_bytes = 0;      ///< calm load
  Bytes spike_peak_bytes = 0;
  double oom_probability = 0;  ///< per iteration
  Seconds recompute_time = 0;  ///< per iteration on the critical rank (walked candidates)
  bool walked = false;       ///< memory known (else only its lower bound)
  /// The policies whose candidates of this layout gave bit for bit this result (step
  /// time, recompute time, peaks, OOM risk), in the order of SearchOptions::policies,
  /// `policy` first: {"none", "adaptive"} when the budget lets adaptive save
  /// everything. The search keeps one row for them (SearchResult::merged).
  std::vector<std::string> equivalent_policies;
  /// `policy`, or the equivalent policies joined by '=' ("none=adaptive").
  std::string policy_label() const;
  nlohmann::json to_json() const;
};

struct SearchResult {
  std::vector<Candidate> top;
  std::int64_t enumerated = 0;    ///< combinations looked at
  std::int64_t invalid = 0;       ///< dropped by the layout and schedule rules
  std::int64_t no_fit = 0;        ///< dropped by memory (lower bound or walk)
  std::int64_t timed = 0;         ///< timed (at the calm load, without memory walks)
  /// Simulations of the timing pass: an adaptive candidate is timed as its none
  /// sibling (without the walk it saves everything), so the two take one.
  std::int64_t simulations = 0;
  std::int64_t walked = 0;        ///< simulated with memory walks
  /// Walked candidates whose result equals a row's under another policy (same layout,
  /// schedule and micro-batch size): listed in that row's equivalent_policies, not
  /// given a row of their own.
  std::int64_t merged = 0;
  Seconds seconds = 0;
  nlohmann::json to_json(const SearchOptions& o) const;
  std::string format(const SearchOptions& o) const;
};

/// Runs the search. Throws ConfigError when nothing fits (naming the smallest
/// persistent footprint seen against the memory).
SearchResult search(const SearchOptions& o);

}  // namespace moeflex::search
