// `moeflex calibrate`: measuring the HardwareProfile and validating the cost model.
// This file runs the phases in turn (calibrate_phases), reports the held-out checks
// and writes the profile; the phases are calibrate_{gemm,ops,memory,system}.cpp, their
// timing harness calibrate_timing.cpp, the held-out checks held_out.cpp.
//
// Phases and their shares of the budget:
//   memory      the rest      y += x over sizes from L1-resident to past the last-level
//                             cache (the elementwise table; launch overhead, bandwidth)
//                             and memcpy between an arena block and a host buffer
//                             (copy tables), both with sqrt(2)..2x steps
//   GEMMs       kGemmShare    every linear layer's three GEMMs (y = x w^T nt, dx = dy w
//                             nn, dw += dy^T x tn) along the token count, for every
//                             weight shape of the default model and two larger ones,
//                             plus the per-head GEMMs of attention with their strides
//   op tables   kOpShare      rmsnorm, swiglu, router, (un)permute, cross entropy over
//                             token counts; rope's tables and rotation; attention,
//                             forward and backward, on one sequence over lengths
//   optimizer   kOptimizerShare  (on top) the trainer's per-step parameter work
//                             (zero_grads, norm, clip, AdamW) over parameter counts
//   link        (on top, under mpirun only, about 0.1 s) all-to-all between the
//                             ranks over sizes: latency and bandwidth (measure_link)
// Within a phase every measurement runs once (warm-up, and an estimate of its time),
// then the remaining share is split equally between the measurements, each repeated
// [kMinRepeats, kMaxRepeats] times in interleaved rounds, each timed run from evicted
// caches (see run_jobs); its time is the median of those repeats. Isolated dips in a
// GEMM line or an op table are measured once more (run_series).
//
// The held-out invocations (kHeldLinears and the rest) are timed in the rounds of the
// phase that prices them (calibrate_and_validate), so that a burst of load from
// elsewhere touches both alike; the grids leave out every shape and size they use.
#include "moeflex/profile/calibrate.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moeflex/comm/wait_policy.h"
#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/ops/blas.h"
#include "moeflex/profile/held_out.h"

