// The simulator's timeline (simulator.h: run_plan): ranks run their step plan's
// actions in order at each action's cost, messages arrive after their send. At full
// speed that is the schedule's own executor (schedule/simulate.h: run_in_order) with
// the cost model as its cost function; under CoreSharing a global event loop shares
// the host's cores among the processes (segment_time, nap_share). An overlapped F&B
// pair hides comm (pair_exposed_comm).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "moeflex/comm/wait_policy.h"
#include "moeflex/core/error.h"
#include "moeflex/schedule/simulate.h"
#include "moeflex/sim/simulator.h"

namespace moeflex::sim {

namespace {

// A timeline of zeros sized for every rank and action of `plan`.
PlanTimeline empty_timeline(const StepPlan& plan) {
  const std::size_t P = std::size_t(plan.num_ranks);
  PlanTimeline tl;
  tl.busy.assign(P, 0);
  tl.comm.assign(P, 0);
  tl.idle.assign(P, 0);
  tl.finish.assign(P, 0);
  tl.times.resize(P);
  for (std::size_t r = 0; r < P; ++r) tl.times[r].resize(plan.actions[r].size());
  return tl;
}

}  // namespace

Seconds segment_time(const ActionCost::Segment& g, double cores) {
  if (!(cores > 0)) throw Error(fmt::format("segment_time: {} cores (must be > 0)", cores));
  if (!std::is_sorted(g.each.begin(), g.each.end())) throw Error("segment_time: Segment::each is not sorted");
  if (g.each.empty()) return std::max(g.T, g.D / cores);
  const std::size_t n = g.each.size();
  Seconds t = 0, done = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const double rate = std::min(1.0, cores / double(n - k));
    t += (g.each[k] - done) / rate;
    done = g.each[k];
  }
  return t;
}

double nap_share(const CoreSharing& sh, Seconds waited, Seconds* piece_end) {
  // The waits at which the shortest nap starts to grow and the longest is reached.
  constexpr Seconds w0 = comm::kMinPollSleepOversubscribed * comm::kPollSleepDivisorOversubscribed;
  constexpr Seconds w1 = comm::kMaxPollSleep * comm::kPollSleepDivisorOversubscribed;
  // A nudge: a wait that ends exactly at a piece's end is in the next piece (the
  // event loop adds its own, relative to the time, as well).
  const Seconds w = std::max<Seconds>(0, waited) * (1 + 1e-12) + 1e-15;
  Seconds nap = comm::kMinPollSleepOversubscribed;
  if (w < w0) {
    *piece_end = w0;
  } else if (w >= w1) {
    nap = comm::kMaxPollSleep;
    *piece_end = std::numeric_limits<Seconds>::infinity();
  } else {
    Seconds lo = w0;
    while (2 * lo <= w) lo *= 2;
    const Seconds hi = std::min(2 * lo, w1);
    *piece_end = hi;
    nap = comm::poll_nap_seconds(std::sqrt(lo * hi), true);
  }
  return sh.nap_cost > 0 ? sh.nap_cost / (nap + sh.nap_overshoot) : 0.0;
}

Seconds pair_exposed_comm(const ActionCost& f, const ActionCost& b, bool overlap) {
  if (!overlap) return f.comm + b.comm;
  // What a half may hide is part of its comm: clamped to [0, comm].
  const Seconds fo = std::clamp<Seconds>(f.overlappable, 0, std::max<Seconds>(0, f.comm));
  const Seconds bo = std::clamp<Seconds>(b.overlappable, 0, std::max<Seconds>(0, b.comm));
  return (f.comm - fo) + (b.comm - bo) + std::max<Seconds>(0, fo - b.compute) + std::max<Seconds>(0, bo - f.compute);
}

namespace {

/// Throws the ScheduleError of a plan that cannot go on: every rank not done, at
/// the action it waits at (`pc`: each rank's next action).
[[noreturn]] void throw_deadlock(const StepPlan& plan, const std::vector<std::size_t>& pc) {
  std::string blocked;
  for (int r = 0; r < plan.num_ranks; ++r)
    if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size())
      blocked += fmt::format(" rank {} at {};", r, to_string(plan.actions[std::size_t(r)][pc[std::size_t(r)]]));
  throw ScheduleError("deadlock in the simulated plan:" + blocked);
}

