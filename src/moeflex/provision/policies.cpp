#include "moeflex/provision/policies.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moeflex {

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

bool moe_light(const std::string& a) {
  return a == "experts.act" || a == "shared.act" || a == "experts.in" || a == "router.probs" ||
         a == "router.topk_w" || a == "router.logits";
}

bool moe_medium(const std::string& a) {
  return moe_light(a) || a == "experts.gate_out" || a == "experts.up_out" || starts_with(a, "shared.");
}

bool moe_full(const std::string& a) {
  return starts_with(a, "experts.") || starts_with(a, "shared.") || starts_with(a, "router.") ||
         starts_with(a, "moe.") || starts_with(a, "ffn_norm.");
}

}  // namespace

const std::vector<std::string>& static_policy_names() {
  static const std::vector<std::string> names = {"none", "full", "selective", "moe-light", "moe-medium", "moe-full"};
  return names;
}

bool static_policy_recomputes(const std::string& policy, const std::string& a) {
  if (policy == "none") return false;
  if (policy == "full") return true;
  if (policy == "selective") return a == "attn.probs" || a == "attn.out";
  if (policy == "moe-light") return moe_light(a);
  if (policy == "moe-medium") return moe_medium(a);
  if (policy == "moe-full") return moe_full(a);
  if (policy == "adaptive" || policy == "threshold")
    throw ConfigError(fmt::format("provisioning policy '{}' is not implemented yet (issue 4); known: {}", policy,
                                  fmt::join(static_policy_names(), ", ")));
  throw ConfigError(fmt::format("unknown provisioning policy '{}' (known: {})", policy,
                                fmt::join(static_policy_names(), ", ")));
}

ProvisionPolicy make_static_policy(const std::string& name) {
  static_policy_recomputes(name, "");  // validates the name
  if (name == "none") return {};
  return [name](const LedgerEntry& e) {
    return static_policy_recomputes(name, e.name) ? Provision::recompute : Provision::save;
  };
}

}  // namespace moeflex
