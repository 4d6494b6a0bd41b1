// The discrete-event simulator (see simulator.h).
#include "moeflex/sim/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "moeflex/comm/layout.h"
#include "moeflex/comm/wait_policy.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/policies.h"
#include "moeflex/schedule/generators.h"

namespace moeflex::sim {

namespace {

using nlohmann::json;

/// Bytes of one tensor of `numel` elements at `bytes_per_element` (fractional for
/// sharded optimizer state), rounded as the arena rounds every allocation.
Bytes tensor_bytes(double numel, double bytes_per_element) {
  return Arena::round_up(Bytes(std::ceil(numel * bytes_per_element)));
}

/// A global stage's model content.
struct StageInfo {
  int first_layer = 0, last_layer = 0;  ///< real layers [first, last) (padding dropped)
  bool embedding = false, head = false;
};

/// What recomputes under a provisioning level or static policy.
bool recomputes(const std::string& policy, const ActivationSpec& a, double ratio) {
  if (!a.recomputable || policy == "none") return false;
  if (const double r = threshold_ratio(policy); r > 0) return ratio > r && static_policy_recomputes("moe-full", a.name);
  return static_policy_recomputes(policy, a.name);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Options

ParallelSpec ParallelSpec::parse(const std::string& s) {
  ParallelSpec p;
  std::stringstream ss(s);
  std::string part;
  std::set<std::string> seen;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    const auto eq = part.find('=');
    int v = 0;
    try {
      if (eq == std::string::npos) throw std::invalid_argument("no =");
      std::size_t used = 0;
      const std::string num = part.substr(eq + 1);
      v = std::stoi(num, &used);
      if (used != num.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("--parallel '{}': expected key=integer in '{}'", s, part));
    }
    const std::string k = part.substr(0, eq);
    if (!seen.insert(k).second) throw ConfigError(fmt::format("--parallel '{}': {} is given twice", s, k));
    if (v < 1) throw ConfigError(fmt::format("--parallel '{}': {} must be at least 1 (got {})", s, k, v));
    if (k == "tp") p.tp = v;
    else if (k == "pp") p.pp = v;
    else if (k == "vpp") p.vpp = v;
    else if (k == "ep") p.ep = v;
    else if (k == "dp") p.dp = v;
    else
      throw ConfigError(
          fmt::format("--parallel '{}': unknown key '{}' (tp, pp, vpp, ep, dp; expert tensor parallelism "
                      "is 1 and there is no context parallelism)",
                      s, k));
  }
  // tp x pp x dp devices (ep divides the tp x dp ranks of a stage): refuse what overflows.
  const double world = double(p.tp) * double(p.pp) * double(p.dp);
  if (world > double(kMaxSimulatedDevices))
    throw ConfigError(fmt::format("--parallel '{}': tp x pp x dp = {:.0f} devices, more than the {} this simulator takes",
                                  s, world, kMaxSimulatedDevices));
  return p;
}

std::vector<int> parse_trace_ranks(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) {
    if (x.empty()) continue;
    std::size_t used = 0;
    int r = -1;
    try {
      r = std::stoi(x, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != x.size() || r < 0)
      throw ConfigError(fmt::format("--trace-ranks '{}': '{}' is not a pipeline rank (a non-negative integer, as in "
                                    "--trace-ranks 0,3)", s, x));
    if (std::find(v.begin(), v.end(), r) == v.end()) v.push_back(r);  // a rank named twice is traced once
  }
  return v;
}

std::string ParallelSpec::str() const { return fmt::format("tp={},pp={},vpp={},ep={},dp={}", tp, pp, vpp, ep, dp); }

const std::vector<std::string>& adaptive_levels() {
  static const std::vector<std::string> v = {"none", "moe-light", "moe-medium", "moe-full", "full"};
  return v;
}

int SimOptions::num_microbatches() const {
  const std::int64_t per = std::int64_t(parallel.dp) * micro_batch_size;
  // A per-rank replay defaults to the recorded run's micro-batches per step (its grad_accum).
  const std::int64_t dflt = loads.per_rank() ? per * loads.recorded_microbatches() : per * 4 * parallel.pp;
  const std::int64_t g = global_batch > 0 ? global_batch : dflt;
  if (g % per != 0)
    throw ConfigError(fmt::format("global batch {} sequences is not a multiple of dp {} x micro-batch size {}", g,
                                  parallel.dp, micro_batch_size));
  if (g / per > kMaxMicrobatches)
    throw ConfigError(
        fmt::format("global batch {} sequences makes {} micro-batches per iteration (dp {} x micro-batch "
                    "size {} a micro-batch), more than the {} simulated: use a smaller --global-batch or "
                    "a larger --micro-batch-size",
                    g, g / per, parallel.dp, micro_batch_size, kMaxMicrobatches));
  return int(g / per);
}

// ---------------------------------------------------------------------------------------------
// Plan executor

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

/// run_plan under core sharing (see CoreSharing): a global event loop in virtual
/// time. Between two events (an action or one of a segment's processes ends, a
/// message arrives, a wait's polling ends, a nap's share changes) the set of
/// computing ranks and what they share is fixed, so each progresses at a constant rate.
PlanTimeline run_plan_shared(const StepPlan& plan, const std::function<ActionCost(int, const Action&)>& cost,
                             const std::function<Seconds(const Action&)>& message_time, bool overlap_pair_comm,
                             const CoreSharing& sh) {
  const int P = plan.num_ranks;
  const double p = std::max(sh.processes_per_rank, 1);
  PlanTimeline tl = empty_timeline(plan);
  std::vector<Seconds> arrival(std::size_t(2 * plan.num_microbatches * plan.num_stages), -1.0);
  auto key = [&](const Action& a) { return std::size_t(message_tag(plan, a)); };
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
  auto segments_of = [&](const ActionCost& c) {
    if (!c.segments.empty()) return c.segments;
    return std::vector<ActionCost::Segment>{
        {c.compute + c.comm, c.demand > 0 ? c.demand : (c.compute + c.comm) * p, {}}};
  };
  std::vector<Running> run(static_cast<std::size_t>(P));
  std::vector<std::size_t> pc(std::size_t(P), 0);
  Seconds t = 0;
  auto all_done = [&] {
    for (int r = 0; r < P; ++r)
      if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size()) return false;
    return true;
  };
  while (true) {
    // Every rank not computing goes through its sends, arrived receives, and starts
    // its next compute action (again while a send unblocks a rank before it).
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
          moved = true;
        }
      }
    }
    if (all_done()) break;
    // Processes that want a core: a computing rank's p (in a segment of uneven work,
    // only those not done with it), and a waiting rank's p still polling (the first
    // poll_seconds of a wait); napping processes (past their polls) count as
    // nap_share of one, and the next change of a nap's share is an event. Each gets
    // `share` of a core; time slicing's loss (efficiency) only while the busy ones
    // alone outnumber the cores (nap_cost is the naps' own).
    double busy = 0, want = 0;
    Seconds nap_event = std::numeric_limits<Seconds>::infinity();
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
    const double share = want > cores ? (busy > cores ? sh.efficiency : 1.0) * cores / want : 1.0;
    // The next event: an action ending, a message arriving for a waiting rank, or a nap's share changing.
    Seconds next = nap_event;
    std::vector<double> rate(std::size_t(P), 0);
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
    if (!std::isfinite(next)) {
      std::string blocked;
      for (int r = 0; r < P; ++r)
        if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size())
          blocked += fmt::format(" rank {} at {};", r, to_string(plan.actions[std::size_t(r)][pc[std::size_t(r)]]));
      throw ScheduleError("deadlock in the simulated plan:" + blocked);
    }
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
  for (int r = 0; r < P; ++r) {
    const auto& acts = plan.actions[std::size_t(r)];
    Seconds end = 0;
    for (std::size_t i = 0; i < acts.size(); ++i) end = std::max(end, tl.times[std::size_t(r)][i].end);
    tl.finish[std::size_t(r)] = end;
    tl.makespan = std::max(tl.makespan, end);
  }
  for (int r = 0; r < P; ++r) tl.idle[std::size_t(r)] = tl.makespan - tl.busy[std::size_t(r)];
  return tl;
}

}  // namespace