/// run_plan under core sharing (see CoreSharing): a global event loop in virtual
/// time. Between two events (an action or one of a segment's processes ends, a
/// message arrives, a wait's polling ends, a nap's share changes) the set of
/// computing ranks and what they share is fixed, so each progresses at a constant rate.
struct SharedTimeline {
  /// One rank's compute action in progress, or, when not `on`, its wait for the next.
  struct Running {
    bool on = false;
    bool pair = false;       // an overlapped F&B pair: two actions end together
    std::vector<ActionCost::Segment> parts;
    std::size_t part = 0;    // the segment running
    double left = 0;         // fraction of that segment still to run (a segment of alike processes)
    // A segment of uneven processes (Segment::each) runs as processor sharing, exactly:
    // `done` is the work each still-running process has done, `ended` how many have ended.
    std::size_t ended = 0;
    Seconds done = 0;
    std::vector<Seconds> ended_at;  // when each ended process began to wait for the others
    Seconds T = 0, comm = 0, start = 0;
    Seconds waiting_since = 0;  // when not running: when its wait (polling, then sleep) began
  };

  SharedTimeline(const StepPlan& pl, const std::function<ActionCost(int, const Action&)>& c,
                 const std::function<Seconds(const Action&)>& mt, bool overlap, const CoreSharing& sharing)
      : plan(pl),
        cost(c),
        message_time(mt),
        overlap_pair_comm(overlap),
        sh(sharing),
        P(pl.num_ranks),
        p(std::max(sharing.processes_per_rank, 1)),
        tl(empty_timeline(pl)),
        arrival(std::size_t(2 * pl.num_microbatches * pl.num_stages), -1.0),
        run(std::size_t(pl.num_ranks)),
        pc(std::size_t(pl.num_ranks), 0) {}

  /// Runs the event loop to the end of the plan.
  PlanTimeline simulate() {
    while (true) {
      start_ready();
      if (all_done()) break;
      Seconds nap_event = std::numeric_limits<Seconds>::infinity();
      const double share = core_share(nap_event);
      std::vector<double> rate(std::size_t(P), 0);
      const Seconds next = next_event(share, nap_event, rate);
      if (!std::isfinite(next)) throw_deadlock(plan, pc);
      advance(next, rate);
    }
    return finish();
  }

  std::size_t key(const Action& a) const { return std::size_t(message_tag(plan, a)); }

  /// An action's segments: its own, else one of its whole time and demand.
  std::vector<ActionCost::Segment> segments_of(const ActionCost& c) const {
    if (!c.segments.empty()) return c.segments;
    return std::vector<ActionCost::Segment>{
        {c.compute + c.comm, c.demand > 0 ? c.demand : (c.compute + c.comm) * p, {}}};
  }

