// `moeflex calibrate`: measures this machine's HardwareProfile by timing the real
// moeflex kernels (ops::gemm, rmsnorm, rope, attention, swiglu, router, permute,
// cross entropy) and memcpy at shapes of the default model (configs/default.toml)
// and larger ones, then checks the cost model built from it against a held-out set
// of op invocations whose shapes the calibration never ran.
//
// Every time is the median of repeated runs after one warm-up run; the repeats of
// each measurement are sized so that the whole calibration fits the time budget.
// Weights come cold from a large ring and activations warm, as in a training step.
// Other processes on the cores show up as noise (multi-threaded kernels then wait
// for descheduled threads): calibrate on an idle machine.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex {

/// The default time budget of a calibration (measurement and validation together).
inline constexpr Seconds kDefaultCalibrationBudget = 20.0;
/// Below this budget the calibration uses a coarse grid (fewer and smaller shapes).
inline constexpr Seconds kFullGridMinBudget = 10.0;
/// The profile `moeflex calibrate` writes without --out.
inline constexpr const char* kDefaultHardwareProfilePath = "data/hardware/this-machine.json";

/// Measures this machine with `threads` OpenMP/BLAS threads (<= 0: all cores) in
/// about `budget` seconds. Sets the process's OpenMP and BLAS thread counts.
HardwareProfile calibrate(int threads, Seconds budget = kDefaultCalibrationBudget);

/// Writes `profile` as JSON to `path` (creating its folder); DataError on failure.
void write_profile(const HardwareProfile& profile, const std::filesystem::path& path);

/// One held-out op invocation: what the cost model predicted and what it took.
struct CalibrationRow {
  std::string op;       ///< e.g. "linear_forward"
  std::string shape;    ///< e.g. "n=768 in=256 out=4096"
  Seconds measured = 0;   ///< median wall time on this machine
  Seconds predicted = 0;  ///< the cost model's time
  /// |predicted - measured| / measured.
  double relative_error() const;
};

/// The cost model's accuracy on held-out invocations.
struct CalibrationReport {
  std::vector<CalibrationRow> rows;
  double mean_abs_relative_error = 0;  ///< mean of rows[i].relative_error()
};

/// Times a held-out set of op invocations (shapes outside the calibration grid,
/// including skewed expert token counts) with `threads` threads (<= 0: all cores)
/// in about `budget` seconds, and compares them with `profile`'s cost model.
CalibrationReport validate(const HardwareProfile& profile, int threads, Seconds budget = 4.0);

/// `moeflex calibrate [--out FILE] [--threads N] [--seconds S]`: calibrates within
/// `budget_seconds` (measurement and validation), prints the validation table (op,
/// shape, measured, predicted, error) and the mean error, writes the profile to
/// `out_path` and returns 0. Throws moeflex::Error on failure.
/// With report_and_write false (a peer rank under mpirun) it only measures, so that
/// rank 0's profile sees the cores shared as several training ranks share them.
int run_calibrate_command(const std::string& out_path = kDefaultHardwareProfilePath, int threads = 0,
                          double budget_seconds = kDefaultCalibrationBudget, bool report_and_write = true);

}  // namespace moeflex
