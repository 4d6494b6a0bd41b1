// Dense operator kernels (blas, linear, embedding, rmsnorm, rope, attention, swiglu,
// cross_entropy): every op against a naive double-precision reference written here,
// every gradient against central finite differences (op_harness.h), float against
// double, "=" outputs pre-filled with NaN so an output that is not written shows, "+="
// outputs called twice, and bit-for-bit determinism.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/ops/attention.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/embedding.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/swiglu.h"
#include "moeflex/ops/vec_math.h"
#include "op_harness.h"

namespace moeflex::test {
namespace {

using namespace moeflex::ops;
using Vec = std::vector<double>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
/// Float results against double ones (relative error in norm).
constexpr double kFloatTol = 1e-5;

std::vector<float> to_f(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }
Vec to_d(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

template <typename T>
bool bit_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

/// Runs f with `threads` OpenMP threads, restoring the previous count.
template <typename F>
void with_threads(int threads, F&& f) {
  const int old = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(old);
}

// ---------------------------------------------------------------------------------
// gemm

/// Naive row-major C = alpha op(A) op(B) + beta C.
void naive_gemm(bool ta, bool tb, int M, int N, int K, double alpha, const Vec& A, int lda, const Vec& B, int ldb,
                double beta, Vec& C, int ldc) {
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int p = 0; p < K; ++p) s += (ta ? A[p * lda + i] : A[i * lda + p]) * (tb ? B[j * ldb + p] : B[p * ldb + j]);
      C[i * ldc + j] = alpha * s + beta * C[i * ldc + j];
    }
  }
}

TEST(OpsDense, GemmAllTransposesWithStridesMatchNaive) {
  const int M = 5, N = 7, K = 4;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Padded leading dimensions: lda/ldb/ldc larger than the logical row length.
      const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 1;
      const Vec A = random_vec(std::size_t((ta ? K : M) * lda), 1);
      const Vec B = random_vec(std::size_t((tb ? N : K) * ldb), 2);
      Vec C = random_vec(std::size_t(M * ldc), 3), ref = C;
      gemm<double>(ta, tb, M, N, K, 0.5, A.data(), lda, B.data(), ldb, 2.0, C.data(), ldc);
      naive_gemm(ta, tb, M, N, K, 0.5, A, lda, B, ldb, 2.0, ref, ldc);
      EXPECT_LT(rel_err(C, ref), 1e-14) << "ta=" << ta << " tb=" << tb;
      // The padding column of C is not part of the product and must be untouched.
      const Vec C0 = random_vec(std::size_t(M * ldc), 3);
      for (int i = 0; i < M; ++i) EXPECT_EQ(C[i * ldc + N], C0[i * ldc + N]);
    }
  }
}

TEST(OpsDense, GemmBetaZeroOverwritesNaNAndEmptyKScalesC) {
  const Vec A = random_vec(6, 1), B = random_vec(6, 2);
  Vec C(4, kNaN), ref(4, 0.0);
  gemm<double>(false, false, 2, 2, 3, 1.0, A.data(), 3, B.data(), 2, 0.0, C.data(), 2);
  naive_gemm(false, false, 2, 2, 3, 1.0, A, 3, B, 2, 0.0, ref, 2);
  EXPECT_LT(rel_err(C, ref), 1e-14);
  Vec D = {1, 2, 3, 4};
  gemm<double>(false, false, 2, 2, 0, 1.0, A.data(), 1, B.data(), 2, 3.0, D.data(), 2);
  EXPECT_EQ(D, (Vec{3, 6, 9, 12}));
  Vec E(4, kNaN);
  gemm<double>(false, false, 2, 2, 0, 1.0, A.data(), 1, B.data(), 2, 0.0, E.data(), 2);
  EXPECT_EQ(E, (Vec{0, 0, 0, 0}));
}

// ---------------------------------------------------------------------------------
// linear

struct LinearCase {
  static constexpr int n = 5, in = 7, out = 6;
  Vec x = random_vec(n * in, 10), w = random_vec(out * in, 11), probe = random_vec(n * out, 12);
};

