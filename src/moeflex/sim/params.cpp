// Parameter placement and the work on parameters (simulator.h, simulation.h): which
// parameter tensors a pipeline rank holds (for_each_param_tensor), their persistent
// bytes, the time of the optimizer step and of the ordered all-reduce's local sum, and
// a step's gradient reduction and optimizer over the layout (parameter_work).
#include <algorithm>
#include <cmath>

#include "moeflex/core/arena.h"
#include "moeflex/model/parameters.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

namespace {

/// Bytes of one tensor of `numel` elements at `bytes_per_element` (fractional for
/// sharded optimizer state), rounded as the arena rounds every allocation.
Bytes tensor_bytes(double numel, double bytes_per_element) {
  return Arena::round_up(Bytes(std::ceil(numel * bytes_per_element)));
}

}  // namespace

void for_each_param_tensor(const ModelConfig& cfg, const ParallelSpec& par, const std::vector<std::pair<int, int>>& ranges,
                           bool embedding, bool head, const std::function<void(double, bool)>& add) {
  // The engine's own parameter list (model/parameters.h), each tensor as one tp rank holds it.
  // A layer's list depends on its kind only: sized once per kind (the search calls this often).
  const std::int64_t local_experts = cfg.num_experts / std::max(par.ep, 1);  // (ep divides the experts)
  std::vector<std::pair<double, bool>> kind[2];
  bool sized[2] = {false, false};
  for (auto [first, last] : ranges)
    for (int l = first; l < last; ++l) {
      const int moe = cfg.is_moe_layer(l) ? 1 : 0;
      if (!sized[moe]) {
        for (const ParamSpec& p : layer_parameters(cfg, l, local_experts))
          kind[moe].emplace_back(p.numel_per_rank(cfg, par.tp), p.expert);
        sized[moe] = true;
      }
      for (const auto& [numel, expert] : kind[moe]) add(numel, expert);
    }
  if (embedding) add(embedding_parameter(cfg).numel_per_rank(cfg, par.tp), false);
  if (head) {
    add(final_norm_parameter(cfg).numel_per_rank(cfg, par.tp), false);
    if (!cfg.tie_word_embeddings || !embedding) add(lm_head_parameter(cfg).numel_per_rank(cfg, par.tp), false);
  }
}

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

ParameterWork parameter_work(const Simulation& sim) {
  const SimOptions& o = sim.o;
  const ParallelSpec& par = o.parallel;
  ParameterWork pw;
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
  for (int r = 0; r < sim.P; ++r) {
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
    pw.optimizer_ops += rank_opt;
  }
  // Every process reduces its gradients and runs its optimizer at once (the CPU
  // engine's reductions are its own copies and sums): with more processes than the
  // host's cores they share them.
  const double shared_by = o.cluster.host_cores > 0 ? std::max(1.0, double(par.world()) / o.cluster.host_cores) : 1.0;
  pw.dp_reduce = dp_t * shared_by;
  pw.optimizer = opt_t * shared_by;
  return pw;
}

}  // namespace moeflex::sim
