// Every CUDA op against the CPU reference op (ops/*.h) in double, forward and
// backward, in fp32 and bf16, with "=" outputs NaN-prefilled, "+=" outputs
// pre-filled, fp32 gradients also checked by directional finite differences, and
// bit-for-bit determinism of the backward kernels; each op timed and reported
// (cuda_harness.h). Then every ops::Backend op through the interface, the CUDA
// backend against the CPU backend in f32 and bf16 (CudaBackend.*). Training-size
// timings: test_cuda_bench.cpp. Without a GPU every test skips: "skipped: no GPU".
#include <array>
#include <numeric>
#include <tuple>

#include "cuda_harness.h"
#include "moeflex/core/tensor.h"
#include "moeflex/ops/attention.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cuda/attention.h"
#include "moeflex/ops/cuda/backend.h"
#include "moeflex/ops/cuda/grouped_linear.h"
#include "moeflex/ops/cuda/linear.h"
#include "moeflex/ops/cuda/moe_dispatch.h"
#include "moeflex/ops/cuda/residual.h"
#include "moeflex/ops/cuda/rmsnorm.h"
#include "moeflex/ops/cuda/rope.h"
#include "moeflex/ops/cuda/router.h"
#include "moeflex/ops/cuda/swiglu.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/router.h"
#include "moeflex/ops/swiglu.h"

namespace moeflex::test {
namespace {

namespace gops = moeflex::ops::cuda;
using Vec = std::vector<double>;

// ---------------------------------------------------------------------------------
// The device itself

TEST(CudaDevice, DescribesTheCard) {
  MOEFLEX_REQUIRE_GPU();
  const cu::DeviceInfo info = cu::device_info(0);
  std::printf("[ harness  ] device 0: %s\n", cu::describe(info).c_str());
  if (const char* path = std::getenv("MOEFLEX_OP_REPORT")) {
    if (FILE* f = std::fopen(path, "a")) {
      std::fprintf(f, "#device\t%s\n", cu::describe(info).c_str());
      std::fclose(f);
    }
  }
  EXPECT_GT(info.multiprocessors, 0);
  EXPECT_GT(info.total_memory, 0);
  EXPECT_GE(info.cc_major, 9) << "the kernels are built for sm_90 (+ PTX for newer); older cards cannot run them";
}

// ---------------------------------------------------------------------------------
// GEMM (cuBLAS) in the three precision pairs, every transpose, padded strides

template <typename TA, typename TC>
void check_gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K) {
  const std::int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
  const double alpha = 0.75, beta = 0.5;
  const Vec A = quantize<TA>(random_vec(sz((ta ? K : M) * lda), 1));
  const Vec B = quantize<TA>(random_vec(sz((tb ? N : K) * ldb), 2));
  const Vec C0 = quantize<TC>(random_vec(sz(M * ldc), 3));
  Vec ref = C0;
  ops::gemm<double>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, ref.data(), ldc);
  DevArray<TA> dA(A, "A"), dB(B, "B");
  DevArray<TC> dC(C0, "C");
  gops::gemm<TA, TC>(gpu().blas, ta, tb, M, N, K, float(alpha), dA.get(), lda, dB.get(), ldb, float(beta), dC.get(),
                     ldc);
  const Vec out = dC.download();
  // Only the M x N block is the product; the padding columns must be untouched.
  Vec got, want;
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      got.push_back(out[sz(i * ldc + j)]);
      want.push_back(ref[sz(i * ldc + j)]);
    }
    for (std::int64_t j = N; j < ldc; ++j) EXPECT_EQ(out[sz(i * ldc + j)], C0[sz(i * ldc + j)]);
  }
  OpRow row{"gemm", std::string(dtype_name<TA>()) + ">" + dtype_name<TC>(),
            shape_str({{"M", M}, {"N", N}, {"K", K}, {"ta", ta}, {"tb", tb}})};
  row.err = rel_err(got, want);
  row.tol = tol<TC>();
  row.flops = 2.0 * M * N * K;
  row.ms = time_ms([&] {
    gops::gemm<TA, TC>(gpu().blas, ta, tb, M, N, K, 1.0f, dA.get(), lda, dB.get(), ldb, 0.0f, dC.get(), ldc);
  });
  report(row);
  expect_close("gemm " + row.dtype + " " + row.shape, row.err, row.tol);
}

TEST(CudaOps, GemmEveryTransposeAndPrecisionMatchesTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      check_gemm<float, float>(ta, tb, 37, 45, 61);
      check_gemm<bf16, bf16>(ta, tb, 37, 45, 61);
      check_gemm<bf16, float>(ta, tb, 37, 45, 61);
    }
  }
  check_gemm<bf16, bf16>(false, true, 256, 384, 512);
  check_gemm<float, float>(false, false, 1, 1, 1);
}

TEST(CudaOps, GemmWithEmptyKWritesBetaTimesC) {
  MOEFLEX_REQUIRE_GPU();
  DevArray<float> dC(Vec(12, 7.0), "C"), dA(Vec(1, 0.0), "A");
  gops::gemm<float, float>(gpu().blas, false, false, 3, 4, 0, 1.0f, dA.get(), 1, dA.get(), 4, 1.0f, dC.get(), 4);
  EXPECT_EQ(dC.download(), Vec(12, 7.0));
  dC.fill_nan();
  gops::gemm<float, float>(gpu().blas, false, false, 3, 4, 0, 1.0f, dA.get(), 1, dA.get(), 4, 0.0f, dC.get(), 4);
  EXPECT_EQ(dC.download(), Vec(12, 0.0));
}

// ---------------------------------------------------------------------------------
// Linear

template <typename T>
void check_linear(std::int64_t n, std::int64_t in, std::int64_t out) {
  const Vec x = quantize<T>(random_vec(sz(n * in), 10)), w = quantize<T>(random_vec(sz(out * in), 11));
  const Vec dy = quantize<T>(random_vec(sz(n * out), 12));
  const Vec dw0 = quantize<float>(random_vec(sz(out * in), 13)), dx0 = quantize<T>(random_vec(sz(n * in), 14));
  Vec y_ref(sz(n * out)), dx_ref(sz(n * in)), dw_ref = dw0;
  ops::linear_forward(x.data(), w.data(), y_ref.data(), n, in, out);
  ops::linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), n, in, out);
  Vec dx_acc_ref = dx0;
  ops::linear_backward<double>(dy.data(), x.data(), w.data(), dx_acc_ref.data(), nullptr, n, in, out, true);

  DevArray<T> dX(x, "x"), dW(w, "w"), dY(n * out, "y"), dDY(dy, "dy"), dDX(n * in, "dx");
  DevArray<float> dDW(dw0, "dw");
  dY.fill_nan();
  dDX.fill_nan();
  auto& blas = gpu().blas;
  gops::linear_forward(blas, dX.get(), dW.get(), dY.get(), n, in, out);
  gops::linear_backward(blas, dDY.get(), dX.get(), dW.get(), dDX.get(), dDW.get(), n, in, out);
  const std::string shape = shape_str({{"n", n}, {"in", in}, {"out", out}});
  OpRow f{"linear_fwd", dtype_name<T>(), shape, rel_err(dY.download(), y_ref), tol<T>()};
  f.flops = 2.0 * n * in * out;
  f.ms = time_ms([&] { gops::linear_forward(blas, dX.get(), dW.get(), dY.get(), n, in, out); });
  report(f);
  expect_close("linear_fwd y", f.err, f.tol);
  const double err_dx = rel_err(dDX.download(), dx_ref), err_dw = rel_err(dDW.download(), dw_ref);
  expect_close("linear_bwd dx", err_dx, tol<T>());
  expect_close("linear_bwd dw (fp32 +=)", err_dw, kTolF32);
  // dx += on request, dw untouched when null.
  dDX.upload(dx0);
  gops::linear_backward<T>(blas, dDY.get(), dX.get(), dW.get(), dDX.get(), nullptr, n, in, out, true);
  expect_close("linear_bwd dx +=", rel_err(dDX.download(), dx_acc_ref), tol<T>());
  OpRow b{"linear_bwd", dtype_name<T>(), shape, std::max(err_dx, err_dw), tol<T>()};
  b.flops = 4.0 * n * in * out;
  b.ms = time_ms([&] { gops::linear_backward(blas, dDY.get(), dX.get(), dW.get(), dDX.get(), dDW.get(), n, in, out); });
  report(b);
}

TEST(CudaOps, LinearForwardBackwardMatchTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  check_linear<float>(33, 70, 50);
  check_linear<bf16>(33, 70, 50);
  check_linear<bf16>(512, 256, 384);
}

// ---------------------------------------------------------------------------------
// Grouped expert GEMM: both cuBLAS paths, skewed and empty experts