// Only OpenBLAS's fallback for a CPU model it does not know ("Prescott", SSE3) is
// replaced, and by the best kernel set the CPU runs; any other choice stands.
TEST(OpsDense, BlasCoreOverrideReplacesOnlyTheGenericFallback) {
  const CpuIsa avx512{true, true}, avx2{true, false}, sse{false, false};
  EXPECT_EQ(blas_core_override("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(blas_core_override("PRESCOTT", avx512), "SkylakeX");
  EXPECT_EQ(blas_core_override("Prescott", avx2), "Haswell");
  EXPECT_EQ(blas_core_override("Prescott", sse), "");
  EXPECT_EQ(blas_core_override("Haswell", avx512), "");
  EXPECT_EQ(blas_core_override("SkylakeX", avx512), "");
  EXPECT_EQ(blas_core_override("Zen", avx2), "");
  EXPECT_EQ(blas_core_override("", avx512), "");
  EXPECT_FALSE(blas_core_name().empty());
}

TEST(OpsDense, LinearForwardMatchesNaive) {
  LinearCase c;
  Vec y(c.n * c.out, kNaN), ref(c.n * c.out);
  linear_forward(c.x.data(), c.w.data(), y.data(), c.n, c.in, c.out);
  for (int i = 0; i < c.n; ++i) {
    for (int o = 0; o < c.out; ++o) {
      double s = 0;
      for (int j = 0; j < c.in; ++j) s += c.x[i * c.in + j] * c.w[o * c.in + j];
      ref[i * c.out + o] = s;
    }
  }
  EXPECT_LT(rel_err(y, ref), 1e-14);
}

TEST(OpsDense, LinearGradientsMatchFiniteDifferences) {
  LinearCase c;
  Vec y(c.n * c.out);
  auto loss = [&] {
    linear_forward(c.x.data(), c.w.data(), y.data(), c.n, c.in, c.out);
    return dot(y, c.probe);
  };
  Vec dx(c.n * c.in, kNaN), dw(c.out * c.in, 0.0);
  linear_backward(c.probe.data(), c.x.data(), c.w.data(), dx.data(), dw.data(), c.n, c.in, c.out);
  expect_grad_close("linear dx", dx, c.x, loss);
  expect_grad_close("linear dw", dw, c.w, loss);
}

TEST(OpsDense, LinearAccumulateSemantics) {
  LinearCase c;
  Vec dx(c.n * c.in, kNaN), dw(c.out * c.in, 0.0);
  linear_backward(c.probe.data(), c.x.data(), c.w.data(), dx.data(), dw.data(), c.n, c.in, c.out);
  const Vec dx1 = dx, dw1 = dw;
  // dw is always +=; dx is = by default and += on request.
  const Vec base = random_vec(dx.size(), 13);
  Vec dx_acc = base;
  linear_backward(c.probe.data(), c.x.data(), c.w.data(), dx_acc.data(), dw.data(), c.n, c.in, c.out, true);
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], 2 * dw1[i], 1e-14);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx_acc[i], base[i] + dx1[i], 1e-14);
  EXPECT_GT(max_abs(dw1), 0.1);  // the doubling is not the trivial 0 == 2 * 0
  // Null pointers skip a gradient.
  Vec dw_only(c.out * c.in, 0.0);
  linear_backward<double>(c.probe.data(), c.x.data(), c.w.data(), nullptr, dw_only.data(), c.n, c.in, c.out);
  EXPECT_EQ(dw_only, dw1);
  Vec dx_only(c.n * c.in, kNaN);
  linear_backward<double>(c.probe.data(), c.x.data(), c.w.data(), dx_only.data(), nullptr, c.n, c.in, c.out);
  EXPECT_EQ(dx_only, dx1);
}

TEST(OpsDense, LinearFloatMatchesDouble) {
  LinearCase c;
  Vec y(c.n * c.out), dx(c.n * c.in), dw(c.out * c.in, 0.0);
  linear_forward(c.x.data(), c.w.data(), y.data(), c.n, c.in, c.out);
  linear_backward(c.probe.data(), c.x.data(), c.w.data(), dx.data(), dw.data(), c.n, c.in, c.out);
  auto xf = to_f(c.x), wf = to_f(c.w), pf = to_f(c.probe);
  std::vector<float> yf(y.size()), dxf(dx.size()), dwf(dw.size(), 0.0f);
  linear_forward(xf.data(), wf.data(), yf.data(), c.n, c.in, c.out);
  linear_backward(pf.data(), xf.data(), wf.data(), dxf.data(), dwf.data(), c.n, c.in, c.out);
  EXPECT_LT(rel_err(to_d(yf), y), kFloatTol);
  EXPECT_LT(rel_err(to_d(dxf), dx), kFloatTol);
  EXPECT_LT(rel_err(to_d(dwf), dw), kFloatTol);
}

// ---------------------------------------------------------------------------------
// embedding

TEST(OpsDense, EmbeddingForwardCopiesRowsAndGradientMatchesFiniteDifferences) {
  const int V = 7, d = 5, n = 9;
  const std::vector<std::int32_t> ids = {3, 0, 6, 3, 3, 1, 6, 2, 0};  // repeats, row 4 and 5 unused
  Vec table = random_vec(V * d, 20), probe = random_vec(n * d, 21), out(n * d, kNaN);
  embedding_forward(ids.data(), table.data(), out.data(), n, d);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) EXPECT_EQ(out[i * d + j], table[ids[i] * d + j]);
  auto loss = [&] {
    embedding_forward(ids.data(), table.data(), out.data(), n, d);
    return dot(out, probe);
  };
  Vec dtable(V * d, 0.0);
  embedding_backward(ids.data(), probe.data(), dtable.data(), n, d);
  expect_grad_close("embedding dtable", dtable, table, loss);
  for (int j = 0; j < d; ++j) EXPECT_EQ(dtable[4 * d + j], 0.0);  // unused rows get nothing
  // += semantics.
  const Vec once = dtable;
  embedding_backward(ids.data(), probe.data(), dtable.data(), n, d);
  for (std::size_t i = 0; i < dtable.size(); ++i) EXPECT_EQ(dtable[i], 2 * once[i]);
  EXPECT_GT(max_abs(once), 0.5);
}

TEST(OpsDense, EmbeddingBackwardSumsTokensInIndexOrderForAnyThreadCount) {
  // Big enough for the parallel path; few rows, so every row collects many tokens
  // and a different order would change the float sum.
  const int V = 10, d = 96, n = 512;
  std::vector<std::int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = std::int32_t((i * 7 + i / 3) % V);
  const auto dout = to_f(random_vec(std::size_t(n) * d, 22));
  const auto init = to_f(random_vec(std::size_t(V) * d, 23));
  std::vector<float> ref = init;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) ref[ids[i] * d + j] += dout[i * d + j];
  for (int threads : {1, 2, 3}) {
    std::vector<float> got = init;
    with_threads(threads, [&] { embedding_backward(ids.data(), dout.data(), got.data(), n, d); });
    EXPECT_TRUE(bit_equal(got, ref)) << "threads=" << threads;
  }
}

