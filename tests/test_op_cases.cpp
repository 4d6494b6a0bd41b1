// The op-case registry's CPU modes (op_cases.h, docs/testing.md):
//   OpCase.Gradients: for every case with a backward, each gradient the CPU backend
//     writes against central finite differences of its fp32 forward, for the probe
//     loss L = forward's loss + sum <output, seed> (op_cases.h), every element of an
//     input up to kMaxFdElements and evenly spaced ones past that; and, so that every
//     case can fail, each gradient scaled by 1.01 must fail its check;
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

/// One gradient of a case against finite differences.
struct GradientCheck {
  std::string name, of;
  bool accumulate = false;
  double err = 0;             ///< relative error in norm over the checked elements
  double numeric_norm = 0;    ///< norm of the finite differences (0: L does not depend on the input)
  std::size_t checked = 0;    ///< elements compared
  std::ptrdiff_t not_finite = -1;  ///< first element that is not finite (not written?), or -1
};

/// Runs `c` forward and backward on the CPU backend in fp32 and compares every
/// gradient (or only the one named `only`) with central finite differences of the
/// probe loss.
std::vector<GradientCheck> check_gradients(const mt::OpCase& c, const std::string& only = "") {
  Backend& be = moeflex::ops::cpu_backend();
  mt::OpTensors t(be, mt::cpu_arena(), DType::f32, c.build());
  c.forward(be, t);
  c.backward(be, t);
  std::vector<std::pair<const mt::TensorSpec*, std::vector<double>>> analytic;
  for (const mt::TensorSpec& s : t.specs())
    if (!mt::gradient_input(s).empty() && (only.empty() || s.name == only))
      analytic.emplace_back(&s, mt::gradient_written(t, s));

  auto loss = [&] {
    double L = c.forward(be, t);
    for (const mt::TensorSpec& s : t.specs())
      if (s.role == mt::Role::seed) L += mt::dot(t.read(s.of), s.init);
    return L;
  };
  std::vector<GradientCheck> checks;
  for (const auto& [g, full] : analytic) {
    GradientCheck r{g->name, mt::gradient_input(*g), g->accumulate};
    const std::vector<double> x0 = t.stored_init(r.of);
    // Every element written ("=" outputs start as NaN), also those not sampled below.
    const auto bad = std::find_if(full.begin(), full.end(), [](double v) { return !std::isfinite(v); });
    if (bad != full.end()) r.not_finite = bad - full.begin();
    std::vector<double> a, numeric;
    for (std::size_t e : fd_elements(x0.size())) {
      std::vector<double> x = x0;
      double L[2], at[2];
      for (int side = 0; side < 2; ++side) {
        x[e] = x0[e] + (side == 0 ? c.tol.fd_eps : -c.tol.fd_eps);
        t.reset();
        t.set(r.of, x);
        at[side] = double(float(x[e]));  // the point as stored (fp32), so the step is exact
        L[side] = loss();
      }
      a.push_back(full[e]);
      numeric.push_back((L[0] - L[1]) / (at[0] - at[1]));
    }
    r.err = mt::rel_err(a, numeric);
    r.numeric_norm = norm(numeric);
    r.checked = numeric.size();
    checks.push_back(r);
  }
  return checks;
}

class OpCase : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCase, Gradients) {
  const mt::OpCase& c = *GetParam();
  const std::vector<GradientCheck> checks = check_gradients(c);
  ASSERT_FALSE(checks.empty()) << c.name << " has a backward but declares no gradient";
  for (const GradientCheck& r : checks) {
    std::printf("[ fd       ] %-34s %-10s err %-10.3g tol %.0e\n", c.name.c_str(), r.name.c_str(), r.err, c.tol.fd);
    EXPECT_EQ(r.not_finite, -1) << c.name << ": " << r.name << "[" << r.not_finite << "] is not finite (not written?)";
    EXPECT_LT(r.err, c.tol.fd) << c.name << " (" << c.shape << "): gradient " << r.name << " of " << r.of
                               << (r.accumulate ? " (+=)" : " (=)") << ": relative error " << r.err << " against "
                               << r.checked << " finite differences (step " << c.tol.fd_eps << "; " << c.tol.why
                               << ")";
    EXPECT_GT(r.numeric_norm, 0.0) << c.name << ": the probe loss does not depend on " << r.of;
  }
}

/// Every gradient check of every case can fail: the case with one gradient scaled
/// by 1.01 after its backward (an error of 1%) must fail the check of that gradient.
TEST_P(OpCase, GradientsCatchAOnePercentError) {
  const mt::OpCase& c = *GetParam();
  mt::OpTensors probe(moeflex::ops::cpu_backend(), mt::cpu_arena(), DType::f32, c.build());
  for (const mt::TensorSpec& g : probe.specs()) {
    if (mt::gradient_input(g).empty()) continue;
    mt::OpCase broken = c;
    broken.backward = [&c, name = g.name](Backend& be, mt::OpTensors& t) {
      c.backward(be, t);
      be.scale(t.f(name), t.numel(name), 1.01f);
    };
    for (const GradientCheck& r : check_gradients(broken, g.name)) {
      EXPECT_GT(r.err, c.tol.fd) << c.name << ": a 1% error in " << g.name << " passes (relative error " << r.err
                                 << ", tolerance " << c.tol.fd << ")";
    }
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
