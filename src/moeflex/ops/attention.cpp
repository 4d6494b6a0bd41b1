// Causal multi-head scaled dot-product attention (Vaswani et al. 2017), with
// grouped-query attention (Ainslie et al. 2023): H query heads share Hkv key/value
// heads, query head h reading kv head h / (H / Hkv) (Hkv = H: multi-head, 1: MQA).
//   q, out, dout, dq: [B, S, H, hd]; k, v, dk, dv: [B, S, Hkv, hd] (token-major, heads
//   interleaved); probs, dprobs_ws: [B, H, S, S].
//   forward:  probs (=) = softmax(q k^T / sqrt(hd) + causal mask), 0 above the diagonal;
//             out (=) = probs v.
//   backward: dv (=) = probs^T dout;  dP = dout v^T;  dS = probs * (dP - rowsum(dP * probs));
//             dq (=) = dS k / sqrt(hd);  dk (=) = dS^T q / sqrt(hd), dk and dv summed
//             over the query heads of their group.
// Head (b, h) of q is the S x hd matrix at q + b*S*H*hd + h*hd with row stride H*hd
// (of k and v: kv head h / (H / Hkv), row stride Hkv*hd), so every matmul is a GEMM on
// a strided view and nothing is transposed in memory. A group's query heads run one
// after another, the first writing its kv head's dk and dv (beta 0), the rest adding.
//
// Threading: heads run one after another; OpenBLAS threads each GEMM (at S=128, hd=64
// a head's GEMM is 2^20 multiply-adds, above OpenBLAS's threading threshold of 2^18),
// and the softmax rows of a head run on the calling thread between its two GEMMs,
// while the head's S x S block is still in L2. There is deliberately no OpenMP here:
// the installed OpenBLAS is the pthreads build, with its own worker threads, and
// - an OpenMP loop over (b, h) calling BLAS (set to one thread) gained nothing:
//   concurrent calls into the pthreads build serialise (1.49 ms, as one thread), and
// - an OpenMP softmax phase between GEMM phases hands the two cores back and forth
//   between two thread pools that each spin while idle: with libgomp's default wait
//   policy that measured 11-13 ms against 1.0 ms for this layout (B=8, S=128, H=4,
//   hd=64, 2 cores; 1.55 ms single-threaded). The serial softmax is ~0.17 ms of it.
// Softmax rows are independent, so results are bit-identical to a row-parallel version.
#include "moeflex/ops/attention.h"

#include <cmath>

#include "moeflex/ops/blas.h"
#include "moeflex/ops/vec_math.h"

namespace moeflex::ops {

namespace {

/// Causal softmax in place over the rows of one head's S x S scores: row i keeps
/// columns 0..i, the rest become 0.
template <typename T>
void causal_softmax_rows(T* scores, std::int64_t S) {
  for (std::int64_t i = 0; i < S; ++i) {
    T* row = scores + i * S;
    const std::int64_t len = i + 1;
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
}

/// Softmax backward in place over one head's dP: dS = scale * P * (dP - rowsum(P * dP)),
/// with the 1/sqrt(hd) of the scores folded in as `scale`.
template <typename T>
void causal_softmax_backward_rows(const T* probs, T* dp, std::int64_t S, T scale) {
  for (std::int64_t i = 0; i < S; ++i) {
    const T* p = probs + i * S;
    T* g = dp + i * S;
    const std::int64_t len = i + 1;
    const T dot = detail::lane_sum<T>(len, [&](std::int64_t j) { return p[j] * g[j]; });
    for (std::int64_t j = 0; j < len; ++j) g[j] = scale * (p[j] * (g[j] - dot));
    for (std::int64_t j = len; j < S; ++j) g[j] = T(0);
  }
}

}  // namespace

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* probs, std::int64_t B, std::int64_t S,
                       std::int64_t H, std::int64_t Hkv, std::int64_t hd) {
  const std::int64_t ld = H * hd, ldkv = Hkv * hd, G = H / Hkv;
  const T scale = T(1) / std::sqrt(T(hd));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd, kv = b * S * ldkv + (h / G) * hd;
      T* p = probs + (b * H + h) * S * S;
      gemm<T>(false, true, S, S, hd, scale, q + off, ld, k + kv, ldkv, T(0), p, S);
      causal_softmax_rows(p, S);
      gemm<T>(false, false, S, hd, S, T(1), p, S, v + kv, ldkv, T(0), out + off, ld);
    }
  }
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* probs, T* dq, T* dk, T* dv,
                        T* dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                        std::int64_t hd) {
  const std::int64_t ld = H * hd, ldkv = Hkv * hd, G = H / Hkv;
  const T scale = T(1) / std::sqrt(T(hd));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t off = b * S * ld + h * hd, kv = b * S * ldkv + (h / G) * hd;
      const T acc = h % G == 0 ? T(0) : T(1);  // the group's first query head writes dk, dv; the rest add
      const T* p = probs + (b * H + h) * S * S;
      T* dp = dprobs_ws + (b * H + h) * S * S;
      gemm<T>(true, false, S, hd, S, T(1), p, S, dout + off, ld, acc, dv + kv, ldkv);
      gemm<T>(false, true, S, S, hd, T(1), dout + off, ld, v + kv, ldkv, T(0), dp, S);
      causal_softmax_backward_rows(p, dp, S, scale);
      gemm<T>(false, false, S, hd, S, T(1), dp, S, k + kv, ldkv, T(0), dq + off, ld);
      gemm<T>(true, false, S, hd, S, T(1), dp, S, q + off, ld, acc, dk + kv, ldkv);
    }
  }
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                       std::int64_t, std::int64_t, std::int64_t, std::int64_t);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*,
                                        std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                        float*, float*, float*, float*, std::int64_t, std::int64_t, std::int64_t,
                                        std::int64_t, std::int64_t);
template void attention_backward<double>(const double*, const double*, const double*, const double*,
                                         const double*, double*, double*, double*, double*, std::int64_t,
                                         std::int64_t, std::int64_t, std::int64_t, std::int64_t);

}  // namespace moeflex::ops
