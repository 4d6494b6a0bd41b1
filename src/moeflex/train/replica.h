// Replica: what one rank holds of the model under a parallel layout — the chunk of
// every pipeline stage it owns (one MoEModel each, with its expert shard) — and how
// it runs a training step: the schedule's plan through the PipelineExecutor, then
// gradient reduction over data-parallel, expert-data-parallel and tied-embedding
// groups. One pipeline rank with one stage is the plain single-process case.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moeflex/comm/layout.h"
#include "moeflex/model/model.h"
#include "moeflex/schedule/plan.h"
#include "moeflex/train/pipeline.h"

namespace moeflex {

class Replica {
 public:
  /// schedule: a name of make_schedule(); M: micro-batches per step on this rank;
  /// B, S: micro-batch shape. Throws ConfigError when the schedule does not fit
  /// the layout (e.g. dualpipev needs vpp = 2, interleaved M % pp == 0).
  Replica(const ModelConfig& cfg, const std::string& schedule, const comm::ParallelLayout& layout,
          comm::ParallelGroups& groups, Arena& arena, std::int64_t M, std::int64_t B, std::int64_t S);

  void init_weights(std::uint64_t seed);
  void zero_grads();

  /// One step's forward and backward of this rank's M micro-batches (batch(mb, ...)
  /// with mb local, 0..M-1), then gradients reduced across replicas. Returns the
  /// global loss: mean over micro-batches and data-parallel replicas.
  LossParts forward_backward(const BatchFn& batch);
  /// Global gradient norm across the layout; clips when max_norm > 0.
  double clip_grad_norm(double max_norm);
  /// MoEModel::update_expert_bias for every chunk, over the data-parallel group.
  void update_expert_bias();
  /// The global loss of one evaluation batch (forward only, through the pipeline).
  LossParts evaluate(const std::int32_t* ids, const std::int32_t* targets);

  /// Seconds of compute (F, B, W) in the last forward_backward on this rank.
  double last_compute_seconds() const { return executor_->last_compute_seconds(); }

  /// Records the following steps into `trace` (null stops): compute and comm tracks
  /// and a device-memory counter from the executor, the step's gradient and loss
  /// reductions ("dp all-reduce" on the comm track), and every copy of the chunks'
  /// copy engines (offloads and prefetches, with their bytes) on a "copy" track.
  /// `trace` must outlive the recording: call set_trace(nullptr) before it goes.
  void set_trace(train::TraceWriter* trace);

  std::vector<Param*> params();
  std::vector<MoEModel*> chunks();
  const StepPlan& plan() const { return plan_; }
  /// This rank's step as the memory walk replays it (for projections and feasibility).
  const StepProgram& step_program() const { return executor_->step_program(); }
  /// Routing statistics of the MoE-layer forwards since clear_routing().
  std::vector<RoutingStats> routing() const { return executor_->routing(); }
  void clear_routing() { executor_->clear_routing(); }

 private:
  LossParts global_loss(LossParts local, double divide_by);
  const ModelConfig cfg_;
  const comm::ParallelLayout& layout_;
  comm::ParallelGroups& groups_;
  Arena& arena_;
  StepPlan plan_;
  std::vector<std::unique_ptr<MoEModel>> chunks_;
  std::unique_ptr<PipelineExecutor> executor_;
  std::int64_t M_;
  train::TraceWriter* trace_ = nullptr;
};

}  // namespace moeflex
