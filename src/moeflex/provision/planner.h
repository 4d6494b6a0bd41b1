// The adaptive provisioning planner: decides, per micro-batch and per layer block,
// which activations are saved, recomputed or offloaded, once their exact sizes for
// the real token counts are known (after the router for MoE layers), so that the
// step's projected device-memory peak stays under the budget at the least cost.
//
// The projection is the caller's (DESIGN.md, "The planner's contract"): the model
// replays the rest of the rank's step on its exact memory program (model/
// memory_plan.h) with this block's choice, every later block at its most
// memory-saving choice, and unknown routings at their worst case, so the no-OOM
// invariant holds by construction. This class searches the choices: keep all if
// that fits; else drop candidates cheapest first (exposed seconds per byte freed:
// recompute time, or the part of an offload's copies not hidden under compute)
// until the projection fits, then puts back what still fits, and takes instead a
// static policy's part of the block (policies.h) when that fits for less exposed
// time (greedy is not always the cheapest set). The limit is the budget less a
// fragmentation margin (kPlannerMarginFraction). The closed form is an upper bound; the most-saving
// choice is also walked exactly, so a block whose floor an earlier decision's walk
// found to fit always finds it fitting too (the invariant). If even that does not
// fit, it takes it and counts an infeasible decision. Decisions are cached by (caller's key,
// memory bucket), so repeated situations cost a lookup.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/provision/stash.h"

namespace moeflex {

/// One activation a block is about to save.
struct SaveCandidate {
  std::string name;
  std::string op;
  Bytes bytes = 0;
  bool recomputable = false;
  /// Exposed seconds if it is not kept (recompute time, or the unhidden part of
  /// its offload and prefetch copies); <= 0: estimated from the op family.
  Seconds drop_seconds = 0;
  /// Bytes its recompute allocates beyond itself for a moment (the lineage's other
  /// outputs, e.g. the rstd beside a recomputed RMSNorm output).
  Bytes rebuild_extra = 0;
  /// Saved before the block allocates anything more (the MoE block's experts are
  /// saved before its shared expert runs; its router entries after).
  bool saved_first = true;
  /// > 0: computed after the decision (the MoE block's FC1 outputs and activation,
  /// model.expert_chunk_rows): when recomputed it is never held whole, only this
  /// many bytes (one chunk's, rounded) while the block's experts run.
  Bytes chunk_bytes = 0;
};

/// A block's choice: provision by activation name (absent = save).
using BlockChoice = std::map<std::string, Provision>;

/// The projected peak of the rest of a step as a function of one block's choice,
/// from one walk of the step with the block kept whole (MemoryWalk's phases around
/// the block's layer): dropping a candidate lowers every phase until its layer's
/// backward by its bytes (offloads only until they are prefetched back, one layer
/// ahead), and its recompute adds at most its lineage's extra outputs to the
/// layer's backward, where every entry is back on the device anyway.
struct BlockProjection {
  Bytes tail = 0;        ///< the block finishing (only saved_first recomputes are freed yet)
  Bytes landing = 0;     ///< until the next decision point (offloads still copying)
  Bytes held = 0;        ///< until the layer's offloads are prefetched back
  Bytes prefetched = 0;  ///< from then until the layer's backward starts
  Bytes backward = 0;    ///< during the block's own backward, everything kept
  Bytes backward_rest = 0;  ///< the rest of the layer's backward (all entries back by then)
  Bytes after = 0;       ///< after the layer is released
  /// An MoE block's experts running after its decision, before its saves (0 for
  /// other blocks): a recomputed chunk_bytes candidate is a chunk there, not whole.
  Bytes compute = 0;
  /// The largest phase: the peak of the walk itself.
  Bytes peak() const;
  /// The projected peak if the block takes `choice` (rounded bytes per candidate).
  Bytes evaluate(const std::vector<SaveCandidate>& candidates, const BlockChoice& choice) const;
};

/// Computes the block's projection (one walk of the rest of the step) with the
/// block kept whole (choice null), or exactly with `choice` applied (its peak()
/// is then that choice's projected peak).
using ProjectFn = std::function<BlockProjection(const BlockChoice* choice)>;

/// The planner's margin for allocator fragmentation, as a fraction of the budget,
/// on an arena that cannot stitch (the CUDA arena): a soft target. The planner takes
/// the cheapest choice whose projected peak stays under budget - margin when one
/// exists, else the floor (the most memory-saving choice: the lowest peak); a
/// decision is infeasible only when the floor exceeds the budget less its
/// Arena::placement_reserve, the invariant's hard limit. What fragmentation the
/// margin cannot absorb, the arena does by compaction and eviction, so the smallest
/// feasible budget (minimum_budget) carries only the placement reserve. Constant,
/// so that a decision's projection still holds at the next one. A host arena
/// stitches free pages whenever held blocks split them, so its margin is the
/// placement reserve alone (Arena::can_stitch).
inline constexpr double kPlannerMarginFraction = 0.05;

class AdaptivePlanner {
 public:
  /// margin_fraction: of the budget, kept out of the planner's target (at least the
  /// placement reserve); negative: kPlannerMarginFraction on an arena that cannot
  /// stitch, else none beyond the reserve.
  explicit AdaptivePlanner(Arena& arena, double margin_fraction = -1)
      : arena_(arena), margin_fraction_(margin_fraction >= 0 ? margin_fraction
                                        : arena.can_stitch() ? 0.0
                                                             : kPlannerMarginFraction) {}

