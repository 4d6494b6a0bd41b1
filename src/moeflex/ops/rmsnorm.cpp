// RMSNorm (Zhang & Sennrich 2019): y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
//   x, y, dx, dy: [n, d]; w, dw: [d]; rstd: [n] (saved by forward for backward).
//   forward:  y (=), rstd (=).
//   backward: dx (=), dw (+=, rows summed in a fixed order).
// Backward maths, with r = rstd_i and c_i = r^2 * (sum_j dy_ij w_j x_ij) / d:
//   dx_ij = r * (dy_ij w_j - x_ij c_i),   dw_j += sum_i dy_ij x_ij r_i.
// dw is a reduction over rows. Rows are cut into fixed chunks of kRowsPerChunk; each
// chunk sums its rows in order into its own partial vector (in the same pass that
// writes dx), then the partials are added in chunk order. The chunking does not
// depend on the thread count, so dw is bit-identical for any number of threads.
#include "moeflex/ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "moeflex/ops/vec_math.h"

namespace moeflex::ops {
namespace {

/// Rows per dw partial: small enough to give every thread chunks, large enough that
/// the partials (n / kRowsPerChunk rows of d) are a small extra pass.
constexpr std::int64_t kRowsPerChunk = 32;

/// Columns per work item when summing the partials.
constexpr std::int64_t kColumnBlock = 64;

}  // namespace

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, std::int64_t n, std::int64_t d, T eps) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    T* yi = y + i * d;
    const T ss = detail::lane_sum<T>(d, [&](std::int64_t j) { return xi[j] * xi[j]; });
    const T r = T(1) / std::sqrt(ss / T(d) + eps);
    rstd[i] = r;
    for (std::int64_t j = 0; j < d; ++j) yi[j] = (xi[j] * r) * w[j];
  }
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, std::int64_t n,
                      std::int64_t d) {
  const std::int64_t chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  std::vector<T> partial(static_cast<std::size_t>(chunks * d));
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < chunks; ++c) {
    T* pdw = partial.data() + c * d;
    const std::int64_t i1 = std::min(n, (c + 1) * kRowsPerChunk);
    for (std::int64_t i = c * kRowsPerChunk; i < i1; ++i) {
      const T* dyi = dy + i * d;
      const T* xi = x + i * d;
      T* dxi = dx + i * d;
      const T r = rstd[i];
      const T dot = detail::lane_sum<T>(d, [&](std::int64_t j) { return (dyi[j] * w[j]) * xi[j]; });
      const T ci = r * r * dot / T(d);
      for (std::int64_t j = 0; j < d; ++j) {
        dxi[j] = r * (dyi[j] * w[j] - xi[j] * ci);
        pdw[j] += dyi[j] * (xi[j] * r);
      }
    }
  }
  const std::int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t j0 = b * kColumnBlock, j1 = std::min(d, j0 + kColumnBlock);
    T acc[kColumnBlock] = {};
    for (std::int64_t c = 0; c < chunks; ++c) {
      const T* pdw = partial.data() + c * d;
      for (std::int64_t j = j0; j < j1; ++j) acc[j - j0] += pdw[j];
    }
    for (std::int64_t j = j0; j < j1; ++j) dw[j] += acc[j - j0];
  }
}

template void rmsnorm_forward<float>(const float*, const float*, float*, float*, std::int64_t, std::int64_t, float);
template void rmsnorm_forward<double>(const double*, const double*, double*, double*, std::int64_t, std::int64_t,
                                      double);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*, float*, float*,
                                      std::int64_t, std::int64_t);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*, double*,
                                       double*, std::int64_t, std::int64_t);

}  // namespace moeflex::ops
