// Shared fixtures of the engine tests that train a model on a device arena (the
// emulated device and the real CUDA one).
#pragma once

#include <string>

#include "moeflex/model/model.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/policies.h"

namespace moeflex::test {

/// Provisions `model`'s activations by `policy`: "adaptive" (the planner), "offload"
/// (everything offloaded), or a static policy name (make_static_policy).
inline void apply_policy(MoEModel& model, AdaptivePlanner& planner, const std::string& policy) {
  if (policy == "adaptive") model.set_planner(&planner);
  else if (policy == "offload") model.stash().set_policy([](const LedgerEntry&) { return Provision::offload; });
  else model.stash().set_policy(make_static_policy(policy));
}

}  // namespace moeflex::test
