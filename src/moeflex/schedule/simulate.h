// The executor of step plans in virtual time (run_in_order): every rank runs its
// actions in order, a compute action holds its rank for the time a cost function
// gives, a Send costs nothing and never blocks, a message arrives its message time
// after its Send, a Recv waits for its message. simulate() runs it at unit costs
// (Costs) and gives the makespan, each rank's busy and idle time (its bubble), the
// peaks of micro-batches in flight, and a deadlock report when the plan cannot
// finish (validate() uses it for that). The discrete-event simulator of sim/ runs the
// same executor at the cost model's per-action times (sim::run_plan), and its own
// event loop when processes share cores.
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/schedule/plan.h"

namespace moeflex {

/// Time of each kind of action, the same on every stage.
struct Costs {
  Seconds forward = 1;           ///< F of one micro-batch through one stage
  Seconds backward_input = 1;    ///< B: input gradient (a fused Backward costs B + W)
  Seconds backward_weight = 1;   ///< W: weight gradient
  Seconds comm = 0;              ///< one message, from its Send to its arrival
  Seconds overlapped_pair = -1;  ///< an overlapped F&B pair; < 0: F and B back to back
};

/// When one action ran. A Send has start == end; a Recv starts when it is
/// reached and ends when its message is in; both halves of an overlapped pair
/// carry the pair's interval.
struct ActionTime {
  Seconds start = 0;
  Seconds end = 0;
};

/// One rank's share of the step.
struct RankStats {
  Seconds busy = 0;    ///< time spent computing
  Seconds idle = 0;    ///< makespan - busy: this rank's bubble
  Seconds finish = 0;  ///< end of its last action
  /// Most (micro-batch, stage) held at once between F and the input backward
  /// (Backward or BackwardInput): the activations a 1F1B count refers to.
  int peak_activations = 0;
  /// Most (micro-batch, stage) held at once between F and the weight gradient
  /// (Backward or W): W still reads the stage's saved inputs.
  int peak_weight_activations = 0;
};

struct SimResult {
  Seconds makespan = 0;                        ///< last action's end over all ranks
  double bubble_fraction = 0;                  ///< sum of idle / (num_ranks * makespan)
  std::vector<RankStats> ranks;                ///< per rank
  std::vector<std::vector<ActionTime>> times;  ///< per rank, per entry of plan.actions
};

/// What one compute action costs its rank in run_in_order: it holds the rank for
/// compute + comm, comm being its blocking collectives (0 at unit costs).
struct ComputeTime {
  Seconds compute = 0;
  Seconds comm = 0;
};

/// The cost model of run_in_order: the ComputeTime of compute action `a` of `rank`,
/// or, with `second` (an overlapped F&B pair's other half; null otherwise), of the
/// pair as one.
using ComputeTimeFn = std::function<ComputeTime(int rank, const Action& a, const Action* second)>;

/// run_in_order's timeline. When not `complete`, no rank could proceed: `next`
/// holds each rank's first action not run (its blocked Recv).
struct OrderedTimeline {
  Seconds makespan = 0;                        ///< last action's end over all ranks
  std::vector<Seconds> busy, comm, finish;     ///< per rank: compute time, of which collectives; its end
  std::vector<std::vector<ActionTime>> times;  ///< per rank, per entry of plan.actions
  std::vector<std::size_t> next;               ///< per rank: the first action not run
  bool complete = false;                       ///< every rank ran all its actions
};

/// Runs `plan` in virtual time under cost model `compute` (see the file comment;
/// times as ActionTime says), messages arriving message_time(send) after their Send.
/// Expects a plan that passes validate()'s static checks; throws ScheduleError for a
/// message outside its micro-batches and stages.
OrderedTimeline run_in_order(const StepPlan& plan, const ComputeTimeFn& compute,
                             const std::function<Seconds(const Action&)>& message_time);

/// Runs `plan` in virtual time at unit costs. Expects a plan that passes validate()'s static
/// checks; throws ScheduleError starting with "deadlock" when some rank waits
/// for a message that is never sent before it (naming each blocked rank).
SimResult simulate(const StepPlan& plan, const Costs& costs = {});

/// The bubble per rank (idle time) from the literature, in the per-action costs
/// of simulate(), with comm = 0:
///  gpipe, 1f1b   (p-1)(F+B+W)                            exact
///  interleaved   (p-1)(f+b+w) = (p-1)(F+B+W)/v           exact for m % p == 0
///                (f = F/v etc. are the costs of one of the v chunks)
///  zb-h1         (p-1)(F+B-W)                            exact when W <= min(F, B)
///  dualpipev     (p-1)(F&B + (B+W) - 3W)                 exact when F = B >= W and
///                (DualPipe README: (PP/2-1)(F&B+B-3W),   F&B = F+B+W (the README
///                 PP = 2p stages, B there = our B+W)     figure's proportions)
///  1f1b-overlap  as interleaved                           with pairs at F+B+W (Costs::
///                                                         overlapped_pair < 0) and comm 0;
///                                                         throws ConfigError otherwise
/// "Exact" was established by simulation over p <= 8, m in [p, 4p] (tests and
/// docs/schedules.md). Throws ConfigError for an unknown schedule.
Seconds closed_form_bubble(const std::string& schedule, int p, const Costs& costs);

/// An ASCII Gantt chart, one row per rank and one 5-character cell per `cell`
/// seconds: "F3a" etc. as in StepPlan::format_table, "." for idle.
std::string format_gantt(const StepPlan& plan, const SimResult& result, Seconds cell = 1);

}  // namespace moeflex
