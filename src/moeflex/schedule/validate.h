// The step-plan validator: a plan that passes can be executed by the engine
// (train/) and the simulators without losing, repeating or reordering any
// work, and without hanging.
#pragma once
#include "moeflex/schedule/plan.h"

namespace moeflex {

/// Throws ScheduleError with a message naming the rank, the action and the
/// rule, unless all of these hold:
///  - layout: stage_rank covers every stage with a rank in range, one action
///    list per rank, micro-batches and stages in range;
///  - ownership: every compute action runs on the rank that holds its stage;
///  - completeness: every (micro-batch, stage) has exactly one F and either one
///    fused Backward or one BackwardInput and one BackwardWeight;
///  - order on the owning rank: F before B (or Bi) before W;
///  - data flow: F of stage s follows F of s-1 (same rank) or a Recv of its
///    activation; B of s follows B of s+1 (same rank) or a Recv of its gradient;
///  - messages: each Send follows the action that produced its tensor, goes to
///    the rank of the consuming stage (never to itself: a same-rank hand-off is
///    local), and matches exactly one Recv there, and vice versa;
///  - FIFO: between two ranks, each direction's messages are received in the
///    order they are sent (so matching by order and by tag agree);
///  - overlapped pairs: a flagged Forward is followed by a Backward or
///    BackwardInput;
///  - no deadlock: executed with non-blocking Sends and blocking Recvs (see
///    plan.h), every rank reaches the end of its list (checked by simulate()).
void validate(const StepPlan& plan);

}  // namespace moeflex
