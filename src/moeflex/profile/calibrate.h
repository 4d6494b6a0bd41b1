// `moeflex calibrate`: measures this machine's HardwareProfile by timing the real
// moeflex kernels (ops::gemm, rmsnorm, rope, attention, swiglu, router, permute,
// cross entropy) and memcpy at shapes of the default model (configs/default.toml)
// and larger ones, then checks the cost model built from it against a held-out set
// of op invocations whose shapes the calibration never ran.
//
// Every time is the median of repeated runs after one warm-up run; the repeats of
// each measurement are sized so that the whole calibration fits the time budget.
// Every timed run starts from evicted caches followed by one untimed run of the same
// call: activations warm as after the op that produced them, weights cold (a large
// ring), as in a training step; copies are timed cold. With one thread, a run is
// timed by the thread's CPU clock, which leaves out the time the scheduler gave other
// processes (see calibrate_timing.cpp); with several, by the wall clock, and other
// processes on the cores show up as noise: calibrate on an idle machine.
// The time budget is counted on the same clock (with one thread, CPU time: a busy
// machine makes the calibration take longer rather than measure less, up to three
// times the budget in wall time).
// The held-out invocations are timed among the calibration's own jobs, so that both
// see the same machine, but nothing of theirs goes into the profile.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex {

/// The default time budget of a calibration (measurement and validation together).
inline constexpr Seconds kDefaultCalibrationBudget = 60.0;
/// Below this budget the calibration uses a coarse grid (fewer and smaller shapes).
inline constexpr Seconds kFullGridMinBudget = 10.0;
/// The profile `moeflex calibrate` writes without --out.
inline constexpr const char* kDefaultHardwareProfilePath = "data/hardware/this-machine.json";

/// Measures this machine with `threads` OpenMP/BLAS threads (<= 0: all cores) in
/// about `budget` seconds. Sets the process's OpenMP and BLAS thread counts.
HardwareProfile calibrate(int threads, Seconds budget = kDefaultCalibrationBudget);

/// The profile's time_sharing_efficiency: with as many ranks as the host has cores
/// (`mpirun -np 2` here, which binds a rank to each core), every rank runs a
/// single-threaded loop of mixed work (three GEMMs of an MoE layer's sizes and a
/// streaming add; calibrate_system.cpp, work_loop) for `seconds` as launched, then, free of
/// the binding, on two threads for `seconds` more: twice as many threads as cores.
/// Returns the second phase's rounds over the first's, at most 1. Returns 1 (not
/// measured) for any other rank count, on any failure, and below 0.8, which is
/// another load or a CPU quota rather than time slicing (a warning says so). Sets
/// one OpenMP and BLAS thread meanwhile and restores the counts and the binding. On
/// this 2-core VM, 2026-11-30: 95.5-99.4%.
double measure_time_sharing(Seconds seconds);

/// What a rank napping through a wait costs a rank computing on its core (the
/// profile's nap_cost and nap_overshoot).
struct NapCost {
  Seconds cost = 0;       ///< core-seconds the computing rank loses per nap
  Seconds overshoot = 0;  ///< wall time a nap lasts beyond the one asked for
};

/// Measures NapCost on this process's core: single-threaded GEMMs of an expert's
/// shape (256 x 384 x 256) run for `seconds` alone, then for `seconds` beside a
/// thread bound to the same core that naps as a waiting rank of an oversubscribed
/// node does (comm/wait_policy.h, kMinPollSleepOversubscribed), twice. cost = the
/// work lost (1 - with / alone) x seconds / naps. Every rank measures on its own
/// core at once (its bound core, or the (rank mod n)-th of the n it may use) and the
/// ranks' means are returned. Returns {0, 0} (not measured) with more ranks than
/// cores on any rank's host, or when the threads cannot be bound to one core.
/// Sets one OpenMP and BLAS thread meanwhile and restores the counts and binding.
NapCost measure_nap_cost(Seconds seconds);

/// The 1-minute load average from /proc/loadavg, or -1 where there is none.
double load_average();
/// Load average per core above which calibrate and train warn that multi-threaded
/// kernels will wait for threads other processes have descheduled.
inline constexpr double kBusyLoadPerCore = 0.5;

/// Writes `profile` as JSON to `path` (creating its folder) atomically: an old
/// profile there survives a failed write. DataError on failure.
void write_profile(const HardwareProfile& profile, const std::filesystem::path& path);