  bool all_done() const {
    for (int r = 0; r < P; ++r)
      if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size()) return false;
    return true;
  }

  /// Every rank not computing goes through its sends, arrived receives, and starts
  /// its next compute action (again while a send unblocks a rank before it).
  void start_ready() {
    for (bool moved = true; moved;) {
      moved = false;
      for (int r = 0; r < P; ++r) {
        auto& R = run[std::size_t(r)];
        const auto& acts = plan.actions[std::size_t(r)];
        std::size_t& i = pc[std::size_t(r)];
        while (!R.on && i < acts.size()) {
          const Action& a = acts[i];
          if (is_recv(a.kind)) {
            const Seconds at = arrival[key(a)];
            if (at < 0 || at > t) break;
            tl.times[std::size_t(r)][i++] = {t, t};  // its wait counts as idle (makespan - busy)
          } else if (is_send(a.kind)) {
            arrival[key(a)] = t + message_time(a);
            tl.times[std::size_t(r)][i++] = {t, t};
          } else {
            start_compute(r);
          }
          moved = true;
        }
      }
    }
  }

  /// Starts rank r's compute action at its pc (an overlapped pair as one).
  void start_compute(int r) {
    auto& R = run[std::size_t(r)];
    const auto& acts = plan.actions[std::size_t(r)];
    std::size_t& i = pc[std::size_t(r)];
    const Action& a = acts[i];
    ActionCost c = cost(r, a);
    R.pair = a.overlapped_with_next && i + 1 < acts.size();
    R.parts = segments_of(c);
    if (R.pair) {  // both halves' compute, their comm added or hidden as run_plan does
      const ActionCost b = cost(r, acts[i + 1]);
      const Seconds both = c.compute + c.comm + b.compute + b.comm;
      const Seconds compute = c.compute + b.compute;
      const Seconds comm = pair_exposed_comm(c, b, overlap_pair_comm);
      for (const auto& g : segments_of(b)) R.parts.push_back(g);
      const double scale = both > 0 ? (compute + comm) / both : 0;  // hidden comm shortens every segment
      for (auto& g : R.parts) {
        g.T *= scale;
        g.D *= scale;
        for (Seconds& x : g.each) x *= scale;
      }
      c.compute = compute;
      c.comm = comm;
    }
    std::erase_if(R.parts, [](const ActionCost::Segment& g) { return g.T <= 0; });
    R.T = c.compute + c.comm;
    R.comm = c.comm;
    R.start = t;
    R.part = 0;
    R.left = 1;
    R.ended = 0;
    R.ended_at.clear();
    R.done = 0;
    R.on = !R.parts.empty();
    if (!R.on) {  // nothing to run
      tl.times[std::size_t(r)][i] = {t, t};
      if (R.pair) tl.times[std::size_t(r)][++i] = {t, t};
      ++i;
    }
  }

  /// The share of a core each process that wants one gets now: a computing rank's p
  /// (in a segment of uneven work, only those not done with it), and a waiting
  /// rank's p still polling (the first poll_seconds of a wait); napping processes
  /// (past their polls) count as nap_share of one, and the next change of a nap's
  /// share (into `nap_event`) is an event. Time slicing's loss (efficiency) only
  /// while the busy ones alone outnumber the cores (nap_cost is the naps' own).
  double core_share(Seconds& nap_event) const {
    double busy = 0, want = 0;
    const bool naps_cost = sh.nap_cost > 0;
    // The wait so far, nudged by the event loop's tolerance: at a piece's end, the
    // next piece, even where t is large and t - since rounds below the end.
    const Seconds nudge = 1e-12 * std::max<Seconds>(t, 1e-9);
    auto napping = [&](Seconds since) {
      Seconds end = 0;
      const double s = nap_share(sh, t - since + nudge, &end);
      nap_event =
          std::min(nap_event, std::max(since + end, std::nextafter(t, std::numeric_limits<Seconds>::infinity())));
      return s;
    };
    for (const auto& R : run) {
      if (R.on) {
        const auto& g = R.parts[R.part];
        busy += g.each.empty() ? p : double(g.each.size() - R.ended);
        if (naps_cost)
          for (const Seconds since : R.ended_at) want += napping(since);
      } else if (t < R.waiting_since + sh.poll_seconds) {
        busy += p;
      } else if (naps_cost) {
        want += p * napping(R.waiting_since);
      }
    }
    want += busy;
    const double cores = double(sh.cores);
    return want > cores ? (busy > cores ? sh.efficiency : 1.0) * cores / want : 1.0;
  }

  /// The next event at `share` (an action ending, a message arriving for a waiting
  /// rank, a wait's polling ending, or `nap_event`); each computing rank's `rate`.
  Seconds next_event(double share, Seconds nap_event, std::vector<double>& rate) const {
    Seconds next = nap_event;
    for (int r = 0; r < P; ++r) {
      const auto& R = run[std::size_t(r)];
      if (R.on) {
        const auto& g = R.parts[R.part];
        if (g.each.empty()) {
          rate[std::size_t(r)] = 1.0 / segment_time(g, p * share);
          next = std::min(next, t + R.left / rate[std::size_t(r)]);
        } else {  // each still-running process's speed, until the next one ends
          rate[std::size_t(r)] = std::min(1.0, share);
          next = std::min(next, t + (g.each[R.ended] - R.done) / rate[std::size_t(r)]);
        }
      } else {
        if (t < R.waiting_since + sh.poll_seconds) next = std::min(next, R.waiting_since + sh.poll_seconds);
        if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size()) {
          const Action& a = plan.actions[std::size_t(r)][pc[std::size_t(r)]];
          if (is_recv(a.kind) && arrival[key(a)] > t) next = std::min(next, arrival[key(a)]);
        }
      }
    }
    return next;
  }

  /// Moves virtual time to `next`: every computing rank progresses at its rate; a
  /// segment that ends starts the next, an action that ends frees its rank.
  void advance(Seconds next, const std::vector<double>& rate) {
    const bool naps_cost = sh.nap_cost > 0;
    const Seconds dt = next - t;
    t = next;
    for (int r = 0; r < P; ++r) {
      auto& R = run[std::size_t(r)];
      if (!R.on) continue;
      const auto& g = R.parts[R.part];
      const double tol = 1e-12 * std::max<Seconds>(t, 1e-9);
      if (g.each.empty()) {
        const Seconds ends = t - dt + R.left / rate[std::size_t(r)];
        if (ends > t + tol) {  // still in this segment
          R.left -= rate[std::size_t(r)] * dt;
          continue;
        }
      } else {
        R.done += rate[std::size_t(r)] * dt;
        while (R.ended < g.each.size() && g.each[R.ended] <= R.done + tol) {
          ++R.ended;
          if (naps_cost) R.ended_at.push_back(t);
        }
        if (R.ended < g.each.size()) continue;  // some of its processes still work
      }
      if (++R.part < R.parts.size()) {  // the next segment, at its own rate from the next event on
        R.left = 1;
        R.ended = 0;
        R.ended_at.clear();
        R.done = 0;
        continue;
      }
      std::size_t& i = pc[std::size_t(r)];
      const Seconds dur = t - R.start;
      tl.times[std::size_t(r)][i] = {R.start, t};
      if (R.pair) tl.times[std::size_t(r)][++i] = {R.start, t};
      ++i;
      tl.busy[std::size_t(r)] += dur;
      tl.comm[std::size_t(r)] += R.T > 0 ? dur * R.comm / R.T : 0;
      R.on = false;
      R.waiting_since = t;  // polls if its next step cannot start now
    }
  }

  /// Each rank's finish and idle time, and the makespan.
  PlanTimeline finish() {
    for (int r = 0; r < P; ++r) {
      const auto& acts = plan.actions[std::size_t(r)];
      Seconds end = 0;
      for (std::size_t i = 0; i < acts.size(); ++i) end = std::max(end, tl.times[std::size_t(r)][i].end);
      tl.finish[std::size_t(r)] = end;
      tl.makespan = std::max(tl.makespan, end);
    }
    for (int r = 0; r < P; ++r) tl.idle[std::size_t(r)] = tl.makespan - tl.busy[std::size_t(r)];
    return std::move(tl);
  }

  const StepPlan& plan;
  const std::function<ActionCost(int, const Action&)>& cost;
  const std::function<Seconds(const Action&)>& message_time;
  bool overlap_pair_comm;
  const CoreSharing& sh;
  int P;
  double p;                     // processes behind each pipeline rank
  PlanTimeline tl;
  std::vector<Seconds> arrival;  // per message tag: when it arrives (-1: not sent yet)
  std::vector<Running> run;
  std::vector<std::size_t> pc;   // per rank: its next action
  Seconds t = 0;                 // virtual time
};

}  // namespace

