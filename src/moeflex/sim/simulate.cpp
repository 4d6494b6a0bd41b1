// The simulation (simulator.h: simulate), as an outline of named steps: the inputs
// checked and the layout placed (Simulation::setup), the per-rank inputs and the
// budget checked, the parameter work priced; then per iteration the provisioning and
// memory walks of every pipeline rank, its actions priced (pricing.cpp), the plan run
// in virtual time (timeline.cpp) and the iteration accounted; last the report's
// means, restart losses and trace (report.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "moeflex/core/error.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

namespace {

/// What simulate() carries from step to step besides the Simulation: the report it
/// fills, what is fixed before the first iteration, and the sums over iterations.
struct Run {
  Simulation& sim;
  SimReport rep{};
  bool adaptive = false;            ///< SimOptions::policy is adaptive
  std::vector<Bytes> persist{};     ///< per pipeline rank: weights, gradients, optimizer state
  Seconds optimizer_ops = 0;        ///< the optimizer's priced work summed over the pipeline ranks (SimReport::ops)
  Seconds msg_time = 0;             ///< one pipeline message (activations or their gradients)
  bool shared = false;              ///< processes (ranks) time-share fewer host cores: run_plan's CoreSharing
  int iters = 1;                    ///< iterations simulated
  double step_sum = 0, bubble_sum = 0, comm_sum = 0, recompute_sum = 0;  ///< over iterations
  Seconds failed_attempts = 0;      ///< each OOM's restart and failed iteration
  PlanTimeline last{};              ///< the last iteration's timeline (the ranks' times, the trace)
  Policies last_policy{};           ///< and its provisioning
};

/// The report's inputs and every pipeline rank's persistent bytes; checks the
/// policy's name and the trace ranks before any work.
Run start_run(Simulation& sim) {
  const SimOptions& o = sim.o;
  Run run{sim};
  SimReport& rep = run.rep;
  rep.options = o;
  rep.num_microbatches = sim.m;
  rep.memory_limit = sim.limit;
  for (const auto& s : sim.stages) rep.stage_layers.push_back(s.last_layer - s.first_layer);
  rep.ranks.resize(std::size_t(sim.P));
  run.adaptive = o.policy == "adaptive";
  if (!run.adaptive) recomputes(o.policy, ActivationSpec{"attn.probs", "", 0, true, {}, false, -1, {}}, 1.0);  // validates the name
  if (run.adaptive) rep.adaptive_level_histogram.assign(adaptive_levels().size(), 0);
  run.persist.resize(std::size_t(sim.P));
  for (int r = 0; r < sim.P; ++r)
    run.persist[std::size_t(r)] = rep.ranks[std::size_t(r)].persistent_bytes = sim.persistent(r);
  for (int r : o.trace_ranks)  // before the work, not after it
    if (r < 0 || r >= sim.P)
      throw ConfigError(fmt::format("--trace-ranks: pipeline rank {} is not in [0, {})", r, sim.P));
  run.iters = std::max(o.iterations, 1);
  return run;
}

/// A budget that cannot hold the persistent state fails every iteration at once;
/// the adaptive policy needs the trainer's minimum budget (it refuses less).
void check_budget(const Run& run) {
  const Simulation& sim = run.sim;
  for (int r = 0; r < sim.P; ++r)
    if (run.persist[std::size_t(r)] > sim.limit)
      throw ConfigError(fmt::format(
          "memory limit {} ({} B per device: --memory, or the cluster's usable memory) cannot hold pipeline rank "
          "{}'s persistent state: {} ({} B) of weights, gradients and optimizer state for {}",
          format_bytes(sim.limit), sim.limit, r, format_bytes(run.persist[std::size_t(r)]),
          run.persist[std::size_t(r)], sim.o.parallel.str()));
  if (run.adaptive)
    for (int r = 0; r < sim.P; ++r)
      if (const Bytes need = sim.adaptive_minimum(r); need > sim.limit)
        throw ConfigError(fmt::format(
            "memory limit {} ({} B per device) is below the smallest budget for which adaptive provisioning can "
            "guarantee no out-of-memory error on pipeline rank {}: {} ({} B: {} of weights, gradients and optimizer "
            "state, plus one step with every activation recomputed or offloaded and worst-case expert routing), "
            "as `moeflex train` refuses it",
            format_bytes(sim.limit), sim.limit, r, format_bytes(need), need,
            format_bytes(run.persist[std::size_t(r)])));
}

/// Model FLOPs of one iteration (all replicas; recompute not counted).
double model_flops_per_iteration(const Simulation& sim) {
  const SimOptions& o = sim.o;
  double f = 0;
  for (int l = 0; l < sim.cfg.num_hidden_layers; ++l) f += layer_forward_flops(sim.cfg, l, o.micro_batch_size, o.seq_len);
  f += head_forward_flops(sim.cfg, o.micro_batch_size, o.seq_len);
  return 3 * f * double(sim.m) * double(o.parallel.dp);
}

/// The step's fixed costs: the parameter work after the last backward, the model
/// FLOPs, one pipeline message, and whether processes share the host's cores.
void price_fixed_work(Run& run) {
  const Simulation& sim = run.sim;
  const SimOptions& o = sim.o;
  const ParallelSpec& par = o.parallel;
  const ParameterWork pw = parameter_work(sim);
  run.rep.dp_reduce_time = pw.dp_reduce;
  run.rep.optimizer_time = pw.optimizer;
  run.optimizer_ops = pw.optimizer_ops;
  run.rep.model_flops_per_iteration = model_flops_per_iteration(sim);
  const bool same_node_pp = std::int64_t(par.tp) * par.dp * par.pp <= o.cluster.gpus_per_node;
  const Bytes msg_bytes = sim.n_rank * sim.cfg.hidden_size * sim.elem;
  run.msg_time = sim.plan.num_ranks > 1 ? p2p_time(o.cluster, same_node_pp, msg_bytes) : 0;
  run.shared = o.cluster.host_cores > 0 && par.world() > o.cluster.host_cores;
}

/// Loads of iteration `it`: the hottest EP rank's ratio per micro-batch (its most
/// loaded layer's; a replayed trace's per-layer ratios enter the times in price_step).
std::vector<double> microbatch_ratios(const Simulation& sim, int it) {
  std::vector<double> mb_ratio(static_cast<std::size_t>(sim.m));
  for (int mb = 0; mb < sim.m; ++mb) {
    double r = 1;
    for (int l = 0; l < sim.cfg.num_hidden_layers; ++l) r = std::max(r, sim.ratio(it, mb, l));
    mb_ratio[std::size_t(mb)] = r;
  }
  return mb_ratio;
}

/// The adaptive policy's provisioning of pipeline rank r: the cheapest (calm level
/// u, spike level s >= u) whose walk fits, into `pol`; returns the rank's bytes at
/// it, `dp_walks` each data-parallel rank's walk (per-rank replays). Counts the
/// chosen levels in the histogram.
Bytes adaptive_walk(Run& run, int r, int it, const std::vector<double>& mb_ratio, std::vector<std::string>& pol,
                    std::vector<Bytes>& dp_walks) {
  Simulation& sim = run.sim;
  const double calm_max = sim.o.loads.calm_max;
  const auto& L = adaptive_levels();
  Bytes hot = 0;
  bool fit = false;
  for (std::size_t u = 0; u < L.size() && !fit; ++u)
    for (std::size_t s = u; s < L.size() && !fit; ++s) {
      for (int mb = 0; mb < sim.m; ++mb) pol[std::size_t(mb)] = L[mb_ratio[std::size_t(mb)] > calm_max ? s : u];
      hot = sim.rank_bytes(run.persist[std::size_t(r)], sim.walk_peak(r, it, mb_ratio, pol, &dp_walks));
      fit = hot <= sim.limit;
      if (!fit && s + 1 < L.size()) {
        bool any_spike = false;
        for (double x : mb_ratio) any_spike |= x > calm_max;
        if (!any_spike) break;  // raising the spike level changes nothing
      }
    }
  for (int mb = 0; mb < sim.m; ++mb)
    ++run.rep.adaptive_level_histogram[std::size_t(std::find(L.begin(), L.end(), pol[std::size_t(mb)]) - L.begin())];
  return hot;
}

/// Pipeline rank r's bytes at balanced loads (the adaptive policy at its calm
/// level, and never above its hot walk once over the limit).
Bytes balanced_peak(Run& run, int r, const std::vector<std::string>& pol, Bytes hot) {
  Simulation& sim = run.sim;
  const std::vector<double> calm(std::size_t(sim.m), 1.0);
  std::vector<std::string> pol_calm = pol;
  if (run.adaptive) std::fill(pol_calm.begin(), pol_calm.end(), adaptive_levels()[0]);
  Bytes bal = sim.rank_bytes(run.persist[std::size_t(r)], sim.walk(r, -1, calm, pol_calm));
  if (run.adaptive && bal > sim.limit) bal = std::min(bal, hot);
  return bal;
}

/// Pipeline rank r's bytes with micro-batch 0 at SimOptions::spike_check's ratio.
Bytes spike_peak(Run& run, int r, const std::vector<double>& mb_ratio, const std::vector<std::string>& pol) {
  Simulation& sim = run.sim;
  std::vector<double> spiked = mb_ratio;
  spiked[0] = std::max(spiked[0], sim.o.spike_check);
  std::vector<std::string> pol_spiked = pol;
  Bytes spike = sim.rank_bytes(run.persist[std::size_t(r)], sim.walk(r, -1, spiked, pol_spiked));
  if (run.adaptive) {
    // The spike gets the cheapest level from its calm one up whose walk fits (as
    // the iteration's own choice above), the most-saving one when none fits.
    const auto& L = adaptive_levels();
    for (auto lv = std::size_t(std::find(L.begin(), L.end(), pol[0]) - L.begin()) + 1;
         spike > sim.limit && lv < L.size(); ++lv) {
      pol_spiked[0] = L[lv];
      spike = sim.rank_bytes(run.persist[std::size_t(r)], sim.walk(r, -1, spiked, pol_spiked));
    }
  }
  return spike;
}

/// Provisions and walks pipeline rank r in iteration `it` (its policy per
/// micro-batch into `pol`), keeping its peaks in the report; true when it runs out
/// of memory.
bool walk_rank_memory(Run& run, int r, int it, const std::vector<double>& mb_ratio, std::vector<std::string>& pol) {
  Simulation& sim = run.sim;
  RankReport& rr = run.rep.ranks[std::size_t(r)];
  const Bytes persist = run.persist[std::size_t(r)];
  std::vector<Bytes> dp_walks;  // per data-parallel rank (per-rank replays)
  const Bytes hot = run.adaptive ? adaptive_walk(run, r, it, mb_ratio, pol, dp_walks)
                                 : sim.rank_bytes(persist, sim.walk_peak(r, it, mb_ratio, pol, &dp_walks));
  if (!dp_walks.empty()) {
    rr.dp_rank_peak_bytes.resize(dp_walks.size(), 0);
    for (std::size_t q = 0; q < dp_walks.size(); ++q)
      rr.dp_rank_peak_bytes[q] = std::max(rr.dp_rank_peak_bytes[q], sim.rank_bytes(persist, dp_walks[q]));
  }
  rr.peak_bytes = std::max(rr.peak_bytes, hot);
  if (it == 0) rr.peak_balanced_bytes = balanced_peak(run, r, pol, hot);
  if (sim.o.spike_check > 0 && it == 0)
    run.rep.spike_peak_bytes = std::max(run.rep.spike_peak_bytes, spike_peak(run, r, mb_ratio, pol));
  return hot > sim.limit;
}

/// The provisioning of iteration `it` for every pipeline rank and micro-batch, with
/// the memory walks (SimOptions::walk_memory; without them adaptive runs at none).
/// Sets `oom` when some rank runs out of memory.
Policies provision(Run& run, int it, const std::vector<double>& mb_ratio, bool& oom) {
  const SimOptions& o = run.sim.o;
  Policies policy(std::size_t(run.sim.P), std::vector<std::string>(std::size_t(run.sim.m), o.policy));
  oom = false;
  for (int r = 0; r < run.sim.P && o.walk_memory; ++r)
    if (walk_rank_memory(run, r, it, mb_ratio, policy[std::size_t(r)])) oom = true;
  if (!o.walk_memory)
    for (auto& pol : policy)
      for (auto& x : pol)
        if (x == "adaptive") x = "none";
  return policy;
}

/// Runs the plan in virtual time at `costs`, the host's cores shared when
/// processes outnumber them.
PlanTimeline run_step(const Run& run, const StepCosts& costs) {
  const SimOptions& o = run.sim.o;
  const ParallelSpec& par = o.parallel;
  return run_plan(
      run.sim.plan, [&](int, const Action& a) { return costs.of(a); }, [&](const Action&) { return run.msg_time; },
      o.overlap_pair_comm,
      run.shared ? CoreSharing{o.cluster.host_cores, par.dp * par.tp, kCommPollSeconds,
                               o.cluster.profile.time_sharing_efficiency, o.cluster.profile.nap_cost,
                               o.cluster.profile.nap_overshoot}
                 : CoreSharing{});
}

/// Adds iteration `it` to the sums: its op stream, step time, bubble, exposed comm,
/// recompute, and an OOM's restart and rolled-back iterations.
void account_iteration(Run& run, int it, const StepCosts& costs, PlanTimeline tl, Policies policy, bool oom) {
  const SimOptions& o = run.sim.o;
  SimReport& rep = run.rep;
  const int P = run.sim.P, iters = run.iters;
  if (o.breakdown) {
    add_breakdown(rep.ops, costs.ops, 1.0 / iters);
    OpTally& opt = rep.ops[{"optimizer", "optimizer_step"}];
    opt.count += double(P) / iters;
    opt.seconds += run.optimizer_ops / iters;
  }
  const Seconds step = tl.makespan + rep.dp_reduce_time + rep.optimizer_time;
  run.step_sum += step;
  rep.step_time_max = std::max(rep.step_time_max, step);
  double idle = 0;
  for (int r = 0; r < P; ++r) idle += tl.idle[std::size_t(r)];
  run.bubble_sum += tl.makespan > 0 ? idle / (double(P) * tl.makespan) : 0;
  int crit = int(std::max_element(tl.finish.begin(), tl.finish.end()) - tl.finish.begin());
  run.comm_sum += tl.comm[std::size_t(crit)] + rep.dp_reduce_time;
  run.recompute_sum += *std::max_element(costs.recompute.begin(), costs.recompute.end());
  if (oom) {
    ++rep.ooms;
    const int lost = it % std::max(o.checkpoint_interval, 1);
    rep.lost_iterations += lost;
    rep.restart_time += o.restart_seconds + step * (lost + 1);  // the failed iteration and the redone ones
    run.failed_attempts += o.restart_seconds + step;
  }
  run.last = std::move(tl);
  run.last_policy = std::move(policy);
}

/// The report's means over iterations, its throughput with and without restart
/// losses, and the ranks' times of the last iteration.
void finish_report(Run& run) {
  const SimOptions& o = run.sim.o;
  const ParallelSpec& par = o.parallel;
  SimReport& rep = run.rep;
  const int iters = run.iters;
  rep.step_time = run.step_sum / iters;
  rep.bubble_fraction = run.bubble_sum / iters;
  rep.exposed_comm = run.comm_sum / iters;
  rep.recompute_time = run.recompute_sum / iters;
  const double tokens = double(run.sim.m) * double(par.dp) * double(o.micro_batch_size) * double(o.seq_len);
  const double world = par.world();
  rep.tgs = tokens / (rep.step_time * world);
  rep.mfu = o.cluster.peak_flops > 0 ? rep.model_flops_per_iteration / (rep.step_time * world * o.cluster.peak_flops) : 0;
  if (rep.ooms == iters) {
    // No iteration fits: none completes, so a restart has nothing to redo (none is
    // rolled back) and its retry fails again. The run makes no progress.
    rep.lost_iterations = 0;
    rep.restart_time = run.failed_attempts;
    rep.effective_tgs = rep.effective_mfu = 0;  // SimReport::note says why (below)
  } else {
    const Seconds total = run.step_sum + rep.restart_time;
    rep.effective_tgs = tokens * iters / (total * world);
    rep.effective_mfu = rep.mfu * run.step_sum / total;
  }
  for (int r = 0; r < run.sim.P; ++r) {
    RankReport& rr = rep.ranks[std::size_t(r)];
    rr.pp_rank = r;
    rr.busy = run.last.busy[std::size_t(r)];
    rr.comm = run.last.comm[std::size_t(r)];
    rr.idle = run.last.idle[std::size_t(r)];
    rep.peak_bytes = std::max(rep.peak_bytes, rr.peak_bytes);
  }
  if (rep.ooms == iters)
    rep.note = fmt::format("every iteration ran out of memory (peak {} over the limit {}): none completes, so the "
                           "effective TGS is 0",
                           format_bytes(rep.peak_bytes), format_bytes(run.sim.limit));
}

}  // namespace

SimReport simulate(const SimOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  Simulation sim(o);
  sim.setup();                          // inputs checked; the layout, plans and stages placed
  Run run = start_run(sim);             // the report's inputs, each rank's persistent bytes
  if (o.walk_memory) check_budget(run);  // the limit holds every rank's persistent state
  price_fixed_work(run);                // gradient reduction, optimizer, FLOPs, messages
  for (int it = 0; it < run.iters; ++it) {
    const std::vector<double> mb_ratio = microbatch_ratios(sim, it);
    bool oom = false;
    Policies policy = provision(run, it, mb_ratio, oom);  // per-rank memory: provisioning and walks
    const StepCosts costs = price_step(sim, it, policy, run.shared);
    PlanTimeline tl = run_step(run, costs);  // the timeline
    account_iteration(run, it, costs, std::move(tl), std::move(policy), oom);
  }
  finish_report(run);  // the report
  run.rep.trace = chrome_trace(sim, run.last, run.last_policy, run.rep, run.msg_time);
  run.rep.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return std::move(run.rep);
}

}  // namespace moeflex::sim
