// Causal multi-head scaled dot-product attention (Vaswani et al. 2017).
//   q, k, v, out, dout, dq, dk, dv: [B, S, H, hd] (token-major, heads interleaved);
//   probs, dprobs_ws:               [B, H, S, S].
//   forward:  probs (=) = softmax(q k^T / sqrt(hd) + causal mask), 0 above the diagonal;
//             out (=) = probs v.
//   backward: dv (=) = probs^T dout;  dP = dout v^T;  dS = probs * (dP - rowsum(dP * probs));
//             dq (=) = dS k / sqrt(hd);  dk (=) = dS^T q / sqrt(hd).
// Head (b, h) of q is the S x hd matrix at q + b*S*H*hd + h*hd with row stride H*hd,
// so every matmul is a GEMM on a strided view and nothing is transposed in memory.
//
// Threading: the GEMMs run one (b, h) after another and OpenBLAS threads each of them;
// the softmax rows of all heads are one OpenMP loop in between. The installed OpenBLAS
// is the pthreads build, which ignores omp_in_parallel(): calling it from an OpenMP loop
// over (b, h) would put its own worker threads on top of OpenMP's (oversubscription on
// 2 cores), and forcing it to one thread is process-wide state. At S=128, hd=64 each
// GEMM is 1 MFLOP-pairs, above OpenBLAS's threading threshold (2^18 multiply-adds), so
// both cores do work in every phase, and grouping the phases means the two thread
// pools hand over only four times per call instead of once per head.
#include "moeflex/ops/attention.h"

#include <cmath>

#include "moeflex/ops/blas.h"
#include "moeflex/ops/vec_math.h"

namespace moeflex::ops {

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* probs, std::int64_t B, std::int64_t S,
                       std::int64_t H, std::int64_t hd) {
  const std::int64_t ld = H * hd;
  const T scale = T(1) / std::sqrt(T(hd));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd;
      gemm<T>(false, true, S, S, hd, scale, q + off, ld, k + off, ld, T(0), probs + (b * H + h) * S * S, S);
    }
  }
  // Row r is query i = r % S of head r / S; it sees keys 0..i.
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < B * H * S; ++r) {
    const std::int64_t len = r % S + 1;
    T* row = probs + r * S;
    const T m = detail::lane_max(row, len);
    const T sum = detail::lane_sum<T>(len, [&](std::int64_t j) {
      const T e = detail::vexp(row[j] - m);
      row[j] = e;
      return e;
    });
    const T inv = T(1) / sum;
    for (std::int64_t j = 0; j < len; ++j) row[j] *= inv;
    for (std::int64_t j = len; j < S; ++j) row[j] = T(0);
  }
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd;
      gemm<T>(false, false, S, hd, S, T(1), probs + (b * H + h) * S * S, S, v + off, ld, T(0), out + off, ld);
    }
  }
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* probs, T* dq, T* dk, T* dv,
                        T* dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
  const std::int64_t ld = H * hd;
  const T scale = T(1) / std::sqrt(T(hd));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd;
      const T* p = probs + (b * H + h) * S * S;
      T* dp = dprobs_ws + (b * H + h) * S * S;
      gemm<T>(true, false, S, hd, S, T(1), p, S, dout + off, ld, T(0), dv + off, ld);
      gemm<T>(false, true, S, S, hd, T(1), dout + off, ld, v + off, ld, T(0), dp, S);
    }
  }
  // Softmax backward in place on dP; the 1/sqrt(hd) of the scores is folded in here.
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < B * H * S; ++r) {
    const std::int64_t len = r % S + 1;
    const T* p = probs + r * S;
    T* g = dprobs_ws + r * S;
    const T dot = detail::lane_sum<T>(len, [&](std::int64_t j) { return p[j] * g[j]; });
    for (std::int64_t j = 0; j < len; ++j) g[j] = scale * (p[j] * (g[j] - dot));
    for (std::int64_t j = len; j < S; ++j) g[j] = T(0);
  }
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd;
      const T* ds = dprobs_ws + (b * H + h) * S * S;
      gemm<T>(false, false, S, hd, S, T(1), ds, S, k + off, ld, T(0), dq + off, ld);
      gemm<T>(true, false, S, hd, S, T(1), ds, S, q + off, ld, T(0), dk + off, ld);
    }
  }
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                       std::int64_t, std::int64_t, std::int64_t);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*,
                                        std::int64_t, std::int64_t, std::int64_t, std::int64_t);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                        float*, float*, float*, float*, std::int64_t, std::int64_t, std::int64_t,
                                        std::int64_t);
template void attention_backward<double>(const double*, const double*, const double*, const double*,
                                         const double*, double*, double*, double*, double*, std::int64_t,
                                         std::int64_t, std::int64_t, std::int64_t);

}  // namespace moeflex::ops