TEST(OpsDense, EmbeddingRejectsNegativeId) {
  const std::vector<std::int32_t> ids = {0, -1};
  Vec table(4, 1.0), out(4);
  EXPECT_THROW(embedding_forward(ids.data(), table.data(), out.data(), 2, 2), DataError);
}

// ---------------------------------------------------------------------------------
// rmsnorm

struct RmsCase {
  int n, d;
  double eps = 1e-5;
  Vec x, w, probe;
  RmsCase(int n_, int d_) : n(n_), d(d_) {
    x = random_vec(std::size_t(n) * d, 30);
    w = random_vec(std::size_t(d), 31);
    for (double& v : w) v += 1.0;  // norm weights live near 1
    probe = random_vec(std::size_t(n) * d, 32);
  }
};

TEST(OpsDense, RmsNormForwardMatchesNaive) {
  RmsCase c(5, 12);
  Vec y(c.n * c.d, kNaN), rstd(c.n, kNaN);
  rmsnorm_forward(c.x.data(), c.w.data(), y.data(), rstd.data(), c.n, c.d, c.eps);
  Vec ref(y.size()), ref_rstd(c.n);
  for (int i = 0; i < c.n; ++i) {
    double ss = 0;
    for (int j = 0; j < c.d; ++j) ss += c.x[i * c.d + j] * c.x[i * c.d + j];
    ref_rstd[i] = 1.0 / std::sqrt(ss / c.d + c.eps);
    for (int j = 0; j < c.d; ++j) ref[i * c.d + j] = c.x[i * c.d + j] * ref_rstd[i] * c.w[j];
  }
  EXPECT_LT(rel_err(y, ref), 1e-14);
  EXPECT_LT(rel_err(rstd, ref_rstd), 1e-14);
}

TEST(OpsDense, RmsNormGradientsMatchFiniteDifferences) {
  // 70 rows: three dw chunks, the last one partial.
  RmsCase c(70, 9);
  Vec y(c.n * c.d), rstd(c.n);
  auto loss = [&] {
    rmsnorm_forward(c.x.data(), c.w.data(), y.data(), rstd.data(), c.n, c.d, c.eps);
    return dot(y, c.probe);
  };
  loss();
  Vec dx(c.n * c.d, kNaN), dw(c.d, 0.0);
  rmsnorm_backward(c.probe.data(), c.x.data(), c.w.data(), rstd.data(), dx.data(), dw.data(), c.n, c.d);
  expect_grad_close("rmsnorm dx", dx, c.x, loss);
  expect_grad_close("rmsnorm dw", dw, c.w, loss);
  // dw accumulates; dx is overwritten.
  const Vec dw1 = dw, dx1 = dx;
  rmsnorm_backward(c.probe.data(), c.x.data(), c.w.data(), rstd.data(), dx.data(), dw.data(), c.n, c.d);
  for (int j = 0; j < c.d; ++j) EXPECT_EQ(dw[j], 2 * dw1[j]);
  EXPECT_EQ(dx, dx1);
  EXPECT_GT(max_abs(dw1), 0.5);
}

TEST(OpsDense, RmsNormFloatMatchesDouble) {
  RmsCase c(40, 64);
  Vec y(c.n * c.d), rstd(c.n), dx(c.n * c.d), dw(c.d, 0.0);
  rmsnorm_forward(c.x.data(), c.w.data(), y.data(), rstd.data(), c.n, c.d, c.eps);
  rmsnorm_backward(c.probe.data(), c.x.data(), c.w.data(), rstd.data(), dx.data(), dw.data(), c.n, c.d);
  auto xf = to_f(c.x), wf = to_f(c.w), pf = to_f(c.probe);
  std::vector<float> yf(y.size()), rf(rstd.size()), dxf(dx.size()), dwf(dw.size(), 0.0f);
  rmsnorm_forward(xf.data(), wf.data(), yf.data(), rf.data(), c.n, c.d, float(c.eps));
  rmsnorm_backward(pf.data(), xf.data(), wf.data(), rf.data(), dxf.data(), dwf.data(), c.n, c.d);
  EXPECT_LT(rel_err(to_d(yf), y), kFloatTol);
  EXPECT_LT(rel_err(to_d(rf), rstd), kFloatTol);
  EXPECT_LT(rel_err(to_d(dxf), dx), kFloatTol);
  EXPECT_LT(rel_err(to_d(dwf), dw), kFloatTol);
}

TEST(OpsDense, RmsNormBitIdenticalAcrossRunsAndThreadCounts) {
  RmsCase c(200, 80);
  auto xf = to_f(c.x), wf = to_f(c.w), pf = to_f(c.probe);
  auto run = [&](int threads) {
    std::vector<float> y(xf.size()), r(c.n), dx(xf.size()), dw(c.d, 0.5f);
    with_threads(threads, [&] {
      rmsnorm_forward(xf.data(), wf.data(), y.data(), r.data(), c.n, c.d, 1e-5f);
      rmsnorm_backward(pf.data(), xf.data(), wf.data(), r.data(), dx.data(), dw.data(), c.n, c.d);
    });
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dw.begin(), dw.end());
    return y;
  };
  const auto a = run(2);
  EXPECT_TRUE(bit_equal(a, run(2)));
  EXPECT_TRUE(bit_equal(a, run(1)));
  EXPECT_TRUE(bit_equal(a, run(3)));
}

