// Shared fixtures of the simulator tests: a hardware profile whose times are pure
// GEMM FLOPs at one rate.
#pragma once

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"

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

}  // namespace moeflex::test
