// The cross-backend op harness (STYLE habit 4), CPU part: every op test builds its
// inputs in double precision, runs forward and backward, and compares each analytic
// gradient with central finite differences of a scalar probe loss
//   L = sum(out * probe), probe fixed random,
// so d L / d out = probe is what the op's backward receives.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moeflex/core/rng.h"

namespace moeflex::test {

/// Fixed pseudo-random values in [-scale, scale), from (seed, stream).
inline std::vector<double> random_vec(std::size_t n, std::uint64_t stream, double scale = 1.0,
                                      std::uint64_t seed = 1234) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = (2.0 * uniform01(seed, stream, i) - 1.0) * scale;
  return v;
}

/// sum(a * b).
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

/// Relative error in norm: ||a - b|| / max(||b||, tiny).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

/// Central finite differences of `loss` with respect to every element of `x`
/// (x is perturbed in place and restored). Step eps, in double.
inline std::vector<double> numeric_grad(std::vector<double>& x, const std::function<double()>& loss,
                                        double eps = 1e-6) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double old = x[i];
    x[i] = old + eps;
    const double lp = loss();
    x[i] = old - eps;
    const double lm = loss();
    x[i] = old;
    g[i] = (lp - lm) / (2 * eps);
  }
  return g;
}

/// Asserts that the analytic gradient of `name` matches finite differences
/// within relative error `tol` (in norm).
inline void expect_grad_close(const std::string& name, const std::vector<double>& analytic,
                              std::vector<double>& x, const std::function<double()>& loss, double tol = 1e-6,
                              double eps = 1e-6) {
  auto numeric = numeric_grad(x, loss, eps);
  const double err = rel_err(analytic, numeric);
  EXPECT_LT(err, tol) << "gradient of " << name << ": relative error " << err;
}

}  // namespace moeflex::test
