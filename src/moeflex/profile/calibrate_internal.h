// Internal to `moeflex calibrate` (calibrate.cpp and the calibrate_*.cpp, held_out.cpp
// files it is split into): the default model's shapes, the held-out set, the budget's
// shares, a measurement (Job) and the timing harness that runs it, and the phases
// calibrate_phases runs in turn.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/profile/calibrate_shapes.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex::calibration {

// ---- the default model (configs/default.toml) ------------------------------------
constexpr std::int64_t kHidden = 256;        // hidden_size
constexpr std::int64_t kExpertFfn = 384;     // moe_intermediate_size
constexpr std::int64_t kDenseFfn = 1024;     // intermediate_size
constexpr std::int64_t kVocab = 4096;        // vocab_size
constexpr std::int64_t kExperts = 8;         // num_experts
constexpr std::int64_t kTopK = 2;            // num_experts_per_tok
constexpr std::int64_t kSeq = 128;           // seq_len
constexpr std::int64_t kHeads = 4;           // num_attention_heads
constexpr std::int64_t kHeadDim = kHidden / kHeads;
constexpr double kRopeTheta = 10000.0;
constexpr float kRmsEps = 1e-5f;
constexpr std::int64_t kMicroBatch = 8;      // micro_batch_size
constexpr std::int64_t kAttentionTableBatch = 4;  // sequences per call of the attention tables

// ---- the held-out set (validate) ---------------------------------------------------
// The shapes a training step of the default model runs (a micro-batch of 1024 tokens,
// 256 rows per expert under uniform routing, 2048 expert rows in all), and shapes
// beside them (5 and 10 sequences, attention at 80 and 160 positions, skewed expert
// rows with an idle expert). The calibration never runs any of them: its grids drop
// every GEMM shape (held_out_gemms) and op-table size (held_out_op_bytes) that a
// held-out invocation looks up.
constexpr std::int64_t kTrainTokens = kMicroBatch * kSeq;
inline const std::vector<std::int64_t> kHeldTokens = {kTrainTokens, 5 * kSeq};
constexpr std::int64_t kHeldRmsnormLarge = 30 * kSeq;
/// (n, in, out, note, with backward) of the held-out linear layers.
struct HeldLinear {
  std::int64_t n, in, out;
  const char* note;
};
inline const std::vector<HeldLinear> kHeldLinears = {
    {kTrainTokens, kHidden, kHidden, " (q/k/v/o)"}, {kTrainTokens, kHidden, kExperts, " (router)"},
    {kTrainTokens, kHidden, kVocab, " (head)"},     {5 * kSeq, kHidden, kHidden, ""},
    {10 * kSeq, kHidden, kDenseFfn, ""},             {5 * kSeq, kHidden, kVocab, " (head)"}};
/// Expert rows: uniform routing of a training micro-batch, and a skewed one of 640 tokens.
inline const std::vector<std::vector<std::int64_t>> kHeldExpertRows = {
    std::vector<std::int64_t>(std::size_t(kExperts), kTrainTokens * kTopK / kExperts),
    {412, 97, 0, 233, 61, 301, 152, 24}};
inline const std::vector<std::pair<std::int64_t, std::int64_t>> kHeldAttention = {{kMicroBatch, kSeq}, {4, 80}, {2, 160}};
inline const std::vector<std::int64_t> kHeldSwigluRows = {kTrainTokens * kTopK, 700};
/// Elementwise passes y += x (the residual adds) over [n, d].
inline const std::vector<std::int64_t> kHeldElementwiseRows = {kTrainTokens, kTrainTokens * kTopK};
inline const std::vector<Bytes> kHeldCopyBytes = {1 * kMiB, 3 * kMiB, 24 * kMiB};

// ---- budget ------------------------------------------------------------------------
constexpr double kGemmShare = 0.55;     ///< of the measurement budget
constexpr double kOpShare = 0.35;       ///< of the measurement budget
/// Of the measurement budget, on top of the others (a few seconds): the optimizer_step table.
constexpr double kOptimizerShare = 0.04;
constexpr int kMaxRepeats = 101;        ///< repeats of one measurement, at most
constexpr int kPreemptedRetries = 3;    ///< attempts at a visit the scheduler interrupts (the last one counts)
constexpr double kWallBudgetFactor = 3;  ///< wall time a phase may take, in budgets (see run_jobs)
constexpr int kMinRepeats = 5;          ///< repeats of one measurement, at least (while the budget lasts)
constexpr Seconds kTimeSharingSeconds = 1.5;       ///< each phase of measure_time_sharing, at most
constexpr double kTimeSharingBudgetShare = 0.025;  ///< and at most this share of the budget
constexpr Seconds kNapCostSeconds = 0.3;           ///< each phase of measure_nap_cost (4 phases), at most
constexpr double kTimeSharingFloor = 0.8;          ///< below: not time slicing's loss (a busy host, a CPU quota)
/// A measurement's time is this quantile of its repeats (the median; a lower
/// quartile, which shrugs off more of the load from elsewhere, was no steadier on a
/// busy 2-core machine).
constexpr double kTimeQuantile = 0.5;
/// Jobs at least this long are not run untimed before each timed run: their own
/// first touches of the activations cost under 1% of their time.
constexpr Seconds kRewarmBelow = 5e-3;
constexpr double kRecheckShare = 0.1;   ///< of a phase's budget, for measuring dips again
constexpr double kDipRatio = 0.8;       ///< a rate below this times both neighbours' is a dip
constexpr Bytes kColdRingBytes = 128 * kMiB;  ///< several times a large last-level cache