template <typename T>
void check_grouped_linear(const std::vector<std::int32_t>& offsets, std::int64_t in, std::int64_t out,
                          gops::GroupedGemmPath path) {
  const std::int64_t E = std::int64_t(offsets.size()) - 1, rows = offsets.back();
  const Vec x = quantize<T>(random_vec(sz(rows * in), 20)), w = quantize<T>(random_vec(sz(E * out * in), 21));
  const Vec dy = quantize<T>(random_vec(sz(rows * out), 22)), dw0 = quantize<float>(random_vec(sz(E * out * in), 23));
  Vec y_ref(sz(rows * out)), dx_ref(sz(rows * in)), dw_ref = dw0;
  ops::grouped_linear_forward(x.data(), w.data(), y_ref.data(), offsets.data(), E, in, out);
  ops::grouped_linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), offsets.data(), E, in, out);

  DevArray<T> dX(x, "x"), dW(w, "w"), dY(rows * out, "y"), dDY(dy, "dy"), dDX(rows * in, "dx");
  DevArray<float> dDW(dw0, "dw");
  dY.fill_nan();
  dDX.fill_nan();
  auto& blas = gpu().blas;
  const std::string shape = shape_str({{"E", E}, {"rows", rows}, {"in", in}, {"out", out}});
  std::string used_fwd, used_dx, used_dw;
  gops::grouped_linear_forward(blas, dX.get(), dW.get(), dY.get(), offsets.data(), E, in, out, path);
  used_fwd = gops::to_string(blas.last_grouped_path());
  gops::grouped_linear_backward<T>(blas, dDY.get(), dX.get(), dW.get(), dDX.get(), nullptr, offsets.data(), E, in,
                                   out, path);
  used_dx = gops::to_string(blas.last_grouped_path());
  // A forced grouped path may be refused by cuBLAS for bf16 -> fp32 (the dw GEMM);
  // automatic falls back to the loop then, and the test says which ran.
  bool dw_ran = true;
  try {
    gops::grouped_linear_backward<T>(blas, dDY.get(), dX.get(), dW.get(), nullptr, dDW.get(), offsets.data(), E, in,
                                     out, path);
    used_dw = gops::to_string(blas.last_grouped_path());
  } catch (const cu::CudaError& e) {
    dw_ran = false;
    EXPECT_EQ(path, gops::GroupedGemmPath::grouped) << e.what();
    used_dw = "refused";
    std::printf("[ harness  ] grouped dw with forced grouped path refused: %s\n", e.what());
  }
  const double err_y = rel_err(dY.download(), y_ref), err_dx = rel_err(dDX.download(), dx_ref);
  expect_close("grouped y (" + std::string(gops::to_string(path)) + ")", err_y, tol<T>());
  expect_close("grouped dx (" + std::string(gops::to_string(path)) + ")", err_dx, tol<T>());
  double err_dw = 0;
  if (dw_ran) {
    const Vec dw = dDW.download();
    err_dw = rel_err(dw, dw_ref);
    expect_close("grouped dw (fp32 +=, " + std::string(gops::to_string(path)) + ")", err_dw, kTolF32);
    // Empty experts' dw stays exactly dw0.
    for (std::int64_t e = 0; e < E; ++e) {
      if (offsets[sz(e + 1)] != offsets[sz(e)]) continue;
      for (std::int64_t i = 0; i < out * in; ++i) {
        ASSERT_EQ(dw[sz(e * out * in + i)], dw0[sz(e * out * in + i)]) << "empty expert " << e;
      }
    }
  }
  const std::string note = std::string("path ") + gops::to_string(path) + ": fwd " + used_fwd + ", dx " + used_dx +
                           ", dw " + used_dw;
  OpRow f{"grouped_linear_fwd", dtype_name<T>(), shape, err_y, tol<T>()};
  f.flops = 2.0 * rows * in * out;
  f.note = note;
  f.ms = time_ms([&] { gops::grouped_linear_forward(blas, dX.get(), dW.get(), dY.get(), offsets.data(), E, in, out, path); });
  report(f);
  if (dw_ran) {
    OpRow b{"grouped_linear_bwd", dtype_name<T>(), shape, std::max(err_dx, err_dw), tol<T>()};
    b.flops = 4.0 * rows * in * out;
    b.note = note;
    b.ms = time_ms([&] {
      gops::grouped_linear_backward(blas, dDY.get(), dX.get(), dW.get(), dDX.get(), dDW.get(), offsets.data(), E, in,
                                    out, path);
    });
    report(b);
  }
}

TEST(CudaOps, GroupedExpertGemmBothPathsMatchTheCpuWithSkewedAndEmptyExperts) {
  MOEFLEX_REQUIRE_GPU();
  // 7 experts: empty first and last, one hot expert, one single-row expert.
  const std::vector<std::int32_t> skewed = {0, 0, 3, 3, 53, 54, 61, 61};
  for (auto path : {gops::GroupedGemmPath::loop, gops::GroupedGemmPath::grouped, gops::GroupedGemmPath::automatic}) {
    check_grouped_linear<float>(skewed, 48, 40, path);
    check_grouped_linear<bf16>(skewed, 48, 40, path);
  }
  // Every token on one expert; and a larger balanced case.
  check_grouped_linear<bf16>({0, 0, 0, 90, 90}, 64, 32, gops::GroupedGemmPath::automatic);
  std::vector<std::int32_t> balanced(17);
  for (int e = 0; e <= 16; ++e) balanced[sz(e)] = 64 * e;
  check_grouped_linear<bf16>(balanced, 256, 128, gops::GroupedGemmPath::automatic);
  // No rows at all: nothing runs, nothing is written.
  check_grouped_linear<float>({0, 0, 0}, 8, 8, gops::GroupedGemmPath::automatic);
}

// ---------------------------------------------------------------------------------
// RMSNorm

template <typename T>
void check_rmsnorm(std::int64_t n, std::int64_t d) {
  const float eps = 1e-6f;
  const Vec x = quantize<T>(random_vec(sz(n * d), 30, 2.0)), w = quantize<T>(random_vec(sz(d), 31));
  const Vec dy = quantize<T>(random_vec(sz(n * d), 32)), dw0 = quantize<float>(random_vec(sz(d), 33));
  Vec y_ref(x.size()), rstd_ref(sz(n)), dx_ref(x.size()), dw_ref = dw0;
  ops::rmsnorm_forward<double>(x.data(), w.data(), y_ref.data(), rstd_ref.data(), n, d, eps);
  ops::rmsnorm_backward<double>(dy.data(), x.data(), w.data(), rstd_ref.data(), dx_ref.data(), dw_ref.data(), n, d);

  DevArray<T> dX(x, "x"), dW(w, "w"), dY(n * d, "y"), dDY(dy, "dy"), dDX(n * d, "dx");
  DevArray<float> dR(n, "rstd"), dDW(dw0, "dw"), ws(gops::rmsnorm_backward_workspace_bytes(n, d) / 4 + 1, "ws");
  dY.fill_nan();
  dR.fill_nan();
  dDX.fill_nan();
  ws.fill_nan();  // the partial sums must be written before they are read
  const cudaStream_t s = gpu().s();
  gops::rmsnorm_forward(dX.get(), dW.get(), dY.get(), dR.get(), n, d, eps, s);
  gops::rmsnorm_backward(dDY.get(), dX.get(), dW.get(), dR.get(), dDX.get(), dDW.get(), ws.get(), n, d, s);
  const std::string shape = shape_str({{"n", n}, {"d", d}});
  OpRow f{"rmsnorm_fwd", dtype_name<T>(), shape, rel_err(dY.download(), y_ref), tol<T>()};
  expect_close("rmsnorm y", f.err, f.tol);
  expect_close("rmsnorm rstd (fp32)", rel_err(dR.download(), rstd_ref), kTolF32);
  const auto dx_gpu = dDX.download_raw();
  const auto dw_gpu = dDW.download_raw();
  OpRow b{"rmsnorm_bwd", dtype_name<T>(), shape, rel_err(widen(dx_gpu), dx_ref), tol<T>()};
  const double err_dw = rel_err(widen(dw_gpu), dw_ref);
  expect_close("rmsnorm dx", b.err, b.tol);
  expect_close("rmsnorm dw (fp32 +=)", err_dw, kTolF32);
  b.err = std::max(b.err, err_dw);
  // Deterministic: the same backward again gives the same bits.
  dDW.upload(dw0);
  gops::rmsnorm_backward(dDY.get(), dX.get(), dW.get(), dR.get(), dDX.get(), dDW.get(), ws.get(), n, d, s);
  EXPECT_TRUE(bit_equal(dDX.download_raw(), dx_gpu)) << "rmsnorm dx is not deterministic";
  EXPECT_TRUE(bit_equal(dDW.download_raw(), dw_gpu)) << "rmsnorm dw is not deterministic";
  f.bytes = double(sizeof(T)) * 2 * n * d;
  f.ms = time_ms([&] { gops::rmsnorm_forward(dX.get(), dW.get(), dY.get(), dR.get(), n, d, eps, s); });
  report(f);
  b.bytes = double(sizeof(T)) * 3 * n * d;
  b.ms = time_ms([&] {
    gops::rmsnorm_backward(dDY.get(), dX.get(), dW.get(), dR.get(), dDX.get(), dDW.get(), ws.get(), n, d, s);
  });
  report(b);
}

TEST(CudaOps, RmsNormForwardBackwardMatchTheCpuAndAreDeterministic) {
  MOEFLEX_REQUIRE_GPU();
  for (auto [n, d] : {std::pair<std::int64_t, std::int64_t>{37, 300}, {1, 7}, {700, 1024}, {9000, 64}}) {
    check_rmsnorm<float>(n, d);
    check_rmsnorm<bf16>(n, d);
  }
}

TEST(CudaOps, RmsNormFp32GradientsMatchFiniteDifferences) {
  MOEFLEX_REQUIRE_GPU();
  const std::int64_t n = 12, d = 96;
  const Vec x = random_vec(sz(n * d), 40), w = random_vec(sz(d), 41), probe = random_vec(sz(n * d), 42);
  const Vec ux = random_vec(x.size(), 43), uw = random_vec(w.size(), 44);
  DevArray<float> dX(x, "x"), dW(w, "w"), dY(n * d, "y"), dR(n, "rstd"), dP(probe, "probe"), dDX(n * d, "dx"),
      dDW(Vec(sz(d), 0.0), "dw"), ws(gops::rmsnorm_backward_workspace_bytes(n, d) / 4 + 1, "ws");
  auto loss = [&](double eps) {
    dX.upload(axpy(x, eps, ux));
    dW.upload(axpy(w, eps, uw));
    gops::rmsnorm_forward(dX.get(), dW.get(), dY.get(), dR.get(), n, d, 1e-6f, gpu().s());
    return dot(dY.download(), probe);
  };
  const double eps = 1e-3, lp = loss(eps), lm = loss(-eps);
  loss(0);
  gops::rmsnorm_backward(dP.get(), dX.get(), dW.get(), dR.get(), dDX.get(), dDW.get(), ws.get(), n, d, gpu().s());
  expect_directional_derivative("rmsnorm (dx, dw)", dot(dDX.download(), ux) + dot(dDW.download(), uw), lp, lm, eps);
}

// ---------------------------------------------------------------------------------
// RoPE

template <typename T>
void check_rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
  const double theta = 10000.0;
  const Vec x = quantize<T>(random_vec(sz(B * S * H * hd), 50)), g = quantize<T>(random_vec(x.size(), 51));
  Vec y_ref = x, dx_ref = g;
  ops::rope_forward<double>(y_ref.data(), B, S, H, hd, theta);
  ops::rope_backward<double>(dx_ref.data(), B, S, H, hd, theta);
  DevArray<T> dX(x, "x"), dG(g, "g");
  gops::rope_forward(dX.get(), B, S, H, hd, theta, gpu().s());
  gops::rope_backward(dG.get(), B, S, H, hd, theta, gpu().s());
  const std::string shape = shape_str({{"B", B}, {"S", S}, {"H", H}, {"hd", hd}});
  OpRow f{"rope_fwd", dtype_name<T>(), shape, rel_err(dX.download(), y_ref), tol<T>()};
  OpRow b{"rope_bwd", dtype_name<T>(), shape, rel_err(dG.download(), dx_ref), tol<T>()};
  expect_close("rope forward", f.err, f.tol);
  expect_close("rope backward", b.err, b.tol);
  f.bytes = b.bytes = 2.0 * sizeof(T) * x.size();
  f.ms = time_ms([&] { gops::rope_forward(dX.get(), B, S, H, hd, theta, gpu().s()); });
  b.ms = time_ms([&] { gops::rope_backward(dG.get(), B, S, H, hd, theta, gpu().s()); });
  report(f);
  report(b);
}