  /// Decides the provision of one block's activations (called just before they are
  /// saved). `cache_key`: what, besides the arena's use, determines the projection
  /// (layer, save point, position in the step's plan, token-count buckets), or empty
  /// for no caching. The decision is what decide() answers for these entries.
  void plan_block(int microbatch, int layer, const std::vector<SaveCandidate>& candidates, const ProjectFn& project,
                  const std::vector<std::int64_t>& cache_key);
  /// Decides, at the start of a zero-bubble B, whether what its queued weight-gradient
  /// GEMMs will read stays on the device until their W (false) or waits on the host,
  /// each layer's once the B is past it (true: the most memory-saving choice).
  /// project(offload): the exact peak of the rest of the step with that choice and
  /// every later decision at its floor (project_weight_reads). Keeps them when that
  /// fits under budget - margin.
  bool plan_weight_reads(const std::function<Bytes(bool offload)>& project);
  /// The policy callback for ActivationStash::set_policy.
  Provision decide(const LedgerEntry& e) const;
  ProvisionPolicy policy() {
    return [this](const LedgerEntry& e) { return decide(e); };
  }
  /// At the end of a step: clears the step's decisions and per-step statistics.
  void end_step();

  /// Bytes kept out of the budget for the allocator's fragmentation (the margin
  /// fraction of the budget, at least its Arena::placement_reserve).
  Bytes margin() const;

  std::int64_t decisions() const { return decisions_; }
  std::int64_t cache_hits() const { return cache_hits_; }
  /// W-read decisions (plan_weight_reads) since construction, and those that offloaded.
  std::int64_t weight_read_decisions() const { return weight_read_decisions_; }
  std::int64_t weight_read_offloads() const { return weight_read_offloads_; }
  /// Decisions of the current step where a static policy's part of the block was
  /// cheaper than the greedy choice and fit, so the planner took it.
  std::int64_t static_level_choices() const { return static_level_choices_; }
  /// Decisions of the current step where even the most memory-saving choice did
  /// not fit the projection (worst-case routing of what is still unknown).
  std::int64_t infeasible() const { return infeasible_; }
  /// Seconds per plan_block call in the last step, for percentiles.
  const std::vector<double>& decision_seconds() const { return decision_seconds_; }
  /// The largest projected peak of the step's decisions (bytes; a bound, as each
  /// projection takes every later block at its most memory-saving choice).
  Bytes last_projected_peak() const { return projected_peak_; }
  /// The step's peak as predicted at its last decision: the arena's peak until
  /// then, or that decision's projection of the rest with its choice (bytes).
  Bytes predicted_step_peak() const { return predicted_step_peak_; }

 private:
  Arena& arena_;
  double margin_fraction_;
  std::map<std::tuple<int, int, std::string>, Provision> current_;
  struct Cached {
    BlockChoice choice;
    Bytes peak = 0;      ///< projected peak with the bucket's slack
    Bytes raw = 0;       ///< the projection itself
    Bytes in_use = 0;    ///< arena use when it was computed
  };
  std::map<std::vector<std::int64_t>, Cached> cache_;
  Bytes projected_peak_ = 0, predicted_step_peak_ = 0;
  std::int64_t decisions_ = 0, cache_hits_ = 0, infeasible_ = 0, static_level_choices_ = 0;
  std::int64_t weight_read_decisions_ = 0, weight_read_offloads_ = 0;
  std::vector<double> decision_seconds_;
};

/// Exposed seconds per byte of rebuilding an op family's output, relative (GEMM
/// outputs cost most, elementwise results least); the fallback ranking when a
/// candidate carries no drop_seconds.
double recompute_cost_per_byte(const std::string& op);

}  // namespace moeflex
