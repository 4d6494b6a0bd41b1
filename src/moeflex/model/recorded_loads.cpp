// loads.jsonl parsing (see recorded_loads.h).
#include "moeflex/model/recorded_loads.h"

#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"

namespace moeflex {
namespace {

/// Whether `v` is an integer in [lo, hi] (0 <= lo <= hi), checked as 64 bits before any narrowing.
bool integer_within(const nlohmann::json& v, std::int64_t lo, std::int64_t hi) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>() >= std::uint64_t(lo) && v.get<std::uint64_t>() <= std::uint64_t(hi);
  return v.is_number_integer() && v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi;
}

/// An integer field of a loads.jsonl record in [lo, hi]: DataError naming the line,
/// the field and the value otherwise.
std::int64_t integer_in(const nlohmann::json& v, const std::string& where, const std::string& field, std::int64_t lo,
                        std::int64_t hi) {
  if (!integer_within(v, lo, hi))
    throw DataError(fmt::format("{}: {} must be an integer in [{}, {}] (got {})", where, field, lo, hi, v.dump()));
  return v.get<std::int64_t>();
}

// Bounds of a recorded layout (far beyond any run; they keep products in 64 bits).
constexpr std::int64_t kMaxRecordedRanks = std::int64_t(1) << 24;
constexpr std::int64_t kMaxRecordedMicrobatches = std::int64_t(1) << 20;
constexpr std::int64_t kMaxRecordedRows = std::int64_t(1) << 48;

/// A line's layout (dp, ep, micro-batches, MoE layers), checked on its own.
RecordedLoads parse_layout(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("dp") || !j.contains("ep") || !j.contains("microbatches") ||
      !j.contains("moe_layers") || !j["moe_layers"].is_array())
    throw DataError(fmt::format("{}: needs dp, ep, microbatches and moe_layers (an array)", where));
  RecordedLoads l;
  l.dp = int(integer_in(j["dp"], where, "dp", 1, kMaxRecordedRanks));
  l.ep = int(integer_in(j["ep"], where, "ep", 1, kMaxRecordedRanks));
  l.microbatches = int(integer_in(j["microbatches"], where, "microbatches", 1, kMaxRecordedMicrobatches));
  for (std::size_t k = 0; k < j["moe_layers"].size(); ++k)
    l.moe_layers.push_back(
        int(integer_in(j["moe_layers"][k], where, fmt::format("moe_layers[{}]", k), 0, kMaxRecordedRanks)));
  if (l.dp % l.ep != 0 || l.layers() < 1)
    throw DataError(fmt::format("{}: dp {}, ep {}, microbatches {}, {} MoE layers: need ep dividing dp and "
                                "at least one of each", where, l.dp, l.ep, l.microbatches, l.layers()));
  return l;
}

/// Whether `t` is an array of L arrays of M arrays of dp elements.
bool table_shaped(const nlohmann::json& t, int L, int M, int dp) {
  bool ok = t.is_array() && int(t.size()) == L;
  for (int k = 0; ok && k < L; ++k) {
    const auto& layer = t[std::size_t(k)];
    ok = layer.is_array() && int(layer.size()) == M;
    for (int mb = 0; ok && mb < M; ++mb)
      ok = layer[std::size_t(mb)].is_array() && int(layer[std::size_t(mb)].size()) == dp;
  }
  return ok;
}

/// The "received" and "kept" tables of one line into `rows` (sized L x M x dp).
void parse_tables(const nlohmann::json& j, const std::string& where, const RecordedLoads& l,
                  std::vector<RecordedRows>& rows) {
  const int L = l.layers(), M = l.microbatches, dp = l.dp;
  rows.assign(std::size_t(L) * std::size_t(M) * std::size_t(dp), RecordedRows{});
  for (const char* field : {"received", "kept"}) {
    const auto& t = j.contains(field) ? j[field] : nlohmann::json();
    if (!table_shaped(t, L, M, dp))
      throw DataError(fmt::format("{}: '{}' must be {} layers x {} micro-batches x {} ranks of row counts >= 0",
                                  where, field, L, M, dp));
    const bool received = std::string(field) == "received";
    for (int k = 0; k < L; ++k)
      for (int mb = 0; mb < M; ++mb)
        for (int q = 0; q < dp; ++q) {
          const auto& x = t[std::size_t(k)][std::size_t(mb)][std::size_t(q)];
          if (!integer_within(x, 0, kMaxRecordedRows))  // named only when it fails
            integer_in(x, where, fmt::format("{}[layer {}][micro-batch {}][rank {}]", field, k, mb, q), 0,
                       kMaxRecordedRows);
          auto& r = rows[(std::size_t(k) * std::size_t(M) + std::size_t(mb)) * std::size_t(dp) + std::size_t(q)];
          (received ? r.received : r.kept) = x.get<std::int64_t>();
        }
  }
}

/// A rank receives only what its EP group kept (conservation; with capacity
/// dropping on the receiving side, at most that).
void check_conservation(const std::string& where, const RecordedLoads& l, const std::vector<RecordedRows>& rows) {
  const std::size_t M = std::size_t(l.microbatches), dp = std::size_t(l.dp);
  for (std::size_t i = 0; i < std::size_t(l.layers()) * M; ++i)
    for (int g = 0; g < l.dp / l.ep; ++g) {
      std::int64_t kept = 0;
      for (int q = g * l.ep; q < (g + 1) * l.ep; ++q) kept += rows[i * dp + std::size_t(q)].kept;
      for (int q = g * l.ep; q < (g + 1) * l.ep; ++q)
        if (rows[i * dp + std::size_t(q)].received > kept)
          throw DataError(fmt::format("{}: received[layer {}][micro-batch {}][rank {}] = {} is more than the {} "
                                      "assignments its EP group kept",
                                      where, i / M, i % M, q, rows[i * dp + std::size_t(q)].received, kept));
    }
}

}  // namespace

void for_each_json_line(const std::filesystem::path& path,
                        const std::function<void(const nlohmann::json&, const std::string&)>& fn) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot read", path.string()));
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    if (line.empty()) continue;
    const std::string where = fmt::format("{}:{}", path.string(), no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}: not valid JSON ({})", where, e.what()));
    }
    fn(j, where);
  }
}

RecordedLoads read_recorded_loads(const std::filesystem::path& path) {
  RecordedLoads out;
  for_each_json_line(path, [&](const nlohmann::json& j, const std::string& where) {
    RecordedLoads l = parse_layout(j, where);
    if (!out.steps.empty() && (l.dp != out.dp || l.ep != out.ep || l.microbatches != out.microbatches ||
                               l.layers() != out.layers()))
      throw DataError(fmt::format("{}: layout dp {} ep {} microbatches {} layers {} differs from the first line's "
                                  "(dp {} ep {} microbatches {} layers {})", where, l.dp, l.ep, l.microbatches,
                                  l.layers(), out.dp, out.ep, out.microbatches, out.layers()));
    std::vector<RecordedRows> rows;
    parse_tables(j, where, l, rows);
    check_conservation(where, l, rows);
    if (out.steps.empty()) {
      out.dp = l.dp;
      out.ep = l.ep;
      out.microbatches = l.microbatches;
      out.moe_layers = std::move(l.moe_layers);
    }
    out.steps.push_back(std::move(rows));
  });
  if (out.steps.empty()) throw DataError(fmt::format("{}: no steps", path.string()));
  return out;
}

}  // namespace moeflex