// ---------------------------------------------------------------------------------
// rope

/// The formula of docs/model.md, evaluated directly.
Vec naive_rope(const Vec& x, int B, int S, int H, int hd, double theta) {
  Vec out(x.size());
  const int half = hd / 2;
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < half; ++i) {
          const double angle = s * std::pow(theta, -2.0 * i / hd);
          const int base = ((b * S + s) * H + h) * hd;
          out[base + i] = x[base + i] * std::cos(angle) - x[base + i + half] * std::sin(angle);
          out[base + i + half] = x[base + i + half] * std::cos(angle) + x[base + i] * std::sin(angle);
        }
  return out;
}

TEST(OpsDense, RopeForwardMatchesFormula) {
  const int B = 2, S = 6, H = 3, hd = 8;
  for (double theta : {10000.0, 7.0}) {
    Vec x = random_vec(B * S * H * hd, 40);
    const Vec ref = naive_rope(x, B, S, H, hd, theta);
    rope_forward(x.data(), B, S, H, hd, theta);
    EXPECT_LT(rel_err(x, ref), 1e-15) << "theta=" << theta;
  }
  // Position 0 is the identity; position 1, pair 0 rotates by exactly 1 radian.
  Vec two(2 * hd, 0.0);
  two[hd] = 1.0;  // token at position 1
  rope_forward(two.data(), 1, 2, 1, hd, 10000.0);
  EXPECT_EQ(two[0], 0.0);
  EXPECT_NEAR(two[hd + 0], std::cos(1.0), 1e-16);
  EXPECT_NEAR(two[hd + hd / 2], std::sin(1.0), 1e-16);
}

TEST(OpsDense, RopeGradientMatchesFiniteDifferencesAndInvertsForward) {
  const int B = 2, S = 5, H = 2, hd = 6;
  const double theta = 3.0;  // large angles, so a sign error in sin shows
  Vec x = random_vec(B * S * H * hd, 41), probe = random_vec(x.size(), 42);
  auto loss = [&] {
    Vec y = x;
    rope_forward(y.data(), B, S, H, hd, theta);
    return dot(y, probe);
  };
  Vec dx = probe;
  rope_backward(dx.data(), B, S, H, hd, theta);
  expect_grad_close("rope dx", dx, x, loss);
  Vec round_trip = x;
  rope_forward(round_trip.data(), B, S, H, hd, theta);
  EXPECT_GT(rel_err(round_trip, x), 0.1);  // the rotation did something
  rope_backward(round_trip.data(), B, S, H, hd, theta);
  EXPECT_LT(rel_err(round_trip, x), 1e-15);
}

TEST(OpsDense, RopeFloatMatchesDoubleAndRejectsOddHeadDim) {
  const int B = 2, S = 64, H = 2, hd = 16;
  Vec x = random_vec(B * S * H * hd, 43);
  auto xf = to_f(x);
  rope_forward(x.data(), B, S, H, hd, 10000.0);
  rope_forward(xf.data(), B, S, H, hd, 10000.0);
  EXPECT_LT(rel_err(to_d(xf), x), kFloatTol);
  EXPECT_THROW(rope_forward(x.data(), 1, 1, 1, 3, 10000.0), Error);
}

// ---------------------------------------------------------------------------------
// attention

struct AttnCase {
  int B, S, H, hd;
  Vec q, k, v, probe;
  AttnCase(int B_, int S_, int H_, int hd_, double scale = 1.0) : B(B_), S(S_), H(H_), hd(hd_) {
    const std::size_t n = std::size_t(B) * S * H * hd;
    q = random_vec(n, 50, scale);
    k = random_vec(n, 51, scale);
    v = random_vec(n, 52);
    probe = random_vec(n, 53);
  }
  std::size_t numel() const { return q.size(); }
  std::size_t pnumel() const { return std::size_t(B) * H * S * S; }
  int at(int b, int s, int h, int i) const { return ((b * S + s) * H + h) * hd + i; }
};

/// Plain-loop causal attention in double: out and probs.
void naive_attention(const AttnCase& c, Vec& out, Vec& probs) {
  out.assign(c.numel(), 0.0);
  probs.assign(c.pnumel(), 0.0);
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.H; ++h)
      for (int i = 0; i < c.S; ++i) {
        std::vector<double> s(i + 1);
        double m = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dotp = 0;
          for (int t = 0; t < c.hd; ++t) dotp += c.q[c.at(b, i, h, t)] * c.k[c.at(b, j, h, t)];
          s[j] = dotp / std::sqrt(double(c.hd));
          m = std::max(m, s[j]);
        }
        double z = 0;
        for (int j = 0; j <= i; ++j) z += std::exp(s[j] - m);
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - m) / z;
          probs[((b * c.H + h) * c.S + i) * c.S + j] = p;
          for (int t = 0; t < c.hd; ++t) out[c.at(b, i, h, t)] += p * c.v[c.at(b, j, h, t)];
        }
      }
}

