// Slow-rank detection: which rank, in which phase of the step, is slower than it
// should be, and by how much (MXMACA's slow-node detection, level 0; Megatron's
// straggler detector and nvidia-resiliency-ext's section scores do the like).
//
// Every rank measures its step phase by phase (core/phase_clock.h); every
// `every` steps the ranks exchange those times in one small all-gather and each
// rank scores them alike (rank 0 reports). A rank's own time in a phase is:
// - compute phases: the time charged to it (waiting in a collective never is);
// - the routed experts: scaled to the mean load of its peers (seconds x mean rows
//   / its rows), so that a rank that received more tokens is not called slow;
// - communication phases: what the fastest rank spent in those calls (the
//   transfer itself) plus the rank's own part (PhaseTimes::comm_own): the time a
//   rank spent waiting for a late peer is that peer's lateness, never its own.
// Its factor compares that time with the median of its peers' (the ranks of its
// pipeline stage, which do the same work), or, for a rank without peers, with the
// median of its own first `baseline` steps. A (rank, phase) whose factor, as a
// median over the last `window` steps, stays at or above `threshold` for
// `persist` steps, while what it adds to the step (its time less the reference, a
// median over the window too) is at least `min_impact` of the step, is reported once, naming its host, the phase, the factor and the
// first step it was slow; it is reported again only after it has recovered.
// Phases shorter than `min_share` of the step or `min_seconds` are not scored
// (their relative noise is larger than any slowdown worth naming).
#pragma once
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/comm/communicator.h"
#include "moeflex/core/phase_clock.h"

namespace moeflex::train {

/// The detector's settings (train.slow_rank_* in the run config).
struct SlowRankOptions {
  double threshold = 1.2;     ///< the factor that counts as slow
  int window = 5;             ///< steps in the median of a factor
  int persist = 3;            ///< steps the median stays at or above the threshold before a report
  int baseline = 10;          ///< steps of a rank's own history that a rank without peers is compared with
  int warmup = 2;             ///< first steps of a launch not scored (allocation, caches)
  double min_share = 0.02;    ///< phases below this share of the step are not scored
  double min_seconds = 2e-4;  ///< nor below this many seconds
  double min_impact = 0.02;   ///< a slowdown adding less than this share to the step is not reported
};

/// One rank's measurements of one step.
struct RankStep {
  PhaseTimes times;
  double expert_rows = 0;  ///< rows the rank's routed experts received in the step
};

/// A slow rank, as reported.
struct SlowRankReport {
  int rank = 0;
  std::string host;
  StepPhase phase = StepPhase::forward;
  double factor = 1.0;           ///< its time / its peers' (or its own baseline), median over the window
  std::int64_t first_step = 0;   ///< the first step of the window that was slow
  std::int64_t report_step = 0;  ///< the step the report was made at
  bool vs_peers = true;          ///< compared with its peers (else with its own first steps)
  nlohmann::json to_json() const;
  static SlowRankReport from_json(const nlohmann::json& j);
};

/// Scores the ranks' steps (see the file comment). `peer_group[r]`: the group of
/// world rank r (ranks of one group do the same work: its pipeline stage);
/// `hosts[r]`: its host name. Throws Error if their sizes differ.
class SlowRankDetector {
 public:
  SlowRankDetector(SlowRankOptions opts, std::vector<int> peer_group, std::vector<std::string> hosts);

  /// Adds step `step` (1-based) of every rank (`ranks[r]`); returns the reports it
  /// made. Throws Error if ranks.size() differs from the rank count.
  std::vector<SlowRankReport> observe(std::int64_t step, const std::vector<RankStep>& ranks);
  /// Each rank's own seconds per phase in the step last observed (what was scored).
  const std::vector<PhaseTimes>& last_own() const { return own_; }
  /// The (rank, phase) pairs slow now, with their current factors.
  std::vector<SlowRankReport> active() const;
  /// Every report made so far, in order.
  const std::vector<SlowRankReport>& reports() const { return reports_; }

 private:
  struct Track {
    struct Score {
      std::int64_t step;
      double factor, excess;  // excess: (time - reference) / the step's time
    };
    std::deque<Score> scores;  // the last `window`
    std::vector<double> history;                          // own seconds, for the baseline
    int above = 0;       // steps the windowed median has stayed at or above the threshold
    bool reported = false;
    double current = 1.0;  // the windowed median
    bool vs_peers = true;  // the factors compare with peers (else with the baseline)
  };
  std::vector<PhaseTimes> own_times(const std::vector<RankStep>& ranks) const;
  /// (factor, excess) of rank r in phase p; NaN factor: not scored.
  std::pair<double, double> factor_of(int r, StepPhase p, const std::vector<PhaseTimes>& own, Track& tr) const;
  void update(std::int64_t step, int r, StepPhase p, std::pair<double, double> score,
              std::vector<SlowRankReport>& made);

  SlowRankOptions opts_;
  std::vector<int> group_;
  std::vector<std::string> hosts_;
  std::map<std::pair<int, int>, Track> tracks_;  // (rank, phase)
  std::vector<PhaseTimes> own_;
  std::vector<SlowRankReport> reports_;
  int observed_ = 0;
};

/// An injected slowdown (train.inject_slowdown) and the world rank it slows (-1: none).
struct InjectedSlowdown {
  int rank = -1;
  Slowdown slowdown;
};
/// Parses "rank=R:phase=P:factor=F[:from=S]" (P a StepPhase name other than
/// "other", F >= 1, S >= 1); empty or "none": no slowdown. Throws ConfigError
/// naming the bad part.
InjectedSlowdown parse_slowdown(const std::string& text);

/// The trainer's side of the detection: this rank's steps buffered, exchanged with
/// every rank's every `every` steps (one all-gather over `world`), scored alike on
/// every rank; rank 0 appends each step's times to `phases_path` (phases.jsonl;
/// empty path: none). Collective: the constructor (which gathers the host names)
/// and every add() are called by every rank at the same steps.
class SlowRankMonitor {
 public:
  SlowRankMonitor(comm::Communicator& world, SlowRankOptions opts, int every, std::vector<int> peer_group,
                  std::filesystem::path phases_path);
  /// Adds this rank's step `step` (1-based); exchanges and scores when `every`
  /// steps are buffered or `flush`. Returns the new reports (the same on every rank).
  std::vector<SlowRankReport> add(std::int64_t step, const RankStep& mine, bool flush);
  /// Exchanges and scores the steps buffered so far (a run that stops early).
  std::vector<SlowRankReport> flush();
  const SlowRankDetector& detector() const { return detector_; }

 private:
  void write_phases(std::int64_t step, const std::vector<RankStep>& ranks);
  comm::Communicator& world_;
  int every_;
  SlowRankDetector detector_;
  std::filesystem::path phases_path_;
  std::vector<std::pair<std::int64_t, RankStep>> pending_;
};

/// The host names of every rank of `world` (collective).
std::vector<std::string> gather_host_names(comm::Communicator& world);

/// The median of `v` (0 when empty).
double median_of(std::vector<double> v);

}  // namespace moeflex::train