/// One measurement: a kernel call, and after run_jobs its time (the kTimeQuantile
/// of its repeats).
struct Job {
  std::function<void()> run;
  Seconds time = 0;
  /// The operands' state in the caches at the timed call (see run_jobs): true, as
  /// after the op that produced them (a kernel); false, cold (a copy of data that
  /// was produced long before, as the offload engine's).
  bool warm = true;
  /// After run_jobs: |time of the even repeats - time of the odd ones| / time, an
  /// estimate of the measurement's own noise.
  double spread = 0;
};

// ---- the timing harness (calibrate_timing.cpp) ----------------------------------------

/// Times every job in `jobs` within `budget` (see calibrate_timing.cpp): each job's
/// time is the kTimeQuantile of its repeats, each repeat from evicted caches.
void run_jobs(std::vector<Job>& jobs, Seconds budget);

/// Appends `extra` (may be null) to `jobs`, to be timed in the same rounds; returns
/// where they start, for take_extra.
inline std::size_t add_extra(std::vector<Job>& jobs, const std::vector<Job>* extra) {
  const std::size_t at = jobs.size();
  if (extra) jobs.insert(jobs.end(), extra->begin(), extra->end());
  return at;
}

/// Copies the times (and spreads) of the jobs add_extra appended at `at` back into `extra`.
inline void take_extra(const std::vector<Job>& jobs, std::size_t at, std::vector<Job>* extra) {
  if (!extra) return;
  for (std::size_t i = 0; i < extra->size(); ++i) (*extra)[i].time = jobs[at + i].time, (*extra)[i].spread = jobs[at + i].spread;
}

/// One series of measurements whose rate (work / time) should change smoothly with
/// the work: a GEMM line, an op table. (work, index of the job) pairs.
using Series = std::vector<std::pair<double, std::size_t>>;

/// run_jobs, then a second look at the isolated dips of each series (calibrate_timing.cpp).
void run_series(std::vector<Job>& jobs, const std::vector<Series>& series, Seconds budget);

/// `threads`, or every core for threads <= 0.
int resolve_threads(int threads);
/// Sets the OpenMP and BLAS thread counts and the clock jobs are timed by (a thread's
/// CPU clock with one thread, else the wall clock).
void set_threads(int threads);

// ---- the held-out set's shapes, which the grids leave out (held_out.cpp) ---------------

/// (layout, M, N, K) of a GEMM: the calibration never measures a held-out one.
using GemmKey = std::tuple<GemmLayout, std::int64_t, std::int64_t, std::int64_t>;
inline GemmKey key_of(const GemmShape& g) { return {g.layout(), g.M, g.N, g.K}; }

/// Every GEMM the held-out linear and grouped linear invocations run.
std::set<GemmKey> held_out_gemms();
/// Every (op table, bytes) point the held-out invocations of the other ops look up.
std::map<std::string, std::set<Bytes>> held_out_op_bytes();

// ---- the phases, each filling its part of the profile; `extra` (may be null): jobs
// ---- timed in the same rounds (the held-out invocations of the phase) ------------------

/// The GEMM lines (calibrate_gemm.cpp).
void measure_gemms(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra);
/// The op tables of the non-GEMM kernels (calibrate_ops.cpp).
void measure_ops(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra);
/// The elementwise table, launch overhead, bandwidth and the copy tables (calibrate_memory.cpp).
void measure_memory(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra);
/// The optimizer_step and optimizer kernel tables (calibrate_memory.cpp).
void measure_optimizer(HardwareProfile& p, bool full, Seconds budget);
/// The all-to-all link between the ranks under mpirun (calibrate_system.cpp).
std::vector<std::pair<double, Seconds>> measure_link(HardwareProfile& p);
/// The host's cores (not the ones this process is bound to), at least 1.
int host_cores();
/// This host's name ("this-machine" when it has none).
std::string host_name();

}  // namespace moeflex::calibration