TEST(OpsDense, AttentionForwardMatchesNaiveAndIsCausal) {
  AttnCase c(2, 5, 3, 4, 2.0);
  Vec out(c.numel(), kNaN), probs(c.pnumel(), kNaN), ref_out, ref_probs;
  attention_forward(c.q.data(), c.k.data(), c.v.data(), out.data(), probs.data(), c.B, c.S, c.H, c.H, c.hd);
  naive_attention(c, ref_out, ref_probs);
  EXPECT_LT(rel_err(out, ref_out), 1e-13);
  EXPECT_LT(rel_err(probs, ref_probs), 1e-13);
  for (int r = 0; r < c.B * c.H * c.S; ++r) {
    double row = 0;
    for (int j = 0; j < c.S; ++j) {
      if (j > r % c.S) {
        EXPECT_EQ(probs[r * c.S + j], 0.0) << "above the diagonal, row " << r;
      }
      row += probs[r * c.S + j];
    }
    EXPECT_NEAR(row, 1.0, 1e-14);
  }
  // Changing the last token's q, k, v leaves every earlier token's output bit-identical.
  AttnCase c2 = c;
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.H; ++h)
      for (int t = 0; t < c.hd; ++t) {
        c2.q[c.at(b, c.S - 1, h, t)] += 1.0;
        c2.k[c.at(b, c.S - 1, h, t)] -= 3.0;
        c2.v[c.at(b, c.S - 1, h, t)] *= 5.0;
      }
  Vec out2(c.numel()), probs2(c.pnumel());
  attention_forward(c2.q.data(), c2.k.data(), c2.v.data(), out2.data(), probs2.data(), c.B, c.S, c.H, c.H, c.hd);
  for (int b = 0; b < c.B; ++b)
    for (int s = 0; s + 1 < c.S; ++s)
      for (int h = 0; h < c.H; ++h)
        for (int t = 0; t < c.hd; ++t) EXPECT_EQ(out2[c.at(b, s, h, t)], out[c.at(b, s, h, t)]);
  EXPECT_NE(out2[c.at(0, c.S - 1, 0, 0)], out[c.at(0, c.S - 1, 0, 0)]);
}

TEST(OpsDense, AttentionStableForLargeScores) {
  // Scores of several hundred: a softmax without the max subtraction overflows.
  AttnCase c(1, 6, 2, 8, 30.0);
  Vec out(c.numel()), probs(c.pnumel()), ref_out, ref_probs;
  attention_forward(c.q.data(), c.k.data(), c.v.data(), out.data(), probs.data(), c.B, c.S, c.H, c.H, c.hd);
  naive_attention(c, ref_out, ref_probs);
  EXPECT_LT(rel_err(out, ref_out), 1e-12);
  auto qf = to_f(c.q), kf = to_f(c.k), vf = to_f(c.v);
  std::vector<float> outf(c.numel()), probsf(c.pnumel());
  attention_forward(qf.data(), kf.data(), vf.data(), outf.data(), probsf.data(), c.B, c.S, c.H, c.H, c.hd);
  for (float x : outf) EXPECT_TRUE(std::isfinite(x));
}

TEST(OpsDense, AttentionGradientsMatchFiniteDifferences) {
  AttnCase c(2, 4, 2, 3, 1.5);
  Vec out(c.numel()), probs(c.pnumel());
  auto loss = [&] {
    attention_forward(c.q.data(), c.k.data(), c.v.data(), out.data(), probs.data(), c.B, c.S, c.H, c.H, c.hd);
    return dot(out, c.probe);
  };
  loss();
  Vec dq(c.numel(), kNaN), dk(c.numel(), kNaN), dv(c.numel(), kNaN), ws(c.pnumel(), kNaN);
  attention_backward(c.probe.data(), c.q.data(), c.k.data(), c.v.data(), probs.data(), dq.data(), dk.data(),
                     dv.data(), ws.data(), c.B, c.S, c.H, c.H, c.hd);
  expect_grad_close("attention dq", dq, c.q, loss);
  expect_grad_close("attention dk", dk, c.k, loss);
  expect_grad_close("attention dv", dv, c.v, loss);
}

