// Helpers shared by the schedule generators (not part of the module's API).
#pragma once
#include <string>
#include <vector>

#include "moeflex/schedule/plan.h"

namespace moeflex::schedule_detail {

/// A plan with its layout and an empty action list per rank.
StepPlan empty_plan(std::string schedule, int p, int m, std::vector<int> stage_rank);

/// Throws ConfigError("<schedule>: <arg> = <value>: <rule>") unless `ok`.
void require(bool ok, const std::string& schedule, const std::string& arg, int value,
             const std::string& rule);

/// A generator's closing invariant: throws ScheduleError naming the generator
/// and what broke (a bug in the generator, never the caller's fault).
void invariant(bool ok, const std::string& schedule, const std::string& what);

/// Appends a compute action to `plan.actions[rank]`.
void emit(StepPlan& plan, int rank, ActionKind kind, int microbatch, int stage,
          bool overlapped_with_next = false);

}  // namespace moeflex::schedule_detail
