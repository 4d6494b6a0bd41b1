// Shared fixtures of the simulator tests: a hardware profile whose times are pure
// GEMM FLOPs at one rate.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"
#include "scratch_dir.h"

namespace moeflex::test {

/// FLOP/s of every GEMM in gemm_only_profile().
inline constexpr FlopsPerSecond kGemmOnlyRate = 1e12;

/// Every GEMM at kGemmOnlyRate, elementwise work and launches free: a layer's time
/// is its GEMM FLOPs / kGemmOnlyRate.
inline HardwareProfile gemm_only_profile() {
  HardwareProfile p;
  p.name = "gemm-only";
  p.gemm = {{64, 64, 64, kGemmOnlyRate}};
  p.memory_bandwidth = 1e30;
  p.launch_overhead = 0;
  p.h2d_bandwidth = p.d2h_bandwidth = 1e9;
  p.copy_latency = 0;
  return p;
}

/// Received rows [MoE layer][micro-batch][dp rank] of write_loads_jsonl's step:
/// every (layer, micro-batch) sums to 128, the group's 2 x 64 kept rows.
inline const std::vector<std::vector<std::vector<std::int64_t>>> kLoadsReceived = {
    {{100, 28}, {30, 98}, {40, 88}}, {{38, 90}, {88, 40}, {120, 8}}};

/// A loads.jsonl (the format `moeflex train` writes) of one step: dp 2, ep 2, 3
/// micro-batches, MoE layers 1 and 2, kLoadsReceived rows received and `kept`
/// assignments kept per rank and micro-batch; written into a fresh directory
/// named after `tag` and the process, which is returned.
inline std::filesystem::path write_loads_jsonl(std::int64_t kept, const std::string& tag) {
  nlohmann::json kept_j = nlohmann::json::array();
  for (int k = 0; k < 2; ++k) kept_j.push_back(std::vector<std::vector<std::int64_t>>(3, {kept, kept}));
  const nlohmann::json line = {{"step", 1},         {"dp", 2},           {"ep", 2},
                               {"microbatches", 3}, {"moe_layers", {1, 2}}, {"received", kLoadsReceived},
                               {"kept", kept_j},    {"step_cpu_seconds", {0.1, 0.1}}};
  const auto dir = scratch_dir("moeflex_test_", tag);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "loads.jsonl") << line.dump() << "\n";
  return dir;
}

}  // namespace moeflex::test