/// Refuses (ConfigError) an --out a profile could not be written to, before any
/// measuring: not a directory, and its folder exists (or can be created) and takes a file.
void check_profile_out(const std::filesystem::path& out);

/// One held-out op invocation: what the cost model predicted and what it took.
struct CalibrationRow {
  std::string op;       ///< e.g. "linear_forward"
  std::string shape;    ///< e.g. "n=768 in=256 out=4096"
  Seconds measured = 0;   ///< its time on this machine (the median of its repeats, see calibrate_timing.cpp)
  Seconds predicted = 0;  ///< the cost model's time
  /// |time of the even repeats - time of the odd ones| / measured: the measurement's own noise.
  double spread = 0;
  /// |predicted - measured| / measured.
  double relative_error() const;
};

/// The cost model's accuracy on held-out invocations.
struct CalibrationReport {
  std::vector<CalibrationRow> rows;
  double mean_abs_relative_error = 0;  ///< mean of rows[i].relative_error()
  double mean_spread = 0;              ///< mean of rows[i].spread
};

/// Times the held-out set of op invocations (the default model's training shapes
/// and shapes beside them, including skewed expert token counts; none of them a
/// point the calibration measures) with `threads` threads (<= 0: all cores) in
/// about `budget` seconds, and compares them with `profile`'s cost model.
CalibrationReport validate(const HardwareProfile& profile, int threads, Seconds budget = 4.0);

/// A profile and its held-out report from one run.
struct CalibrationResult {
  HardwareProfile profile;
  CalibrationReport report;
};

/// calibrate() with the held-out invocations of validate() timed in the same rounds
/// as the calibration's own jobs (each beside the jobs of its phase), in about
/// `budget` seconds; with `progress`, prints a line per phase.
CalibrationResult calibrate_and_validate(int threads, Seconds budget = kDefaultCalibrationBudget,
                                         bool progress = false);

/// `moeflex calibrate [--out FILE] [--threads N] [--seconds S]`: calibrates within
/// `budget_seconds` (measurement and validation), prints the validation table (op,
/// shape, measured, predicted, error) and the mean error, writes the profile to
/// `out_path` and returns 0. Throws moeflex::Error on failure.
/// With report_and_write false (a peer rank under mpirun) it only measures, so that
/// rank 0's profile sees the cores shared as several training ranks share them.
int run_calibrate_command(const std::string& out_path = kDefaultHardwareProfilePath, int threads = 0,
                          double budget_seconds = kDefaultCalibrationBudget, bool report_and_write = true);

// The kinds in_situ_profile takes (kInSituExactKinds, kInSituScaledKinds) are
// declared in provision/cost_model.h, beside the profile that holds them.

/// `base` plus the ops of real training steps: reads `run_dir`/op_times.json (a run
/// trained with --profile-ops) and sets base.in_situ_* (replacing any there):
///   - each kind of kInSituExactKinds at each shape the run executed: the median
///     of its measured times;
///   - each kind of kInSituScaledKinds per weight [in, out]: sum of measured times /
///     sum of `base`'s predictions for the same row splits (the ratio carries over to
///     other routings, whose exact shapes a run rarely repeats).
/// A base that holds in-situ entries already (an earlier --from-run) keeps those this
/// run has no entry for, and the ratios are taken against its tables alone.
/// Every entry of a taken kind is checked: integer extents (exact kinds: as many as
/// in_situ_shape_rank, each >= 0; grouped: rows >= 0, in and out >= 1), a count >= 1,
/// times finite in (0, kInSituMaxSeconds] (grouped totals: per call), no exact
/// (kind, shape) listed twice, grouped ratios in [kInSituMinScale, kInSituMaxScale].
/// Exact entries with a zero extent (calls that ran no kernel, priced 0 by the cost
/// model) are left out and counted in `*zero_sized` when given.
/// Throws DataError naming the file, and the entry's index, kind and field.
HardwareProfile in_situ_profile(HardwareProfile base, const std::filesystem::path& run_dir,
                                std::size_t* zero_sized = nullptr);

/// `moeflex calibrate --from-run RUN [--base FILE] [--out FILE]`: in_situ_profile
/// of the profile at `base_path`, written to `out_path` (atomically); prints what it
/// took. Returns 0. Throws ConfigError for an empty path, or an `out_path` that is
/// the base's file (compared as files, not as strings): the base is never replaced.
int run_in_situ_calibrate_command(const std::string& run_dir, const std::string& base_path,
                                  const std::string& out_path);

}  // namespace moeflex
