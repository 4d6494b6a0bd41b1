// The op-case registry's CPU modes (op_cases.h, docs/testing.md):
//   OpCase.Gradients: for every case with a backward, each gradient the CPU backend
//     writes against central finite differences of its fp32 forward, for the probe
//     loss L = forward's loss + sum <output, seed> (op_cases.h), every element of an
//     input up to kMaxFdElements and evenly spaced ones past that;
//   OpCaseBf16.CpuMatchesFp32: every case's bf16 run on the CPU backend against its
//     fp32 run on the same bf16-rounded inputs (the reference the CUDA bf16 kernels
//     are held to, checked for what it promises: outputs rounded once);
//   OpCaseTiming.Cpu: with MOEFLEX_OP_TIMING=1, the median time and GFLOP/s of every
//     case's forward and backward on the CPU backend, fp32 and bf16 (a table; no
//     assertion).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "op_cases.h"
#include "op_harness.h"

namespace {

namespace mt = moeflex::test;
using moeflex::Arena;
using moeflex::DType;
using moeflex::ops::Backend;

/// Inputs with more elements are checked at this many evenly spaced ones (each
/// element costs two forwards).
constexpr std::size_t kMaxFdElements = 160;

std::vector<std::size_t> fd_elements(std::size_t numel) {
  std::vector<std::size_t> at;
  if (numel <= kMaxFdElements) {
    for (std::size_t e = 0; e < numel; ++e) at.push_back(e);
  } else {
    for (std::size_t j = 0; j < kMaxFdElements; ++j) at.push_back(j * numel / kMaxFdElements);
  }
  return at;
}

double norm(const std::vector<double>& v) { return std::sqrt(mt::dot(v, v)); }

class OpCase : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCase, Gradients) {
  const mt::OpCase& c = *GetParam();
  Backend& be = moeflex::ops::cpu_backend();
  mt::OpTensors t(be, mt::cpu_arena(), DType::f32, c.build());
  c.forward(be, t);
  c.backward(be, t);
  std::vector<std::pair<const mt::TensorSpec*, std::vector<double>>> analytic;
  for (const mt::TensorSpec& s : t.specs())
    if (!mt::gradient_input(s).empty()) analytic.emplace_back(&s, mt::gradient_written(t, s));
  ASSERT_FALSE(analytic.empty()) << c.name << " has a backward but declares no gradient";

  auto loss = [&] {
    double L = c.forward(be, t);
    for (const mt::TensorSpec& s : t.specs())
      if (s.role == mt::Role::seed) L += mt::dot(t.read(s.of), s.init);
    return L;
  };
  for (const auto& [g, full] : analytic) {
    const std::string x_name = mt::gradient_input(*g);
    const std::vector<double> x0 = t.stored_init(x_name);
    // Every element written ("=" outputs start as NaN), also those not sampled below.
    const auto bad = std::find_if(full.begin(), full.end(), [](double v) { return !std::isfinite(v); });
    EXPECT_TRUE(bad == full.end()) << c.name << ": " << g->name << "[" << (bad - full.begin())
                                   << "] is not finite (not written?)";
    std::vector<double> a, numeric;
    for (std::size_t e : fd_elements(x0.size())) {
      std::vector<double> x = x0;
      double L[2], at[2];
      for (int side = 0; side < 2; ++side) {
        x[e] = x0[e] + (side == 0 ? c.tol.fd_eps : -c.tol.fd_eps);
        t.reset();
        t.set(x_name, x);
        at[side] = double(float(x[e]));  // the point as stored (fp32), so the step is exact
        L[side] = loss();
      }
      a.push_back(full[e]);
      numeric.push_back((L[0] - L[1]) / (at[0] - at[1]));
    }
    const double err = mt::rel_err(a, numeric);
    std::printf("[ fd       ] %-34s %-10s err %-10.3g tol %.0e\n", c.name.c_str(), g->name.c_str(), err, c.tol.fd);
    EXPECT_LT(err, c.tol.fd) << c.name << " (" << c.shape << "): gradient " << g->name << " of " << x_name
                             << (g->accumulate ? " (+=)" : " (=)") << ": relative error " << err << " against "
                             << numeric.size() << " finite differences (step " << c.tol.fd_eps << "; "
                             << c.tol.why << ")";
    EXPECT_GT(norm(numeric), 0.0) << c.name << ": the probe loss does not depend on " << x_name;
  }
}

/// The CPU backend's bf16 path widens the inputs, runs the fp32 op and rounds each
/// output once (ops/backend.h): against the fp32 run on the same bf16-rounded
/// inputs, an output is off by at most half a bf16 ulp (2^-9 = 2e-3 relative). The
/// measured worst is 3.1e-3, a "+=" onto a bf16 prior (gemm's dA), whose increment
/// carries the rounding of the whole sum; 5e-3 keeps that margin.
constexpr double kCpuBf16Tol = 5e-3;

class OpCaseBf16 : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCaseBf16, CpuMatchesFp32) {
  Backend& cpu = moeflex::ops::cpu_backend();
  mt::expect_runs_match(*GetParam(), {cpu, mt::cpu_arena(), DType::bf16}, {cpu, mt::cpu_arena(), DType::f32},
                        kCpuBf16Tol);
}

class OpCaseTiming : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCaseTiming, Cpu) {
  if (!mt::timing_requested()) GTEST_SKIP() << "timing mode: set MOEFLEX_OP_TIMING=1";
  for (DType act : {DType::f32, DType::bf16})
    mt::record_timing(mt::time_case(*GetParam(), moeflex::ops::cpu_backend(), mt::cpu_arena(), act));
}

// Gradients: the small cases with a backward; bf16 and timing: every case.
INSTANTIATE_TEST_SUITE_P(, OpCase, ::testing::ValuesIn(mt::op_cases_for_gradients()), mt::op_case_name);
INSTANTIATE_TEST_SUITE_P(, OpCaseBf16, ::testing::ValuesIn(mt::all_op_case_pointers()), mt::op_case_name);
INSTANTIATE_TEST_SUITE_P(, OpCaseTiming, ::testing::ValuesIn(mt::all_op_case_pointers()), mt::op_case_name);

}  // namespace
