// One simulation's per-rank model (simulation.h): layer costs by load (shared through
// SimCache), the collectives of a layer, persistent bytes and the adaptive minimum of
// a pipeline rank, and its memory walks (MemoryWalk over the ledger, at the hottest EP
// rank's loads or each recorded rank's own); the per-rank maxima of simulator.h.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>

#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/policies.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

namespace {

/// The provisioning functions of a walk's policies, one per name ("none" saves
/// everything); flash attention never keeps the attention probabilities.
class PolicyFns {
 public:
  PolicyFns(const std::vector<std::string>& policies, bool flash_attention) : flash_(flash_attention) {
    for (const auto& p : policies)
      if (!fns_.count(p)) fns_.emplace(p, p == "none" ? ProvisionFn{} : make_static_policy(p));
  }
  /// The provision of ledger entry `e` under policy `name`.
  Provision operator()(const LedgerEntry& e, const std::string& name) const {
    if (flash_ && e.name == "attn.probs") return Provision::recompute;
    const ProvisionFn& f = fns_.at(name);
    return f ? f(e) : Provision::save;
  }

 private:
  bool flash_;
  std::map<std::string, ProvisionFn> fns_;
};

}  // namespace

Simulation::Simulation(const SimOptions& opt)
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

MoERows Simulation::rows_at(double ratio) const {
  MoERows r = MoERows::balanced(cfg, n_rank);
  if (o.parallel.ep > 1) {
    const MoERows cap = MoERows::worst_case(cfg, n_rank, o.parallel.ep);
    // Capped before rounding: a huge ratio would overflow llround.
    r.received = std::llround(std::min(double(cap.received), ratio * double(r.received)));
  }
  return r;
}

const LayerCost& Simulation::layer_at(int l, double ratio) {
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

Seconds Simulation::layer_a2a(const LayerCost& lc) const {
  if (lc.a2a_send_bytes <= 0 && lc.a2a_recv_bytes <= 0) return 0;
  return 2 * (o.dispatcher == "deepep"
                  ? dedup_all_to_all_time(o.cluster, ep_group, lc.a2a_send_bytes, lc.a2a_recv_bytes, cfg.num_experts,
                                          cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
                  : all_to_all_time(o.cluster, ep_group, lc.a2a_send_bytes, lc.a2a_recv_bytes));
}

Seconds Simulation::layer_comm(const LayerCost& lc) const {
  Seconds t = layer_a2a(lc);
  if (lc.tp_collective_bytes > 0) t += 4 * all_gather_time(o.cluster, tp_group, lc.tp_collective_bytes);
  return t;
}

double Simulation::ratio(int it, int mb, int layer) const {
  const int k = moe_index[std::size_t(layer)];
  return k < 0 ? 1.0 : o.loads.ratio(it, mb, m, k);
}

Bytes Simulation::persistent(int r) const {
  Bytes total = 0;
  for (int s : plan.stages_of(r)) {
    const StageInfo& si = stages[std::size_t(s)];
    // each chunk is its own model: a tied head without the embedding keeps a copy
    total += persistent_bytes(cfg, o.cluster, o.parallel, {{si.first_layer, si.last_layer}}, si.embedding, si.head);
  }
  return total;
}

std::vector<StageSpec> Simulation::stage_specs(int r) const {
  std::vector<StageSpec> specs;
  for (int s : plan.stages_of(r)) {
    const StageInfo& si = stages[std::size_t(s)];
    specs.push_back({si.first_layer, si.last_layer, si.embedding, si.head, o.parallel.ep});
  }
  return specs;
}

Bytes Simulation::adaptive_minimum(int r) const {
  StepProgram program;
  program.stages = stage_specs(r);
  program.actions = walk_actions(memory_plan, r);
  return rank_bytes(persistent(r),
                    minimum_budget(cfg, o.micro_batch_size, o.seq_len / o.parallel.tp, program, 0));
}

Bytes Simulation::walk(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy) {
  const std::vector<StageSpec> specs = stage_specs(r);
  // Micro-batch i of a shorter walk stands for the i-th most loaded of the step
  // (so a spike is walked, at the position held longest).
  const int mw = memory_plan.num_microbatches;
  std::vector<int> order(mb_ratio.size());
  std::iota(order.begin(), order.end(), 0);
  if (mw < int(mb_ratio.size()))
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return mb_ratio[std::size_t(a)] > mb_ratio[std::size_t(b)]; });
  const PolicyFns fns(mb_policy, o.cluster.flash_attention);
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
        [&](const LedgerEntry& e) { return fns(e, mb_policy[std::size_t(order[std::size_t(e.microbatch)])]); });
  return w.peak();
}

Bytes Simulation::walk_rank(int r, int it, int q, const std::vector<std::string>& mb_policy) {
  const std::vector<StageSpec> specs = stage_specs(r);
  const PolicyFns fns(mb_policy, o.cluster.flash_attention);
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
        [&](const LedgerEntry& e) { return fns(e, mb_policy[std::size_t(e.microbatch)]); });
  return w.peak();
}

Bytes Simulation::walk_peak(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy,
                std::vector<Bytes>* per_rank) {
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

std::vector<const LayerCost*> Simulation::group_layers(int it, int mb, int l, double hot) {
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

}  // namespace moeflex::sim
