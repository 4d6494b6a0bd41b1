// The simulation (simulator.h: simulate): inputs checked, provisioning and memory
// walks per pipeline rank and iteration, every action priced at its loads, the plan
// run in virtual time, and the report's times, OOMs and trace.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "moeflex/provision/policies.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

namespace {

using nlohmann::json;


/// What recomputes under a provisioning level or static policy.
bool recomputes(const std::string& policy, const ActivationSpec& a, double ratio) {
  if (!a.recomputable || policy == "none") return false;
  if (const double r = threshold_ratio(policy); r > 0) return ratio > r && static_policy_recomputes("moe-full", a.name);
  return static_policy_recomputes(policy, a.name);
}

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

}  // namespace moeflex::sim
