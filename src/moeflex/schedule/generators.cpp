// The schedule registry behind `--schedule`, and the helpers the generators share.
#include "moeflex/schedule/generators.h"

#include <algorithm>

#include "moeflex/schedule/generator_util.h"

namespace moeflex {

namespace schedule_detail {

StepPlan empty_plan(std::string schedule, int p, int m, std::vector<int> stage_rank) {
  StepPlan plan;
  plan.schedule = std::move(schedule);
  plan.num_ranks = p;
  plan.num_microbatches = m;
  plan.num_stages = static_cast<int>(stage_rank.size());
  plan.stage_rank = std::move(stage_rank);
  plan.actions.resize(p);
  return plan;
}

void require(bool ok, const std::string& schedule, const std::string& arg, int value,
             const std::string& rule) {
  if (!ok) throw ConfigError(schedule + " schedule: " + arg + " = " + std::to_string(value) + ": " + rule);
}

void invariant(bool ok, const std::string& schedule, const std::string& what) {
  if (!ok) throw ScheduleError(schedule + " generator broke its closing invariant: " + what);
}

void emit(StepPlan& plan, int rank, ActionKind kind, int microbatch, int stage, bool overlapped_with_next) {
  Action a{kind, microbatch, stage};
  a.overlapped_with_next = overlapped_with_next;
  plan.actions[rank].push_back(a);
}

}  // namespace schedule_detail

bool schedule_takes_vpp(const std::string& name) { return name == "interleaved" || name == "1f1b-overlap"; }

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved", "1f1b-overlap", "zb-h1", "dualpipev"};
  return names;
}

void require_known_schedule(const std::string& name) {
  if (std::find(schedule_names().begin(), schedule_names().end(), name) != schedule_names().end()) return;
  std::string known;
  for (const std::string& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError("schedule: unknown name \"" + name + "\" (known: " + known + ")");
}

StepPlan make_schedule(const std::string& name, int p, int m, int v) {
  require_known_schedule(name);
  if (!schedule_takes_vpp(name))
    schedule_detail::require(v == 1, name, "vpp", v, "only the interleaved and 1f1b-overlap schedules take --vpp > 1");
  if (name == "gpipe") return gpipe(p, m);
  if (name == "1f1b") return one_f_one_b(p, m);
  if (name == "interleaved") return interleaved_1f1b(p, m, v);
  if (name == "1f1b-overlap") return combined_1f1b(p, m, v);
  if (name == "zb-h1") return zb_h1(p, m);
  if (name == "dualpipev") return dualpipev(p, m);
  throw ConfigError("schedule: \"" + name + "\" is listed in schedule_names() without a generator");
}

}  // namespace moeflex
