// Typed errors. Every error carries the numbers that explain it (DESIGN.md, "Errors").
#pragma once
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "moeflex/core/units.h"

namespace moeflex {

/// Base of every moeflex error; `what()` is a complete, user-facing sentence.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

/// A bad value in a config, a flag or a file: names the field and the rule.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// Bad input data (corpus, token shard, checkpoint).
class DataError : public Error {
 public:
  using Error::Error;
};

/// Throws ConfigError(msg) unless `cond` holds.
inline void check_config(bool cond, const std::string& msg) {
  if (!cond) throw ConfigError(msg);
}

/// Parses a size such as "512MiB", "2GiB", "1.5 GiB", "4096", "64KB" into bytes.
/// Accepted suffixes: B, KiB/KB/K, MiB/MB/M, GiB/GB/G, TiB/TB/T (all powers of 1024).
/// "unlimited" or "none" give -1. Throws ConfigError naming the text otherwise.
Bytes parse_size(const std::string& text);

/// Formats bytes for people: "12.3 MiB".
std::string format_bytes(Bytes bytes);

/// Formats a parameter count for people, in decimal units: "11.5 M", "671.0 B".
std::string format_count(double n);

/// Makes sure `dir` is, or can be made, a directory files can be written into, before
/// long work that would write there: ConfigError "`flag` '`given`': ..." naming the
/// folder otherwise (a file in its place, a folder that cannot be created or written).
void check_writable_dir(const std::filesystem::path& dir, const std::string& flag, const std::string& given);

/// " (did you mean 'x'?)" for the name of `known` closest to `name` (Levenshtein
/// distance) when it is within 3 edits, else "": for errors about misspelt keys.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& known);

}  // namespace moeflex