PlanTimeline run_plan(const StepPlan& plan, const std::function<ActionCost(int, const Action&)>& cost,
                      const std::function<Seconds(const Action&)>& message_time, bool overlap_pair_comm,
                      const CoreSharing& sharing) {
  if (sharing.cores > 0 &&
      double(plan.num_ranks) * double(std::max(sharing.processes_per_rank, 1)) > double(sharing.cores))
    return run_plan_shared(plan, cost, message_time, overlap_pair_comm, sharing);
  const int P = plan.num_ranks;
  PlanTimeline tl = empty_timeline(plan);
  std::vector<Seconds> arrival(std::size_t(2 * plan.num_microbatches * plan.num_stages), -1.0);
  auto key = [&](const Action& a) { return std::size_t(message_tag(plan, a)); };
  std::vector<std::size_t> pc(std::size_t(P), 0);
  std::vector<Seconds> clock(std::size_t(P), 0);
  bool progress = true;
  std::size_t done = 0, total = 0;
  for (const auto& v : plan.actions) total += v.size();
  while (done < total) {
    if (!progress) {
      std::string blocked;
      for (int r = 0; r < P; ++r)
        if (pc[std::size_t(r)] < plan.actions[std::size_t(r)].size())
          blocked += fmt::format(" rank {} at {};", r, to_string(plan.actions[std::size_t(r)][pc[std::size_t(r)]]));
      throw ScheduleError("deadlock in the simulated plan:" + blocked);
    }
    progress = false;
    for (int r = 0; r < P; ++r) {
      const auto& acts = plan.actions[std::size_t(r)];
      std::size_t& i = pc[std::size_t(r)];
      Seconds& t = clock[std::size_t(r)];
      while (i < acts.size()) {
        const Action& a = acts[i];
        if (is_recv(a.kind)) {
          const Seconds at = arrival[key(a)];
          if (at < 0) break;
          tl.times[std::size_t(r)][i] = {t, std::max(t, at)};
          tl.idle[std::size_t(r)] += std::max<Seconds>(0, at - t);
          t = std::max(t, at);
        } else if (is_send(a.kind)) {
          arrival[key(a)] = t + message_time(a);
          tl.times[std::size_t(r)][i] = {t, t};
        } else if (a.overlapped_with_next && i + 1 < acts.size()) {
          const ActionCost f = cost(r, a), b = cost(r, acts[i + 1]);
          const Seconds compute = f.compute + b.compute;
          const Seconds comm = pair_exposed_comm(f, b, overlap_pair_comm);
          tl.times[std::size_t(r)][i] = tl.times[std::size_t(r)][i + 1] = {t, t + compute + comm};
          tl.busy[std::size_t(r)] += compute + comm;
          tl.comm[std::size_t(r)] += comm;
          t += compute + comm;
          ++i;
          ++done;
        } else {
          const ActionCost c = cost(r, a);
          tl.times[std::size_t(r)][i] = {t, t + c.compute + c.comm};
          tl.busy[std::size_t(r)] += c.compute + c.comm;
          tl.comm[std::size_t(r)] += c.comm;
          t += c.compute + c.comm;
        }
        ++i;
        ++done;
        progress = true;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    tl.finish[std::size_t(r)] = clock[std::size_t(r)];
    tl.makespan = std::max(tl.makespan, clock[std::size_t(r)]);
  }
  for (int r = 0; r < P; ++r) tl.idle[std::size_t(r)] = tl.makespan - tl.busy[std::size_t(r)];
  return tl;
}

// ---------------------------------------------------------------------------------------------
// Memory

namespace {

/// Ranks that hold the same routed experts and so reduce their gradients together
/// (and shard their optimizer state): the routed experts are whole on each of the tp
/// ranks of a replica, which run their own n / tp tokens through them (expert tensor
/// parallelism 1, as Megatron-Core's MoE parallel folding allows), times the dp / ep
/// replicas of an expert shard: tp x dp / ep.
int expert_data_parallel(const ParallelSpec& par) { return par.tp * par.dp / par.ep; }

}  // namespace

GroupPlacement expert_parallel_placement(const ParallelSpec& par, int gpus_per_node) {
  return place_group(par.ep, 1, gpus_per_node);
}

GroupPlacement expert_data_parallel_placement(const ParallelSpec& par, int gpus_per_node) {
  return place_group(expert_data_parallel(par), par.ep, gpus_per_node);
}

namespace {

/// Calls add(numel, expert) for every parameter tensor one rank holds of layers
/// `ranges` and the ends, in model.cpp's order (one all-reduce each in the engine's
/// reduce_gradients; expert: routed-expert weights, reduced over
/// expert_data_parallel()).
void for_each_param_tensor(const ModelConfig& cfg, const ParallelSpec& par, const std::vector<std::pair<int, int>>& ranges,
                           bool embedding, bool head, const std::function<void(double, bool)>& add) {
  const double d = double(cfg.hidden_size), tp = par.tp;
  const double El = double(cfg.num_experts) / par.ep, f = double(cfg.moe_intermediate_size);
  const double fs = double(cfg.shared_width()), I = double(cfg.intermediate_size), V = double(cfg.vocab_size);
  // q and o: H heads split over tp; k and v: the kv heads split over tp (at least one a rank).
  const double q_width = double(cfg.q_width()) / tp;
  const double kv_width = double(cfg.kv_heads_per_rank(par.tp) * cfg.head_dim());
  for (auto [first, last] : ranges) {
    for (int l = first; l < last; ++l) {
      add(d, false);
      if (cfg.mla()) {  // MLA's down projections and latent norms whole on every tp rank, the rest split
        const double ql = double(cfg.q_lora_rank), kl = double(cfg.kv_lora_rank), H = cfg.num_attention_heads;
        const double qk = double(cfg.qk_head_dim()), vd = double(cfg.v_head_dim), rp = double(cfg.qk_rope_head_dim);
        if (ql > 0) {
          add(d * ql, false);
          add(ql, false);
          add(ql * H * qk / tp, false);
        } else {
          add(d * H * qk / tp, false);
        }
        add(d * (kl + rp), false);
        add(kl, false);
        add(kl * H * (double(cfg.qk_nope_head_dim) + vd) / tp, false);
        add(H * vd * d / tp, false);  // o
      } else {
        add(d * q_width, false);   // q
        add(d * kv_width, false);  // k
        add(d * kv_width, false);  // v
        add(d * q_width, false);   // o
      }
      add(d, false);
      if (cfg.is_moe_layer(l)) {
        add(double(cfg.num_experts) * d, false);
        for (int i = 0; i < 3; ++i) add(El * f * d, true);
        if (fs > 0)
          for (int i = 0; i < 3; ++i) add(fs * d / tp, false);
      } else {
        for (int i = 0; i < 3; ++i) add(I * d / tp, false);
      }
    }
  }
  if (embedding) add(V * d / tp, false);
  if (head) {
    add(d, false);
    if (!cfg.tie_word_embeddings || !embedding) add(V * d / tp, false);
  }
}

}  // namespace

Bytes persistent_bytes(const ModelConfig& cfg, const ClusterSpec& cl, const ParallelSpec& par,
                       const std::vector<std::pair<int, int>>& ranges, bool embedding, bool head) {
  const double pb = cl.param_bytes / 2, ob = cl.optimizer_bytes / 2;  // two tensors each (w+g, m+v)
  const double dense_shard = cl.optimizer_sharded ? par.dp : 1;
  const double expert_shard = cl.optimizer_sharded ? expert_data_parallel(par) : 1;
  // A bf16 model on a cluster of 4-byte elements is the engine's --bf16 on it: the
  // fp32 state plus each tensor's bf16 working copy (a 2-byte cluster's param_bytes
  // and optimizer_bytes already describe mixed precision).
  const bool working_copy = cfg.bf16 && cl.element_bytes == 4;
  Bytes total = 0;
  for_each_param_tensor(cfg, par, ranges, embedding, head, [&](double numel, bool expert) {
    total += 2 * tensor_bytes(numel, pb) + 2 * tensor_bytes(numel / (expert ? expert_shard : dense_shard), ob);
    if (working_copy) total += tensor_bytes(numel, 2);
  });
  return total;
}

Seconds ordered_sum_time(const CostModel& cost, int n, Bytes bytes) {
  if (n <= 1 || bytes <= 0) return 0;
  // The rank's block (bytes / n): copied out (read + write), then n - 1 blocks added
  // to it (read both, write): (2 + 3 (n - 1)) / n bytes per byte reduced.
  return cost.elementwise(Bytes(std::llround(double(bytes) * (3.0 * n - 1.0) / n)));
}

Seconds optimizer_step_time(const CostModel& cost, double params, double sharded_params) {
  const auto& tables = cost.profile().op_tables;
  if (tables.count(kOptimizerStepOp)) return cost.op(kOptimizerStepOp, Bytes(std::llround(4 * params)));
  return cost.elementwise(Bytes(std::llround(16 * params))) + cost.elementwise(Bytes(std::llround(28 * sharded_params)));
}

// ---------------------------------------------------------------------------------------------
// The simulation

namespace {

struct Simulation {
  const SimOptions& o;
  ModelConfig cfg;
  std::shared_ptr<SimCache> cache;
  const CostModel& cost;
  StepPlan memory_plan;  // the plan the memory walks replay (fewer micro-batches when that keeps the peak)
  StepPlan plan;
  int m = 0, P = 0;
  std::int64_t n_rank = 0;  // tokens per micro-batch on one rank (n / tp)
  std::vector<StageInfo> stages;
  std::vector<int> moe_index;  // layer -> index among MoE layers, -1 for dense
  bool split = false;
  Bytes limit = 0;
  LayerCost head, embed;
  std::vector<LayerCost> stage_copies;  // per global stage: its boundary copies (stage_copy_cost)
  GroupPlacement ep_group, tp_group;    // the layers' collectives (setup)

  explicit Simulation(const SimOptions& opt)
      : o(opt),
        cfg(opt.model),
        cache(opt.cache ? opt.cache : std::make_shared<SimCache>(opt.cluster.profile)),
        cost(cache->cost) {
    // A bf16 model (a --bf16 run's config), or a cluster of bf16 elements, runs the
    // bf16 engine: the memory walk replays its program (2-byte activations, fp32 rstd
    // and router tensors) exactly, and the all-to-alls carry 2-byte rows.
    cfg.bf16 = opt.model.bf16 || opt.cluster.element_bytes == 2;
    elem = cfg.bf16 ? 2 : opt.cluster.element_bytes;
  }
  Bytes elem = 4;  // bytes of an activation element, in memory and on the wire

  MoERows rows_at(double ratio) const {
    MoERows r = MoERows::balanced(cfg, n_rank);
    if (o.parallel.ep > 1) {
      const MoERows cap = MoERows::worst_case(cfg, n_rank, o.parallel.ep);
      // Capped before rounding: a huge ratio would overflow llround.
      r.received = std::llround(std::min(double(cap.received), ratio * double(r.received)));
    }
    return r;
  }

  const LayerCost& layer_at(int l, double ratio) {
    const bool moe = cfg.is_moe_layer(l);
    const MoERows rows = moe ? rows_at(ratio) : MoERows{};
    auto k = std::make_tuple(o.parallel.tp, o.micro_batch_size, o.seq_len, o.parallel.ep, split, moe, rows.received,
                             o.breakdown);
    {
      std::lock_guard lk(cache->mu);
      auto it = cache->layers.find(k);
      if (it != cache->layers.end()) return it->second;  // map nodes stay put: the reference outlives the lock
    }
    LayerWork w{o.micro_batch_size, o.seq_len, rows, o.parallel.ep, o.parallel.tp, split, elem};
    w.breakdown = o.breakdown;
    LayerCost lc = layer_cost(cost, cfg, l, w);
    std::lock_guard lk(cache->mu);
    return cache->layers.emplace(k, std::move(lc)).first->second;
  }

  /// The expert all-to-alls of one layer (dispatch and combine), forward or backward.
  Seconds layer_a2a(const LayerCost& lc) const {
    if (lc.a2a_send_bytes <= 0 && lc.a2a_recv_bytes <= 0) return 0;
    return 2 * (o.dispatcher == "deepep"
                    ? dedup_all_to_all_time(o.cluster, ep_group, lc.a2a_send_bytes, lc.a2a_recv_bytes, cfg.num_experts,
                                            cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
                    : all_to_all_time(o.cluster, ep_group, lc.a2a_send_bytes, lc.a2a_recv_bytes));
  }

  /// Blocking collectives of one layer, forward or backward: its all-to-alls and the
  /// tensor-parallel all-gathers / reduce-scatters.
  Seconds layer_comm(const LayerCost& lc) const {
    Seconds t = layer_a2a(lc);
    if (lc.tp_collective_bytes > 0) t += 4 * all_gather_time(o.cluster, tp_group, lc.tp_collective_bytes);
    return t;
  }

  void setup() {
    const ParallelSpec& p = o.parallel;
    cfg.validate();
    m = o.num_microbatches();
    P = p.pp;
    if (p.tp > 1) {
      if (cfg.num_attention_heads % p.tp != 0)
        throw ConfigError(fmt::format("tp {} does not divide num_attention_heads {}", p.tp, cfg.num_attention_heads));
      // Megatron-Core splits the key/value heads (query groups) over tp as it does the heads.
      if (cfg.kv_heads() % p.tp != 0)
        throw ConfigError(
            fmt::format("tp {} does not divide num_key_value_heads {} (Megatron-Core splits the query "
                        "groups over tp)",
                        p.tp, cfg.kv_heads()));
      if (p.tp > o.cluster.gpus_per_node)
        throw ConfigError(fmt::format("tp {} spans nodes of {} GPUs", p.tp, o.cluster.gpus_per_node));
      if ((o.micro_batch_size * o.seq_len) % p.tp != 0)
        throw ConfigError(fmt::format("tp {} does not divide the micro-batch's {} tokens", p.tp,
                                      o.micro_batch_size * o.seq_len));
    }
    if (o.dispatcher != "alltoall" && o.dispatcher != "deepep")
      throw ConfigError(fmt::format("--dispatcher '{}': alltoall or deepep", o.dispatcher));
    const bool dualv = o.schedule == "dualpipev";
    require_known_schedule(o.schedule);
    if (!schedule_takes_vpp(o.schedule) && p.vpp != 1)
      throw ConfigError(
          fmt::format("vpp {} needs --schedule interleaved or 1f1b-overlap (dualpipev holds 2 chunks by "
                      "itself)",
                      p.vpp));
    const int v = dualv ? 2 : p.vpp;
    // The layout's own checks on the expert layers' view of a stage (MoE parallel
    // folding, expert tensor parallelism 1): its tp x dp ranks are ep x expert_dp, so
    // ep divides tp x dp and the experts; the layers fit the stages.
    if ((p.tp * p.dp) % p.ep != 0)
      throw ConfigError(
          fmt::format("ep {} does not divide tp {} x dp {} = {}: the expert layers' ep x expert_dp ranks "
                      "are the tp x dp ranks of a stage (MoE parallel folding, expert tensor parallelism 1)",
                      p.ep, p.tp, p.dp, p.tp * p.dp));
    // Uneven stages are padded (Megatron-Core's account_for_embedding/loss), but a
    // stage without any layer is no layout anyone runs (search drops them too).
    if (std::int64_t(p.pp) * v > cfg.num_hidden_layers)
      throw ConfigError(
          fmt::format("pp {} x {} stage{} a rank = {} stages for {} layers: a stage would hold no layer; "
                      "lower pp or vpp",
                      p.pp, v, v == 1 ? "" : "s", std::int64_t(p.pp) * v, cfg.num_hidden_layers));
    comm::LayoutSpec ls;
    ls.world_size = p.pp * p.tp * p.dp;
    ls.pp = p.pp;
    ls.dp = p.tp * p.dp;
    ls.ep = p.ep;
    ls.vpp = v;
    ls.num_layers = int(cfg.num_hidden_layers);
    ls.num_experts = int(cfg.num_experts);
    ls.pad_layers = true;
    const comm::ParallelLayout layout(ls);
    ep_group = expert_parallel_placement(p, o.cluster.gpus_per_node);
    tp_group = place_group(p.tp, 1, o.cluster.gpus_per_node);
    plan = make_schedule(o.schedule, p.pp, m, dualv ? 1 : p.vpp);
    // Memory walks replay a shorter step when the schedule's steady phase repeats:
    // every schedule but GPipe holds at most ~2 pp x chunks micro-batches at once, so
    // a step of mw >= that many reaches the same peak (test_sim checks it).
    int mw = m;
    if (o.schedule != "gpipe") {
      mw = std::min(m, 2 * p.pp * v + 2);
      if (schedule_takes_vpp(o.schedule)) mw = std::min(m, (mw + p.pp - 1) / p.pp * p.pp);
    }
    if (o.loads.per_rank()) {
      // A per-rank replay walks every recorded micro-batch in its own place.
      int moe_layers = 0;
      for (int l = 0; l < cfg.num_hidden_layers; ++l) moe_layers += cfg.is_moe_layer(l) ? 1 : 0;
      const LoadModel& L = o.loads;
      if (L.recorded_dp() != p.dp || L.recorded_ep() != p.ep || L.recorded_microbatches() != m ||
          L.recorded_moe_layers() != moe_layers)
        throw ConfigError(fmt::format(
            "--loads: the recorded run has dp {}, ep {}, {} micro-batches and {} MoE layers; this simulation has dp "
            "{}, ep {}, {} micro-batches (global batch {} / (dp {} x micro-batch size {})) and {} MoE layers "
            "(per-rank replay needs the run's own layout; without --global-batch it takes the run's micro-batches)",
            L.recorded_dp(), L.recorded_ep(), L.recorded_microbatches(), L.recorded_moe_layers(), p.dp, p.ep, m,
            std::int64_t(m) * p.dp * o.micro_batch_size, p.dp, o.micro_batch_size, moe_layers));
      // Dropless routing keeps tokens x top-k assignments per rank and micro-batch:
      // the recording's tell the run's micro-batch tokens (B x S).
      const std::int64_t want = o.micro_batch_size * o.seq_len / p.tp * cfg.num_experts_per_tok;
      const std::int64_t kept = L.rows(0, 0, 0, 0).kept;
      if (cfg.capacity_factor <= 0 && moe_layers > 0 && kept != want)
        throw ConfigError(fmt::format(
            "--loads: the recorded run kept {} expert assignments per rank and micro-batch; this simulation's "
            "micro-batch of {} x {} tokens (tp {}) with top-{} keeps {} (give the run's micro_batch_size and seq_len: "
            "--model RUN/config.toml, or --micro-batch-size and --seq-len)",
            kept, o.micro_batch_size, o.seq_len, p.tp, cfg.num_experts_per_tok, want));
      mw = m;
    }
    memory_plan = mw == m ? plan : make_schedule(o.schedule, p.pp, mw, dualv ? 1 : p.vpp);
    split = o.schedule == "zb-h1";
    n_rank = o.micro_batch_size * o.seq_len / p.tp;
    const auto& sl = layout.stage_layers();
    int first = 0;
    for (int s = 0; s < int(sl.size()); ++s) {
      StageInfo si;
      si.first_layer = std::min(first, int(cfg.num_hidden_layers));
      si.last_layer = std::min(first + sl[std::size_t(s)], int(cfg.num_hidden_layers));
      si.embedding = s == 0;
      si.head = s == int(sl.size()) - 1;
      first += sl[std::size_t(s)];
      stages.push_back(si);
    }
    int k = 0;
    for (int l = 0; l < cfg.num_hidden_layers; ++l) moe_index.push_back(cfg.is_moe_layer(l) ? k++ : -1);
    limit = o.memory_limit > 0 ? o.memory_limit : o.cluster.usable_memory();
    LayerWork w{o.micro_batch_size, o.seq_len, {}, p.ep, p.tp, split, elem};
    w.breakdown = o.breakdown;
    head = head_cost(cost, cfg, w);
    embed = embedding_cost(cost, cfg, w);
    for (const StageInfo& si : stages) stage_copies.push_back(stage_copy_cost(cost, cfg, w, si.embedding, si.head));
  }

  double ratio(int it, int mb, int layer) const {
    const int k = moe_index[std::size_t(layer)];
    return k < 0 ? 1.0 : o.loads.ratio(it, mb, m, k);
  }

  /// Persistent bytes of pipeline rank r.
  Bytes persistent(int r) const {
    std::vector<std::pair<int, int>> ranges;
    Bytes total = 0;
    for (int s : plan.stages_of(r)) {
      const StageInfo& si = stages[std::size_t(s)];
      // each chunk is its own model: a tied head without the embedding keeps a copy
      total += persistent_bytes(cfg, o.cluster, o.parallel, {{si.first_layer, si.last_layer}}, si.embedding, si.head);
    }
    return total;
  }

  /// The smallest budget under which the adaptive planner's invariant holds for
  /// pipeline rank r (the trainer's refusal): its persistent bytes plus the peak of
  /// one step with every decided activation at its most memory-saving provision and
  /// every MoE layer at its worst-case routing (minimum_budget, model/memory_plan.h).
  Bytes adaptive_minimum(int r) const {
    StepProgram program;
    for (int s : plan.stages_of(r)) {
      const StageInfo& si = stages[std::size_t(s)];
      program.stages.push_back({si.first_layer, si.last_layer, si.embedding, si.head, o.parallel.ep});
    }
    program.actions = walk_actions(memory_plan, r);
    return rank_bytes(persistent(r),
                      minimum_budget(cfg, o.micro_batch_size, o.seq_len / o.parallel.tp, program, 0, 0.0));
  }

  /// Peak bytes of pipeline rank r's activations and buffers (MemoryWalk, fp32,
  /// persistent bytes excluded) over one iteration, with per-micro-batch ratios and
  /// provisioning policies.
  Bytes walk(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy) {
    std::vector<StageSpec> specs;
    for (int s : plan.stages_of(r)) {
      const StageInfo& si = stages[std::size_t(s)];
      specs.push_back({si.first_layer, si.last_layer, si.embedding, si.head, o.parallel.ep});
    }
    std::map<std::string, ProvisionFn> fns;
    // Micro-batch i of a shorter walk stands for the i-th most loaded of the step
    // (so a spike is walked, at the position held longest).
    const int mw = memory_plan.num_microbatches;
    std::vector<int> order(mb_ratio.size());
    std::iota(order.begin(), order.end(), 0);
    if (mw < int(mb_ratio.size()))
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return mb_ratio[std::size_t(a)] > mb_ratio[std::size_t(b)]; });
    for (const auto& p : mb_policy)
      if (!fns.count(p)) fns.emplace(p, p == "none" ? ProvisionFn{} : make_static_policy(p));
    MemoryWalk w(cfg, o.micro_batch_size, o.seq_len / o.parallel.tp, 0);
    w.run(walk_actions(memory_plan, r), 0, specs,
          [&](int mb, const StageSpec& st) {
            // each layer at its own ratio (a replayed trace differs by layer); a spike
            // check or a shortened walk uses the micro-batch's ratio throughout
            const int full = order[std::size_t(mb)];
            std::vector<MoERows> rows;
            for (int l = st.first_layer; l < st.last_layer; ++l)
              rows.push_back(rows_at(it < 0 || mw < int(mb_ratio.size()) ? mb_ratio[std::size_t(full)]
                                                                         : ratio(it, full, l)));
            return rows;
          },
          [&](const LedgerEntry& e) {
            if (o.cluster.flash_attention && e.name == "attn.probs") return Provision::recompute;
            const ProvisionFn& f = fns.at(mb_policy[std::size_t(order[std::size_t(e.microbatch)])]);
            return f ? f(e) : Provision::save;
          });
    return w.peak();
  }

  /// Peak bytes of data-parallel rank q of pipeline rank r (as walk()), at the rows
  /// that rank recorded (SimOptions::loads per_rank()): exact for that rank.
  Bytes walk_rank(int r, int it, int q, const std::vector<std::string>& mb_policy) {
    std::vector<StageSpec> specs;
    for (int s : plan.stages_of(r)) {
      const StageInfo& si = stages[std::size_t(s)];
      specs.push_back({si.first_layer, si.last_layer, si.embedding, si.head, o.parallel.ep});
    }
    std::map<std::string, ProvisionFn> fns;
    for (const auto& p : mb_policy)
      if (!fns.count(p)) fns.emplace(p, p == "none" ? ProvisionFn{} : make_static_policy(p));
    MemoryWalk w(cfg, o.micro_batch_size, o.seq_len / o.parallel.tp, 0);
    w.run(walk_actions(plan, r), 0, specs,
          [&](int mb, const StageSpec& st) {
            std::vector<MoERows> rows;
            for (int l = st.first_layer; l < st.last_layer; ++l) {
              const int k = moe_index[std::size_t(l)];
              if (k < 0) {
                rows.push_back(rows_at(1.0));  // dense: unused by the walk
                continue;
              }
              const RecordedRows rec = o.loads.rows(it, mb, k, q);
              rows.push_back(MoERows{rec.kept, rec.received});
            }
            return rows;
          },
          [&](const LedgerEntry& e) {
            if (o.cluster.flash_attention && e.name == "attn.probs") return Provision::recompute;
            const ProvisionFn& f = fns.at(mb_policy[std::size_t(e.microbatch)]);
            return f ? f(e) : Provision::save;
          });
    return w.peak();
  }

  /// Peak activation bytes of pipeline rank r in iteration `it`: the largest of its
  /// data-parallel ranks' exact walks when the loads give every rank's rows, else the
  /// upper bound of walk() at the hottest EP rank's loads of every micro-batch.
  /// `per_rank` (when not null) receives each data-parallel rank's walk (per-rank replays only).
  Bytes walk_peak(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy,
                  std::vector<Bytes>* per_rank = nullptr) {
    if (!o.loads.per_rank() || it < 0) return walk(r, it, mb_ratio, mb_policy);
    Bytes mx = 0;
    if (per_rank) per_rank->assign(std::size_t(o.parallel.dp), 0);
    for (int q = 0; q < o.parallel.dp; ++q) {
      const Bytes b = walk_rank(r, it, q, mb_policy);
      if (per_rank) (*per_rank)[std::size_t(q)] = b;
      mx = std::max(mx, b);
    }
    return mx;
  }

  /// The layer costs of the dp processes of one pipeline rank for (iteration,
  /// micro-batch, MoE layer l) whose hottest EP rank is at ratio `hot`: each rank's
  /// own recorded rows in a per-rank replay; else, in each EP group, one rank at
  /// `hot` and the other ep - 1 sharing the rest of the group's rows evenly, at
  /// (ep - hot) / (ep - 1) each (the group's total is conserved).
  std::vector<const LayerCost*> group_layers(int it, int mb, int l, double hot) {
    const ParallelSpec& p = o.parallel;
    std::vector<const LayerCost*> out;
    const int k = moe_index[std::size_t(l)];
    if (o.loads.per_rank() && k >= 0) {
      // The recorded data-parallel ranks' loads; with tp > 1 each stands for its tp
      // processes (the engine records tp 1), so the group is tp x dp processes as below.
      const double balanced = double(MoERows::balanced(cfg, n_rank).received);
      for (int q = 0; q < p.dp; ++q) {
        const LayerCost* lc = &layer_at(l, double(o.loads.rows(it, mb, k, q).received) / balanced);
        for (int t = 0; t < p.tp; ++t) out.push_back(lc);
      }
      return out;
    }
    const double cold = p.ep > 1 ? std::max(0.0, (double(p.ep) - hot) / double(p.ep - 1)) : 1.0;
    // The tp x dp processes of the pipeline rank, in (tp x dp) / ep EP groups.
    for (int g = 0; g < p.tp * p.dp / p.ep; ++g) {
      out.push_back(&layer_at(l, p.ep > 1 ? hot : 1.0));
      for (int q = 1; q < p.ep; ++q) out.push_back(&layer_at(l, cold));
    }
    return out;
  }

  /// A rank's bytes: its persistent state plus a walk's activation peak.
  Bytes rank_bytes(Bytes persistent_b, Bytes act) const { return persistent_b + act; }
};

}  // namespace

SimReport simulate(const SimOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  Simulation sim(o);
  sim.setup();
  const ParallelSpec& par = o.parallel;
  const int P = sim.P, m = sim.m;
  SimReport rep;
  rep.options = o;
  rep.num_microbatches = m;
  rep.memory_limit = sim.limit;
  for (const auto& s : sim.stages) rep.stage_layers.push_back(s.last_layer - s.first_layer);
  rep.ranks.resize(std::size_t(P));
  const bool adaptive = o.policy == "adaptive";
  if (!adaptive) recomputes(o.policy, ActivationSpec{"attn.probs", "", 0, true, {}, false, -1, {}}, 1.0);  // validates the name
  if (adaptive) rep.adaptive_level_histogram.assign(adaptive_levels().size(), 0);
  std::vector<Bytes> persist(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) persist[std::size_t(r)] = rep.ranks[std::size_t(r)].persistent_bytes = sim.persistent(r);
  for (int r : o.trace_ranks)  // before the work, not after it
    if (r < 0 || r >= P) throw ConfigError(fmt::format("--trace-ranks: pipeline rank {} is not in [0, {})", r, P));
  if (o.walk_memory) {
    // A budget that cannot hold the persistent state fails every iteration at once;
    // the adaptive policy needs the trainer's minimum budget (it refuses less).
    for (int r = 0; r < P; ++r)
      if (persist[std::size_t(r)] > sim.limit)
        throw ConfigError(fmt::format(
            "memory limit {} ({} B per device: --memory, or the cluster's usable memory) cannot hold pipeline rank "
            "{}'s persistent state: {} ({} B) of weights, gradients and optimizer state for {}",
            format_bytes(sim.limit), sim.limit, r, format_bytes(persist[std::size_t(r)]), persist[std::size_t(r)],
            par.str()));
    if (adaptive)
      for (int r = 0; r < P; ++r)
        if (const Bytes need = sim.adaptive_minimum(r); need > sim.limit)
          throw ConfigError(fmt::format(
              "memory limit {} ({} B per device) is below the smallest budget for which adaptive provisioning can "
              "guarantee no out-of-memory error on pipeline rank {}: {} ({} B: {} of weights, gradients and optimizer "
              "state, plus one step with every activation recomputed or offloaded and worst-case expert routing), "
              "as `moeflex train` refuses it",
              format_bytes(sim.limit), sim.limit, r, format_bytes(need), need, format_bytes(persist[std::size_t(r)])));
  }

  // Data-parallel gradient reduction and optimizer, after the last backward.
  Seconds optimizer_ops = 0;  // the optimizer's priced work summed over the pipeline ranks (SimReport::ops)
  {
    Seconds dp_t = 0, opt_t = 0;
    const GroupPlacement dense_g = place_group(par.dp, par.tp, o.cluster.gpus_per_node);
    const GroupPlacement expert_g = expert_data_parallel_placement(par, o.cluster.gpus_per_node);
    const Bytes grad_bytes = 4;  // fp32 gradients (the engine; Megatron's main_grad)
    // The CPU engine's sync_tied_embedding (train/distributed.cpp), on every pipeline
    // rank when the embedding is tied and split over stages: the V x d gradient copies
    // summed into a zeroed buffer (zero 4 B, add 12 B per element of a copy), an
    // all-reduce over the pipeline group (with its local sum), and the result copied
    // back (8 B).
    Seconds tied_sync = 0;
    if (o.cluster.per_tensor_gradient_reduce && sim.cfg.tie_word_embeddings && sim.plan.num_stages > 1) {
      const double vd = double(sim.cfg.vocab_size) * double(sim.cfg.hidden_size) / par.tp;
      const Bytes b = Bytes(std::llround(vd)) * grad_bytes;
      tied_sync = all_reduce_time(o.cluster, place_group(par.pp, par.tp * par.dp, o.cluster.gpus_per_node), b) +
                  ordered_sum_time(sim.cost, par.pp, b) + sim.cost.elementwise(Bytes(std::llround(24 * vd)));
    }
    for (int r = 0; r < P; ++r) {
      double dense = 0, expert = 0;
      Seconds per_tensor = 0;  // the CPU engine's reduce_gradients: one all-reduce per tensor
      for (int s : sim.plan.stages_of(r)) {
        const StageInfo& si = sim.stages[std::size_t(s)];
        for_each_param_tensor(sim.cfg, par, {{si.first_layer, si.last_layer}}, si.embedding, si.head,
                              [&](double numel, bool is_expert) {
                                (is_expert ? expert : dense) += numel;
                                const GroupPlacement& g = is_expert ? expert_g : dense_g;
                                const Bytes b = Bytes(std::llround(numel)) * grad_bytes;
                                per_tensor += all_reduce_time(o.cluster, g, b) + ordered_sum_time(sim.cost, g.size, b);
                              });
      }
      // One ring all-reduce of all dense and one of all expert gradients (bucketed, as
      // frameworks do), or, for the CPU engine (per_tensor_gradient_reduce), one per
      // tensor, each with its own 2(n-1) alpha and the local sum of its ordered all-reduce.
      const Seconds t =
          o.cluster.per_tensor_gradient_reduce
              ? per_tensor
              : all_reduce_time(o.cluster, dense_g, Bytes(std::llround(dense)) * grad_bytes) +
                    all_reduce_time(o.cluster, expert_g, Bytes(std::llround(expert)) * grad_bytes);
      dp_t = std::max(dp_t, t + tied_sync);
      const double shard_d = o.cluster.optimizer_sharded ? par.dp : 1;
      const double shard_e = o.cluster.optimizer_sharded ? expert_data_parallel(par) : 1;
      const Seconds rank_opt = optimizer_step_time(sim.cost, dense + expert, dense / shard_d + expert / shard_e);
      opt_t = std::max(opt_t, rank_opt);
      optimizer_ops += rank_opt;
    }
    // Every process reduces its gradients and runs its optimizer at once (the CPU
    // engine's reductions are its own copies and sums): with more processes than the
    // host's cores they share them.
    const double shared_by = o.cluster.host_cores > 0 ? std::max(1.0, double(par.world()) / o.cluster.host_cores) : 1.0;
    rep.dp_reduce_time = dp_t * shared_by;
    rep.optimizer_time = opt_t * shared_by;
  }

  // Model FLOPs of one iteration (all replicas).
  {
    double f = 0;
    for (int l = 0; l < sim.cfg.num_hidden_layers; ++l) f += layer_forward_flops(sim.cfg, l, o.micro_batch_size, o.seq_len);
    f += head_forward_flops(sim.cfg, o.micro_batch_size, o.seq_len);
    rep.model_flops_per_iteration = 3 * f * double(m) * double(par.dp);
  }

  const bool same_node_pp = std::int64_t(par.tp) * par.dp * par.pp <= o.cluster.gpus_per_node;
  const Bytes msg_bytes = sim.n_rank * sim.cfg.hidden_size * sim.elem;
  const Seconds msg_time = sim.plan.num_ranks > 1 ? p2p_time(o.cluster, same_node_pp, msg_bytes) : 0;

  // Processes (ranks) time-sharing fewer host cores: run_plan's CoreSharing.
  const bool shared = o.cluster.host_cores > 0 && par.world() > o.cluster.host_cores;
  double step_sum = 0, bubble_sum = 0, comm_sum = 0, recompute_sum = 0;
  Seconds failed_attempts = 0;  // each OOM's restart and failed iteration
  const int iters = std::max(o.iterations, 1);
  PlanTimeline last;
  std::vector<std::vector<std::string>> last_policy;
  for (int it = 0; it < iters; ++it) {
    // Loads of this iteration: the hottest EP rank's ratio per micro-batch (first MoE layer's; a
    // replayed trace's per-layer ratios enter the times below).
    std::vector<double> mb_ratio(static_cast<std::size_t>(m));
    for (int mb = 0; mb < m; ++mb) {
      double r = 1;
      for (int l = 0; l < sim.cfg.num_hidden_layers; ++l) r = std::max(r, sim.ratio(it, mb, l));
      mb_ratio[std::size_t(mb)] = r;
    }
    const std::vector<double> calm(std::size_t(m), 1.0);
    // Provisioning per pipeline rank and micro-batch; memory walks.
    std::vector<std::vector<std::string>> policy(std::size_t(P), std::vector<std::string>(std::size_t(m), o.policy));
    bool oom = false;
    for (int r = 0; r < P && o.walk_memory; ++r) {
      RankReport& rr = rep.ranks[std::size_t(r)];
      auto& pol = policy[std::size_t(r)];
      Bytes hot = 0;
      std::vector<Bytes> dp_walks;  // per data-parallel rank (per-rank replays)
      if (adaptive) {
        // The cheapest (calm level u, spike level s >= u) whose walk fits.
        const auto& L = adaptive_levels();
        bool fit = false;
        for (std::size_t u = 0; u < L.size() && !fit; ++u)
          for (std::size_t s = u; s < L.size() && !fit; ++s) {
            for (int mb = 0; mb < m; ++mb)
              pol[std::size_t(mb)] = L[mb_ratio[std::size_t(mb)] > o.loads.calm_max ? s : u];
            hot = sim.rank_bytes(persist[std::size_t(r)], sim.walk_peak(r, it, mb_ratio, pol, &dp_walks));
            fit = hot <= sim.limit;
            if (!fit && s + 1 < L.size()) {
              bool any_spike = false;
              for (double x : mb_ratio) any_spike |= x > o.loads.calm_max;
              if (!any_spike) break;  // raising the spike level changes nothing
            }
          }
        for (int mb = 0; mb < m; ++mb)
          ++rep.adaptive_level_histogram[std::size_t(
              std::find(L.begin(), L.end(), pol[std::size_t(mb)]) - L.begin())];
      } else {
        hot = sim.rank_bytes(persist[std::size_t(r)], sim.walk_peak(r, it, mb_ratio, pol, &dp_walks));
      }
      if (!dp_walks.empty()) {
        rr.dp_rank_peak_bytes.resize(dp_walks.size(), 0);
        for (std::size_t q = 0; q < dp_walks.size(); ++q)
          rr.dp_rank_peak_bytes[q] =
              std::max(rr.dp_rank_peak_bytes[q], sim.rank_bytes(persist[std::size_t(r)], dp_walks[q]));
      }
      rr.peak_bytes = std::max(rr.peak_bytes, hot);
      if (it == 0) {
        std::vector<std::string> pol_calm = pol;
        if (adaptive) std::fill(pol_calm.begin(), pol_calm.end(), adaptive_levels()[0]);
        Bytes bal = sim.rank_bytes(persist[std::size_t(r)], sim.walk(r, -1, calm, pol_calm));
        if (adaptive && bal > sim.limit) bal = std::min(bal, hot);
        rr.peak_balanced_bytes = bal;
      }
      if (hot > sim.limit) oom = true;
      if (o.spike_check > 0 && it == 0) {
        std::vector<double> spiked = mb_ratio;
        spiked[0] = std::max(spiked[0], o.spike_check);
        std::vector<std::string> pol_spiked = pol;
        Bytes spike = sim.rank_bytes(persist[std::size_t(r)], sim.walk(r, -1, spiked, pol_spiked));
        if (adaptive) {
          // The spike gets the cheapest level from its calm one up whose walk fits (as
          // the iteration's own choice above), the most-saving one when none fits.
          const auto& L = adaptive_levels();
          for (auto lv = std::size_t(std::find(L.begin(), L.end(), pol[0]) - L.begin()) + 1;
               spike > sim.limit && lv < L.size(); ++lv) {
            pol_spiked[0] = L[lv];
            spike = sim.rank_bytes(persist[std::size_t(r)], sim.walk(r, -1, spiked, pol_spiked));
          }
        }
        rep.spike_peak_bytes = std::max(rep.spike_peak_bytes, spike);
      }
    }
    if (!o.walk_memory)
      for (auto& pol : policy)
        for (auto& x : pol)
          if (x == "adaptive") x = "none";
    // Times of every (stage, micro-batch) at the hottest rank's loads; with more
    // processes than host cores, also their core-seconds over the dp processes.
    const int S_ = sim.plan.num_stages;
    std::vector<ActionCost> F(std::size_t(S_ * m)), Bi(std::size_t(S_ * m)), W(std::size_t(S_ * m));
    std::vector<Seconds> recompute_rank(std::size_t(P), 0);
    OpBreakdown step_ops;  // this iteration's (SimOptions::breakdown)
    for (int s = 0; s < S_; ++s) {
      const StageInfo& si = sim.stages[std::size_t(s)];
      const int r = sim.plan.rank_of(s);
      for (int mb = 0; mb < m; ++mb) {
        ActionCost f, b, w;
        const std::string& pol = policy[std::size_t(r)][std::size_t(mb)];
        OpBreakdown* bd = o.breakdown ? &step_ops : nullptr;
        // Under core sharing: segments between the processes' synchronisations (the
        // expert all-to-alls); the weight gradients have none (one segment).
        const double dp = par.dp * par.tp;
        auto same = [&](ActionCost& a, Seconds t) {  // work every process does alike
          if (shared && t > 0) a.segments.push_back({t, t * dp, {}});
        };
        ActionCost::Segment w_all;
        // Each process's weight gradients (the expert rows differ), for w_all.each.
        std::vector<Seconds> w_each(shared ? std::size_t(dp) : 0, 0.0);
        bool w_each_known = shared;
        auto add_w = [&](Seconds x) {
          for (Seconds& v : w_each) v += x;
        };
        for (int l = si.first_layer; l < si.last_layer; ++l) {
          const double rt = sim.ratio(it, mb, l);
          const LayerCost& lc = sim.layer_at(l, rt);
          const Seconds comm = sim.layer_comm(lc), a2a = sim.layer_a2a(lc);
          f.compute += lc.forward;
          f.comm += comm;
          f.overlappable += a2a;
          b.compute += lc.backward_input;
          b.comm += comm;
          b.overlappable += a2a;
          w.compute += lc.backward_weight;
          std::set<std::string> dropped;
          if (pol != "none" || o.cluster.flash_attention) {
            const auto specs = layer_activations(sim.cfg, l, o.micro_batch_size, o.seq_len / par.tp,
                                                 sim.rows_at(rt), par.ep > 1);
            for (const auto& sp : specs)
              if (recomputes(pol, sp, rt) || (o.cluster.flash_attention && sp.name == "attn.probs"))
                dropped.insert(sp.name);
          }
          auto is_dropped = [&](const std::string& name) { return dropped.count(name) > 0; };
          const Seconds rc = dropped.empty() ? 0 : lc.recompute_total(is_dropped);
          b.compute += rc;
          recompute_rank[std::size_t(r)] += rc;
          if (bd) {
            // The ops every process runs: an MoE layer's at each data-parallel rank's own
            // rows (their mean), while the time above follows the hottest.
            const std::vector<const LayerCost*> group =
                sim.moe_index[std::size_t(l)] >= 0 && par.ep > 1 ? sim.group_layers(it, mb, l, rt)
                                                                  : std::vector<const LayerCost*>{&lc};
            for (const LayerCost* q : group) {
              OpBreakdown one = q->ops;
              if (!dropped.empty()) q->recompute_total(is_dropped, &one);
              add_breakdown(*bd, one, 1.0 / double(group.size()));
            }
          }
          if (!shared) continue;
          if (sim.moe_index[std::size_t(l)] >= 0 && par.ep > 1) {
            // The layer without expert rows is the same on every rank; the expert
            // rows (grouped GEMMs, SwiGLU) differ, between dispatch and combine: a
            // segment of each process's own time (Segment::each, processor sharing).
            // D, the demand, counts a process done with its rows as polling until the
            // group's combine for at most kCommPollSeconds: x + min(T - x, poll) each.
            const LayerCost& e = sim.layer_at(l, 0.0);
            const auto group = sim.group_layers(it, mb, l, rt);
            ActionCost::Segment xf, xb;
            for (const LayerCost* q : group) {
              xf.T = std::max(xf.T, q->forward - e.forward);
              xb.T = std::max(xb.T, q->backward_input - e.backward_input);
              w_all.D += q->backward_weight;
            }
            if (group.size() != w_each.size()) w_each_known = false;
            for (std::size_t j = 0; j < group.size(); ++j) {
              const LayerCost* q = group[j];
              const Seconds x = q->forward - e.forward, y = q->backward_input - e.backward_input;
              xf.D += x + std::min(xf.T - x, kCommPollSeconds);
              xb.D += y + std::min(xb.T - y, kCommPollSeconds);
              xf.each.push_back(x);
              xb.each.push_back(y);
              if (w_each_known) w_each[j] += q->backward_weight;
            }
            std::sort(xf.each.begin(), xf.each.end());
            std::sort(xb.each.begin(), xb.each.end());
            same(f, e.forward + comm);
            f.segments.push_back(xf);
            same(b, e.backward_input + comm + rc);
            b.segments.push_back(xb);
          } else {
            same(f, lc.forward + comm);
            same(b, lc.backward_input + comm + rc);
            w_all.D += lc.backward_weight * dp;
            add_w(lc.backward_weight);
          }
          w_all.T += lc.backward_weight;
        }
        {  // a stage's boundary copies (received input, gradients in and out)
          const LayerCost& sc = sim.stage_copies[std::size_t(s)];
          f.compute += sc.forward;
          b.compute += sc.backward_input;
          same(f, sc.forward);
          same(b, sc.backward_input);
          if (bd) add_breakdown(*bd, sc.ops);
        }
        if (si.embedding) {
          if (bd) add_breakdown(*bd, sim.embed.ops);
          f.compute += sim.embed.forward;
          w.compute += sim.embed.backward_weight;
          same(f, sim.embed.forward);
          w_all.T += sim.embed.backward_weight;
          w_all.D += sim.embed.backward_weight * dp;
          add_w(sim.embed.backward_weight);
        }
        if (si.head) {
          if (bd) add_breakdown(*bd, sim.head.ops);
          std::set<std::string> dropped;
          for (const auto& sp : head_activations(sim.cfg, o.micro_batch_size, o.seq_len / par.tp))
            if (recomputes(pol, sp, 1.0)) dropped.insert(sp.name);
          const Seconds head_rc =
              sim.head.recompute_total([&](const std::string& name) { return dropped.count(name) > 0; }, bd);
          f.compute += sim.head.forward;
          b.compute += sim.head.backward_input + head_rc;
          w.compute += sim.head.backward_weight;
          same(f, sim.head.forward);
          // the head's backward runs first in B
          if (shared)
            b.segments.insert(b.segments.begin(),
                              {sim.head.backward_input + head_rc, (sim.head.backward_input + head_rc) * dp, {}});
          w_all.T += sim.head.backward_weight;
          w_all.D += sim.head.backward_weight * dp;
          add_w(sim.head.backward_weight);
        }
        if (shared && w_all.T > 0) {
          if (w_each_known && par.ep > 1) {
            w_all.each = std::move(w_each);
            std::sort(w_all.each.begin(), w_all.each.end());
            w_all.T = w_all.each.back();  // no synchronisation inside: the slowest process's own sum
          }
          w.segments.push_back(w_all);
        }
        F[std::size_t(s * m + mb)] = f;
        Bi[std::size_t(s * m + mb)] = b;
        W[std::size_t(s * m + mb)] = w;
      }
    }
    PlanTimeline tl = run_plan(
        sim.plan,
        [&](int, const Action& a) -> ActionCost {
          const std::size_t i = std::size_t(a.stage * m + a.microbatch);
          switch (a.kind) {
            case ActionKind::Forward: return F[i];
            case ActionKind::BackwardInput: return Bi[i];
            case ActionKind::BackwardWeight: return W[i];
            default: {  // a whole backward: B's segments, then W's
              ActionCost c{Bi[i].compute + W[i].compute, Bi[i].comm, 0, Bi[i].segments};
              c.overlappable = Bi[i].overlappable;
              c.segments.insert(c.segments.end(), W[i].segments.begin(), W[i].segments.end());
              return c;
            }
          }
        },
        [&](const Action&) { return msg_time; }, o.overlap_pair_comm,
        shared ? CoreSharing{o.cluster.host_cores, par.dp * par.tp, kCommPollSeconds,
                             o.cluster.profile.time_sharing_efficiency, o.cluster.profile.nap_cost,
                             o.cluster.profile.nap_overshoot}
               : CoreSharing{});
    if (o.breakdown) {
      add_breakdown(rep.ops, step_ops, 1.0 / iters);
      OpTally& opt = rep.ops[{"optimizer", "optimizer_step"}];
      opt.count += double(P) / iters;
      opt.seconds += optimizer_ops / iters;
    }
    const Seconds step = tl.makespan + rep.dp_reduce_time + rep.optimizer_time;
    step_sum += step;
    rep.step_time_max = std::max(rep.step_time_max, step);
    double idle = 0;
    for (int r = 0; r < P; ++r) idle += tl.idle[std::size_t(r)];
    bubble_sum += tl.makespan > 0 ? idle / (double(P) * tl.makespan) : 0;
    int crit = int(std::max_element(tl.finish.begin(), tl.finish.end()) - tl.finish.begin());
    comm_sum += tl.comm[std::size_t(crit)] + rep.dp_reduce_time;
    recompute_sum += *std::max_element(recompute_rank.begin(), recompute_rank.end());
    if (oom) {
      ++rep.ooms;
      const int lost = it % std::max(o.checkpoint_interval, 1);
      rep.lost_iterations += lost;
      rep.restart_time += o.restart_seconds + step * (lost + 1);  // the failed iteration and the redone ones
      failed_attempts += o.restart_seconds + step;
    }
    last = std::move(tl);
    last_policy = std::move(policy);
  }
  rep.step_time = step_sum / iters;
  rep.bubble_fraction = bubble_sum / iters;
  rep.exposed_comm = comm_sum / iters;
  rep.recompute_time = recompute_sum / iters;
  const double tokens = double(m) * double(par.dp) * double(o.micro_batch_size) * double(o.seq_len);
  const double world = par.world();
  rep.tgs = tokens / (rep.step_time * world);
  rep.mfu = o.cluster.peak_flops > 0 ? rep.model_flops_per_iteration / (rep.step_time * world * o.cluster.peak_flops) : 0;
  if (rep.ooms == iters) {
    // No iteration fits: none completes, so a restart has nothing to redo (none is
    // rolled back) and its retry fails again. The run makes no progress.
    rep.lost_iterations = 0;
    rep.restart_time = failed_attempts;
    rep.effective_tgs = rep.effective_mfu = 0;  // SimReport::note says why (below)
  } else {
    const Seconds total = step_sum + rep.restart_time;
    rep.effective_tgs = tokens * iters / (total * world);
    rep.effective_mfu = rep.mfu * step_sum / total;
  }
  for (int r = 0; r < P; ++r) {
    RankReport& rr = rep.ranks[std::size_t(r)];
    rr.pp_rank = r;
    rr.busy = last.busy[std::size_t(r)];
    rr.comm = last.comm[std::size_t(r)];
    rr.idle = last.idle[std::size_t(r)];
    rep.peak_bytes = std::max(rep.peak_bytes, rr.peak_bytes);
  }
  if (rep.ooms == iters)
    rep.note = fmt::format("every iteration ran out of memory (peak {} over the limit {}): none completes, so the "
                           "effective TGS is 0",
                           format_bytes(rep.peak_bytes), format_bytes(sim.limit));
  // Chrome trace of the chosen ranks (last iteration), times in microseconds.
  json ev = json::array();
  for (int r : o.trace_ranks) {
    ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r}, {"args", {{"name", fmt::format("pp rank {}", r)}}}});
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 0}, {"args", {{"name", "compute"}}}});
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 1}, {"args", {{"name", "comm"}}}});
    const auto& acts = sim.plan.actions[std::size_t(r)];
    for (std::size_t i = 0; i < acts.size(); ++i) {
      const Action& a = acts[i];
      const Interval iv = last.times[std::size_t(r)][i];
      if (is_send(a.kind)) {
        ev.push_back({{"name", to_string(a.kind)}, {"ph", "X"}, {"pid", r}, {"tid", 1}, {"ts", iv.start * 1e6},
                      {"dur", msg_time * 1e6}, {"args", {{"mb", a.microbatch}, {"stage", a.stage}}}});
      } else if (is_compute(a.kind)) {
        if (i > 0 && acts[i - 1].overlapped_with_next) continue;  // the pair is drawn once
        std::string name = fmt::format("{}{} s{}", to_string(a.kind), a.microbatch, a.stage);
        if (a.overlapped_with_next && i + 1 < acts.size())  // the pair's backward, named beside its forward
          name += fmt::format(" + {}{} s{}", to_string(acts[i + 1].kind), acts[i + 1].microbatch, acts[i + 1].stage);
        ev.push_back({{"name", name}, {"cat", "compute"}, {"ph", "X"}, {"pid", r}, {"tid", 0}, {"ts", iv.start * 1e6},
                      {"dur", (iv.end - iv.start) * 1e6},
                      {"args", {{"mb", a.microbatch}, {"stage", a.stage},
                                {"policy", last_policy[std::size_t(r)][std::size_t(a.microbatch)]}}}});
      }
    }
    ev.push_back({{"name", "dp all-reduce"}, {"ph", "X"}, {"pid", r}, {"tid", 1}, {"ts", last.makespan * 1e6},
                  {"dur", rep.dp_reduce_time * 1e6}});
    ev.push_back({{"name", "optimizer"}, {"ph", "X"}, {"pid", r}, {"tid", 0},
                  {"ts", (last.makespan + rep.dp_reduce_time) * 1e6}, {"dur", rep.optimizer_time * 1e6}});
  }
  rep.trace = {{"traceEvents", ev}, {"displayTimeUnit", "ms"}};
  rep.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return rep;
}