// Grouped-query attention (Ainslie et al. 2023): H query heads share Hkv key/value
// heads, query head h reading kv head h / (H / Hkv). It must equal multi-head
// attention over k and v with each kv head repeated for its group, and its dk, dv
// the group's sums of that attention's gradients.
TEST(OpsDense, GroupedQueryAttentionIsMultiHeadOverRepeatedKv) {
  for (int Hkv : {2, 1}) {
    const int B = 2, S = 5, H = 4, hd = 3, group = H / Hkv;
    AttnCase full(B, S, H, hd, 1.5);  // q and probe; k, v rebuilt from the kv heads below
    const Vec kk = random_vec(std::size_t(B) * S * Hkv * hd, 61, 1.5), vv = random_vec(kk.size(), 62);
    auto kv_at = [&](int b, int s, int g, int i) { return ((b * S + s) * Hkv + g) * hd + i; };
    for (int b = 0; b < B; ++b)
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < H; ++h)
          for (int i = 0; i < hd; ++i) {
            full.k[full.at(b, s, h, i)] = kk[kv_at(b, s, h / group, i)];
            full.v[full.at(b, s, h, i)] = vv[kv_at(b, s, h / group, i)];
          }
    Vec out(full.numel(), kNaN), probs(full.pnumel(), kNaN), ref_out(full.numel()), ref_probs(full.pnumel());
    attention_forward(full.q.data(), kk.data(), vv.data(), out.data(), probs.data(), B, S, H, Hkv, hd);
    attention_forward(full.q.data(), full.k.data(), full.v.data(), ref_out.data(), ref_probs.data(), B, S, H, H, hd);
    EXPECT_LT(rel_err(out, ref_out), 1e-14) << "Hkv " << Hkv;
    EXPECT_LT(rel_err(probs, ref_probs), 1e-14) << "Hkv " << Hkv;
    Vec dq(full.numel(), kNaN), dk(kk.size(), kNaN), dv(kk.size(), kNaN), ws(full.pnumel(), kNaN);
    attention_backward(full.probe.data(), full.q.data(), kk.data(), vv.data(), probs.data(), dq.data(), dk.data(),
                       dv.data(), ws.data(), B, S, H, Hkv, hd);
    Vec rdq(full.numel()), rdk(full.numel()), rdv(full.numel()), rws(full.pnumel());
    attention_backward(full.probe.data(), full.q.data(), full.k.data(), full.v.data(), ref_probs.data(), rdq.data(),
                       rdk.data(), rdv.data(), rws.data(), B, S, H, H, hd);
    Vec sdk(kk.size(), 0.0), sdv(kk.size(), 0.0);
    for (int b = 0; b < B; ++b)
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < H; ++h)
          for (int i = 0; i < hd; ++i) {
            sdk[kv_at(b, s, h / group, i)] += rdk[full.at(b, s, h, i)];
            sdv[kv_at(b, s, h / group, i)] += rdv[full.at(b, s, h, i)];
          }
    EXPECT_LT(rel_err(dq, rdq), 1e-13) << "Hkv " << Hkv;
    EXPECT_LT(rel_err(dk, sdk), 1e-13) << "Hkv " << Hkv;
    EXPECT_LT(rel_err(dv, sdv), 1e-13) << "Hkv " << Hkv;
  }
  EXPECT_THROW(check_kv_heads("attention_forward", 3, 2), Error);  // 3 query heads cannot share 2 kv heads
  EXPECT_THROW(check_kv_heads("attention_forward", 4, 0), Error);
  EXPECT_NO_THROW(check_kv_heads("attention_forward", 4, 2));
}

TEST(OpsDense, AttentionFloatMatchesDouble) {
  AttnCase c(2, 16, 2, 8);
  Vec out(c.numel()), probs(c.pnumel()), dq(c.numel()), dk(c.numel()), dv(c.numel()), ws(c.pnumel());
  attention_forward(c.q.data(), c.k.data(), c.v.data(), out.data(), probs.data(), c.B, c.S, c.H, c.H, c.hd);
  attention_backward(c.probe.data(), c.q.data(), c.k.data(), c.v.data(), probs.data(), dq.data(), dk.data(),
                     dv.data(), ws.data(), c.B, c.S, c.H, c.H, c.hd);
  auto qf = to_f(c.q), kf = to_f(c.k), vf = to_f(c.v), pf = to_f(c.probe);
  std::vector<float> o(c.numel()), p(c.pnumel()), gq(c.numel()), gk(c.numel()), gv(c.numel()), w(c.pnumel());
  attention_forward(qf.data(), kf.data(), vf.data(), o.data(), p.data(), c.B, c.S, c.H, c.H, c.hd);
  attention_backward(pf.data(), qf.data(), kf.data(), vf.data(), p.data(), gq.data(), gk.data(), gv.data(), w.data(),
                     c.B, c.S, c.H, c.H, c.hd);
  EXPECT_LT(rel_err(to_d(o), out), kFloatTol);
  EXPECT_LT(rel_err(to_d(p), probs), kFloatTol);
  EXPECT_LT(rel_err(to_d(gq), dq), kFloatTol);
  EXPECT_LT(rel_err(to_d(gk), dk), kFloatTol);
  EXPECT_LT(rel_err(to_d(gv), dv), kFloatTol);
}

// ---------------------------------------------------------------------------------
// swiglu

TEST(OpsDense, SwigluForwardAndGradientsMatch) {
  const int n = 40;
  Vec gate = random_vec(n, 60, 6.0), up = random_vec(n, 61, 2.0), probe = random_vec(n, 62);
  Vec out(n, kNaN);
  swiglu_forward(gate.data(), up.data(), out.data(), n);
  for (int i = 0; i < n; ++i) EXPECT_NEAR(out[i], gate[i] / (1 + std::exp(-gate[i])) * up[i], 1e-15);
  auto loss = [&] {
    swiglu_forward(gate.data(), up.data(), out.data(), n);
    return dot(out, probe);
  };
  Vec dgate(n, kNaN), dup(n, kNaN);
  swiglu_backward(probe.data(), gate.data(), up.data(), dgate.data(), dup.data(), n);
  expect_grad_close("swiglu dgate", dgate, gate, loss);
  expect_grad_close("swiglu dup", dup, up, loss);
}

TEST(OpsDense, SwigluFloatMatchesDoubleOverWideRange) {
  // 70000 elements takes the parallel path; gates up to +-100 reach exp's clamps.
  const int n = 70000;
  Vec gate = random_vec(n, 63, 100.0), up = random_vec(n, 64), dout = random_vec(n, 65);
  Vec out(n), dg(n), du(n);
  swiglu_forward(gate.data(), up.data(), out.data(), n);
  swiglu_backward(dout.data(), gate.data(), up.data(), dg.data(), du.data(), n);
  auto gf = to_f(gate), uf = to_f(up), df = to_f(dout);
  std::vector<float> o(n), g(n), u(n);
  swiglu_forward(gf.data(), uf.data(), o.data(), n);
  swiglu_backward(df.data(), gf.data(), uf.data(), g.data(), u.data(), n);
  EXPECT_LT(rel_err(to_d(o), out), kFloatTol);
  EXPECT_LT(rel_err(to_d(g), dg), kFloatTol);
  EXPECT_LT(rel_err(to_d(u), du), kFloatTol);
  for (int i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(o[i]) && std::isfinite(g[i])) << "gate " << gf[i];
}

