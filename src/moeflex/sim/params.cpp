// Parameter placement and the work on parameters (simulator.h, simulation.h): which
// parameter tensors a pipeline rank holds (for_each_param_tensor), their persistent
// bytes, the time of the optimizer step and of the ordered all-reduce's local sum, and
// a step's gradient reduction and optimizer over the layout (parameter_work).
#include <algorithm>
#include <cmath>

#include "moeflex/core/arena.h"
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
