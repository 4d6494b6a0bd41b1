// Grouped GEMM over experts with variable row counts, plus the sequential-experts reference.
//   x, dx: [rows, in] sorted by expert; y, dy: [rows, out]; offsets: [E+1]; w, dw: [E, out, in].
//   forward:  y_e = x_e @ w_e^T   (=)
//   backward: dx_e = dy_e @ w_e (=); dw_e += dy_e^T @ x_e (+=); either may be null.
//   moe_experts_reference: y[i] = sum_j kept w_ij * W2_e (silu(W1_e x_i) * W3_e x_i)  (=)
// One GEMM per non-empty expert; an empty expert is skipped (its dw_e is unchanged and
// no GEMM of zero rows reaches BLAS). The parallelism is inside each GEMM (OpenBLAS),
// whose result is fixed for a fixed thread count.
#include "moeflex/ops/grouped_linear.h"

#include <cmath>
#include <vector>

#include "moeflex/ops/blas.h"

namespace moeflex::ops {

template <typename T>
void grouped_linear_forward(const T* x, const T* w, T* y, const std::int32_t* offsets, std::int64_t E,
                            std::int64_t in, std::int64_t out) {
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) continue;
    gemm<T>(false, true, rows, out, in, T(1), x + begin * in, in, w + e * out * in, in, T(0), y + begin * out,
            out);
  }
}

template <typename T>
void grouped_linear_backward(const T* dy, const T* x, const T* w, T* dx, T* dw, const std::int32_t* offsets,
                             std::int64_t E, std::int64_t in, std::int64_t out) {
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) continue;
    const T* dy_e = dy + begin * out;
    if (dx)
      gemm<T>(false, false, rows, in, out, T(1), dy_e, out, w + e * out * in, in, T(0), dx + begin * in, in);
    if (dw)
      gemm<T>(true, false, out, in, rows, T(1), dy_e, out, x + begin * in, in, T(1), dw + e * out * in, in);
  }
}

template <typename T>
void moe_experts_reference(const T* x, const std::int32_t* topk_idx, const T* topk_w, const std::int32_t* slot_of,
                           const T* w1, const T* w3, const T* w2, T* y, std::int64_t n, std::int64_t d,
                           std::int64_t f, std::int64_t k) {
  std::vector<T> act(static_cast<std::size_t>(f));
  for (std::int64_t i = 0; i < n * d; ++i) y[i] = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    for (std::int64_t j = 0; j < k; ++j) {
      if (slot_of[i * k + j] < 0) continue;
      const std::int64_t e = topk_idx[i * k + j];
      const T* g_w = w1 + e * f * d;
      const T* u_w = w3 + e * f * d;
      const T* d_w = w2 + e * d * f;
      for (std::int64_t r = 0; r < f; ++r) {
        T g = 0, u = 0;
        for (std::int64_t c = 0; c < d; ++c) {
          g += g_w[r * d + c] * xi[c];
          u += u_w[r * d + c] * xi[c];
        }
        act[static_cast<std::size_t>(r)] = g / (T(1) + std::exp(-g)) * u;
      }
      const T wt = topk_w[i * k + j];
      for (std::int64_t r = 0; r < d; ++r) {
        T s = 0;
        for (std::int64_t c = 0; c < f; ++c) s += d_w[r * f + c] * act[static_cast<std::size_t>(c)];
        y[i * d + r] += wt * s;
      }
    }
  }
}

#define MOEFLEX_INSTANTIATE_GROUPED(T)                                                                         \
  template void grouped_linear_forward<T>(const T*, const T*, T*, const std::int32_t*, std::int64_t,          \
                                          std::int64_t, std::int64_t);                                         \
  template void grouped_linear_backward<T>(const T*, const T*, const T*, T*, T*, const std::int32_t*,         \
                                           std::int64_t, std::int64_t, std::int64_t);                          \
  template void moe_experts_reference<T>(const T*, const std::int32_t*, const T*, const std::int32_t*,        \
                                         const T*, const T*, const T*, T*, std::int64_t, std::int64_t,         \
                                         std::int64_t, std::int64_t);

MOEFLEX_INSTANTIATE_GROUPED(float)
MOEFLEX_INSTANTIATE_GROUPED(double)
#undef MOEFLEX_INSTANTIATE_GROUPED

}  // namespace moeflex::ops
