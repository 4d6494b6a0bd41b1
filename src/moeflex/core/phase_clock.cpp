// The compute thread's phase clock (phase_clock.h).
#include "moeflex/core/phase_clock.h"

#include <time.h>

#include <thread>

namespace moeflex {

namespace {
constexpr const char* kPhaseNames[kStepPhases] = {"data",       "forward",    "backward",  "experts", "optimizer",
                                                  "all_to_all", "all_reduce", "send_recv", "other"};
}  // namespace

const char* to_string(StepPhase p) { return kPhaseNames[std::size_t(p)]; }

std::optional<StepPhase> parse_step_phase(std::string_view name) {
  for (int i = 0; i < kStepPhases; ++i)
    if (name == kPhaseNames[i]) return StepPhase(i);
  return std::nullopt;
}

double PhaseTimes::total() const {
  double s = 0;
  for (double x : seconds) s += x;
  return s;
}

double PhaseClock::now() const {
  timespec ts{};
  clock_gettime(cpu_time_ ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void PhaseClock::set_cpu_time(bool on) {
  cpu_time_ = on;
  last_ = now();
}

void PhaseClock::begin_step(std::int64_t step) {
  times_ = PhaseTimes{};
  calls_.clear();
  current_ = StepPhase::other;
  last_ = now();
  step_ = step;
}

StepPhase PhaseClock::enter(StepPhase p) {
  charge(now());
  const StepPhase prev = current_;
  current_ = p;
  return prev;
}

const PhaseTimes& PhaseClock::times() {
  charge(now());
  return times_;
}

void PhaseClock::charge(double t) {
  const double dt = t - last_;
  const std::size_t i = std::size_t(current_);
  times_.seconds[i] += dt;
  last_ = t;
  if (current_ != slowdown_.phase || slowdown_.factor <= 1.0 || step_ < slowdown_.from_step || dt <= 0) return;
  // The delay sleeps (peers wait for it as for a slower rank, and ranks sharing the
  // cores are not slowed by it); in CPU time it counts as the time it stands for.
  const double extra = (slowdown_.factor - 1.0) * dt;
  delay_for(extra);
  last_ = now();
  const double waited = cpu_time_ ? extra : last_ - t;
  times_.seconds[i] += waited;
  if (is_comm(current_)) times_.comm_own[i] += waited;
}

PhaseClock& phase_clock() {
  thread_local PhaseClock clock;
  return clock;
}

void delay_for(double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  // Sleep all but the last 200 us (the kernel's wake-up slack), then spin.
  if (seconds > 400e-6) std::this_thread::sleep_until(end - std::chrono::microseconds(200));
  while (Clock::now() < end) {
  }
}

}  // namespace moeflex