// ---------------------------------------------------------------------------------------------
// Output

json SimReport::to_json() const {
  json ranks_j = json::array();
  for (const auto& r : ranks)
    ranks_j.push_back({{"pp_rank", r.pp_rank}, {"persistent_bytes", r.persistent_bytes}, {"peak_bytes", r.peak_bytes},
                       {"peak_balanced_bytes", r.peak_balanced_bytes}, {"dp_rank_peak_bytes", r.dp_rank_peak_bytes},
                       {"busy_s", r.busy}, {"comm_s", r.comm}, {"idle_s", r.idle}});
  json j = {{"model_params", options.model.num_params()},
            {"model_active_params", options.model.num_active_params()},
            {"cluster", options.cluster.name},
            {"hardware_profile", options.cluster.profile.name},
            {"parallel", options.parallel.str()},
            {"world_size", options.parallel.world()},
            {"schedule", options.schedule},
            {"dispatcher", options.dispatcher},
            {"policy", options.policy},
            {"micro_batch_size", options.micro_batch_size},
            {"seq_len", options.seq_len},
            {"num_microbatches", num_microbatches},
            {"global_batch", std::int64_t(num_microbatches) * options.parallel.dp * options.micro_batch_size},
            {"iterations", options.iterations},
            {"loads", options.loads.describe()},
            {"stage_layers", stage_layers},
            {"step_time_s", step_time},
            {"step_time_max_s", step_time_max},
            {"dp_reduce_s", dp_reduce_time},
            {"optimizer_s", optimizer_time},
            {"bubble_fraction", bubble_fraction},
            {"exposed_comm_s", exposed_comm},
            {"recompute_s", recompute_time},
            {"mfu", mfu},
            {"tgs", tgs},
            {"ooms", ooms},
            {"lost_iterations", lost_iterations},
            {"restart_s", restart_time},
            {"restart_seconds_each", options.restart_seconds},
            {"checkpoint_interval", options.checkpoint_interval},
            {"effective_tgs", effective_tgs},
            {"effective_mfu", effective_mfu},
            {"memory_limit_bytes", memory_limit},
            {"peak_bytes", peak_bytes},
            {"spike_peak_bytes", spike_peak_bytes},
            {"note", note},
            {"ranks", ranks_j},
            {"simulation_wall_s", wall_seconds}};
  if (!ops.empty()) {
    json o = json::array();
    for (const auto& [key, t] : ops)
      o.push_back({{"phase", key.first}, {"kind", key.second}, {"count", t.count}, {"seconds", t.seconds}});
    j["ops"] = o;
  }
  if (!adaptive_level_histogram.empty()) {
    json h;
    for (std::size_t i = 0; i < adaptive_level_histogram.size(); ++i) h[adaptive_levels()[i]] = adaptive_level_histogram[i];
    j["adaptive_levels"] = h;
  }
  return j;
}

