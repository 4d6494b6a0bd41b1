// The time of one transformer layer's forward, backward-input (B) and
// backward-weight (W) on one rank, and of recomputing each of its saved
// activations, from a CostModel. It still repeats the engine's op sequence
// (attention_block.cpp, moe_block.cpp, the head in model.cpp) call for call: the
// ledger (ledger.h) holds what a block saves, not yet the ops it runs. The op
// profiler's in-situ tests (SimOpStream) check both sides take the same calls, so
// that the simulator advances virtual time by the ops the engine runs and the
// planner prices a recompute by the ops its lineage replays.
//
// What is and is not in a time:
// - compute only: the expert-parallel all-to-alls (dispatch, combine and their
//   backward twins) are returned as byte counts, for the caller's network model;
//   their local scratch copies are compute and are included;
// - with tp > 1 (Megatron tensor parallelism with sequence parallelism; the engine
//   itself runs tp = 1): attention heads, the dense MLP and the shared expert are
//   split over tp ranks, norms and the MoE layer run on the rank's n/tp tokens
//   (expert tensor parallelism 1), and the TP collectives are returned as bytes;
// - the backward's W is every weight-gradient GEMM (and the embedding's scatter);
//   B is the rest. With `split_backward` the extra copies of the residual
//   gradient that a deferred W keeps (model.cpp copy_of) are part of B.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/model/config.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex {

/// The shape of one layer's work on one rank.
struct LayerWork {
  std::int64_t B = 1;        ///< sequences per micro-batch
  std::int64_t S = 1;        ///< tokens per sequence
  MoERows rows;              ///< expert rows of this rank (MoE layers only)
  int ep = 1;                ///< expert-parallel group size (> 1: all-to-alls)
  int tp = 1;                ///< tensor-parallel size (1 in the engine)
  bool split_backward = false;  ///< zero-bubble schedules: W deferred, dx copied
  Bytes element_bytes = kActivationBytes;  ///< bytes per element on the wire (fp32 engine; 2 for bf16)
  /// Also fill LayerCost::ops and the recompute entries' ops (off: no allocation beyond the times).
  bool breakdown = false;
};

/// Calls and seconds of one op kind.
struct OpTally {
  double count = 0;
  Seconds seconds = 0;
};

/// Op times by (phase, kind), named as the op profiler names them (profile/op_profiler.h,
/// op_times.json): phase "forward", "backward_input", "backward_weight" or
/// "recompute" (a rebuild run by the stash); kind the Backend call ("linear_forward",
/// "grouped_linear_backward_dw", "copy", ...), or, for host work that is no backend
/// op (so the profiler does not record it), a name of its own ("a2a_local_copy").
using OpBreakdown = std::map<std::pair<std::string, std::string>, OpTally>;

/// Adds every tally of `b`, times `times`, into `into`.
void add_breakdown(OpBreakdown& into, const OpBreakdown& b, double times = 1);

/// Times of one layer (or the head) on one rank.
struct LayerCost {
  Seconds forward = 0;          ///< F, compute only
  Seconds backward_input = 0;   ///< B (input gradient and the norms' weight gradients)
  Seconds backward_weight = 0;  ///< W (the weight-gradient GEMMs)
  /// Bytes this rank sends and receives in one all-to-all of dispatch (the
  /// backward's combine moves the same), excluding what stays on the rank;
  /// 0 without EP. A layer runs 2 all-to-alls in forward and 2 in backward.
  Bytes a2a_send_bytes = 0;
  Bytes a2a_recv_bytes = 0;
  /// Bytes of one TP all-gather / reduce-scatter of the [n, d] sequence-parallel
  /// activation (the full tensor's bytes); each of forward and backward runs 2
  /// all-gathers and 2 reduce-scatters per layer (4 with a dense MLP too counts
  /// the same: one pair per block). 0 when tp == 1.
  Bytes tp_collective_bytes = 0;
  /// Seconds of rebuilding each saved activation from its lineage, by the
  /// activation's stash name (as layer_activations() names them), assuming its
  /// inputs are on the device.
  std::vector<std::pair<std::string, Seconds>> recompute;
  /// LayerWork::breakdown only: forward, backward_input and backward_weight by op
  /// kind (they sum to the three times), and each recompute entry's ops (phase
  /// "recompute"), in the order of `recompute`.
  OpBreakdown ops;
  std::vector<OpBreakdown> recompute_ops;

  Seconds backward() const { return backward_input + backward_weight; }
  /// The recompute time of `name`; 0 for a name without a lineage (or unknown).
  Seconds recompute_seconds(const std::string& name) const;
  /// Seconds one backward of the layer spends rebuilding every activation for which
  /// `recomputed(name)` is true, as the engine does it (model.cpp): each once (a
  /// rebuilt tensor stays in the stash until the layer's release); the expert FFN's
  /// chunk tensors (experts.gate_out, experts.up_out, experts.act) and, without EP,
  /// moe.combined are rebuilt chunk by chunk by the backward's expert loop itself.
  /// `ops` (breakdown only) receives their ops, the loop's under backward_input as
  /// the profiler labels them.
  Seconds recompute_total(const std::function<bool(const std::string&)>& recomputed, OpBreakdown* ops = nullptr) const;
};

/// Rows per local expert when `rows` spread evenly over `experts` groups (the
/// remainder on the first groups): the grouped GEMMs' group sizes.
std::vector<std::int64_t> even_groups(std::int64_t rows, std::int64_t experts);

/// Layer `layer` of `cfg` (dense or MoE as cfg.is_moe_layer says).
LayerCost layer_cost(const CostModel& cost, const ModelConfig& cfg, int layer, const LayerWork& work);

/// The final norm, LM head and cross entropy (a stage holding the head).
LayerCost head_cost(const CostModel& cost, const ModelConfig& cfg, const LayerWork& work);

/// The embedding lookup (forward) and its gradient scatter (W).
LayerCost embedding_cost(const CostModel& cost, const ModelConfig& cfg, const LayerWork& work);

/// A pipeline stage's boundary copies (MoEModel::forward_impl / backward_stage): a
/// stage without the embedding copies its received input [n, d] into the stage's
/// first activation (forward); one without the head copies the received output
/// gradient into the residual gradient, one without the embedding the input
/// gradient out to its send buffer (backward_input). Zero for a whole model.
LayerCost stage_copy_cost(const CostModel& cost, const ModelConfig& cfg, const LayerWork& work, bool embedding,
                          bool head);

/// Forward FLOPs of one layer for n tokens as the engine computes them (GEMMs of
/// the projections, the full S x S attention, top-k experts and the shared expert;
/// elementwise work not counted). A training step costs 3x (forward + 2x backward).
double layer_forward_flops(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S);
/// Forward FLOPs of the LM head for B x S tokens.
double head_forward_flops(const ModelConfig& cfg, std::int64_t B, std::int64_t S);

}  // namespace moeflex
