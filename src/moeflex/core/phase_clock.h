// Where a rank's step time goes, phase by phase: the level-0 measurements of
// slow-rank detection (train/slow_rank.h). The compute thread's PhaseClock charges
// the time between two events to the phase that was current: the data loading, the
// forward and backward actions (train/pipeline.cpp), the routed experts' FFN inside
// them (model/moe_block.cpp), the optimizer (train/step_loop.cpp) and, nested in any
// of those, each communication call by kind (comm/timed_communicator.h). Compute
// phases therefore never include time spent waiting in a collective. An event is
// one clock read (CLOCK_MONOTONIC, or the thread CPU clock), a few per layer and
// action, never per op.
//
// On a node whose ranks' compute threads fill or exceed its cores the ranks' wall
// times measure the scheduler's time slices among them (and the launcher and the
// system), not the ranks: the clock then reads the thread's CPU time instead
// (set_cpu_time; the trainer decides), and an injected delay counts as the CPU time
// it stands for.
//
// For tests and demonstrations a Slowdown makes one phase F times slower on this
// rank: each stretch charged to it is followed by a delay of (F - 1) times its
// length, charged to it too (for a communication phase, to the rank's own part of
// the call, PhaseTimes::comm_own, as a slow sender would add).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moeflex {

/// A part of a training step on one rank.
enum class StepPhase : std::uint8_t {
  data,        ///< sampling and copying a micro-batch's tokens
  forward,     ///< forward actions, outside the routed experts and communication
  backward,    ///< backward actions (B, W, recomputes), outside the experts and communication
  experts,     ///< the routed experts' FFN, forward and backward
  optimizer,   ///< gradient clipping and the AdamW update
  all_to_all,  ///< the MoE dispatch and combine (all-to-all and all-to-all-v)
  all_reduce,  ///< reductions, gathers, broadcasts and barriers
  send_recv,   ///< point-to-point messages (pipeline hand-offs)
  other,       ///< the rest of the step (statistics, checkpoints)
};
inline constexpr int kStepPhases = 9;

/// The phase's name as it appears in flags and reports ("forward", "all_to_all").
const char* to_string(StepPhase p);
/// The phase named `name`, or nullopt.
std::optional<StepPhase> parse_step_phase(std::string_view name);
/// Whether `p` is a communication phase.
constexpr bool is_comm(StepPhase p) {
  return p == StepPhase::all_to_all || p == StepPhase::all_reduce || p == StepPhase::send_recv;
}

/// One step's seconds on one rank, by phase.
struct PhaseTimes {
  /// Seconds charged to each phase; for a communication phase, the time inside its
  /// calls (the peers' lateness included) and, added to it, comm_own.
  std::array<double, kStepPhases> seconds{};
  /// Communication phases: the part of `seconds` that was this rank's own doing
  /// before or after the transfer (an injected slow sender's delay); 0 otherwise.
  std::array<double, kStepPhases> comm_own{};
  double& operator[](StepPhase p) { return seconds[std::size_t(p)]; }
  double operator[](StepPhase p) const { return seconds[std::size_t(p)]; }
  /// The step's seconds: the sum over the phases.
  double total() const;
};

/// One communication call, as recorded at slow-rank level 2 (PhaseClock::calls).
struct CallRecord {
  StepPhase kind = StepPhase::all_to_all;
  const char* op = "";      ///< the Communicator method ("all_to_all_v", "all_reduce_sum", "recv", ...)
  std::string group;        ///< the communicator's name ("world", "ep", "dp", "pp", ...)
  std::int64_t bytes = 0;   ///< bytes this rank sent (a receive: received)
  int peer = -1;            ///< point to point: the peer's rank in the group; -1: every rank
  double seconds = 0;       ///< in the call, as the clock reads it
};

/// An injected slowdown of one phase (--inject-slowdown): factor >= 1 from step
/// `from_step` (1-based) on.
struct Slowdown {
  StepPhase phase = StepPhase::forward;
  double factor = 1.0;
  std::int64_t from_step = 1;
};

/// The compute thread's clock of the step under way (see the file comment).
class PhaseClock {
 public:

  /// Starts step `step` (1-based): zeroes the times and makes `other` current.
  void begin_step(std::int64_t step);
  /// Charges the time since the last event to the current phase and makes `p`
  /// current; returns the phase that was current.
  StepPhase enter(StepPhase p);
  /// The step's times so far (charges the running stretch first).
  const PhaseTimes& times();
  StepPhase current() const { return current_; }
  /// Makes this rank's `s.phase` slower (factor <= 1: none).
  void set_slowdown(const Slowdown& s) { slowdown_ = s; }
  /// Reads the thread's CPU time instead of the wall clock (an oversubscribed node).
  void set_cpu_time(bool on);
  bool cpu_time() const { return cpu_time_; }
  /// Records every communication call of the step (slow-rank level 2; off by default).
  void set_call_log(bool on) { call_log_ = on; }
  bool call_log() const { return call_log_; }
  /// The step's calls so far (with set_call_log).
  std::vector<CallRecord>& calls() { return calls_; }
  /// The clock's reading now, in seconds (wall or CPU time).
  double now() const;

 private:
  void charge(double now);
  PhaseTimes times_;
  StepPhase current_ = StepPhase::other;
  bool cpu_time_ = false;
  bool call_log_ = false;
  std::vector<CallRecord> calls_;
  double last_ = now();
  std::int64_t step_ = 0;
  Slowdown slowdown_{StepPhase::other, 1.0, 1};
};

/// This thread's clock (the compute thread's is the one the trainer reads).
PhaseClock& phase_clock();

/// Makes `p` the current phase for a scope and restores the previous one after.
class PhaseScope {
 public:
  explicit PhaseScope(StepPhase p) : prev_(phase_clock().enter(p)) {}
  ~PhaseScope() { phase_clock().enter(prev_); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  StepPhase prev_;
};

/// Waits `seconds` (sleeping for most of a long wait, spinning for the rest, so that
/// short delays are kept to about a microsecond).
void delay_for(double seconds);

}  // namespace moeflex
