// One training step of a model on a single rank (1-rank world and layout), every
// backend op going through a ProfilingBackend: the fixture of the tests that compare
// a real step's ops with their prices (the op profiler, the simulator's op stream).
#pragma once

#include <string>

#include "model_fixtures.h"
#include "moeflex/comm/layout.h"
#include "moeflex/provision/policies.h"
#include "moeflex/train/distributed.h"
#include "moeflex/profile/op_profiler.h"
#include "moeflex/train/replica.h"

namespace moeflex::test {

/// Runs one step (M micro-batches of B x S skewed tokens, test::skewed_batch) of
/// `cfg` under `schedule`, provisioned by the static `policy`, on `arena`, recording
/// into `profiler` (step 1; trace events into `trace` when not null). Returns the
/// rank's step plan.
inline StepPlan run_profiled_step(const ModelConfig& cfg, const std::string& schedule, const std::string& policy,
                                  Arena& arena, ProfilingBackend& profiler, std::int64_t M, std::int64_t B,
                                  std::int64_t S, train::TraceWriter* trace = nullptr) {
  ScopedBackendOverride over(&profiler);
  auto world = comm::make_world_communicator();
  comm::LayoutSpec spec;
  spec.world_size = 1;
  spec.num_layers = int(cfg.num_hidden_layers);
  spec.num_experts = int(cfg.num_experts);
  comm::ParallelLayout layout(spec);
  comm::ParallelGroups groups = comm::make_groups(*world, layout);
  Replica replica(cfg, schedule, layout, groups, arena, M, B, S);
  replica.init_weights(3);
  for (MoEModel* c : replica.chunks()) c->stash().set_policy(make_static_policy(policy));
  StepPlan plan = replica.plan();
  profiler.begin_step(1, trace);
  replica.forward_backward(
      [&](int mb, std::int32_t* ids, std::int32_t* tg) { skewed_batch(mb, B * S, cfg.vocab_size, ids, tg); });
  profiler.end_step(1.0, 1.0);
  return plan;
}

}  // namespace moeflex::test
