#include "moeflex/core/error.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fmt/format.h>
#include <unistd.h>

#include <fstream>

namespace moeflex {

Bytes parse_size(const std::string& text) {
  // Spaces around the size and between its number and unit ("10 MiB"), none within
  // them ("1 0 MiB" is no size).
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  const auto first = std::find_if_not(text.begin(), text.end(), space);
  const auto last = std::find_if_not(text.rbegin(), text.rend(), space).base();
  std::string s = first < last ? std::string(first, last) : std::string();
  {
    std::size_t num = 0;
    while (num < s.size() && (std::isdigit(static_cast<unsigned char>(s[num])) || s[num] == '.')) ++num;
    std::size_t unit = num;
    while (unit < s.size() && space(s[unit])) ++unit;
    // What follows a space must be the unit: "1 0MiB" or "1 .5GiB" is no number.
    const bool unit_after_space = unit == num || (unit < s.size() && std::isalpha(static_cast<unsigned char>(s[unit])));
    if (!unit_after_space || std::any_of(s.begin() + std::ptrdiff_t(unit), s.end(), space))
      throw ConfigError(
          fmt::format("cannot parse size '{}': expected a number with an optional unit "
                      "(B, KiB, MiB, GiB, TiB), e.g. '512MiB'",
                      text));
    s.erase(num, unit - num);
  }
  std::string lower;
  for (char c : s) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "unlimited" || lower == "none" || lower == "inf") return -1;
  // A plain decimal number (no sign, exponent or hexadecimal), then the unit.
  std::size_t pos = 0;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) || s[pos] == '.')) ++pos;
  double value = 0;
  try {
    if (pos == 0 || std::count(s.begin(), s.begin() + std::ptrdiff_t(pos), '.') > 1)
      throw std::invalid_argument("not a decimal number");
    value = std::stod(s.substr(0, pos));
  } catch (...) {
    throw ConfigError(fmt::format("cannot parse size '{}': expected a number with an optional unit "
                                  "(B, KiB, MiB, GiB, TiB), e.g. '512MiB'", text));
  }
  std::string unit = lower.substr(pos);
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = double(kKiB);
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = double(kMiB);
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = double(kGiB);
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = double(kGiB) * 1024.0;
  else
    throw ConfigError(
        fmt::format("cannot parse size '{}': unknown unit '{}' (use B, KiB, MiB, GiB or TiB)", text, s.substr(pos)));
  if (!(value >= 0) || !std::isfinite(value))
    throw ConfigError(fmt::format("size '{}' must be a non-negative number of bytes", text));
  if (value * mult >= 9.2e18)
    throw ConfigError(fmt::format("size '{}' is too large (more than 8 EiB)", text));
  return static_cast<Bytes>(std::llround(value * mult));
}

std::string format_bytes(Bytes b) {
  if (b < 0) return "unlimited";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

namespace {
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}
}  // namespace

std::string did_you_mean(const std::string& name, const std::vector<std::string>& known) {
  const std::string* best = nullptr;
  std::size_t best_d = 4;  // more than 3 edits away: no suggestion
  for (const std::string& k : known)
    if (const std::size_t d = edit_distance(name, k); d < best_d) best_d = d, best = &k;
  return best ? fmt::format(" (did you mean '{}'?)", *best) : std::string();
}

void check_writable_dir(const std::filesystem::path& dir, const std::string& flag, const std::string& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw ConfigError(fmt::format("{} '{}': {} exists and is not a directory", flag, given, dir.string()));
  fs::create_directories(dir, ec);
  if (ec) throw ConfigError(fmt::format("{} '{}': cannot create {} ({})", flag, given, dir.string(), ec.message()));
  const fs::path probe = dir / fmt::format(".moeflex-write-check-{}", ::getpid());
  if (!std::ofstream(probe)) throw ConfigError(fmt::format("{} '{}': cannot write into {}", flag, given, dir.string()));
  fs::remove(probe, ec);
}

std::string format_count(double n) {
  if (n >= 1e12) return fmt::format("{:.2f} T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.1f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace moeflex
