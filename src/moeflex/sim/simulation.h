// Internal to sim/: the state one simulation carries from its checked inputs to its
// report (Simulation: the layout, the plans, the stages, layer costs by load and the
// memory walks of each pipeline rank), and the parameter helpers the sim/ files share.
// Not part of the public API (simulator.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moeflex/model/layer_cost.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/schedule/plan.h"
#include "moeflex/sim/simulator.h"

namespace moeflex::sim {

/// A global stage's model content.
struct StageInfo {
  int first_layer = 0, last_layer = 0;  ///< real layers [first, last) (padding dropped)
  bool embedding = false, head = false;
};

/// Ranks that hold the same routed experts and so reduce their gradients together
/// (and shard their optimizer state): the routed experts are whole on each of the tp
/// ranks of a replica, which run their own n / tp tokens through them (expert tensor
/// parallelism 1, as Megatron-Core's MoE parallel folding allows), times the dp / ep
/// replicas of an expert shard: tp x dp / ep.
int expert_data_parallel(const ParallelSpec& par);

/// Calls add(numel, expert) for every parameter tensor one rank holds of layers
/// `ranges` and the ends, in model.cpp's order (one all-reduce each in the engine's
/// reduce_gradients; expert: routed-expert weights, reduced over
/// expert_data_parallel()).
void for_each_param_tensor(const ModelConfig& cfg, const ParallelSpec& par, const std::vector<std::pair<int, int>>& ranges,
                           bool embedding, bool head, const std::function<void(double, bool)>& add);

/// One simulation's inputs, layout and per-rank model, built by setup() and read by
/// every step of simulate().
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

  /// Takes the options; setup() checks and builds the rest.
  explicit Simulation(const SimOptions& opt);
  Bytes elem = 4;  // bytes of an activation element, in memory and on the wire

  /// The rows one MoE layer of this rank holds and receives when its EP rank is at
  /// `ratio` times the balanced load (capped at the worst case).
  MoERows rows_at(double ratio) const;

  /// The priced work of layer l at `ratio` (SimCache::layers: computed once per shape).
  const LayerCost& layer_at(int l, double ratio);

  /// The expert all-to-alls of one layer (dispatch and combine), forward or backward.
  Seconds layer_a2a(const LayerCost& lc) const;

  /// Blocking collectives of one layer, forward or backward: its all-to-alls and the
  /// tensor-parallel all-gathers / reduce-scatters.
  Seconds layer_comm(const LayerCost& lc) const;

  /// Checks the layout against the model and cluster (ConfigError naming the rule),
  /// then builds the plans, the stages and the placements (layout.cpp).
  void setup();
  /// Model chunks a pipeline rank holds: vpp, or DualPipeV's 2.
  int chunks_per_rank() const;
  /// The layout's rules against the model, the cluster and the schedule (setup).
  void check_layout() const;
  /// The step plan, and the shorter one the memory walks replay where that keeps the peak (setup).
  void make_plans();
  /// A per-rank replay's recording against this layout and micro-batch (make_plans).
  void check_replay() const;
  /// The global stages' layers and ends, the MoE layer index, the limit, and the
  /// ends' and boundary copies' costs (setup).
  void place_stages(const std::vector<int>& stage_layers);

  /// The hottest EP rank's load ratio of (iteration, micro-batch, layer); 1 for a dense layer.
  double ratio(int it, int mb, int layer) const;

  /// Persistent bytes of pipeline rank r.
  Bytes persistent(int r) const;

  /// The memory walk's view of pipeline rank r's stages (its chunks, in order).
  std::vector<StageSpec> stage_specs(int r) const;

  /// The smallest budget under which the adaptive planner's invariant holds for
  /// pipeline rank r (the trainer's refusal): its persistent bytes plus the peak of
  /// one step with every decided activation at its most memory-saving provision and
  /// every MoE layer at its worst-case routing (minimum_budget, model/memory_plan.h).
  Bytes adaptive_minimum(int r) const;

