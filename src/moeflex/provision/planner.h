// The adaptive provisioning planner (first version): decides, per micro-batch and
// per layer, which activations are saved, recomputed or offloaded, once their exact
// sizes for the real token counts are known (after the router for MoE layers), so
// that the projected device-memory use stays under the budget at the least
// recompute cost.
//
// Projection (bytes): held now (arena in use) + what this layer keeps + the floor
// of the rest of the micro-batch's forward (layer inputs only) + a working-set
// reserve for transients (the largest transient seen in earlier steps, at least an
// estimate from the layer's own sizes). Choices are tried from cheapest to most
// memory-saving: keep all; recompute the cheapest-to-rebuild bytes first (ranked by
// recompute cost per byte saved, from the op family); offload what cannot be
// recomputed (all-to-all outputs under EP). Decisions are cached by (layer, token
// bucket, memory bucket), so repeated situations cost a map lookup.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/provision/stash.h"

namespace moeflex {

/// One activation a layer is about to save.
struct SaveCandidate {
  std::string name;
  std::string op;
  Bytes bytes = 0;
  bool recomputable = false;
};

class AdaptivePlanner {
 public:
  explicit AdaptivePlanner(Arena& arena) : arena_(arena) {}

  /// Decides the provision of a layer's activations (called just before they are
  /// saved). floor_after: bytes the rest of the micro-batch's forward must keep at
  /// least. tokens: rows this rank's experts received (0 for dense parts).
  void plan_layer(int microbatch, int layer, const std::vector<SaveCandidate>& entries, Bytes floor_after,
                  std::int64_t tokens);
  /// The policy callback for ActivationStash::set_policy.
  Provision decide(const LedgerEntry& e) const;
  ProvisionPolicy policy() {
    return [this](const LedgerEntry& e) { return decide(e); };
  }
  /// At the end of a step: learns the transient working set from the arena's peak
  /// over what the stashes held (stash_peak), and clears the step's decisions.
  void end_step(Bytes stash_peak);

  std::int64_t decisions() const { return decisions_; }
  std::int64_t cache_hits() const { return cache_hits_; }
  /// Seconds per plan_layer call in the last step, for percentiles.
  const std::vector<double>& decision_seconds() const { return decision_seconds_; }
  Bytes transient_reserve() const { return transient_; }
  Bytes last_projected_peak() const { return projected_peak_; }

 private:
  Arena& arena_;
  std::map<std::tuple<int, int, std::string>, Provision> current_;
  std::map<std::tuple<int, std::int64_t, std::int64_t>, std::map<std::string, Provision>> cache_;
  Bytes transient_ = 0;
  Bytes projected_peak_ = 0;
  std::int64_t decisions_ = 0, cache_hits_ = 0;
  std::vector<double> decision_seconds_;
};

/// Recompute cost per byte of an op family, relative (GEMM-produced tensors cost
/// most to rebuild, elementwise results least). Used to rank what to drop first.
double recompute_cost_per_byte(const std::string& op);

}  // namespace moeflex