TEST(OpsDense, VectorisedExpIsAccurateAndSaturatesLikeExpf) {
  double worst = 0;
  // Every 1e-3 over the whole normal range, up to the overflow threshold.
  for (int i = -87336; i <= 88722; ++i) {
    const float x = float(i) * 1e-3f;
    const double ref = std::exp(double(x));
    worst = std::max(worst, std::abs(double(detail::exp_f32(x)) - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);  // about 2.5 ulp
  EXPECT_EQ(detail::exp_f32(0.0f), 1.0f);
  EXPECT_EQ(detail::exp_f32(-100.0f), 0.0f);
  EXPECT_EQ(detail::exp_f32(100.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(detail::exp_f32(88.8f), std::numeric_limits<float>::infinity());
  EXPECT_GT(detail::exp_f32(88.72f), 3.3e38f);
}

// ---------------------------------------------------------------------------------
// cross_entropy

struct CeCase {
  static constexpr int n = 4, V = 9;
  std::vector<std::int32_t> targets = {2, 0, 8, 2};
  Vec logits = random_vec(n * V, 70, 3.0);
};

TEST(OpsDense, CrossEntropyForwardMatchesLogSumExp) {
  CeCase c;
  Vec probs(c.n * c.V, kNaN), losses(c.n, kNaN);
  const double loss = cross_entropy_forward(c.logits.data(), c.targets.data(), probs.data(), losses.data(), c.n, c.V);
  double total = 0;
  for (int i = 0; i < c.n; ++i) {
    double z = 0;
    for (int j = 0; j < c.V; ++j) z += std::exp(c.logits[i * c.V + j]);
    const double li = std::log(z) - c.logits[i * c.V + c.targets[i]];
    EXPECT_NEAR(losses[i], li, 1e-14);
    for (int j = 0; j < c.V; ++j) EXPECT_NEAR(probs[i * c.V + j], std::exp(c.logits[i * c.V + j]) / z, 1e-15);
    total += li;
  }
  EXPECT_NEAR(loss, total / c.n, 1e-14);
  // The mean is the plain in-order sum of the per-token losses.
  double in_order = 0;
  for (double l : losses) in_order += l;
  EXPECT_EQ(loss, in_order / c.n);
}

TEST(OpsDense, CrossEntropyGradientMatchesFiniteDifferences) {
  CeCase c;
  Vec probs(c.n * c.V), losses(c.n);
  auto loss = [&] { return cross_entropy_forward(c.logits.data(), c.targets.data(), probs.data(), losses.data(), c.n, c.V); };
  loss();
  Vec dlogits(c.n * c.V, kNaN);
  cross_entropy_backward(probs.data(), c.targets.data(), dlogits.data(), c.n, c.V, 1.0 / c.n);
  expect_grad_close("cross_entropy dlogits", dlogits, c.logits, loss);
}

TEST(OpsDense, CrossEntropyInPlaceAliasingGivesSameBits) {
  CeCase c;
  auto lf = to_f(c.logits);
  std::vector<float> probs(lf.size()), losses(c.n), dl(lf.size());
  const double l1 = cross_entropy_forward(lf.data(), c.targets.data(), probs.data(), losses.data(), c.n, c.V);
  cross_entropy_backward(probs.data(), c.targets.data(), dl.data(), c.n, c.V, 0.25f);
  std::vector<float> buf = lf, losses2(c.n);
  const double l2 = cross_entropy_forward(buf.data(), c.targets.data(), buf.data(), losses2.data(), c.n, c.V);
  EXPECT_TRUE(bit_equal(buf, probs));
  cross_entropy_backward(buf.data(), c.targets.data(), buf.data(), c.n, c.V, 0.25f);
  EXPECT_TRUE(bit_equal(buf, dl));
  EXPECT_EQ(l1, l2);
}

TEST(OpsDense, CrossEntropyStableAndFloatMatchesDouble) {
  CeCase c;
  Vec probs(c.n * c.V), losses(c.n);
  const double base = cross_entropy_forward(c.logits.data(), c.targets.data(), probs.data(), losses.data(), c.n, c.V);
  Vec shifted = c.logits;
  for (double& x : shifted) x += 1000.0;  // exp(1000) overflows without the max shift
  const double moved = cross_entropy_forward(shifted.data(), c.targets.data(), probs.data(), losses.data(), c.n, c.V);
  EXPECT_NEAR(moved, base, 1e-12);
  // A large vocabulary row, in float: loss and gradient within float tolerance.
  const int n = 3, V = 5000;
  const std::vector<std::int32_t> t = {17, 4999, 0};
  Vec logits = random_vec(std::size_t(n) * V, 71, 8.0), p(logits.size()), ls(n), g(logits.size());
  const double ld = cross_entropy_forward(logits.data(), t.data(), p.data(), ls.data(), n, V);
  cross_entropy_backward(p.data(), t.data(), g.data(), n, V, 1.0 / n);
  auto lf = to_f(logits);
  std::vector<float> pf(lf.size()), lsf(n), gf(lf.size());
  const double lfl = cross_entropy_forward(lf.data(), t.data(), pf.data(), lsf.data(), n, V);
  cross_entropy_backward(pf.data(), t.data(), gf.data(), n, V, 1.0f / n);
  EXPECT_NEAR(lfl, ld, kFloatTol * ld);
  EXPECT_LT(rel_err(to_d(gf), g), kFloatTol);
  EXPECT_GT(ld, 1.0);
}

TEST(OpsDense, CrossEntropyRejectsTargetOutsideVocabulary) {
  const std::vector<std::int32_t> t = {0, 3};
  Vec logits(6, 0.0), probs(6), losses(2);
  EXPECT_THROW(cross_entropy_forward(logits.data(), t.data(), probs.data(), losses.data(), 2, 3), DataError);
}

// ---------------------------------------------------------------------------------
// determinism: every float op twice on the same inputs, at sizes where OpenMP and
// OpenBLAS both use their threads, compared bit for bit.

TEST(OpsDense, AllOpsBitIdenticalAcrossRuns) {
  const int B = 2, S = 128, H = 2, hd = 64, d = H * hd, n = B * S, V = 1000, f = 96;
  const auto x = to_f(random_vec(std::size_t(n) * d, 80));
  const auto w = to_f(random_vec(std::size_t(3) * d * d, 81, 0.1));
  const auto w1 = to_f(random_vec(std::size_t(f) * d, 82, 0.1));
  const auto lm = to_f(random_vec(std::size_t(V) * d, 83, 0.1));
  const auto norm_w = to_f(random_vec(std::size_t(d), 84));
  std::vector<std::int32_t> ids(n), targets(n);
  for (int i = 0; i < n; ++i) {
    ids[i] = (i * 37) % V;
    targets[i] = (i * 11 + 5) % V;
  }
  auto run = [&] {
    std::vector<float> all;
    auto keep = [&](const std::vector<float>& v) { all.insert(all.end(), v.begin(), v.end()); };
    std::vector<float> h(std::size_t(n) * d), a(h.size()), r(n), qkv(std::size_t(n) * 3 * d);
    embedding_forward(ids.data(), lm.data(), h.data(), n, d);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] += x[i];
    rmsnorm_forward(h.data(), norm_w.data(), a.data(), r.data(), n, d, 1e-5f);
    std::vector<float> q(h.size()), k(h.size()), v(h.size()), o(h.size()), p(std::size_t(B) * H * S * S);
    linear_forward(a.data(), w.data(), q.data(), n, d, d);
    linear_forward(a.data(), w.data() + d * d, k.data(), n, d, d);
    linear_forward(a.data(), w.data() + 2 * d * d, v.data(), n, d, d);
    rope_forward(q.data(), B, S, H, hd, 10000.0);
    rope_forward(k.data(), B, S, H, hd, 10000.0);
    attention_forward(q.data(), k.data(), v.data(), o.data(), p.data(), B, S, H, H, hd);
    std::vector<float> g(std::size_t(n) * f), u(g.size()), s(g.size());
    linear_forward(o.data(), w1.data(), g.data(), n, d, f);
    linear_forward(a.data(), w1.data(), u.data(), n, d, f);
    swiglu_forward(g.data(), u.data(), s.data(), std::int64_t(g.size()));
    std::vector<float> logits(std::size_t(n) * V), losses(n);
    linear_forward(o.data(), lm.data(), logits.data(), n, d, V);
    const double loss = cross_entropy_forward(logits.data(), targets.data(), logits.data(), losses.data(), n, V);
    cross_entropy_backward(logits.data(), targets.data(), logits.data(), n, V, 1.0f / n);
    std::vector<float> dlm(lm.size(), 0.0f), dout(o.size());
    linear_backward(logits.data(), o.data(), lm.data(), dout.data(), dlm.data(), n, d, V);
    std::vector<float> dq(h.size()), dk(h.size()), dv(h.size()), ws(p.size());
    attention_backward(dout.data(), q.data(), k.data(), v.data(), p.data(), dq.data(), dk.data(), dv.data(),
                       ws.data(), B, S, H, H, hd);
    rope_backward(dq.data(), B, S, H, hd, 10000.0);
    std::vector<float> dg(g.size()), du(g.size());
    swiglu_backward(s.data(), g.data(), u.data(), dg.data(), du.data(), std::int64_t(g.size()));
    std::vector<float> da(a.size()), dh(h.size()), dnw(d, 0.0f), dtable(lm.size(), 0.0f);
    rmsnorm_backward(dq.data(), h.data(), norm_w.data(), r.data(), dh.data(), dnw.data(), n, d);
    embedding_backward(ids.data(), dh.data(), dtable.data(), n, d);
    for (const auto* t : {&s, &logits, &dlm, &dq, &dk, &dv, &dg, &du, &dh, &dnw, &dtable}) keep(*t);
    return std::make_pair(all, loss);
  };
  const auto [first, loss1] = run();
  const auto [second, loss2] = run();
  EXPECT_TRUE(bit_equal(first, second));
  EXPECT_EQ(std::memcmp(&loss1, &loss2, sizeof(double)), 0);
  EXPECT_GT(max_abs(to_d(first)), 0.0);
  EXPECT_GT(loss1, 1.0);
}

}  // namespace
}  // namespace moeflex::test
