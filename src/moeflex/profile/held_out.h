// Internal to `moeflex calibrate`: the held-out checks of the time model. The
// held-out invocations (kHeldLinears and the rest, calibrate_internal.h) run shapes
// the calibration's grids leave out; each is timed among the jobs of the phase that
// prices it, and compared with the cost model built from the finished profile.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/profile/calibrate_benches.h"
#include "moeflex/profile/calibrate_internal.h"

namespace moeflex::calibration {

/// The held-out invocations (see kHeldLinears and the rest) and the buffers they run
/// on. Each is a Job that a calibration phase times among its own jobs, so that both
/// see the same load from elsewhere on the machine, and a prediction made once the
/// profile is complete. Not movable: the jobs point into the buffers.
class HeldOut {
 public:
  struct Case {
    std::string op, shape;
    std::function<void()> run;
    std::function<Seconds(const CostModel&)> predict;
    bool warm = true;
  };
  /// The cases by calibration phase: GEMM-based ops, other kernels, memory and copies.
  std::vector<Case> gemm_cases, op_cases, memory_cases;

  HeldOut();
  HeldOut(const HeldOut&) = delete;
  HeldOut& operator=(const HeldOut&) = delete;
  ~HeldOut() { arena_.deallocate(dev_, copy_max_, MemCategory::workspace); }

  static std::vector<Job> jobs_of(const std::vector<Case>& cases) {
    std::vector<Job> jobs;
    for (const Case& c : cases) jobs.push_back({c.run, 0, c.warm});
    return jobs;
  }

 private:
  std::vector<float> x_, dy_, y_, dx_, add_y_, add_x_;
  std::vector<std::vector<std::int32_t>> offsets_;
  ColdRing ring_;
  std::unique_ptr<OpBench> bench_;
  std::unique_ptr<AttentionBench> att_;
  Arena arena_;
  Bytes copy_max_ = 0;
  void* dev_ = nullptr;
  std::vector<char> host_;
};

/// The report of `cases` timed in `jobs` (one job per case, in order), predicted by `model`.
void add_rows(CalibrationReport& report, const std::vector<HeldOut::Case>& cases, const std::vector<Job>& jobs,
              const CostModel& model);
/// The report's means over its rows.
void finish_report(CalibrationReport& report);

}  // namespace moeflex::calibration
