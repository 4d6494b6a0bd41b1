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

double threshold_ratio(const std::string& policy) {
  if (policy == "threshold") return 1.2;
  if (policy.rfind("threshold=", 0) != 0) return -1;
  try {
    std::size_t pos = 0;
    const double r = std::stod(policy.substr(10), &pos);
    if (pos == policy.size() - 10 && r > 0) return r;
  } catch (...) {
  }
  throw ConfigError(fmt::format("policy '{}': expected threshold=R with R > 0, e.g. threshold=1.5", policy));
}

bool static_policy_recomputes(const std::string& policy, const std::string& a) {
  if (threshold_ratio(policy) > 0) return moe_full(a);
  if (policy == "none") return false;
  if (policy == "full") return true;
  if (policy == "selective") return a == "attn.probs" || a == "attn.out";
  if (policy == "moe-light") return moe_light(a);
  if (policy == "moe-medium") return moe_medium(a);
  if (policy == "moe-full") return moe_full(a);
  throw ConfigError(fmt::format("unknown provisioning policy '{}' (known: adaptive, threshold[=R], {})", policy,
                                fmt::join(static_policy_names(), ", ")));
}

ProvisionPolicy make_static_policy(const std::string& name) {
  static_policy_recomputes(name, "");  // validates the name
  if (name == "none") return {};
  if (const double r = threshold_ratio(name); r > 0) {
    return [r](const LedgerEntry& e) {
      const bool spike = e.tokens_balanced > 0 && double(e.tokens_received) > r * double(e.tokens_balanced);
      return spike && moe_full(e.name) ? Provision::recompute : Provision::save;
    };
  }
  return [name](const LedgerEntry& e) {
    return static_policy_recomputes(name, e.name) ? Provision::recompute : Provision::save;
  };
}

}  // namespace moeflex
