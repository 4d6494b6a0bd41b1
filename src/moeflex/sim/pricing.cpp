// Pricing one iteration's compute actions (simulation.h: price_step): every (stage,
// micro-batch)'s forward, input backward and weight backward at the hottest EP
// rank's loads of that iteration, with what its provisioning recomputes, the
// blocking collectives inside its layers, and, when processes time-share fewer host
// cores, the segments between their synchronisations (ActionCost::segments).
#include <algorithm>
#include <set>

#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/policies.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

bool recomputes(const std::string& policy, const ActivationSpec& a, double ratio) {
  if (!a.recomputable || policy == "none") return false;
  if (const double r = threshold_ratio(policy); r > 0) return ratio > r && static_policy_recomputes("moe-full", a.name);
  return static_policy_recomputes(policy, a.name);
}

ActionCost StepCosts::of(const Action& a) const {
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
}

namespace {

/// The activations of layer l that policy `pol` (at load ratio `rt`) drops and
/// backward recomputes; flash attention never keeps the attention probabilities.
std::set<std::string> dropped_activations(const Simulation& sim, int l, const std::string& pol, double rt) {
  const SimOptions& o = sim.o;
  std::set<std::string> dropped;
  if (pol != "none" || o.cluster.flash_attention) {
    const auto specs = layer_activations(sim.cfg, l, o.micro_batch_size, o.seq_len / o.parallel.tp, sim.rows_at(rt),
                                         o.parallel.ep > 1);
    for (const auto& sp : specs)
      if (recomputes(pol, sp, rt) || (o.cluster.flash_attention && sp.name == "attn.probs")) dropped.insert(sp.name);
  }
  return dropped;
}

/// One (stage, micro-batch)'s three compute actions, F, B and W, summed piece by
/// piece (its layers, then the stage's ends); under core sharing also their
/// segments, and W's single one (the weight gradients have no synchronisation).
struct StageActions {
  Simulation& sim;
  int it = 0, mb = 0;
  const std::string& pol;  ///< the micro-batch's provisioning on this rank
  bool shared = false;     ///< processes time-share fewer host cores
  double dp = 1;           ///< the pipeline rank's processes: dp x tp
  OpBreakdown* bd = nullptr;     ///< the iteration's op stream (SimOptions::breakdown only)
  Seconds* recompute = nullptr;  ///< the pipeline rank's recompute time, summed layer by layer
  ActionCost f{}, b{}, w{};
  ActionCost::Segment w_all{};
  /// Each process's weight gradients (the expert rows differ), for w_all.each;
  /// known while every MoE layer's group has one entry a process.
  std::vector<Seconds> w_each{};
  bool w_each_known = false;

  /// Work every process does alike: one segment of T = t, D = t x dp.
  void same(ActionCost& a, Seconds t) const {
    if (shared && t > 0) a.segments.push_back({t, t * dp, {}});
  }
  /// Weight-gradient work every process does alike.
  void add_w(Seconds x) {
    for (Seconds& v : w_each) v += x;
  }

  void layer(int l);
  void expert_segments(int l, double rt, Seconds comm, Seconds rc);
  void stage_ends(int s, const StageInfo& si);
  void close_weight_segment();
};

void StageActions::layer(int l) {
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
  const std::set<std::string> dropped = dropped_activations(sim, l, pol, rt);
  auto is_dropped = [&](const std::string& name) { return dropped.count(name) > 0; };
  const Seconds rc = dropped.empty() ? 0 : lc.recompute_total(is_dropped);
  b.compute += rc;
  *recompute += rc;
  const bool expert_group = sim.moe_index[std::size_t(l)] >= 0 && sim.o.parallel.ep > 1;
  if (bd) {
    // The ops every process runs: an MoE layer's at each data-parallel rank's own
    // rows (their mean), while the time above follows the hottest.
    const std::vector<const LayerCost*> group =
        expert_group ? sim.group_layers(it, mb, l, rt) : std::vector<const LayerCost*>{&lc};
    for (const LayerCost* q : group) {
      OpBreakdown one = q->ops;
      if (!dropped.empty()) q->recompute_total(is_dropped, &one);
      add_breakdown(*bd, one, 1.0 / double(group.size()));
    }
  }
  if (!shared) return;
  if (expert_group) {
    expert_segments(l, rt, comm, rc);
  } else {
    same(f, lc.forward + comm);
    same(b, lc.backward_input + comm + rc);
    w_all.D += lc.backward_weight * dp;
    add_w(lc.backward_weight);
  }
  w_all.T += lc.backward_weight;
}

void StageActions::expert_segments(int l, double rt, Seconds comm, Seconds rc) {
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
}

void StageActions::stage_ends(int s, const StageInfo& si) {
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
    for (const auto& sp : head_activations(sim.cfg, sim.o.micro_batch_size, sim.o.seq_len / sim.o.parallel.tp))
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
}

void StageActions::close_weight_segment() {
  if (!shared || w_all.T <= 0) return;
  if (w_each_known && sim.o.parallel.ep > 1) {
    w_all.each = std::move(w_each);
    std::sort(w_all.each.begin(), w_all.each.end());
    w_all.T = w_all.each.back();  // no synchronisation inside: the slowest process's own sum
  }
  w.segments.push_back(w_all);
}

}  // namespace

StepCosts price_step(Simulation& sim, int it, const Policies& policy, bool shared) {
  const ParallelSpec& par = sim.o.parallel;
  const int S = sim.plan.num_stages, m = sim.m;
  StepCosts costs;
  costs.m = m;
  costs.F.resize(std::size_t(S * m));
  costs.Bi.resize(std::size_t(S * m));
  costs.W.resize(std::size_t(S * m));
  costs.recompute.assign(std::size_t(sim.P), 0);
  for (int s = 0; s < S; ++s) {
    const StageInfo& si = sim.stages[std::size_t(s)];
    const int r = sim.plan.rank_of(s);
    for (int mb = 0; mb < m; ++mb) {
      const double dp = par.dp * par.tp;
      StageActions a{sim, it, mb, policy[std::size_t(r)][std::size_t(mb)], shared, dp};
      a.bd = sim.o.breakdown ? &costs.ops : nullptr;
      a.recompute = &costs.recompute[std::size_t(r)];
      a.w_each.assign(shared ? std::size_t(dp) : 0, 0.0);
      a.w_each_known = shared;
      for (int l = si.first_layer; l < si.last_layer; ++l) a.layer(l);
      a.stage_ends(s, si);
      a.close_weight_segment();
      costs.F[std::size_t(s * m + mb)] = a.f;
      costs.Bi[std::size_t(s * m + mb)] = a.b;
      costs.W[std::size_t(s * m + mb)] = a.w;
    }
  }
  return costs;
}

}  // namespace moeflex::sim
