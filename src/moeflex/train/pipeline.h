// The pipeline executor: runs one rank's actions of a StepPlan (schedule/) on the
// model chunks it holds, moving activations and gradients between stages with
// send/recv on the pipeline group (or by hand-off when both stages are local).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "moeflex/comm/communicator.h"
#include "moeflex/model/model.h"
#include "moeflex/schedule/plan.h"
#include "moeflex/train/trace.h"

namespace moeflex {

/// Fills ids and targets [B*S] of a micro-batch (0 .. M-1 within the step).
using BatchFn = std::function<void(int microbatch, std::int32_t* ids, std::int32_t* targets)>;

class PipelineExecutor {
 public:
  /// plan: the step plan of the whole pipeline; pp_rank: this rank in it;
  /// stages: the model chunk of every stage this rank holds (plan.stages_of(pp_rank));
  /// pp_group: the pipeline communicator (rank i = pipeline rank i).
  PipelineExecutor(const StepPlan& plan, int pp_rank, std::map<int, MoEModel*> stages,
                   comm::Communicator* pp_group, Arena& arena, std::int64_t B, std::int64_t S, std::int64_t d);

  /// Runs the plan once: every micro-batch's forward and backward on this rank's
  /// stages, gradients accumulated with grad_scale. Returns this rank's share of the
  /// summed micro-batch losses (ce on the last stage's rank; aux and z of its stages).
  LossParts run_step(const BatchFn& batch, double grad_scale);

  /// Forward-only pass of one batch through the pipeline (stages in order, nothing
  /// kept). Returns this rank's share of the losses (as run_step, for one batch).
  LossParts forward_eval(const std::int32_t* ids, const std::int32_t* targets);

  /// Records every action of the following steps (compute and comm tracks, a device
  /// memory counter) into `trace`; null stops recording.
  void set_trace(train::TraceWriter* trace) { trace_ = trace; }

  /// Seconds this rank spent in compute actions (F, B, W) during the last run_step;
  /// the rest of the step is pipeline bubble and communication.
  double last_compute_seconds() const { return compute_seconds_; }

  /// This rank's step as the memory walk replays it (stages, stashes, actions).
  const StepProgram& step_program() const { return program_; }
  /// Routing statistics of the MoE-layer forwards this rank ran since clear_routing().
  std::vector<RoutingStats> routing() const;
  void clear_routing();

 private:
  using Key = std::pair<int, int>;  // (micro-batch, stage)
  Tensor buffer(const char* name);
  // Before action `ai`: compacts the arena when its largest free block may not hold
  // what the action adds (core/arena.h, "Action-scoped placement").
  void prepare_placement(std::size_t ai, ActionKind kind);
  std::vector<Bytes> action_need_;  // per action of this rank: the most bytes it added (-1: not run yet)
  StepProgram program_;              // this rank's step for the planner's projections
  std::vector<std::size_t> walk_at_;  // action index -> index of its step in program_.actions
  const StepPlan& plan_;
  int rank_;
  std::map<int, MoEModel*> stages_;
  comm::Communicator* pp_;
  Arena& arena_;
  std::int64_t B_, S_, d_;
  double compute_seconds_ = 0;
  train::TraceWriter* trace_ = nullptr;
};

}  // namespace moeflex
