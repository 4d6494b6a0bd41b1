// The training run as an outline of its phases: set-up (the config, the ranks, the
// run folder, the device and the data), the training phase (a resume or a start, the
// step loop) and the summary. The phases are in run_setup.cpp, run_folder.cpp,
// resume.cpp, step_loop.cpp and run_summary.cpp (see run_state.h); this file holds
// the outline and the stop signals.
#include "moeflex/train/trainer.h"

#include <csignal>

#include "moeflex/train/run_state.h"

namespace moeflex {

namespace {

// SIGINT / SIGTERM ask the run to stop after the current step, with a checkpoint
// (a second signal ends the process at once).
volatile std::sig_atomic_t g_stop_requested = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_requested) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop_requested = 1;
}

/// Installs on_stop_signal for SIGINT and SIGTERM while the run lives; the previous
/// handlers come back however it ends.
struct StopSignals {
  using Handler = void (*)(int);
  StopSignals() : i(std::signal(SIGINT, on_stop_signal)), t(std::signal(SIGTERM, on_stop_signal)) {}
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  ~StopSignals() {
    std::signal(SIGINT, i);
    std::signal(SIGTERM, t);
  }
  Handler i, t;
};

}  // namespace

std::filesystem::path default_corpus_path() { return std::filesystem::path("data") / "brown"; }

namespace run {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool stop_requested() { return g_stop_requested != 0; }

}  // namespace run

TrainResult run_training(const TrainOptions& opts) {
  // Set-up: every check that can refuse the run comes before the run folder is taken.
  run::RunContext ctx(opts);
  run::resolve_config(ctx);
  run::join_ranks(ctx);
  if (opts.resume)
    run::find_resume_checkpoint(ctx);
  else
    run::check_new_run_folder(ctx);
  run::set_threads_and_progress(ctx);
  run::open_device(ctx);
  run::open_data(ctx);
  run::claim_run_folder(ctx);

  // Training: the model and its state live for this phase only; an error that ends it
  // is reported (summary.json, the job's end on every rank) once they are gone.
  run::RunRecord rec(ctx);
  rec.t_start = run::Clock::now();
  g_stop_requested = 0;
  const StopSignals signals;
  try {
    run::Training training(ctx, rec);
    training.start();
    training.run_steps();
  } catch (const OutOfMemoryError& oom) {
    run::report_out_of_memory(ctx, rec, oom);
  } catch (const Error& e) {
    run::report_error(ctx, rec, e);
  }

  // Summary.
  run::gather_rank_peaks(ctx, rec);
  run::write_summary(ctx, rec, run::seconds_since(rec.t_start));
  return rec.res;
}

}  // namespace moeflex
