// Static provisioning policies (DESIGN.md, "The planner's contract"), expressed as
// data over the activation ledger's names so that the same stash machinery applies
// every one of them:
//   none        save everything
//   full        recompute every activation that has a lineage (whole layers from
//               their inputs; the layer inputs stay)
//   selective   recompute the attention core: softmax probabilities and the
//               attention output (Korthikanti et al. 2022, "Reducing Activation
//               Recomputation in Large Transformer Models")
//   moe-light   recompute the MoE activation function, the permutation and the router
//   moe-medium  moe-light + the experts' first GEMMs (FC1: gate and up) and the shared expert
//   moe-full    recompute the whole MoE part (MXMACA's multi-level MoE recompute)
//   threshold[=R]  recompute the MoE part of a layer when the rows its experts received
//               on this rank exceed R x the balanced load (default R = 1.2: BaGuaLu-2
//               reports 97.1% of iterations under 1.2x); MXMACA's MoE adaptive recompute
#pragma once
#include <string>
#include <vector>

#include "moeflex/provision/stash.h"

namespace moeflex {

/// The names --policy accepts for static policies.
const std::vector<std::string>& static_policy_names();

/// The policy called `name` (a static name, or "threshold" / "threshold=R"); throws
/// ConfigError listing the names otherwise.
ProvisionPolicy make_static_policy(const std::string& name);

/// R of the policy "threshold=R" (1.2 for plain "threshold"), -1 for any other
/// policy name. Throws ConfigError for a malformed R (not a number > 0).
double threshold_ratio(const std::string& policy);

/// Which activations a static policy recomputes (true = recompute), by ledger name.
bool static_policy_recomputes(const std::string& policy, const std::string& activation);

}  // namespace moeflex