TEST(CudaOps, RopeForwardBackwardMatchTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  check_rope<float>(2, 13, 3, 64);
  check_rope<bf16>(2, 13, 3, 64);
  check_rope<float>(1, 300, 2, 6);
  check_rope<bf16>(3, 129, 4, 128);
  DevArray<float> odd(Vec(6, 1.0), "x");
  EXPECT_THROW(gops::rope_forward(odd.get(), 1, 2, 1, 3, 10000.0, gpu().s()), Error);
}

// ---------------------------------------------------------------------------------
// SwiGLU, residual add, casts

template <typename T>
void check_swiglu(std::int64_t n) {
  const Vec g = quantize<T>(random_vec(sz(n), 60, 4.0)), u = quantize<T>(random_vec(sz(n), 61));
  const Vec dout = quantize<T>(random_vec(sz(n), 62));
  Vec y_ref(sz(n)), dg_ref(sz(n)), du_ref(sz(n));
  ops::swiglu_forward(g.data(), u.data(), y_ref.data(), n);
  ops::swiglu_backward(dout.data(), g.data(), u.data(), dg_ref.data(), du_ref.data(), n);
  DevArray<T> dG(g, "gate"), dU(u, "up"), dY(n, "out"), dD(dout, "dout"), dDG(n, "dgate"), dDU(n, "dup");
  dY.fill_nan();
  dDG.fill_nan();
  dDU.fill_nan();
  gops::swiglu_forward(dG.get(), dU.get(), dY.get(), n, gpu().s());
  gops::swiglu_backward(dD.get(), dG.get(), dU.get(), dDG.get(), dDU.get(), n, gpu().s());
  const std::string shape = shape_str({{"n", n}});
  OpRow f{"swiglu_fwd", dtype_name<T>(), shape, rel_err(dY.download(), y_ref), tol<T>()};
  OpRow b{"swiglu_bwd", dtype_name<T>(), shape,
          std::max(rel_err(dDG.download(), dg_ref), rel_err(dDU.download(), du_ref)), tol<T>()};
  expect_close("swiglu forward", f.err, f.tol);
  expect_close("swiglu backward", b.err, b.tol);
  f.bytes = 3.0 * sizeof(T) * n;
  b.bytes = 5.0 * sizeof(T) * n;
  f.ms = time_ms([&] { gops::swiglu_forward(dG.get(), dU.get(), dY.get(), n, gpu().s()); });
  b.ms = time_ms([&] { gops::swiglu_backward(dD.get(), dG.get(), dU.get(), dDG.get(), dDU.get(), n, gpu().s()); });
  report(f);
  report(b);
}

TEST(CudaOps, SwigluForwardBackwardMatchTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  for (std::int64_t n : {1, 1000, 1 << 20}) {
    check_swiglu<float>(n);
    check_swiglu<bf16>(n);
  }
  // Finite differences of the fp32 kernel.
  const std::int64_t n = 500;
  const Vec g = random_vec(sz(n), 63, 3.0), u = random_vec(sz(n), 64), p = random_vec(sz(n), 65);
  const Vec ug = random_vec(sz(n), 66), uu = random_vec(sz(n), 67);
  DevArray<float> dG(g, "g"), dU(u, "u"), dY(n, "y"), dP(p, "p"), dDG(n, "dg"), dDU(n, "du");
  auto loss = [&](double eps) {
    dG.upload(axpy(g, eps, ug));
    dU.upload(axpy(u, eps, uu));
    gops::swiglu_forward(dG.get(), dU.get(), dY.get(), n, gpu().s());
    return dot(dY.download(), p);
  };
  const double eps = 1e-3, lp = loss(eps), lm = loss(-eps);
  loss(0);
  gops::swiglu_backward(dP.get(), dG.get(), dU.get(), dDG.get(), dDU.get(), n, gpu().s());
  expect_directional_derivative("swiglu (dgate, dup)", dot(dDG.download(), ug) + dot(dDU.download(), uu), lp, lm, eps);
}

template <typename T>
void check_residual_and_casts(std::int64_t n) {
  const Vec a = quantize<T>(random_vec(sz(n), 70)), b = quantize<T>(random_vec(sz(n), 71));
  Vec sum(sz(n));
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + b[i];
  DevArray<T> dA(a, "a"), dB(b, "b"), dO(n, "out");
  dO.fill_nan();
  gops::residual_add(dA.get(), dB.get(), dO.get(), n, gpu().s());
  OpRow r{"residual_add", dtype_name<T>(), shape_str({{"n", n}}), rel_err(dO.download(), sum), tol<T>()};
  expect_close("residual add", r.err, r.tol);
  // In place (out aliases a).
  gops::residual_add(dA.get(), dB.get(), dA.get(), n, gpu().s());
  expect_close("residual add in place", rel_err(dA.download(), sum), tol<T>());
  r.bytes = 3.0 * sizeof(T) * n;
  r.ms = time_ms([&] { gops::residual_add(dO.get(), dB.get(), dO.get(), n, gpu().s()); });
  report(r);
  // accumulate: fp32 += T.
  const Vec acc0 = random_vec(sz(n), 72);
  DevArray<float> dAcc(acc0, "acc");
  gops::accumulate(dB.get(), dAcc.get(), n, gpu().s());
  expect_close("accumulate", rel_err(dAcc.download(), axpy(quantize<float>(acc0), 1.0, b)), kTolF32);
}

TEST(CudaOps, ResidualAddCastsAndAccumulateAreExact) {
  MOEFLEX_REQUIRE_GPU();
  check_residual_and_casts<float>(1001);
  check_residual_and_casts<bf16>(1001);
  // f32 -> bf16 on the device rounds exactly as the host helper (nearest even),
  // including ties, overflow to infinity and subnormals; bf16 -> f32 is exact.
  std::vector<float> v = {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8), 3.0e38f, -3.4e38f,
                          1e-40f, -0.0f, 65504.0f, 0.1f};
  for (double r : random_vec(10000, 73, 1e3)) v.push_back(static_cast<float>(r));
  DevArray<float> src(std::int64_t(v.size()), "src"), back(std::int64_t(v.size()), "back");
  src.upload_raw(v);
  DevArray<bf16> dst(std::int64_t(v.size()), "dst");
  gops::cast(src.get(), dst.get(), std::int64_t(v.size()), gpu().s());
  const auto got = dst.download_raw();
  for (std::size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(got[i].bits, float_to_bf16_bits(v[i])) << "value " << v[i];
  gops::cast(dst.get(), back.get(), std::int64_t(v.size()), gpu().s());
  const auto wide = back.download_raw();
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(wide[i], to_float(got[i]));
}

// ---------------------------------------------------------------------------------
// MoE dispatch: the plan exactly, permute / unpermute against the CPU

/// topk_idx with a hot expert, empty experts and distinct experts per token.
std::vector<std::int32_t> skewed_routing(std::int64_t n, std::int64_t E, std::int64_t k, std::uint64_t seed) {
  std::vector<std::int32_t> idx(sz(n * k));
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<std::int32_t> used;
    for (std::int64_t j = 0; j < k; ++j) {
      std::int32_t e;
      std::uint64_t c = 0;
      do {
        const double u = uniform01(seed, std::uint64_t(i), std::uint64_t(j * 97 + c++));
        // 40% to expert E/2, the rest spread over the first E-2 experts (the last two stay empty).
        e = u < 0.4 ? std::int32_t(E / 2) : std::int32_t(std::int64_t(u * 1e6) % std::max<std::int64_t>(1, E - 2));
      } while (std::find(used.begin(), used.end(), e) != used.end() && c < 1000);
      used.push_back(e);
      idx[sz(i * k + j)] = e;
    }
  }
  return idx;
}

void check_plan(const std::vector<std::int32_t>& idx, std::int64_t n, std::int64_t E, std::int64_t k, double cf) {
  const std::int64_t cap = ops::expert_capacity(cf, n, E, k);
  std::vector<std::int32_t> counts(sz(E)), offsets(sz(E + 1)), slot(sz(n * k));
  const std::int64_t dropped = ops::moe_plan_dispatch(idx.data(), n, E, k, cap, counts.data(), offsets.data(), slot.data());
  DevInts dIdx(idx, "topk_idx"), dCounts(E, "counts"), dOffsets(E + 1, "offsets"), dSlot(n * k, "slot_of"),
      ws(4, "plan_ws");
  dCounts.fill(0xff);
  dSlot.fill(0x7f);
  std::vector<std::int32_t> host_offsets(sz(E + 1), -5);
  const std::int64_t got_dropped = gops::moe_plan_dispatch(dIdx.get(), n, E, k, cap, dCounts.get(), dOffsets.get(),
                                                           dSlot.get(), host_offsets.data(), ws.get(), gpu().s());
  const std::string what = "moe plan n=" + std::to_string(n) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                           " cf=" + std::to_string(cf);
  EXPECT_EQ(got_dropped, dropped) << what;
  EXPECT_EQ(dCounts.download(), counts) << what;
  EXPECT_EQ(dOffsets.download(), offsets) << what;
  EXPECT_EQ(host_offsets, offsets) << what;
  EXPECT_EQ(dSlot.download(), slot) << what;
  if (n * k >= 1000) {
    OpRow r{"moe_plan", "i32", shape_str({{"n", n}, {"E", E}, {"k", k}}), 0.0, 0.0};
    r.note = "exact; dropped " + std::to_string(dropped) + ", includes the host copy of the offsets";
    r.ms = time_ms([&] {
      gops::moe_plan_dispatch(dIdx.get(), n, E, k, cap, dCounts.get(), dOffsets.get(), dSlot.get(),
                              host_offsets.data(), ws.get(), gpu().s());
    });
    report(r);
  }
}

TEST(CudaOps, MoePlanEqualsTheCpuPlanExactly) {
  MOEFLEX_REQUIRE_GPU();
  for (double cf : {-1.0, 1.0, 0.5, 2.0}) {
    check_plan(skewed_routing(50, 8, 2, 1), 50, 8, 2, cf);
    // Many chunks of the per-expert scan (n*k > the block size), 64 experts.
    check_plan(skewed_routing(5000, 64, 4, 2), 5000, 64, 4, cf);
  }
  // Every token to one expert; a single token; top-1.
  check_plan(std::vector<std::int32_t>(300, 3), 300, 5, 1, 1.0);
  check_plan(std::vector<std::int32_t>(300, 3), 300, 5, 1, -1.0);
  check_plan({2, 0}, 1, 4, 2, -1.0);
  // A bad expert index is an error, as on the CPU.
  DevInts bad(std::vector<std::int32_t>{0, 9}, "bad"), c(4, "c"), o(5, "o"), s(2, "s"), ws(4, "ws");
  std::vector<std::int32_t> ho(5);
  EXPECT_THROW(gops::moe_plan_dispatch(bad.get(), 1, 4, 2, -1, c.get(), o.get(), s.get(), ho.data(), ws.get(), gpu().s()),
               Error);
}

