// MoE token dispatch on one rank: capacity plan, permute into the expert-sorted
// buffer and unpermute (weighted combine) back to token order.
//   x, dx, y, dy: [n, d]; xp, dxp, yp, dyp: [rows = offsets[E], d]; topk_idx, topk_w,
//   dtopk_w: [n, k]; slot_of: [n*k] (-1 = dropped); counts: [E]; offsets: [E+1].
//   moe_plan_dispatch: counts, offsets, slot_of (=)
//   permute_forward:   xp[slot] = x[i] (=)          permute_backward:   dx[i] = sum_j dxp[slot] (=)
//   unpermute_forward: y[i] = sum_j w_ij yp[slot] (=)
//   unpermute_backward: dyp[slot] = w_ij dy[i] (=), dtopk_w = <dy[i], yp[slot]> (=)
//   combine_topk_grad:  dtopk_w = <dy[i], yp[slot]> for the slots of one row window (=)
// Every kernel loops over tokens; each kept slot belongs to exactly one token, so a
// token's thread is the only writer of its rows and sums run in j order: results do
// not depend on the thread count.
#include "moeflex/ops/moe_dispatch.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex::ops {

std::int64_t expert_capacity(double capacity_factor, std::int64_t n, std::int64_t E, std::int64_t k) {
  if (capacity_factor <= 0.0) return -1;
  // Evaluated left to right as ((cf * n) * k) / E, the order of the reference formula.
  return static_cast<std::int64_t>(
      std::ceil(capacity_factor * static_cast<double>(n) * static_cast<double>(k) / static_cast<double>(E)));
}

std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                               std::int64_t capacity, std::int32_t* counts, std::int32_t* offsets,
                               std::int32_t* slot_of) {
  const std::int64_t assignments = n * k;
  if (assignments > std::numeric_limits<std::int32_t>::max())
    throw Error("moe_plan_dispatch: " + std::to_string(assignments) +
                " assignments (tokens * top-k) do not fit the int32 slot index");
  const bool dropless = capacity < 0;
  for (std::int64_t e = 0; e < E; ++e) counts[e] = 0;
  // First pass, in (token, slot) order: each assignment's rank inside its expert,
  // which is its row relative to the expert's offset; past the capacity it is dropped.
  std::int64_t dropped = 0;
  for (std::int64_t a = 0; a < assignments; ++a) {
    const std::int32_t e = topk_idx[a];
    if (e < 0 || e >= E)
      throw Error("moe_plan_dispatch: topk_idx[" + std::to_string(a) + "] = " + std::to_string(e) +
                  " is outside [0, " + std::to_string(E) + ")");
    if (dropless || counts[e] < capacity) {
      slot_of[a] = counts[e]++;
    } else {
      slot_of[a] = -1;
      ++dropped;
    }
  }
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  for (std::int64_t a = 0; a < assignments; ++a)
    if (slot_of[a] >= 0) slot_of[a] += offsets[topk_idx[a]];
  return dropped;
}

template <typename T>
void permute_forward(const T* x, const std::int32_t* slot_of, T* xp, std::int64_t n, std::int64_t k,
                     std::int64_t d) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* src = x + i * d;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t s = slot_of[i * k + j];
      if (s < 0) continue;
      T* dst = xp + static_cast<std::int64_t>(s) * d;
      for (std::int64_t c = 0; c < d; ++c) dst[c] = src[c];
    }
  }
}

template <typename T>
void permute_backward(const T* dxp, const std::int32_t* slot_of, T* dx, std::int64_t n, std::int64_t k,
                      std::int64_t d) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    T* dst = dx + i * d;
    for (std::int64_t c = 0; c < d; ++c) dst[c] = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t s = slot_of[i * k + j];
      if (s < 0) continue;
      const T* src = dxp + static_cast<std::int64_t>(s) * d;
      for (std::int64_t c = 0; c < d; ++c) dst[c] += src[c];
    }
  }
}

template <typename T>
void unpermute_forward(const T* yp, const std::int32_t* slot_of, const T* topk_w, T* y, std::int64_t n,
                       std::int64_t k, std::int64_t d) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    T* dst = y + i * d;
    for (std::int64_t c = 0; c < d; ++c) dst[c] = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t s = slot_of[i * k + j];
      if (s < 0) continue;
      const T w = topk_w[i * k + j];
      const T* src = yp + static_cast<std::int64_t>(s) * d;
      for (std::int64_t c = 0; c < d; ++c) dst[c] += w * src[c];
    }
  }
}

namespace {

/// <a, b> over d elements, summed in index order: the one definition of the top-k
/// weight's gradient, so that the whole and the windowed backward give equal bits.
template <typename T>
T row_dot(const T* a, const T* b, std::int64_t d) {
  T dot = 0;
  for (std::int64_t c = 0; c < d; ++c) dot += a[c] * b[c];
  return dot;
}

}  // namespace

template <typename T>
void unpermute_backward(const T* dy, const T* yp, const std::int32_t* slot_of, const T* topk_w, T* dyp,
                        T* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* g = dy + i * d;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t s = slot_of[i * k + j];
      if (s < 0) {
        if (dtopk_w) dtopk_w[i * k + j] = 0;
        continue;
      }
      const T w = topk_w[i * k + j];
      T* dst = dyp + static_cast<std::int64_t>(s) * d;
      for (std::int64_t c = 0; c < d; ++c) dst[c] = w * g[c];
      if (dtopk_w) dtopk_w[i * k + j] = row_dot(g, yp + static_cast<std::int64_t>(s) * d, d);
    }
  }
}

template <typename T>
void combine_topk_grad(const T* dy, const T* yp_rows, const std::int32_t* slot_of, T* dtopk_w, std::int64_t n,
                       std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = slot_of[i * k + j];
      if (s >= r0 && s < r0 + rows) dtopk_w[i * k + j] = row_dot(dy + i * d, yp_rows + (s - r0) * d, d);
    }
}

#define MOEFLEX_INSTANTIATE_DISPATCH(T)                                                                       \
  template void permute_forward<T>(const T*, const std::int32_t*, T*, std::int64_t, std::int64_t,            \
                                   std::int64_t);                                                             \
  template void permute_backward<T>(const T*, const std::int32_t*, T*, std::int64_t, std::int64_t,           \
                                    std::int64_t);                                                            \
  template void unpermute_forward<T>(const T*, const std::int32_t*, const T*, T*, std::int64_t, std::int64_t, \
                                     std::int64_t);                                                           \
  template void unpermute_backward<T>(const T*, const T*, const std::int32_t*, const T*, T*, T*,              \
                                      std::int64_t, std::int64_t, std::int64_t);                              \
  template void combine_topk_grad<T>(const T*, const T*, const std::int32_t*, T*, std::int64_t, std::int64_t, \
                                     std::int64_t, std::int64_t, std::int64_t);

MOEFLEX_INSTANTIATE_DISPATCH(float)
MOEFLEX_INSTANTIATE_DISPATCH(double)
#undef MOEFLEX_INSTANTIATE_DISPATCH

}  // namespace moeflex::ops
