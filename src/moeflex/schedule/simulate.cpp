// The virtual-time executor of step plans under a cost function (run_in_order), and
// the unit-cost simulation of schedules over it (see simulate.h).
#include "moeflex/schedule/simulate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <tuple>

namespace moeflex {

namespace {

using MessageKey = std::tuple<bool, int, int>;  // (is_grad, microbatch, producing stage)

MessageKey key_of(const Action& a) { return {is_grad_message(a.kind), a.microbatch, a.stage}; }

Seconds compute_cost(ActionKind kind, const Costs& c) {
  switch (kind) {
    case ActionKind::Forward: return c.forward;
    case ActionKind::Backward: return c.backward_input + c.backward_weight;
    case ActionKind::BackwardInput: return c.backward_input;
    case ActionKind::BackwardWeight: return c.backward_weight;
    default: return 0;
  }
}

// Where each message is sent: (rank, action index).
std::map<MessageKey, std::pair<int, int>> find_sends(const StepPlan& plan) {
  std::map<MessageKey, std::pair<int, int>> sends;
  for (int r = 0; r < static_cast<int>(plan.actions.size()); ++r)
    for (int i = 0; i < static_cast<int>(plan.actions[r].size()); ++i)
      if (is_send(plan.actions[r][i].kind)) sends.emplace(key_of(plan.actions[r][i]), std::make_pair(r, i));
  return sends;
}

std::string deadlock_report(const StepPlan& plan, const std::vector<size_t>& next) {
  const auto sends = find_sends(plan);
  std::ostringstream out;
  out << "deadlock: no rank can proceed;";
  for (int r = 0; r < static_cast<int>(plan.actions.size()); ++r) {
    if (next[r] >= plan.actions[r].size()) continue;
    const Action& a = plan.actions[r][next[r]];
    out << " rank " << r << " waits at action " << next[r] << " " << to_string(a);
    const auto found = sends.find(key_of(a));
    if (found == sends.end())
      out << ", which is never sent;";
    else
      out << ", which rank " << found->second.first << " sends only at its action " << found->second.second
          << ";";
  }
  std::string text = out.str();
  text.back() = '.';
  return text;
}

void count_peaks(const std::vector<Action>& actions, RankStats& stats) {
  int activations = 0, weight_activations = 0;
  for (const Action& a : actions) {
    switch (a.kind) {
      case ActionKind::Forward: ++activations, ++weight_activations; break;
      case ActionKind::Backward: --activations, --weight_activations; break;
      case ActionKind::BackwardInput: --activations; break;
      case ActionKind::BackwardWeight: --weight_activations; break;
      default: break;
    }
    stats.peak_activations = std::max(stats.peak_activations, activations);
    stats.peak_weight_activations = std::max(stats.peak_weight_activations, weight_activations);
  }
}

}  // namespace

OrderedTimeline run_in_order(const StepPlan& plan, const ComputeTimeFn& compute,
                             const std::function<Seconds(const Action&)>& message_time) {
  const int p = static_cast<int>(plan.actions.size());
  OrderedTimeline tl;
  tl.busy.assign(p, 0);
  tl.comm.assign(p, 0);
  tl.finish.assign(p, 0);
  tl.times.resize(p);
  for (int r = 0; r < p; ++r) tl.times[r].resize(plan.actions[r].size());
  tl.next.assign(p, 0);                 // per rank: index of the next action to run
  std::vector<Seconds> clock(p, 0);     // per rank: when it is free
  // Per message (message_tag): when it arrives, once its Send has run.
  const std::size_t tags = std::size_t(std::max(0, 2 * plan.num_microbatches * plan.num_stages));
  std::vector<Seconds> arrival(tags, 0);
  std::vector<char> sent(tags, 0);
  auto slot = [&](const Action& a) {
    const int tag = message_tag(plan, a);
    if (tag < 0 || std::size_t(tag) >= tags)
      throw ScheduleError("run_in_order: " + to_string(a) + " is outside the plan's micro-batches and stages");
    return std::size_t(tag);
  };

  // Each sweep runs every rank as far as it gets; a rank stops only at a Recv
  // whose Send has not run yet. Times depend only on causality, so the sweep
  // order does not change them.
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const std::vector<Action>& actions = plan.actions[r];
      std::size_t& i = tl.next[r];
      Seconds& t = clock[r];
      while (i < actions.size()) {
        const Action& a = actions[i];
        ActionTime& at = tl.times[r][i];
        if (is_recv(a.kind)) {
          const std::size_t k = slot(a);
          if (!sent[k]) break;  // blocked
          at.start = t;
          t = std::max(t, arrival[k]);
          at.end = t;
          ++i;
        } else if (is_send(a.kind)) {
          at.start = at.end = t;
          const std::size_t k = slot(a);
          arrival[k] = t + message_time(a);
          sent[k] = 1;
          ++i;
        } else {
          const bool pair = a.overlapped_with_next && i + 1 < actions.size();
          const ComputeTime c = compute(r, a, pair ? &actions[i + 1] : nullptr);
          at = {t, t + c.compute + c.comm};
          if (pair) tl.times[r][i + 1] = at;
          t += c.compute + c.comm;
          tl.busy[r] += c.compute + c.comm;
          tl.comm[r] += c.comm;
          i += pair ? 2 : 1;
        }
        progress = true;
      }
    }
  }
  tl.complete = true;
  for (int r = 0; r < p; ++r) {
    if (tl.next[r] < plan.actions[r].size()) tl.complete = false;
    tl.finish[r] = clock[r];
    tl.makespan = std::max(tl.makespan, clock[r]);
  }
  return tl;
}