template <typename T>
void check_permute(std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t d, double cf) {
  const auto idx = skewed_routing(n, E, k, 3);
  const std::int64_t cap = ops::expert_capacity(cf, n, E, k);
  std::vector<std::int32_t> counts(sz(E)), offsets(sz(E + 1)), slot(sz(n * k));
  ops::moe_plan_dispatch(idx.data(), n, E, k, cap, counts.data(), offsets.data(), slot.data());
  const std::int64_t rows = offsets.back();
  const Vec x = quantize<T>(random_vec(sz(n * d), 80)), yp = quantize<T>(random_vec(sz(rows * d), 81));
  const Vec w = quantize<float>(random_vec(sz(n * k), 82)), dy = quantize<T>(random_vec(sz(n * d), 83));
  const Vec dxp = quantize<T>(random_vec(sz(rows * d), 84)), dyp0 = quantize<T>(random_vec(sz(rows * d), 85));
  Vec xp_ref(sz(rows * d)), dx_ref(sz(n * d)), y_ref(sz(n * d)), dyp_ref = dyp0,
      dw_ref(sz(n * k));
  ops::permute_forward(x.data(), slot.data(), xp_ref.data(), n, k, d);
  ops::permute_backward(dxp.data(), slot.data(), dx_ref.data(), n, k, d);
  ops::unpermute_forward(yp.data(), slot.data(), w.data(), y_ref.data(), n, k, d);
  ops::unpermute_backward(dy.data(), yp.data(), slot.data(), w.data(), dyp_ref.data(), dw_ref.data(), n, k, d);

  DevInts dSlot(slot, "slot_of");
  DevArray<T> dX(x, "x"), dXP(rows * d, "xp"), dDXP(dxp, "dxp"), dDX(n * d, "dx"), dYP(yp, "yp"), dY(n * d, "y"),
      dDY(dy, "dy"), dDYP(dyp0, "dyp");
  DevArray<float> dW(w, "w"), dDW(n * k, "dw");
  dXP.fill_nan();
  dDX.fill_nan();
  dY.fill_nan();
  dDW.fill_nan();
  const cudaStream_t s = gpu().s();
  gops::permute_forward(dX.get(), dSlot.get(), dXP.get(), n, k, d, s);
  gops::permute_backward(dDXP.get(), dSlot.get(), dDX.get(), n, k, d, s);
  gops::unpermute_forward(dYP.get(), dSlot.get(), dW.get(), dY.get(), n, k, d, s);
  gops::unpermute_backward(dDY.get(), dYP.get(), dSlot.get(), dW.get(), dDYP.get(), dDW.get(), n, k, d, s);
  const std::string shape = shape_str({{"n", n}, {"E", E}, {"k", k}, {"d", d}, {"rows", rows}});
  const double pf = rel_err(dXP.download(), xp_ref), pb = rel_err(dDX.download(), dx_ref);
  const double uf = rel_err(dY.download(), y_ref);
  const double ub = std::max(rel_err(dDYP.download(), dyp_ref), rel_err(dDW.download(), dw_ref));
  expect_close("permute forward " + shape, pf, tol<T>());
  expect_close("permute backward " + shape, pb, tol<T>());
  expect_close("unpermute forward " + shape, uf, tol<T>());
  expect_close("unpermute backward (dyp, dtopk_w) " + shape, ub, tol<T>());
  const double moved = double(sizeof(T)) * 2 * rows * d;
  OpRow r1{"permute_fwd", dtype_name<T>(), shape, pf, tol<T>()}, r2{"permute_bwd", dtype_name<T>(), shape, pb, tol<T>()};
  OpRow r3{"unpermute_fwd", dtype_name<T>(), shape, uf, tol<T>()}, r4{"unpermute_bwd", dtype_name<T>(), shape, ub, tol<T>()};
  r1.bytes = r2.bytes = r3.bytes = moved;
  r4.bytes = 1.5 * moved;
  r1.ms = time_ms([&] { gops::permute_forward(dX.get(), dSlot.get(), dXP.get(), n, k, d, s); });
  r2.ms = time_ms([&] { gops::permute_backward(dDXP.get(), dSlot.get(), dDX.get(), n, k, d, s); });
  r3.ms = time_ms([&] { gops::unpermute_forward(dYP.get(), dSlot.get(), dW.get(), dY.get(), n, k, d, s); });
  r4.ms = time_ms([&] { gops::unpermute_backward(dDY.get(), dYP.get(), dSlot.get(), dW.get(), dDYP.get(), dDW.get(), n, k, d, s); });
  for (const auto& r : {r1, r2, r3, r4}) report(r);
}

TEST(CudaOps, PermuteAndUnpermuteMatchTheCpuWithDropsAndSkew) {
  MOEFLEX_REQUIRE_GPU();
  for (double cf : {-1.0, 1.0}) {
    check_permute<float>(61, 8, 2, 40, cf);
    check_permute<bf16>(61, 8, 2, 40, cf);
  }
  check_permute<bf16>(2048, 16, 4, 256, 1.25);
}

// ---------------------------------------------------------------------------------
// Router softmax + top-k (fp32)

void check_router(std::int64_t n, std::int64_t E, std::int64_t k, bool norm, bool extra) {
  const Vec logits = quantize<float>(random_vec(sz(n * E), 90, 3.0));
  const Vec dw = quantize<float>(random_vec(sz(n * k), 91)), dex = quantize<float>(random_vec(sz(n * E), 92));
  Vec probs_ref(sz(n * E)), w_ref(sz(n * k)), dl_ref(sz(n * E));
  std::vector<std::int32_t> idx_ref(sz(n * k));
  ops::router_forward<double>(logits.data(), probs_ref.data(), idx_ref.data(), w_ref.data(), n, E, k, norm);
  ops::router_backward<double>(dw.data(), extra ? dex.data() : nullptr, probs_ref.data(), idx_ref.data(),
                               dl_ref.data(), n, E, k, norm);
  DevArray<float> dL(logits, "logits"), dP(n * E, "probs"), dW(n * k, "topk_w"), dDW(dw, "dtopk_w"), dEx(dex, "dprobs"),
      dDL(n * E, "dlogits");
  DevInts dIdx(n * k, "topk_idx");
  dP.fill_nan();
  dW.fill_nan();
  dDL.fill_nan();
  dIdx.fill(0xff);
  const cudaStream_t s = gpu().s();
  gops::router_forward(dL.get(), dP.get(), dIdx.get(), dW.get(), n, E, k, norm, s);
  const auto idx = dIdx.download();
  // Backward from the GPU's own forward (its probs and top-k).
  gops::router_backward(dDW.get(), extra ? dEx.get() : nullptr, dP.get(), dIdx.get(), dDL.get(), n, E, k, norm, s);
  const std::string shape = shape_str({{"n", n}, {"E", E}, {"k", k}, {"norm", norm}, {"extra", extra}});
  EXPECT_EQ(idx, idx_ref) << "router top-k " << shape;
  OpRow f{"router_fwd", "f32", shape, std::max(rel_err(dP.download(), probs_ref), rel_err(dW.download(), w_ref)), kTolF32};
  // With k = 1 and normalised top-k weights the weight is p / p = 1 for any logits, so
  // dlogits is exactly 0 and the reference holds only rounding noise (the relative
  // error of noise against noise is meaningless): measure the GPU's values against
  // the upstream gradient instead.
  const bool zero_grad = norm && k == 1 && !extra;
  const Vec dl_gpu = dDL.download();
  double max_dl = 0, max_dw = 0;
  for (double x : dl_gpu) max_dl = std::max(max_dl, std::abs(x));
  for (double x : dw) max_dw = std::max(max_dw, std::abs(x));
  OpRow b{"router_bwd", "f32", shape, zero_grad ? max_dl / max_dw : rel_err(dl_gpu, dl_ref), kTolF32};
  if (zero_grad) b.note = "exact gradient is 0: err = max|dlogits| / max|dtopk_w|";
  expect_close("router probs/topk_w " + shape, f.err, f.tol);
  expect_close("router dlogits " + shape, b.err, b.tol);
  f.bytes = 8.0 * n * E;
  b.bytes = 12.0 * n * E;
  f.ms = time_ms([&] { gops::router_forward(dL.get(), dP.get(), dIdx.get(), dW.get(), n, E, k, norm, s); });
  b.ms = time_ms([&] {
    gops::router_backward(dDW.get(), extra ? dEx.get() : nullptr, dP.get(), dIdx.get(), dDL.get(), n, E, k, norm, s);
  });
  report(f);
  report(b);
}

TEST(CudaOps, RouterSoftmaxTopKMatchesTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  for (bool norm : {false, true}) {
    for (bool extra : {false, true}) {
      check_router(70, 8, 2, norm, extra);
      check_router(70, 64, 6, norm, extra);
    }
  }
  check_router(33, 160, 1, true, false);  // E not a multiple of 32; dlogits = 0
  check_router(33, 160, 1, true, true);   // the same with the aux-loss gradient
  check_router(33, 160, 1, false, false);
  check_router(5, 1024, 8, true, true);    // the largest E
  check_router(9, 3, 3, true, false);      // k == E
  // Ties go to the lower expert index, as on the CPU: equal logits everywhere.
  DevArray<float> L(Vec(4 * 6, 0.5), "tied"), P(24, "p"), W(8, "w");
  DevInts I(8, "i");
  gops::router_forward(L.get(), P.get(), I.get(), W.get(), 4, 6, 2, false, gpu().s());
  EXPECT_EQ(I.download(), (std::vector<std::int32_t>{0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_THROW(gops::router_forward(L.get(), P.get(), I.get(), W.get(), 1, 2000, 2, false, gpu().s()), Error);
  EXPECT_THROW(gops::router_forward(L.get(), P.get(), I.get(), W.get(), 1, 4, 5, false, gpu().s()), Error);
}

TEST(CudaOps, RouterFp32GradientMatchesFiniteDifferences) {
  MOEFLEX_REQUIRE_GPU();
  // The top-k set must not change under the perturbation: logits well separated.
  const std::int64_t n = 16, E = 8, k = 2;
  Vec logits(sz(n * E));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t e = 0; e < E; ++e) logits[sz(i * E + e)] = 0.7 * double((e * 5 + i) % E);
  const Vec probe = random_vec(sz(n * k), 93), u = random_vec(logits.size(), 94);
  DevArray<float> dL(logits, "logits"), dP(n * E, "p"), dW(n * k, "w"), dProbe(probe, "probe"), dDL(n * E, "dl");
  DevInts dI(n * k, "i");
  auto loss = [&](double eps) {
    dL.upload(axpy(logits, eps, u));
    gops::router_forward(dL.get(), dP.get(), dI.get(), dW.get(), n, E, k, true, gpu().s());
    return dot(dW.download(), probe);
  };
  const double eps = 1e-3, lp = loss(eps), lm = loss(-eps);
  loss(0);
  gops::router_backward(dProbe.get(), nullptr, dP.get(), dI.get(), dDL.get(), n, E, k, true, gpu().s());
  expect_directional_derivative("router dlogits", dot(dDL.download(), u), lp, lm, eps);
}

// ---------------------------------------------------------------------------------
// Attention (own flash kernels) against the CPU attention (which stores probs)

/// lse[b,h,i] = log sum_{j<=i} exp(q_i k_j / sqrt(hd)), in double.
Vec reference_lse(const Vec& q, const Vec& k, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                  std::int64_t hd) {
  Vec lse(sz(B * H * S));
  const double scale = 1.0 / std::sqrt(double(hd));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        Vec s;
        for (std::int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (std::int64_t c = 0; c < hd; ++c)
            d += q[sz(((b * S + i) * H + h) * hd + c)] * k[sz(((b * S + j) * Hkv + h / (H / Hkv)) * hd + c)];
          s.push_back(d * scale);
        }
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double v : s) sum += std::exp(v - m);
        lse[sz((b * H + h) * S + i)] = m + std::log(sum);
      }
  return lse;
}

