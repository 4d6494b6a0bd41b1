// The "key=value:key=value" specs of command-line flags (--inject-imbalance,
// --inject-slowdown): splitting them and reading their numbers strictly.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeflex {

/// `s` without leading and trailing white space.
std::string trim(const std::string& s);
/// Full-string decimal unsigned integer; false on junk or overflow.
bool parse_u64(const std::string& v, std::uint64_t& out);
/// Full-string finite floating-point number; false otherwise.
bool parse_double(const std::string& v, double& out);

/// The parts of "k1=v1:k2=v2" as (key, value), trimmed, in order. nullopt with
/// `why` set when a part is not key=value or a key repeats.
std::optional<std::vector<std::pair<std::string, std::string>>> split_key_values(const std::string& s,
                                                                                 std::string& why);

}  // namespace moeflex