PlanTimeline run_plan(const StepPlan& plan, const std::function<ActionCost(int, const Action&)>& cost,
                      const std::function<Seconds(const Action&)>& message_time, bool overlap_pair_comm,
                      const CoreSharing& sharing) {
  if (sharing.cores > 0 &&
      double(plan.num_ranks) * double(std::max(sharing.processes_per_rank, 1)) > double(sharing.cores))
    return SharedTimeline(plan, cost, message_time, overlap_pair_comm, sharing).simulate();
  // Every rank at full speed: the schedule's in-order executor at the cost model's
  // times (an overlapped pair's comm added or hidden by pair_exposed_comm).
  const ComputeTimeFn priced = [&](int r, const Action& a, const Action* second) -> ComputeTime {
    if (second) {
      const ActionCost f = cost(r, a), b = cost(r, *second);
      const Seconds compute = f.compute + b.compute;
      const Seconds comm = pair_exposed_comm(f, b, overlap_pair_comm);
      return {compute, comm};
    }
    const ActionCost c = cost(r, a);
    return {c.compute, c.comm};
  };
  const OrderedTimeline run = run_in_order(plan, priced, message_time);
  if (!run.complete) throw_deadlock(plan, run.next);
  const int P = plan.num_ranks;
  PlanTimeline tl = empty_timeline(plan);
  for (int r = 0; r < P; ++r) {
    const std::size_t k = std::size_t(r);
    for (std::size_t i = 0; i < run.times[k].size(); ++i) tl.times[k][i] = {run.times[k][i].start, run.times[k][i].end};
    tl.busy[k] = run.busy[k];
    tl.comm[k] = run.comm[k];
    tl.finish[k] = run.finish[k];
  }
  tl.makespan = run.makespan;
  for (int r = 0; r < P; ++r) tl.idle[std::size_t(r)] = tl.makespan - tl.busy[std::size_t(r)];
  return tl;
}
}  // namespace moeflex::sim