  /// Peak bytes of pipeline rank r's activations and buffers (MemoryWalk, fp32,
  /// persistent bytes excluded) over one iteration, with per-micro-batch ratios and
  /// provisioning policies.
  Bytes walk(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy);

  /// Peak bytes of data-parallel rank q of pipeline rank r (as walk()), at the rows
  /// that rank recorded (SimOptions::loads per_rank()): exact for that rank.
  Bytes walk_rank(int r, int it, int q, const std::vector<std::string>& mb_policy);

  /// Peak activation bytes of pipeline rank r in iteration `it`: the largest of its
  /// data-parallel ranks' exact walks when the loads give every rank's rows, else the
  /// upper bound of walk() at the hottest EP rank's loads of every micro-batch.
  /// `per_rank` (when not null) receives each data-parallel rank's walk (per-rank replays only).
  Bytes walk_peak(int r, int it, const std::vector<double>& mb_ratio, const std::vector<std::string>& mb_policy,
                  std::vector<Bytes>* per_rank = nullptr);

  /// The layer costs of the dp processes of one pipeline rank for (iteration,
  /// micro-batch, MoE layer l) whose hottest EP rank is at ratio `hot`: each rank's
  /// own recorded rows in a per-rank replay; else, in each EP group, one rank at
  /// `hot` and the other ep - 1 sharing the rest of the group's rows evenly, at
  /// (ep - hot) / (ep - 1) each (the group's total is conserved).
  std::vector<const LayerCost*> group_layers(int it, int mb, int l, double hot);

  /// A rank's bytes: its persistent state plus a walk's activation peak.
  Bytes rank_bytes(Bytes persistent_b, Bytes act) const { return persistent_b + act; }
};

/// The provisioning of every pipeline rank's micro-batches: a static policy name or
/// an adaptive level, [pipeline rank][micro-batch].
using Policies = std::vector<std::vector<std::string>>;

/// Whether `policy` (a provisioning level, a static policy or threshold[=R]) drops
/// activation `a` for backward to recompute, at load ratio `ratio` (pricing.cpp).
/// Throws ConfigError for an unknown policy name.
bool recomputes(const std::string& policy, const ActivationSpec& a, double ratio);

/// One iteration's priced compute actions (price_step).
struct StepCosts {
  int m = 0;                         ///< micro-batches of the iteration
  std::vector<ActionCost> F, Bi, W;  ///< per (stage, micro-batch) at stage x m + micro-batch
  std::vector<Seconds> recompute;    ///< per pipeline rank: its layers' recompute in backward
  OpBreakdown ops;                   ///< the op stream (SimOptions::breakdown only)
  /// The cost of a compute action of the plan; a whole Backward is B's then W's.
  ActionCost of(const Action& a) const;
};

/// Prices every (stage, micro-batch) of iteration `it` at the hottest EP rank's
/// loads under `policy`; with `shared` (processes time-sharing fewer host cores),
/// also their segments and core-seconds over the dp x tp processes (pricing.cpp).
StepCosts price_step(Simulation& sim, int it, const Policies& policy, bool shared);

/// The step's work on parameters after the last backward, the slowest pipeline rank's
/// (params.cpp).
struct ParameterWork {
  Seconds dp_reduce = 0;      ///< the gradient reduction (SimReport::dp_reduce_time)
  Seconds optimizer = 0;      ///< the optimizer step (SimReport::optimizer_time)
  Seconds optimizer_ops = 0;  ///< the optimizer's priced work summed over the pipeline ranks (SimReport::ops)
};

/// Prices the data-parallel gradient reduction (with the tied embedding's sync over
/// the pipeline) and the optimizer step of every pipeline rank (params.cpp).
ParameterWork parameter_work(const Simulation& sim);

/// The Chrome trace of SimOptions::trace_ranks (times in microseconds): the plan's
/// actions on timeline `tl` under `policy`, then the gradient reduction and the
/// optimizer of `rep` (report.cpp).
nlohmann::json chrome_trace(const Simulation& sim, const PlanTimeline& tl, const Policies& policy, const SimReport& rep,
                            Seconds msg_time);

}  // namespace moeflex::sim