std::string SimReport::format() const {
  const double GiB = double(kGiB);
  std::string s = fmt::format(
      "{} params ({}, {} active) on {} x {} (priced by {}) [{}], schedule {}, policy {}\n"
      "micro-batch {} x {} tokens, {} micro-batches, {} iteration(s); loads {}\n\n",
      options.model.num_params(), format_count(double(options.model.num_params())),
      format_count(double(options.model.num_active_params())), options.parallel.world(), options.cluster.name,
      options.cluster.profile.name, options.parallel.str(), options.schedule, options.policy, options.micro_batch_size,
      options.seq_len, num_microbatches, options.iterations, options.loads.describe());
  s += fmt::format("{:>7} {:>10} {:>12} {:>14} {:>10} {:>10} {:>10}\n", "pp rank", "layers", "persist GiB",
                   "peak GiB (hot)", "balanced", "busy s", "comm s");
  for (const auto& r : ranks) {
    std::string layers;
    for (int st : options.schedule == "dualpipev" ? std::vector<int>{r.pp_rank, 2 * options.parallel.pp - 1 - r.pp_rank}
                                                   : std::vector<int>{})
      layers += fmt::format("{}{}", layers.empty() ? "" : "+", stage_layers[std::size_t(st)]);
    if (layers.empty())
      for (int c = 0; c < options.parallel.vpp; ++c)
        layers += fmt::format("{}{}", layers.empty() ? "" : "+",
                              stage_layers[std::size_t(c * options.parallel.pp + r.pp_rank)]);
    s += fmt::format("{:>7} {:>10} {:>12.2f} {:>14.2f} {:>10.2f} {:>10.3f} {:>10.3f}\n", r.pp_rank, layers,
                     r.persistent_bytes / GiB, r.peak_bytes / GiB, r.peak_balanced_bytes / GiB, r.busy, r.comm);
  }
  s += fmt::format(
      "\nstep time      {:.4f} s (max {:.4f}; dp all-reduce {:.4f}, optimizer {:.4f})\n"
      "MFU            {:.1f}%   TGS {:.1f} tokens/GPU/s\n"
      "bubble         {:.1f}%   exposed comm {:.4f} s/iteration   recompute {:.4f} s/iteration\n"
      "peak memory    {:.2f} GiB of {:.2f} GiB\n"
      "OOMs           {} (restart {:.0f} s each, {} iterations rolled back)\n"
      "effective      TGS {:.1f}, MFU {:.1f}% (restart losses included)\n",
      step_time, step_time_max, dp_reduce_time, optimizer_time, 100 * mfu, tgs, 100 * bubble_fraction, exposed_comm,
      recompute_time, peak_bytes / GiB, memory_limit / GiB, ooms, options.restart_seconds, lost_iterations,
      effective_tgs, 100 * effective_mfu);
  if (!note.empty()) s += fmt::format("note           {}\n", note);
  if (!adaptive_level_histogram.empty()) {
    s += "adaptive       ";
    for (std::size_t i = 0; i < adaptive_level_histogram.size(); ++i)
      s += fmt::format("{} {}  ", adaptive_levels()[i], adaptive_level_histogram[i]);
    s += "(rank-micro-batches per level)\n";
  }
  if (!ops.empty()) {
    // By kind (phases summed), then by phase: ms per step over the pipeline ranks.
    std::map<std::string, OpTally> kinds, phases;
    Seconds total = 0;
    for (const auto& [key, t] : ops) {
      for (OpTally* x : {&kinds[key.second], &phases[key.first]}) {
        x->count += t.count;
        x->seconds += t.seconds;
      }
      total += t.seconds;
    }
    std::vector<std::pair<std::string, OpTally>> by(kinds.begin(), kinds.end());
    std::stable_sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    s += fmt::format("\nops per step (all pipeline ranks): {:.2f} ms\n{:<28} {:>9} {:>10}\n", 1e3 * total, "op kind",
                     "calls", "ms");
    for (const auto& [k, t] : by) s += fmt::format("{:<28} {:>9.1f} {:>10.3f}\n", k, t.count, 1e3 * t.seconds);
    s += "by phase:";
    for (const auto& [p, t] : phases) s += fmt::format(" {} {:.3f} ms;", p, 1e3 * t.seconds);
    s += "\n";
  }
  s += fmt::format("simulated in {:.3f} s\n", wall_seconds);
  return s;
}

