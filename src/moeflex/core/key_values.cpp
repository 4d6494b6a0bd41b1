// Flag specs of the form key=value:key=value (key_values.h).
#include "moeflex/core/key_values.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace moeflex {

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool parse_u64(const std::string& v, std::uint64_t& out) {
  if (v.empty() || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (errno == ERANGE || end != v.c_str() + v.size()) return false;
  out = static_cast<std::uint64_t>(x);
  return true;
}

bool parse_double(const std::string& v, double& out) {
  if (v.empty() || std::isspace(static_cast<unsigned char>(v[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (errno == ERANGE || end != v.c_str() + v.size() || !std::isfinite(x)) return false;
  out = x;
  return true;
}

std::optional<std::vector<std::pair<std::string, std::string>>> split_key_values(const std::string& s,
                                                                                 std::string& why) {
  std::vector<std::pair<std::string, std::string>> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t colon = s.find(':', start);
    const std::string part = trim(s.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    const std::size_t eq = part.find('=');
    if (eq == std::string::npos) {
      why = fmt::format("part '{}' is not of the form key=value", part);
      return std::nullopt;
    }
    std::string key = trim(part.substr(0, eq));
    for (const auto& [k, v] : parts)
      if (k == key) {
        why = fmt::format("'{}' is given twice", key);
        return std::nullopt;
      }
    parts.emplace_back(std::move(key), trim(part.substr(eq + 1)));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return parts;
}

}  // namespace moeflex
