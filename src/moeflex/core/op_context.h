// Where the compute thread is in a training step: the plan action, micro-batch,
// stage and layer under way, and whether a recompute is running. Written by the
// executor (train/pipeline.cpp: action, micro-batch, stage, phase), the model
// (model.cpp: layer) and the stash (provision/stash.cpp: recompute), read only by
// the op profiler (profile/op_profiler.h, `moeflex train --profile-ops`), which
// labels each op it times with it. Writing it is a few thread-local stores per
// action and layer, never per op, so a run without the profiler pays nothing
// measurable for it.
#pragma once
#include <cstdint>

namespace moeflex {

/// What part of a step an op belongs to.
enum class OpPhase : std::uint8_t {
  other,            ///< outside any plan action (evaluation, set-up)
  forward,          ///< F
  backward_input,   ///< B, or the input-gradient ops of a fused B+W
  backward_weight,  ///< W, or the weight-gradient ops of a fused B+W
  recompute,        ///< rebuilding a dropped activation from its lineage (inside B)
  optimizer,        ///< gradient clipping and the AdamW update
};

/// The compute thread's position in the step (see the file comment).
struct OpContext {
  OpPhase phase = OpPhase::other;
  int action = -1;      ///< index of the plan action under way in the rank's action list; -1: none
  int microbatch = -1;  ///< its micro-batch
  int stage = -1;       ///< its global stage
  /// The layer under way: a transformer layer index, kOpLayerEmbedding, or the
  /// memory plan's kHeadLayer (1 << 20) for the final norm, LM head and loss.
  int layer = kNoLayer;
  /// True while an op profiler records: the model then tags deferred weight-gradient
  /// work with its layer (it runs later, in the W action).
  bool profiling = false;

  static constexpr int kNoLayer = -2;
};

/// The layer value of the token embedding (its lookup and gradient scatter).
inline constexpr int kOpLayerEmbedding = -1;

/// This thread's context.
inline OpContext& op_context() {
  thread_local OpContext ctx;
  return ctx;
}

/// Sets the phase and layer for a scope (a recompute inside a backward) and
/// restores both when it ends.
class OpScope {
 public:
  OpScope(OpPhase phase, int layer) : saved_(op_context()) {
    op_context().phase = phase;
    op_context().layer = layer;
  }
  ~OpScope() {
    op_context().phase = saved_.phase;
    op_context().layer = saved_.layer;
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  OpContext saved_;
};

}  // namespace moeflex
