// The tensor-core flash attention kernels (src/moeflex/ops/cuda/attention_tc.cuh), run
// on the CPU through tests/wmma_emulation.h: forward and backward against the double
// CPU reference (ops/attention.h) on the same bf16 inputs, within the bf16 tolerance
// (1e-2, relative in norm), at head dims that are and are not multiples of 16, one
// and several 64-row blocks, multi-head and grouped-query (kv heads shared by 2 or 4
// query heads); and the exact results of a one-token sequence. On a GPU
// test_cuda_ops checks the same kernels on the tensor cores.
#define MOEFLEX_WMMA_EMULATION 1
#include "wmma_emulation.h"
// (the emulation first)
#include "moeflex/ops/cuda/attention_tc.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "moeflex/ops/attention.h"
#include "op_harness.h"

namespace moeflex {
namespace {

using test::random_vec;
using test::rel_err;
namespace tc = ops::cuda::tc;
using tc::bfr;

std::vector<bfr> to_bfr(const std::vector<double>& v) {
  std::vector<bfr> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = emu::float_to_bfr(static_cast<float>(v[i]));
  return out;
}
std::vector<double> widen(const std::vector<bfr>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = emu::bfr_to_float(v[i]);
  return out;
}

struct Result {
  std::vector<bfr> out, dq, dk, dv;
  std::vector<float> lse;
};

/// Runs the three kernels for one padded head dimension HDP.
template <int HDP>
Result run(const std::vector<bfr>& q, const std::vector<bfr>& k, const std::vector<bfr>& v,
           const std::vector<bfr>& dout, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, int hd) {
  const std::size_t N = q.size(), Nkv = k.size();
  Result r{std::vector<bfr>(N), std::vector<bfr>(N), std::vector<bfr>(Nkv), std::vector<bfr>(Nkv),
           std::vector<float>(static_cast<std::size_t>(B * H * S), NAN)};
  std::vector<float> D(static_cast<std::size_t>(B * H * S), NAN);
  const float scale = 1.0f / std::sqrt(float(hd));
  const auto gx = static_cast<unsigned>((S + tc::kRows - 1) / tc::kRows), gy = static_cast<unsigned>(B * H),
             gy_kv = static_cast<unsigned>(B * Hkv);  // dk/dv: one block per key tile of a kv head
  emu::launch(gx, gy, tc::kThreads, tc::tc_forward_smem(HDP), [&] {
    tc::tc_attention_forward<HDP>(q.data(), k.data(), v.data(), r.out.data(), r.lse.data(), S, H, Hkv, hd, scale);
  });
  emu::launch(gx, gy, tc::kThreads, tc::tc_dq_smem(HDP), [&] {
    tc::tc_attention_dq<HDP>(q.data(), k.data(), v.data(), dout.data(), r.lse.data(), D.data(), r.dq.data(), S, H,
                             Hkv, hd, scale);
  });
  emu::launch(gx, gy_kv, tc::kThreads, tc::tc_dkdv_smem(HDP), [&] {
    tc::tc_attention_dkdv<HDP>(q.data(), k.data(), v.data(), dout.data(), r.lse.data(), D.data(), r.dk.data(),
                               r.dv.data(), S, H, Hkv, hd, scale);
  });
  return r;
}

Result run_any(const std::vector<bfr>& q, const std::vector<bfr>& k, const std::vector<bfr>& v,
               const std::vector<bfr>& dout, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
               int hd) {
  switch (tc::instantiated_head_dim(hd)) {  // as attention.cu dispatches
    case 32: return run<32>(q, k, v, dout, B, S, H, Hkv, hd);
    case 48: return run<48>(q, k, v, dout, B, S, H, Hkv, hd);
    case 64: return run<64>(q, k, v, dout, B, S, H, Hkv, hd);
    case 96: return run<96>(q, k, v, dout, B, S, H, Hkv, hd);
    case 128: return run<128>(q, k, v, dout, B, S, H, Hkv, hd);
    default: ADD_FAILURE() << "no instantiation for hd " << hd; return {};
  }
}

void check(std::int64_t B, std::int64_t S, std::int64_t H, int hd, std::int64_t Hkv = 0) {
  if (Hkv == 0) Hkv = H;
  const std::string shape = "B=" + std::to_string(B) + " S=" + std::to_string(S) + " H=" + std::to_string(H) +
                            (Hkv != H ? "/" + std::to_string(Hkv) : "") + " hd=" + std::to_string(hd);
  const auto N = static_cast<std::size_t>(B * S * H * hd), Nkv = static_cast<std::size_t>(B * S * Hkv * hd);
  const auto q = to_bfr(random_vec(N, 300, 1.5)), k = to_bfr(random_vec(Nkv, 301, 1.5));
  const auto v = to_bfr(random_vec(Nkv, 302)), dout = to_bfr(random_vec(N, 303));
  const Result r = run_any(q, k, v, dout, B, S, H, Hkv, hd);
  // The reference: double, from the same (bf16) values.
  const auto qd = widen(q), kd = widen(k), vd = widen(v), dod = widen(dout);
  const auto P = static_cast<std::size_t>(B * H * S * S);
  std::vector<double> out(N), probs(P), dq(N), dk(Nkv), dv(Nkv), ws(P);
  ops::attention_forward<double>(qd.data(), kd.data(), vd.data(), out.data(), probs.data(), B, S, H, Hkv, hd);
  ops::attention_backward<double>(dod.data(), qd.data(), kd.data(), vd.data(), probs.data(), dq.data(), dk.data(),
                                  dv.data(), ws.data(), B, S, H, Hkv, hd);
  const double e_out = rel_err(widen(r.out), out), e_dq = rel_err(widen(r.dq), dq);
  const double e_dk = rel_err(widen(r.dk), dk), e_dv = rel_err(widen(r.dv), dv);
  std::printf("[ tc emu   ] %-22s out %.2e dq %.2e dk %.2e dv %.2e\n", shape.c_str(), e_out, e_dq, e_dk, e_dv);
  EXPECT_LT(e_out, 1e-2) << "out " << shape;
  EXPECT_LT(e_dq, 1e-2) << "dq " << shape;
  EXPECT_LT(e_dk, 1e-2) << "dk " << shape;
  EXPECT_LT(e_dv, 1e-2) << "dv " << shape;
  // lse against the reference's: log of the softmax denominator of the scaled scores.
  const double scale = 1.0 / std::sqrt(double(hd));
  double worst = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        double m = -INFINITY;
        std::vector<double> s(static_cast<std::size_t>(i + 1));
        for (std::int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int d = 0; d < hd; ++d)
            acc += qd[static_cast<std::size_t>(((b * S + i) * H + h) * hd + d)] *
                   kd[static_cast<std::size_t>(((b * S + j) * Hkv + h / (H / Hkv)) * hd + d)];
          s[static_cast<std::size_t>(j)] = acc * scale;
          m = std::max(m, acc * scale);
        }
        double z = 0;
        for (double x : s) z += std::exp(x - m);
        const double want = m + std::log(z);
        worst = std::max(worst, std::abs(r.lse[static_cast<std::size_t>((b * H + h) * S + i)] - want) /
                                    std::max(1.0, std::abs(want)));
      }
  EXPECT_LT(worst, 1e-5) << "lse " << shape;
}