template <typename T>
void check_attention(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, std::int64_t Hkv = 0) {
  if (Hkv == 0) Hkv = H;  // multi-head; fewer: grouped-query
  const std::size_t N = sz(B * S * H * hd), Nkv = sz(B * S * Hkv * hd);
  const Vec q = quantize<T>(random_vec(N, 100, 1.5)), k = quantize<T>(random_vec(Nkv, 101, 1.5));
  const Vec v = quantize<T>(random_vec(Nkv, 102)), dout = quantize<T>(random_vec(N, 103));
  Vec out_ref(N), probs(sz(B * H * S * S)), dq_ref(N), dk_ref(Nkv), dv_ref(Nkv), dprobs(probs.size());
  ops::attention_forward<double>(q.data(), k.data(), v.data(), out_ref.data(), probs.data(), B, S, H, Hkv, hd);
  ops::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), probs.data(), dq_ref.data(), dk_ref.data(),
                                  dv_ref.data(), dprobs.data(), B, S, H, Hkv, hd);
  const Vec lse_ref = reference_lse(q, k, B, S, H, Hkv, hd);

  DevArray<T> dQ(q, "q"), dK(k, "k"), dV(v, "v"), dO(std::int64_t(N), "out"), dDO(dout, "dout"), dDQ(std::int64_t(N), "dq"),
      dDK(std::int64_t(Nkv), "dk"), dDV(std::int64_t(Nkv), "dv");
  DevArray<float> dLse(B * H * S, "lse"), ws(gops::attention_backward_workspace_bytes(B, S, H) / 4 + 1, "ws");
  for (auto* a : {&dO, &dDQ, &dDK, &dDV}) a->fill_nan();
  dLse.fill_nan();
  ws.fill_nan();
  const cudaStream_t s = gpu().s();
  gops::attention_forward(dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), B, S, H, Hkv, hd, s);
  gops::attention_backward(dDO.get(), dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), dDQ.get(), dDK.get(),
                           dDV.get(), ws.get(), B, S, H, Hkv, hd, s);
  const std::string shape = shape_str({{"B", B}, {"S", S}, {"H", H}, {"Hkv", Hkv}, {"hd", hd}});
  OpRow f{"attention_fwd", dtype_name<T>(), shape, rel_err(dO.download(), out_ref), tol<T>()};
  expect_close("attention out " + shape, f.err, f.tol);
  expect_close("attention lse (fp32) " + shape, rel_err(dLse.download(), lse_ref), kTolF32);
  const auto dq1 = dDQ.download_raw(), dk1 = dDK.download_raw(), dv1 = dDV.download_raw();
  const double eq = rel_err(widen(dq1), dq_ref), ek = rel_err(widen(dk1), dk_ref), ev = rel_err(widen(dv1), dv_ref);
  expect_close("attention dq " + shape, eq, tol<T>());
  expect_close("attention dk " + shape, ek, tol<T>());
  expect_close("attention dv " + shape, ev, tol<T>());
  OpRow b{"attention_bwd", dtype_name<T>(), shape, std::max({eq, ek, ev}), tol<T>()};
  // Deterministic: no atomics, so a second backward gives the same bits.
  gops::attention_backward(dDO.get(), dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), dDQ.get(), dDK.get(),
                           dDV.get(), ws.get(), B, S, H, Hkv, hd, s);
  EXPECT_TRUE(bit_equal(dDQ.download_raw(), dq1) && bit_equal(dDK.download_raw(), dk1) &&
              bit_equal(dDV.download_raw(), dv1))
      << "attention backward is not deterministic";
  f.flops = 2.0 * B * H * double(S) * double(S) * hd;  // causal half of 4 B H S^2 hd
  b.flops = 2.5 * f.flops;
  f.ms = time_ms([&] { gops::attention_forward(dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), B, S, H, Hkv, hd, s); });
  b.ms = time_ms([&] {
    gops::attention_backward(dDO.get(), dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), dDQ.get(), dDK.get(),
                             dDV.get(), ws.get(), B, S, H, Hkv, hd, s);
  });
  report(f);
  report(b);
}

TEST(CudaOps, FlashAttentionForwardBackwardMatchTheCpu) {
  MOEFLEX_REQUIRE_GPU();
  check_attention<float>(2, 77, 3, 64);
  check_attention<bf16>(2, 77, 3, 64);
  check_attention<float>(1, 130, 2, 128);
  check_attention<bf16>(1, 130, 2, 128);
  check_attention<float>(2, 33, 2, 48);  // head_dim not a multiple of 32
  check_attention<bf16>(1, 1, 1, 32);    // one token
  check_attention<bf16>(1, 256, 4, 64);
  check_attention<float>(2, 77, 4, 64, 2);  // grouped-query: 2 query heads per kv head
  check_attention<bf16>(2, 77, 4, 64, 2);
  check_attention<float>(1, 130, 6, 40, 2);  // groups of 3, padded head dim
  check_attention<bf16>(1, 130, 4, 128, 1);  // multi-query
  DevArray<float> x(Vec(256, 0.0), "x"), l(Vec(2, 0.0), "l");
  EXPECT_THROW(gops::attention_forward(x.get(), x.get(), x.get(), x.get(), l.get(), 1, 1, 1, 1, 256, gpu().s()), Error);
  EXPECT_THROW(gops::attention_forward(x.get(), x.get(), x.get(), x.get(), l.get(), 1, 1, 3, 2, 32, gpu().s()), Error);
}

TEST(CudaOps, FlashAttentionFp32GradientsMatchFiniteDifferences) {
  MOEFLEX_REQUIRE_GPU();
  const std::int64_t B = 1, S = 20, H = 2, hd = 40;
  const std::size_t N = sz(B * S * H * hd);
  const Vec q = random_vec(N, 110), k = random_vec(N, 111), v = random_vec(N, 112), probe = random_vec(N, 113);
  const Vec uq = random_vec(N, 114), uk = random_vec(N, 115), uv = random_vec(N, 116);
  DevArray<float> dQ(q, "q"), dK(k, "k"), dV(v, "v"), dO(std::int64_t(N), "o"), dP(probe, "probe"), dDQ(std::int64_t(N), "dq"),
      dDK(std::int64_t(N), "dk"), dDV(std::int64_t(N), "dv"), dLse(B * H * S, "lse"),
      ws(gops::attention_backward_workspace_bytes(B, S, H) / 4 + 1, "ws");
  auto loss = [&](double eps) {
    dQ.upload(axpy(q, eps, uq));
    dK.upload(axpy(k, eps, uk));
    dV.upload(axpy(v, eps, uv));
    gops::attention_forward(dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), B, S, H, H, hd, gpu().s());
    return dot(dO.download(), probe);
  };
  const double eps = 1e-3, lp = loss(eps), lm = loss(-eps);
  loss(0);
  gops::attention_backward(dP.get(), dQ.get(), dK.get(), dV.get(), dO.get(), dLse.get(), dDQ.get(), dDK.get(),
                           dDV.get(), ws.get(), B, S, H, H, hd, gpu().s());
  const double analytic = dot(dDQ.download(), uq) + dot(dDK.download(), uk) + dot(dDV.download(), uv);
  expect_directional_derivative("attention (dq, dk, dv)", analytic, lp, lm, eps);
}

// ---------------------------------------------------------------------------------
// Every Backend op through the interface: the CUDA backend (ops/cuda/backend.h)
// against the CPU backend (ops/backend.cpp) on the same inputs, in f32 and in bf16.
// The CPU's bf16 path (widen, fp32 reference op, round each output once) is the
// reference the CUDA bf16 path is held to (1e-2 relative error in norm; f32: 1e-5).
// Each backend runs its own forward before its backward (the CUDA attention keeps
// only the logsumexp in `probs`, the CPU the probabilities).

/// The CUDA backend and its arena (256 MiB), made once per process.
ops::DeviceContext& cuda_context() {
  static ops::DeviceContext ctx = [] {
    ops::cuda::CudaContextOptions options;
    options.budget = Bytes(256) << 20;
    return ops::cuda::make_cuda_context(options);
  }();
  return ctx;
}
ops::Backend& cuda_be() { return *cuda_context().backend; }
ops::Backend& cpu_be() { return ops::cpu_backend(); }

constexpr DType kDtypes[] = {DType::f32, DType::bf16};

double tol_of(DType t) { return t == DType::bf16 ? kTolBf16 : kTolF32; }

/// One tensor argument on both backends: host memory for the CPU backend and the
/// CUDA arena's memory for the CUDA one, of one dtype, set to the same bytes.
class Both {
 public:
  Both(DType t, std::int64_t n, const char* name)
      : t_(t), n_(n), host_(sz((std::max<std::int64_t>(n, 1) * dtype_size(t) + 3) / 4)),
        dev_(*cuda_context().arena, {std::max<std::int64_t>(n, 1)}, MemCategory::activations, name, t) {}
  Both(DType t, const Vec& values, const char* name) : Both(t, std::int64_t(values.size()), name) { set(values); }