SimResult simulate(const StepPlan& plan, const Costs& costs) {
  // Unit costs: each kind of action its Costs time, an overlapped pair its own or
  // both halves'.
  const ComputeTimeFn unit = [&](int, const Action& a, const Action* second) -> ComputeTime {
    if (!second) return {compute_cost(a.kind, costs), 0};
    return {costs.overlapped_pair >= 0 ? costs.overlapped_pair
                                       : compute_cost(a.kind, costs) + compute_cost(second->kind, costs),
            0};
  };
  OrderedTimeline tl = run_in_order(plan, unit, [&](const Action&) { return costs.comm; });
  if (!tl.complete) throw ScheduleError(deadlock_report(plan, tl.next));

  const int p = static_cast<int>(plan.actions.size());
  SimResult result;
  result.makespan = tl.makespan;
  result.times = std::move(tl.times);
  result.ranks.resize(p);
  for (int r = 0; r < p; ++r) {
    result.ranks[r].busy = tl.busy[r];
    result.ranks[r].finish = tl.finish[r];
    count_peaks(plan.actions[r], result.ranks[r]);
  }
  Seconds idle = 0;
  for (RankStats& s : result.ranks) {
    s.idle = result.makespan - s.busy;
    idle += s.idle;
  }
  result.bubble_fraction = result.makespan > 0 ? idle / (p * result.makespan) : 0;
  return result;
}

Seconds closed_form_bubble(const std::string& schedule, int p, const Costs& c) {
  const Seconds F = c.forward, B = c.backward_input, W = c.backward_weight;
  if (schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved") return (p - 1) * (F + B + W);
  // A pair drawn at F + B + W, with zero message latency: interleaved's bubble.
  if (schedule == "1f1b-overlap") {
    if (c.overlapped_pair >= 0 || c.comm != 0)
      throw ConfigError(
          "closed_form_bubble: 1f1b-overlap has a closed form only with pairs drawn at F + B + W and no "
          "message latency (a pair's sends wait for both halves)");
    return (p - 1) * (F + B + W);
  }
  if (schedule == "zb-h1") return (p - 1) * (F + B - W);
  if (schedule == "dualpipev") {
    const Seconds pair = c.overlapped_pair >= 0 ? c.overlapped_pair : F + B + W;
    return (p - 1) * (pair + (B + W) - 3 * W);
  }
  throw ConfigError("closed_form_bubble: no formula for schedule \"" + schedule + "\"");
}

std::string format_gantt(const StepPlan& plan, const SimResult& result, Seconds cell) {
  if (!(cell > 0)) throw ConfigError("format_gantt: cell = " + std::to_string(cell) + ": must be > 0");
  const int cells = static_cast<int>(std::ceil(result.makespan / cell - 1e-9));
  std::ostringstream out;
  for (int r = 0; r < static_cast<int>(plan.actions.size()); ++r) {
    const bool chunked = plan.stages_of(r).size() > 1;
    std::vector<std::string> row(cells, ".");
    for (size_t i = 0; i < plan.actions[r].size(); ++i) {
      const Action& a = plan.actions[r][i];
      if (!is_compute(a.kind)) continue;
      std::string label = to_string(a.kind) + std::to_string(a.microbatch);
      if (chunked) label += static_cast<char>('a' + plan.chunk_of(a.stage));
      // An overlapped pair shares one interval: its F takes the first cell,
      // its B the rest, as in the DualPipe figures.
      const ActionTime& t = result.times[r][i];
      const bool second_of_pair = i > 0 && plan.actions[r][i - 1].overlapped_with_next;
      const int first = static_cast<int>(std::floor(t.start / cell + 1e-9)) + (second_of_pair ? 1 : 0);
      const int end = a.overlapped_with_next ? first + 1 : cells;
      for (int k = first; k < std::min(end, cells) && (k + 0.5) * cell < t.end; ++k) row[k] = label;
    }
    out << "rank " << r << " |";
    for (const std::string& c : row) out << " " << std::string(c.size() < 4 ? 4 - c.size() : 0, ' ') << c;
    out << "\n";
  }
  return out.str();
}

}  // namespace moeflex