TEST(AttentionTensorCore, MatchesTheReferenceInBf16) {
  check(1, 2, 2, 32);    // two keys: the softmax's dS cancels (dk was 1% off with D from the rounded out)
  check(2, 77, 3, 64);   // two 64-row blocks, a partial one
  check(1, 130, 2, 128);  // three blocks at the largest head dim
  check(2, 33, 2, 48);   // head dim 48
  check(1, 70, 1, 40);   // head dim not a multiple of 16 (padded to 48)
  check(2, 65, 1, 16);   // padded to 32; one row into the second block
  check(1, 64, 2, 80);   // padded to 96; exactly one block
}

TEST(AttentionTensorCore, GroupedQueryMatchesTheReferenceInBf16) {
  check(2, 77, 4, 64, 2);   // 2 query heads per kv head, two blocks, a partial one
  check(1, 130, 4, 32, 1);  // multi-query: all 4 share one kv head, three blocks
  check(1, 40, 6, 40, 2);   // groups of 3, head dim padded to 48
}

TEST(AttentionTensorCore, OneTokenIsExact) {
  // One key per row: P = 1, so out = v, dv = dout, and dq = dk = 0 bit for bit.
  const std::int64_t B = 1, S = 1, H = 2;
  const int hd = 32;
  const auto N = static_cast<std::size_t>(B * S * H * hd);
  const auto q = to_bfr(random_vec(N, 310, 1.5)), k = to_bfr(random_vec(N, 311, 1.5)), v = to_bfr(random_vec(N, 312));
  const auto dout = to_bfr(random_vec(N, 313));
  const Result r = run_any(q, k, v, dout, B, S, H, H, hd);
  for (std::size_t i = 0; i < N; ++i) {
    EXPECT_EQ(r.out[i].bits, v[i].bits) << "out " << i;
    EXPECT_EQ(r.dv[i].bits, dout[i].bits) << "dv " << i;
    EXPECT_EQ(emu::bfr_to_float(r.dq[i]), 0.0f) << "dq " << i;
    EXPECT_EQ(emu::bfr_to_float(r.dk[i]), 0.0f) << "dk " << i;
  }
}

}  // namespace
}  // namespace moeflex