  View h() { return View(host_.data(), t_); }
  View d() { return dev_.view(); }
  float* hf() { return h().f32(); }
  float* df() { return d().f32(); }
  std::int32_t* hi() { return reinterpret_cast<std::int32_t*>(host_.data()); }
  std::int32_t* di() { return dev_.i32(); }

  /// Both sides = `v` rounded to the dtype (i32: truncated).
  void set(const Vec& v) {
    ASSERT_EQ(std::int64_t(v.size()), n_);
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (t_ == DType::f32) reinterpret_cast<float*>(host_.data())[i] = float(v[i]);
      else if (t_ == DType::bf16) reinterpret_cast<bf16*>(host_.data())[i] = to_bf16(float(v[i]));
      else hi()[i] = std::int32_t(v[i]);
    }
    upload();
  }
  /// Every byte 0xff on both sides: NaN for f32 and bf16 ("=" outputs).
  void fill_nan() {
    std::memset(host_.data(), 0xff, host_.size() * 4);
    upload();
  }
  /// Values of each side, widened to double.
  Vec host() const { return widen_words(host_); }
  Vec dev() const {
    std::vector<std::uint32_t> w(host_.size());
    cuda_be().copy_to_host(w.data(), dev_.raw(), bytes());
    return widen_words(w);
  }
  std::vector<std::int32_t> host_ints() const { return {host_.begin(), host_.begin() + n_}; }
  std::vector<std::int32_t> dev_ints() const {
    std::vector<std::int32_t> v(sz(n_));
    cuda_be().copy_to_host(v.data(), dev_.raw(), bytes());
    return v;
  }
  /// Whether both sides hold the same bytes.
  bool bits_equal() const {
    std::vector<std::uint32_t> w(host_.size());
    cuda_be().copy_to_host(w.data(), dev_.raw(), bytes());
    return std::memcmp(w.data(), host_.data(), std::size_t(bytes())) == 0;
  }

 private:
  Bytes bytes() const { return n_ * dtype_size(t_); }
  void upload() { cuda_be().copy_from_host(dev_.raw(), host_.data(), bytes()); }
  Vec widen_words(const std::vector<std::uint32_t>& w) const {
    Vec out(sz(n_));
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (t_ == DType::f32) out[i] = reinterpret_cast<const float*>(w.data())[i];
      else if (t_ == DType::bf16) out[i] = to_float(reinterpret_cast<const bf16*>(w.data())[i]);
      else out[i] = reinterpret_cast<const std::int32_t*>(w.data())[i];
    }
    return out;
  }

  DType t_;
  std::int64_t n_;
  std::vector<std::uint32_t> host_;  // 4-byte words: aligned for every dtype
  Tensor dev_;
};

/// Compares outputs of both backends with the tolerance of `t` and reports one
/// harness row (op "be.<op>") with the largest error.
void compare(const std::string& op, DType t, const std::string& shape,
             std::initializer_list<std::pair<const char*, const Both*>> outputs) {
  const double tol = tol_of(t);
  double worst = 0;
  for (const auto& [name, b] : outputs) {
    const double err = rel_err(b->dev(), b->host());
    expect_close("backend " + op + " " + to_string(t) + " " + shape + ": " + name, err, tol);
    if (!std::isnan(worst) && (std::isnan(err) || err > worst)) worst = err;
  }
  report(OpRow{"be." + op, to_string(t), shape, worst, tol});
}

/// |a - b| / |b| within the tolerance of `t`, for scalar results (losses).
void compare_scalar(const std::string& what, DType t, double gpu, double cpu) {
  expect_close("backend " + what + " " + to_string(t), std::abs(gpu - cpu) / std::max(std::abs(cpu), 1e-30), tol_of(t));
}

TEST(CudaBackend, LinearAndGemmMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  const std::int64_t n = 33, in = 70, out = 50;
  const std::string shape = shape_str({{"n", n}, {"in", in}, {"out", out}});
  for (DType t : kDtypes) {
    Both x(t, random_vec(sz(n * in), 200), "x"), w(t, random_vec(sz(out * in), 201), "w"), y(t, n * out, "y");
    Both dy(t, random_vec(sz(n * out), 202), "dy"), dx(t, n * in, "dx");
    Both dw(DType::f32, random_vec(sz(out * in), 203), "dw");
    y.fill_nan();
    dx.fill_nan();
    cpu_be().linear_forward(x.h(), w.h(), y.h(), n, in, out);
    cuda_be().linear_forward(x.d(), w.d(), y.d(), n, in, out);
    compare("linear_forward", t, shape, {{"y", &y}});
    cpu_be().linear_backward(dy.h(), x.h(), w.h(), dx.h(), dw.hf(), n, in, out, false);
    cuda_be().linear_backward(dy.d(), x.d(), w.d(), dx.d(), dw.df(), n, in, out, false);
    compare("linear_backward", t, shape, {{"dx", &dx}, {"dw (fp32 +=)", &dw}});
    // dx += with dw skipped, then dw alone (dx skipped: w is not read).
    dx.set(random_vec(sz(n * in), 204));
    cpu_be().linear_backward(dy.h(), x.h(), w.h(), dx.h(), nullptr, n, in, out, true);
    cuda_be().linear_backward(dy.d(), x.d(), w.d(), dx.d(), nullptr, n, in, out, true);
    cpu_be().linear_backward(dy.h(), x.h(), nullptr, nullptr, dw.hf(), n, in, out, false);
    cuda_be().linear_backward(dy.d(), x.d(), nullptr, nullptr, dw.df(), n, in, out, false);
    compare("linear_backward_acc", t, shape, {{"dx +=", &dx}, {"dw only", &dw}});
    // gemm: every transpose, padded strides, beta != 0.
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const std::int64_t M = 37, N = 45, K = 61;
        const std::int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
        Both A(t, random_vec(sz((ta ? K : M) * lda), 205), "A"), B(t, random_vec(sz((tb ? N : K) * ldb), 206), "B");
        Both C(t, random_vec(sz(M * ldc), 207), "C");
        cpu_be().gemm(ta, tb, M, N, K, 0.75f, A.h(), lda, B.h(), ldb, 0.5f, C.h(), ldc);
        cuda_be().gemm(ta, tb, M, N, K, 0.75f, A.d(), lda, B.d(), ldb, 0.5f, C.d(), ldc);
        compare("gemm", t, shape_str({{"M", M}, {"N", N}, {"K", K}, {"ta", ta}, {"tb", tb}}), {{"C (beta 0.5)", &C}});
      }
    }
  }
}

TEST(CudaBackend, NormRopeSwigluAddAndCastMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  for (DType t : kDtypes) {
    {  // RMSNorm
      const std::int64_t n = 37, d = 300;
      const std::string shape = shape_str({{"n", n}, {"d", d}});
      Both x(t, random_vec(sz(n * d), 210, 2.0), "x"), w(t, random_vec(sz(d), 211), "w"), y(t, n * d, "y");
      Both rstd(DType::f32, n, "rstd"), dy(t, random_vec(sz(n * d), 212), "dy"), dx(t, n * d, "dx");
      Both dw(DType::f32, random_vec(sz(d), 213), "dw");
      y.fill_nan();
      rstd.fill_nan();
      dx.fill_nan();
      cpu_be().rmsnorm_forward(x.h(), w.h(), y.h(), rstd.hf(), n, d, 1e-6f);
      cuda_be().rmsnorm_forward(x.d(), w.d(), y.d(), rstd.df(), n, d, 1e-6f);
      compare("rmsnorm_forward", t, shape, {{"y", &y}, {"rstd (fp32)", &rstd}});
      cpu_be().rmsnorm_backward(dy.h(), x.h(), w.h(), rstd.hf(), dx.h(), dw.hf(), n, d);
      cuda_be().rmsnorm_backward(dy.d(), x.d(), w.d(), rstd.df(), dx.d(), dw.df(), n, d);
      compare("rmsnorm_backward", t, shape, {{"dx", &dx}, {"dw (fp32 +=)", &dw}});
    }
    {  // RoPE, in place
      const std::int64_t B = 2, S = 13, H = 3, hd = 64;
      const std::string shape = shape_str({{"B", B}, {"S", S}, {"H", H}, {"hd", hd}});
      Both x(t, random_vec(sz(B * S * H * hd), 214), "x"), g(t, random_vec(sz(B * S * H * hd), 215), "g");
      cpu_be().rope_forward(x.h(), B, S, H, hd, 10000.0);
      cuda_be().rope_forward(x.d(), B, S, H, hd, 10000.0);
      cpu_be().rope_backward(g.h(), B, S, H, hd, 10000.0);
      cuda_be().rope_backward(g.d(), B, S, H, hd, 10000.0);
      compare("rope", t, shape, {{"x (forward)", &x}, {"dx (backward)", &g}});
    }
    {  // SwiGLU
      const std::int64_t n = 1000;
      Both gate(t, random_vec(sz(n), 216, 4.0), "gate"), up(t, random_vec(sz(n), 217), "up"), out(t, n, "out");
      Both dout(t, random_vec(sz(n), 218), "dout"), dgate(t, n, "dgate"), dup(t, n, "dup");
      out.fill_nan();
      dgate.fill_nan();
      dup.fill_nan();
      cpu_be().swiglu_forward(gate.h(), up.h(), out.h(), n);
      cuda_be().swiglu_forward(gate.d(), up.d(), out.d(), n);
      cpu_be().swiglu_backward(dout.h(), gate.h(), up.h(), dgate.h(), dup.h(), n);
      cuda_be().swiglu_backward(dout.d(), gate.d(), up.d(), dgate.d(), dup.d(), n);
      compare("swiglu", t, shape_str({{"n", n}}), {{"out", &out}, {"dgate", &dgate}, {"dup", &dup}});
    }
    {  // y += x
      const std::int64_t n = 1001;
      Both y(t, random_vec(sz(n), 219), "y"), x(t, random_vec(sz(n), 220), "x");
      cpu_be().add_inplace(y.h(), x.h(), n);
      cuda_be().add_inplace(y.d(), x.d(), n);
      compare("add_inplace", t, shape_str({{"n", n}}), {{"y", &y}});
    }
  }
  // cast: every pair, bit for bit (f32 -> bf16 rounds to nearest even on both).
  const std::int64_t n = 4099;
  Vec v = random_vec(sz(n), 222, 1e3);
  v[0] = 1.0 + std::ldexp(1.0, -8);  // a tie: rounds to even
  v[1] = 3.0e38;                     // rounds past the largest bf16: infinity
  for (DType from : kDtypes) {
    for (DType to : kDtypes) {
      Both src(from, v, "src"), dst(to, n, "dst");
      dst.fill_nan();
      cpu_be().cast(src.h(), dst.h(), n);
      cuda_be().cast(src.d(), dst.d(), n);
      EXPECT_TRUE(dst.bits_equal()) << "cast " << to_string(from) << " -> " << to_string(to);
    }
  }
}