namespace moeflex {

using namespace calibration;  // the phases and their harness (calibrate_internal.h, held_out.h)

namespace {

std::string format_seconds(Seconds s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

/// The calibration's phases, each timing `held`'s cases of its phase among its own
/// jobs when `held` is given (their medians land in the three job lists).
HardwareProfile calibrate_phases(int threads, Seconds budget, HeldOut* held, std::vector<Job>* gemm_jobs,
                                 std::vector<Job>* op_jobs, std::vector<Job>* memory_jobs, bool progress) {
  threads = resolve_threads(threads);
  set_threads(threads);
  const bool full = budget >= kFullGridMinBudget;
  HardwareProfile p;
  p.name = fmt::format("{} cpu ({} threads)", host_name(), threads);
  p.blas_core = ops::blas_core_name();
  p.threads = threads;
  const auto t0 = Clock::now();
  const auto note = [&](const char* what) {
    if (!progress) return;
    fmt::print("  [{:5.1f} s] {}\n", since(t0), what);
    std::fflush(stdout);
  };
  if (held) *gemm_jobs = HeldOut::jobs_of(held->gemm_cases), *op_jobs = HeldOut::jobs_of(held->op_cases),
            *memory_jobs = HeldOut::jobs_of(held->memory_cases);
  // The link first, while the ranks of an mpirun calibration start together.
  note("link between ranks ...");
  if (const auto pts = measure_link(p); progress && !pts.empty()) {  // the medians beside the fit through them
    std::string line = "    all-to-all, bytes to each peer: median (fit)";
    for (const auto& [b, t] : pts)
      line += fmt::format("; {}: {:.0f} us ({:.0f})", format_bytes(Bytes(b)), 1e6 * t,
                          1e6 * (p.all_to_all_latency + b / p.all_to_all_bandwidth));
    fmt::print("{}\n", line);
  }
  if (threads == 1) {  // what the single-threaded ranks of an oversubscribed run get of the cores
    note("cores shared by twice as many threads ...");
    p.time_sharing_efficiency = measure_time_sharing(std::min(kTimeSharingSeconds, kTimeSharingBudgetShare * budget));
    note("what a napping rank costs a computing one ...");
    const NapCost nap = measure_nap_cost(std::min(kNapCostSeconds, kTimeSharingBudgetShare * budget));
    p.nap_cost = nap.cost;
    p.nap_overshoot = nap.overshoot;
  }
  // Memory first: the op tables' stage 1 reads the bandwidth.
  note("memory bandwidth and copies ...");
  measure_memory(p, full, (1.0 - kGemmShare - kOpShare) * budget, held ? memory_jobs : nullptr);
  note("GEMMs ...");
  measure_gemms(p, full, kGemmShare * budget, held ? gemm_jobs : nullptr);
  note("op tables ...");
  measure_ops(p, full, kOpShare * budget, held ? op_jobs : nullptr);
  note("optimizer step ...");
  measure_optimizer(p, full, kOptimizerShare * budget);
  note("done");
  return p;
}

}  // namespace

void write_profile(const HardwareProfile& profile, const std::filesystem::path& path) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  write_file_atomically(path, profile.to_json().dump(2) + "\n");  // an old profile survives a failed write
}

void check_profile_out(const std::filesystem::path& out) {
  namespace fs = std::filesystem;
  check_config(!fs::is_directory(out),
               fmt::format("--out '{}' is a directory; give the profile's file name, e.g. {}/this-machine.json",
                           out.string(), out.string()));
  check_writable_dir(out.has_parent_path() ? out.parent_path() : fs::path("."), "--out", out.string());
}

HardwareProfile calibrate(int threads, Seconds budget) {
  return calibrate_phases(threads, budget, nullptr, nullptr, nullptr, nullptr, false);
}

CalibrationResult calibrate_and_validate(int threads, Seconds budget, bool progress) {
  HeldOut held;
  std::vector<Job> gemm_jobs, op_jobs, memory_jobs;
  CalibrationResult r;
  r.profile = calibrate_phases(threads, budget, &held, &gemm_jobs, &op_jobs, &memory_jobs, progress);
  const CostModel model(r.profile);
  add_rows(r.report, held.gemm_cases, gemm_jobs, model);
  add_rows(r.report, held.op_cases, op_jobs, model);
  add_rows(r.report, held.memory_cases, memory_jobs, model);
  finish_report(r.report);
  return r;
}

int run_calibrate_command(const std::string& out_path, int threads, double budget_seconds, bool report_and_write) {
  check_config(budget_seconds > 0 && budget_seconds <= 3600,
               fmt::format("--seconds must be in (0, 3600] (got {})", budget_seconds));
  check_config(threads >= 0, fmt::format("--threads must be >= 0, 0 meaning every core (got {})", threads));
  threads = resolve_threads(threads);
  // A peer under mpirun measures alongside rank 0 (so that the profile sees the
  // cores' shared memory bandwidth as training ranks do) and reports nothing.
  if (!report_and_write) {
    (void)calibrate_and_validate(threads, budget_seconds, false);
    return 0;
  }
  check_profile_out(out_path);
  fmt::print("moeflex calibrate: {} threads, budget {:.0f} s ({} grid), timed by the {} clock\n", threads,
             budget_seconds, budget_seconds >= kFullGridMinBudget ? "full" : "coarse",
             threads == 1 ? "thread's CPU" : "wall");
  // Other work on the cores makes every multi-threaded kernel wait for descheduled
  // threads: the profile then describes a busy machine. The load average is the
  // host's, so it is set against the host's cores, not the ones this rank is bound to
  // (one under `mpirun -np 2`).
  const int cores = host_cores();
  if (const double load = load_average(); load > kBusyLoadPerCore * cores)
    fmt::print(
        "warning: the machine is busy (load average {:.1f} on {} cores): timings will be noisy{}; calibrate "
        "on an idle machine for a faithful profile\n",
        load, cores, threads == 1 ? "" : " and the profile pessimistic");
  std::fflush(stdout);
  const auto t0 = Clock::now();
  const CalibrationResult result = calibrate_and_validate(threads, budget_seconds, true);
  const HardwareProfile& profile = result.profile;
  const CalibrationReport& report = result.report;
  fmt::print("measured {} GEMM shapes, {} op tables, memory {:.1f} GB/s, copies {:.1f}/{:.1f} GB/s (h2d/d2h) in {:.1f} s\n",
             profile.gemm.size(), profile.op_tables.size(), profile.memory_bandwidth / 1e9, profile.h2d_bandwidth / 1e9,
             profile.d2h_bandwidth / 1e9, since(t0));
  if (profile.all_to_all_bandwidth > 0)
    fmt::print("link between the ranks (all-to-all): latency {:.1f} us, bandwidth {:.2f} GB/s\n",
               1e6 * profile.all_to_all_latency, profile.all_to_all_bandwidth / 1e9);
  fmt::print("cores shared by twice as many threads: {:.1f}% of the ideal split\n",
             100 * profile.time_sharing_efficiency);
  if (profile.nap_cost > 0)
    fmt::print(
        "a waiting rank's naps on a shared core ({:.0f} us asked, {:.0f} us taken): each costs the rank computing "
        "there {:.1f} us\n",
        1e6 * comm::kMinPollSleepOversubscribed, 1e6 * (comm::kMinPollSleepOversubscribed + profile.nap_overshoot),
        1e6 * profile.nap_cost);
  if (profile.op_tables.count(op_names::kOptimizerStep))
    for (const OpSample& s : profile.op_tables.at(op_names::kOptimizerStep))
      fmt::print("optimizer step (zero_grads, norm, clip, AdamW) of {:.1f} M parameters: {:.2f} ms\n",
                 double(s.bytes) / 4e6, 1e3 * s.seconds);
  fmt::print("\nheld-out op invocations (cost model vs this machine; never measured by the calibration):\n");
  fmt::print("{:<24} {:<44} {:>12} {:>12} {:>8}\n", "op", "shape", "measured", "predicted", "error");
  std::map<std::string, std::pair<double, int>> by_op;  // op -> (sum of errors, count)
  for (const CalibrationRow& r : report.rows) {
    fmt::print("{:<24} {:<44} {:>12} {:>12} {:>7.1f}%\n", r.op, r.shape, format_seconds(r.measured),
               format_seconds(r.predicted), 100.0 * r.relative_error());
    auto& [sum, count] = by_op[r.op];
    sum += r.relative_error(), ++count;
  }
  fmt::print("\nmean error by op:");
  int col = 0;
  for (const auto& [op, e] : by_op)
    fmt::print("{}{:<24} {:5.1f}%", col++ % 3 == 0 ? "\n  " : "   ", op, 100.0 * e.first / e.second);
  fmt::print("\nmean absolute relative error: {:.2f}% over {} invocations\n", 100.0 * report.mean_abs_relative_error,
             report.rows.size());
  if (report.mean_spread > 0)
    fmt::print("measurement noise: the even and odd repeats of a held-out invocation differ by {:.2f}% on average\n",
               100.0 * report.mean_spread);
  else  // every held-out invocation ran once: nothing to compare
    fmt::print("measurement noise: unknown (too few repeats to compare; raise --seconds)\n");
  write_profile(profile, out_path);
  fmt::print("wrote {} ({:.1f} s in all)\n", out_path, since(t0));
  return 0;
}

}  // namespace moeflex