namespace {
/// The largest of `per_rank(sim, r)` over the pipeline ranks of `o`'s simulation.
template <class F>
Bytes max_over_ranks(const SimOptions& o, F per_rank) {
  Simulation sim(o);
  sim.setup();
  Bytes mx = 0;
  for (int r = 0; r < sim.P; ++r) mx = std::max(mx, per_rank(sim, r));
  return mx;
}
}  // namespace

Bytes max_persistent_bytes(const SimOptions& o) {
  return max_over_ranks(o, [](Simulation& sim, int r) { return sim.persistent(r); });
}

Bytes adaptive_minimum_budget(const SimOptions& o) {
  return max_over_ranks(o, [](Simulation& sim, int r) { return sim.adaptive_minimum(r); });
}

void write_outputs(const SimReport& r, const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw DataError(fmt::format("{}: cannot create the output directory ({})", dir.string(), ec.message()));
  // Both files are written beside their place and renamed over it once whole, and
  // only when both can be: a failure leaves the folder's earlier files as they were.
  std::vector<std::pair<std::filesystem::path, std::string>> files = {{dir / "summary.json", r.to_json().dump(2)}};
  if (!r.options.trace_ranks.empty()) files.push_back({dir / "trace.json", r.trace.dump()});
  for (const auto& [path, text] : files)
    if (std::filesystem::is_directory(path, ec))
      throw DataError(fmt::format("{}: cannot write, a directory is in its place", path.string()));
  std::vector<std::filesystem::path> written;
  auto discard = [&] {
    for (const auto& t : written) std::filesystem::remove(t, ec);
  };
  for (const auto& [path, text] : files) {
    std::filesystem::path tmp = path;
    tmp += ".tmp";
    std::ofstream f(tmp);
    f << text << "\n";
    f.close();
    if (!f) {
      written.push_back(tmp);
      discard();
      throw DataError(fmt::format("{}: cannot write", path.string()));
    }
    written.push_back(tmp);
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::filesystem::rename(written[i], files[i].first, ec);
    if (ec) {
      written.erase(written.begin(), written.begin() + std::ptrdiff_t(i));  // those renamed are in place
      discard();
      throw DataError(fmt::format("{}: cannot write ({})", files[i].first.string(), ec.message()));
    }
  }
}

}  // namespace moeflex::sim
