// Internal to `moeflex calibrate` (calibrate*.cpp, calibrate_device.cpp): the GEMM
// shapes a linear layer runs, kernel inputs, the clock and the small statistics both
// calibrations use.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex::calibration {

/// One GEMM as its caller passes it to ops::gemm / Backend::gemm (row-major).
struct GemmShape {
  std::int64_t M, N, K;
  bool ta, tb;  ///< transposes as the real caller passes them
  std::int64_t lda, ldb, ldc;
  float beta;
  char weight;  ///< the operand that is a weight, cold from the ring: 'b', 'c' or 0 (none)

  GemmLayout layout() const { return ta ? GemmLayout::tn : tb ? GemmLayout::nt : GemmLayout::nn; }
  double flops() const { return 2.0 * double(M) * double(N) * double(K); }
};

/// The GEMMs of the linear layers, as ops::linear_* and ops::grouped_linear_* call
/// them for a weight [out, in] and n rows: y = x w^T (nt), dx = dy w (nn),
/// dw += dy^T x (tn).
inline GemmShape linear_forward_gemm(std::int64_t n, std::int64_t in, std::int64_t out) {
  return {n, out, in, false, true, in, in, out, 0.0f, 'b'};
}
inline GemmShape linear_dx_gemm(std::int64_t n, std::int64_t in, std::int64_t out) {
  return {n, in, out, false, false, out, in, in, 0.0f, 'b'};
}
inline GemmShape linear_dw_gemm(std::int64_t n, std::int64_t in, std::int64_t out) {
  return {out, in, n, true, false, out, in, in, 1.0f, 'c'};
}

using Clock = std::chrono::steady_clock;

/// Seconds since `t0` on Clock.
inline Seconds since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Deterministic values in [-0.5, 0.5) (no denormals, no NaN) for kernel inputs.
inline void fill(std::vector<float>& v, std::uint32_t seed) {
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (float& f : v) {
    x = x * 1664525u + 1013904223u;
    f = float(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
  }
}

/// fill() of a new vector of max(n, 1) elements.
inline std::vector<float> buffer(std::int64_t n, std::uint32_t seed) {
  std::vector<float> v(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));
  fill(v, seed);
  return v;
}

/// The q-quantile of `t` (0 <= q <= 1, t not empty), interpolated between order statistics.
inline Seconds quantile(std::vector<Seconds> t, double q) {
  std::sort(t.begin(), t.end());
  const double pos = q * double(t.size() - 1);
  const std::size_t lo = std::size_t(pos);
  const std::size_t hi = std::min(lo + 1, t.size() - 1);
  return t[lo] + (pos - double(lo)) * (t[hi] - t[lo]);
}

/// Least squares t = a + b x minimising relative residuals (weights 1/t^2), a >= 0,
/// b > 0 (when time does not grow with x: a = 0 and the largest point's rate).
inline std::pair<Seconds, double> fit_affine(const std::vector<std::pair<double, Seconds>>& pts) {
  double sw = 0, swx = 0, swxx = 0, swt = 0, swxt = 0;
  for (auto [x, t] : pts) {
    const double w = 1.0 / std::max(t * t, 1e-30);
    sw += w, swx += w * x, swxx += w * x * x, swt += w * t, swxt += w * x * t;
  }
  const double det = sw * swxx - swx * swx;
  double a = det != 0 ? (swt * swxx - swx * swxt) / det : 0;
  double b = det != 0 ? (sw * swxt - swx * swt) / det : 0;
  if (a < 0 || det == 0) a = 0, b = swxx > 0 ? swxt / swxx : 0;
  if (!(b > 0)) {
    const auto& last = *std::max_element(pts.begin(), pts.end());
    a = 0, b = last.second / last.first;
  }
  return {a, b};
}

}  // namespace moeflex::calibration