TEST(CudaBackend, AttentionMatchesTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  for (DType t : kDtypes) {
    for (auto [B, S, H, Hkv, hd] :
         {std::array<std::int64_t, 5>{2, 37, 3, 3, 64}, {1, 2, 2, 2, 32}, {2, 37, 4, 2, 64}}) {
      const std::int64_t N = B * S * H * hd, Nkv = B * S * Hkv * hd, P = B * H * S * S;
      const std::string shape = shape_str({{"B", B}, {"S", S}, {"H", H}, {"Hkv", Hkv}, {"hd", hd}});
      Both q(t, random_vec(sz(N), 230, 1.5), "q"), k(t, random_vec(sz(Nkv), 231, 1.5), "k"),
          v(t, random_vec(sz(Nkv), 232), "v");
      Both dout(t, random_vec(sz(N), 233), "dout"), out(t, N, "out"), probs(t, P, "probs"), ws(t, P, "dprobs_ws");
      Both dq(t, N, "dq"), dk(t, Nkv, "dk"), dv(t, Nkv, "dv");
      for (Both* b : {&out, &probs, &ws, &dq, &dk, &dv}) b->fill_nan();
      cpu_be().attention_forward(q.h(), k.h(), v.h(), out.h(), probs.h(), B, S, H, Hkv, hd);
      cuda_be().attention_forward(q.d(), k.d(), v.d(), out.d(), probs.d(), B, S, H, Hkv, hd);
      compare("attention_forward", t, shape, {{"out", &out}});
      cpu_be().attention_backward(dout.h(), q.h(), k.h(), v.h(), out.h(), probs.h(), dq.h(), dk.h(), dv.h(), ws.h(), B,
                                  S, H, Hkv, hd);
      cuda_be().attention_backward(dout.d(), q.d(), k.d(), v.d(), out.d(), probs.d(), dq.d(), dk.d(), dv.d(), ws.d(),
                                   B, S, H, Hkv, hd);
      compare("attention_backward", t, shape, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
    }
  }
  // One token with a bf16 probs buffer: 2 bytes cannot hold the fp32 logsumexp.
  Both x(DType::bf16, Vec(32, 0.5), "x"), o(DType::bf16, 32, "o"), p(DType::bf16, 1, "p");
  EXPECT_THROW(cuda_be().attention_forward(x.d(), x.d(), x.d(), o.d(), p.d(), 1, 1, 1, 1, 32), Error);
}

TEST(CudaBackend, EmbeddingAndCrossEntropyMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  for (DType t : kDtypes) {
    {  // Embedding: a gather (exact), and the fp32 scatter-add with repeated ids.
      const std::int64_t V = 50, d = 24, n = 40;
      std::vector<std::int32_t> ids(sz(n));
      for (std::int64_t i = 0; i < n; ++i) ids[sz(i)] = std::int32_t((i * 7) % 13);  // repeats
      const std::string shape = shape_str({{"V", V}, {"d", d}, {"n", n}});
      Both table(t, random_vec(sz(V * d), 240), "table"), out(t, n * d, "out");
      Both dout(t, random_vec(sz(n * d), 241), "dout"), dtable(DType::f32, random_vec(sz(V * d), 242), "dtable");
      out.fill_nan();
      cpu_be().embedding_forward(ids.data(), table.h(), out.h(), n, d);
      cuda_be().embedding_forward(ids.data(), table.d(), out.d(), n, d);
      EXPECT_TRUE(out.bits_equal()) << "embedding_forward " << to_string(t);
      cpu_be().embedding_backward(ids.data(), dout.h(), dtable.hf(), n, d);
      cuda_be().embedding_backward(ids.data(), dout.d(), dtable.df(), n, d);
      compare("embedding_backward", t, shape, {{"dtable (fp32 +=)", &dtable}});
    }
    {  // Cross-entropy: separate outputs, then in place as the model calls it.
      const std::int64_t n = 19, V = 300;
      std::vector<std::int32_t> targets(sz(n));
      for (std::int64_t i = 0; i < n; ++i) targets[sz(i)] = std::int32_t((i * 37 + 5) % V);
      const std::string shape = shape_str({{"n", n}, {"V", V}});
      const Vec values = random_vec(sz(n * V), 243, 4.0);
      Both logits(t, values, "logits"), probs(t, n * V, "probs"), losses(DType::f32, n, "losses");
      Both dlogits(t, n * V, "dlogits");
      probs.fill_nan();
      losses.fill_nan();
      dlogits.fill_nan();
      const double lc = cpu_be().cross_entropy_forward(logits.h(), targets.data(), probs.h(), losses.hf(), n, V);
      const double lg = cuda_be().cross_entropy_forward(logits.d(), targets.data(), probs.d(), losses.df(), n, V);
      compare_scalar("cross_entropy mean loss", t, lg, lc);
      compare("cross_entropy_forward", t, shape, {{"probs", &probs}, {"losses (fp32)", &losses}});
      cpu_be().cross_entropy_backward(probs.h(), targets.data(), dlogits.h(), n, V, 1.0f / float(n));
      cuda_be().cross_entropy_backward(probs.d(), targets.data(), dlogits.d(), n, V, 1.0f / float(n));
      compare("cross_entropy_backward", t, shape, {{"dlogits", &dlogits}});
      // probs over the logits, dlogits over probs.
      Both inplace(t, values, "inplace");
      losses.fill_nan();
      cpu_be().cross_entropy_forward(inplace.h(), targets.data(), inplace.h(), losses.hf(), n, V);
      cuda_be().cross_entropy_forward(inplace.d(), targets.data(), inplace.d(), losses.df(), n, V);
      compare("cross_entropy_forward_inplace", t, shape, {{"probs", &inplace}, {"losses (fp32)", &losses}});
      cpu_be().cross_entropy_backward(inplace.h(), targets.data(), inplace.h(), n, V, 0.5f);
      cuda_be().cross_entropy_backward(inplace.d(), targets.data(), inplace.d(), n, V, 0.5f);
      compare("cross_entropy_backward_inplace", t, shape, {{"dlogits", &inplace}});
    }
  }
}

TEST(CudaBackend, RouterAndRouterLossesMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  for (DType t : kDtypes) {
    // The last: DeepSeek-V3's rules (sigmoid, an expert bias, 4 of 8 groups by top-2 sum, scaled by 2.5).
    for (auto [n, E, k, norm, deepseek] :
         {std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool>{70, 8, 2, true, false},
          {70, 64, 6, false, false}, {70, 64, 6, true, true}}) {
      const std::string shape = shape_str({{"n", n}, {"E", E}, {"k", k}, {"norm", norm}, {"deepseek", deepseek}});
      Both bias(DType::f32, random_vec(sz(E), 254, 0.1), "bias");
      ops::RouterOptions on_cpu{.norm_topk_prob = norm};
      if (deepseek) {
        on_cpu.score = ops::RouterScore::sigmoid;
        on_cpu.routed_scaling_factor = 2.5;
        on_cpu.n_group = 8;
        on_cpu.topk_group = 4;
        on_cpu.group_score = ops::GroupScore::top2_sum;
        on_cpu.bias = bias.hf();
      }
      ops::RouterOptions on_gpu = on_cpu;
      if (deepseek) on_gpu.bias = bias.df();
      Both logits(t, random_vec(sz(n * E), 250, 3.0), "logits"), probs(DType::f32, n * E, "probs");
      Both idx(DType::i32, n * k, "topk_idx"), w(DType::f32, n * k, "topk_w");
      Both dw(DType::f32, random_vec(sz(n * k), 251), "dtopk_w"), dex(DType::f32, random_vec(sz(n * E), 252), "dprobs");
      Both dlogits(t, n * E, "dlogits");
      probs.fill_nan();
      w.fill_nan();
      dlogits.fill_nan();
      cpu_be().router_forward(logits.h(), probs.hf(), idx.hi(), w.hf(), n, E, k, on_cpu);
      cuda_be().router_forward(logits.d(), probs.df(), idx.di(), w.df(), n, E, k, on_gpu);
      EXPECT_EQ(idx.dev_ints(), idx.host_ints()) << "router top-k " << to_string(t) << " " << shape;
      compare("router_forward", t, shape, {{"probs (fp32)", &probs}, {"topk_w (fp32)", &w}});
      cpu_be().router_backward(dw.hf(), dex.hf(), probs.hf(), idx.hi(), dlogits.h(), n, E, k, on_cpu);
      cuda_be().router_backward(dw.df(), dex.df(), probs.df(), idx.di(), dlogits.d(), n, E, k, on_gpu);
      compare("router_backward", t, shape, {{"dlogits", &dlogits}});
      // Load-balancing loss (fp32 only: probs and its gradient).
      const double ac = cpu_be().aux_loss_forward(probs.hf(), idx.hi(), n, E, k, 0.01, on_cpu.score);
      const double ag = cuda_be().aux_loss_forward(probs.df(), idx.di(), n, E, k, 0.01, on_gpu.score);
      compare_scalar("aux_loss_forward", DType::f32, ag, ac);
      cpu_be().aux_loss_backward(idx.hi(), probs.hf(), dex.hf(), n, E, k, 0.01, on_cpu.score);
      cuda_be().aux_loss_backward(idx.di(), probs.df(), dex.df(), n, E, k, 0.01, on_gpu.score);
      compare("aux_loss_backward", DType::f32, shape, {{"dprobs (fp32 +=)", &dex}});
      // z-loss: the gradient adds into dlogits (small values, so the sum shows it).
      const double zc = cpu_be().z_loss_forward(logits.h(), n, E, 1.0);
      const double zg = cuda_be().z_loss_forward(logits.d(), n, E, 1.0);
      compare_scalar("z_loss_forward", t, zg, zc);
      Both dz(t, random_vec(sz(n * E), 253, 1e-3), "dz");
      cpu_be().z_loss_backward(logits.h(), dz.h(), n, E, 1.0);
      cuda_be().z_loss_backward(logits.d(), dz.d(), n, E, 1.0);
      compare("z_loss_backward", t, shape, {{"dlogits +=", &dz}});
      // Spike injection, in place on the logits.
      ops::RouterSkew skew;
      skew.groups = 2;
      skew.ratio = 1.5;
      cpu_be().skew_router_logits(logits.h(), n, E, k, skew);
      cuda_be().skew_router_logits(logits.d(), n, E, k, skew);
      compare("skew_router_logits", t, shape, {{"logits", &logits}});
    }
  }
}

TEST(CudaBackend, MoeDispatchAndGroupedGemmMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  const std::int64_t n = 61, E = 8, k = 2, d = 40, out_dim = 24;
  const std::vector<std::int32_t> routing = skewed_routing(n, E, k, 5);
  for (double cf : {-1.0, 1.0}) {
    const std::int64_t cap = ops::expert_capacity(cf, n, E, k);
    Both idx(DType::i32, n * k, "topk_idx"), counts(DType::i32, E, "counts"), offsets(DType::i32, E + 1, "offsets");
    Both slot(DType::i32, n * k, "slot_of");
    idx.set(Vec(routing.begin(), routing.end()));
    std::vector<std::int32_t> host_offsets_cpu(sz(E + 1)), host_offsets_gpu(sz(E + 1), -5);
    const std::int64_t dc = cpu_be().moe_plan_dispatch(idx.hi(), n, E, k, cap, counts.hi(), offsets.hi(), slot.hi(),
                                                       host_offsets_cpu.data());
    const std::int64_t dg = cuda_be().moe_plan_dispatch(idx.di(), n, E, k, cap, counts.di(), offsets.di(), slot.di(),
                                                        host_offsets_gpu.data());
    EXPECT_EQ(dg, dc);
    EXPECT_EQ(counts.dev_ints(), counts.host_ints());
    EXPECT_EQ(offsets.dev_ints(), offsets.host_ints());
    EXPECT_EQ(slot.dev_ints(), slot.host_ints());
    ASSERT_EQ(host_offsets_gpu, host_offsets_cpu);
    const std::int64_t rows = host_offsets_cpu.back();
    for (DType t : kDtypes) {
      const std::string shape = shape_str({{"n", n}, {"E", E}, {"k", k}, {"d", d}, {"rows", rows}});
      Both x(t, random_vec(sz(n * d), 260), "x"), xp(t, rows * d, "xp"), dx(t, n * d, "dx");
      Both w(DType::f32, random_vec(sz(n * k), 261), "topk_w"), y(t, n * d, "y"), dy(t, random_vec(sz(n * d), 262), "dy");
      Both dyp(t, random_vec(sz(rows * d), 263), "dyp"), dtw(DType::f32, n * k, "dtopk_w");
      for (Both* b : {&xp, &dx, &y, &dtw}) b->fill_nan();
      cpu_be().permute_forward(x.h(), slot.hi(), xp.h(), n, k, d);
      cuda_be().permute_forward(x.d(), slot.di(), xp.d(), n, k, d);
      cpu_be().permute_backward(xp.h(), slot.hi(), dx.h(), n, k, d);
      cuda_be().permute_backward(xp.d(), slot.di(), dx.d(), n, k, d);
      compare("permute", t, shape, {{"xp", &xp}, {"dx", &dx}});
      // The permuted rows through the grouped expert GEMM and back.
      Both ew(t, random_vec(sz(E * out_dim * d), 264), "expert_w"), yp(t, rows * out_dim, "yp");
      Both dyp2(t, random_vec(sz(rows * out_dim), 265), "dyp2"), dxp(t, rows * d, "dxp");
      Both dew(DType::f32, random_vec(sz(E * out_dim * d), 266), "dexpert_w");
      yp.fill_nan();
      dxp.fill_nan();
      const std::string gshape = shape_str({{"E", E}, {"rows", rows}, {"in", d}, {"out", out_dim}});
      cpu_be().grouped_linear_forward(xp.h(), ew.h(), yp.h(), host_offsets_cpu.data(), E, d, out_dim);
      cuda_be().grouped_linear_forward(xp.d(), ew.d(), yp.d(), host_offsets_cpu.data(), E, d, out_dim);
      compare("grouped_linear_forward", t, gshape, {{"y", &yp}});
      cpu_be().grouped_linear_backward(dyp2.h(), xp.h(), ew.h(), dxp.h(), dew.hf(), host_offsets_cpu.data(), E, d,
                                       out_dim);
      cuda_be().grouped_linear_backward(dyp2.d(), xp.d(), ew.d(), dxp.d(), dew.df(), host_offsets_cpu.data(), E, d,
                                        out_dim);
      compare("grouped_linear_backward", t, gshape, {{"dx", &dxp}, {"dw (fp32 +=)", &dew}});
      // Combine: unpermute of xp (d columns) with the top-k weights.
      cpu_be().unpermute_forward(xp.h(), slot.hi(), w.hf(), y.h(), n, k, d);
      cuda_be().unpermute_forward(xp.d(), slot.di(), w.df(), y.d(), n, k, d);
      cpu_be().unpermute_backward(dy.h(), xp.h(), slot.hi(), w.hf(), dyp.h(), dtw.hf(), n, k, d);
      cuda_be().unpermute_backward(dy.d(), xp.d(), slot.di(), w.df(), dyp.d(), dtw.df(), n, k, d);
      compare("unpermute", t, shape, {{"y", &y}, {"dyp", &dyp}, {"dtopk_w (fp32)", &dtw}});
      // The same top-k gradient window by window (the backward's expert chunks when
      // the combine's input was dropped): equal bits to the whole op's on each side.
      Both dtw_win(DType::f32, Vec(sz(n * k), 0.0), "dtopk_w (windows)");
      cpu_be().unpermute_backward(dy.h(), CView(), slot.hi(), w.hf(), dyp.h(), nullptr, n, k, d);
      cuda_be().unpermute_backward(dy.d(), CView(), slot.di(), w.df(), dyp.d(), nullptr, n, k, d);
      for (std::int64_t r0 = 0; r0 < rows; r0 += 7) {
        const std::int64_t win = std::min<std::int64_t>(7, rows - r0);
        cpu_be().combine_topk_grad(dy.h(), xp.h() + r0 * d, slot.hi(), dtw_win.hf(), n, k, d, r0, win);
        cuda_be().combine_topk_grad(dy.d(), xp.d() + r0 * d, slot.di(), dtw_win.df(), n, k, d, r0, win);
      }
      compare("combine_topk_grad", t, shape, {{"dtopk_w (fp32)", &dtw_win}});
      EXPECT_EQ(dtw_win.dev(), dtw.dev()) << "CUDA windows against the whole backward, " << to_string(t);
      for (std::int64_t i = 0; i < n * k; ++i) {
        if (slot.host_ints()[sz(i)] < 0) {
          EXPECT_EQ(dtw_win.host()[sz(i)], 0.0) << "a dropped slot is untouched";
        }
      }
      EXPECT_EQ(dtw_win.host(), dtw.host()) << "CPU windows against the whole backward, " << to_string(t);
    }
  }
}

TEST(CudaBackend, OptimizerOpsMatchTheCpuBackend) {
  MOEFLEX_REQUIRE_GPU();
  const std::int64_t n = 10007;  // not a multiple of the 4096 chunk
  Both g(DType::f32, random_vec(sz(n), 270), "g"), w(DType::f32, random_vec(sz(n), 271), "w");
  Both m(DType::f32, random_vec(sz(n), 272, 0.1), "m"), v(DType::f32, random_vec(sz(n), 273, 0.01), "v");
  Vec vv = v.host();  // the second moment is >= 0
  for (double& x : vv) x = x * x;
  v.set(vv);
  compare_scalar("square_sum", DType::f32, cuda_be().square_sum(g.df(), n), cpu_be().square_sum(g.hf(), n));
  cpu_be().scale(g.hf(), n, 0.37f);
  cuda_be().scale(g.df(), n, 0.37f);
  cpu_be().adamw(w.hf(), g.hf(), m.hf(), v.hf(), n, 0.9f, 0.95f, 1e-8f, 0.999f, 1e-3f, 1.2f);
  cuda_be().adamw(w.df(), g.df(), m.df(), v.df(), n, 0.9f, 0.95f, 1e-8f, 0.999f, 1e-3f, 1.2f);
  compare("optimizer", DType::f32, shape_str({{"n", n}}), {{"g (scaled)", &g}, {"w", &w}, {"m", &m}, {"v", &v}});
}

TEST(CudaBackend, MixedDtypesAreErrorsNamingTheOpAndDtypes) {
  MOEFLEX_REQUIRE_GPU();
  // The views of one call share one dtype (ops/backend.h), on both backends.
  Both x16(DType::bf16, Vec(64, 0.5), "x16"), x32(DType::f32, Vec(64, 0.5), "x32"), y16(DType::bf16, 64, "y16");
  Both y32(DType::f32, 64, "y32");
  try {
    cuda_be().linear_forward(x16.d(), x32.d(), y16.d(), 8, 8, 8);
    ADD_FAILURE() << "linear_forward with a bf16 input and an f32 weight did not throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("linear_forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("x bf16, w f32, y bf16"), std::string::npos) << msg;
  }
  EXPECT_THROW(cpu_be().linear_forward(x16.h(), x32.h(), y16.h(), 8, 8, 8), Error);
  EXPECT_THROW(cuda_be().linear_forward(x16.d(), x16.d(), y32.d(), 8, 8, 8), Error);  // fp32 output
  EXPECT_THROW(cuda_be().gemm(false, false, 8, 8, 8, 1.0f, x16.d(), 8, x16.d(), 8, 0.0f, y32.d(), 8), Error);
  EXPECT_THROW(cuda_be().rmsnorm_forward(x32.d(), x16.d(), y16.d(), y32.df(), 8, 8, 1e-6f), Error);
  EXPECT_THROW(cuda_be().swiglu_forward(x16.d(), x32.d(), y16.d(), 64), Error);
  EXPECT_THROW(cuda_be().add_inplace(y32.d(), x16.d(), 64), Error);
  EXPECT_THROW(cuda_be().embedding_forward(std::vector<std::int32_t>(2, 1).data(), x32.d(), y16.d(), 2, 8), Error);
  const std::vector<std::int32_t> targets(4, 1);
  EXPECT_THROW(cuda_be().cross_entropy_forward(x16.d(), targets.data(), y32.d(), y32.df(), 4, 16), Error);
  EXPECT_THROW(cuda_be().z_loss_backward(x16.d(), y32.d(), 4, 16, 1.0), Error);
  // Attention's probs buffer too: it shares q's dtype.
  EXPECT_THROW(cuda_be().attention_forward(x16.d(), x16.d(), x16.d(), y16.d(), y32.d(), 1, 2, 1, 1, 16), Error);
  // Integer views are not activations.
  Both ints(DType::i32, 64, "ints");
  EXPECT_THROW(cuda_be().swiglu_forward(ints.d(), ints.d(), ints.d(), 64), Error);
  EXPECT_THROW(cuda_be().cast(ints.d(), y16.d(), 64), Error);
}

}  // namespace
}  // namespace moeflex::test
