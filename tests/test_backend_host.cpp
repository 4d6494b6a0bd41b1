// The CUDA backend's host-side pieces, tested without a GPU (built in every
// configuration): the bf16 round-to-nearest-even conversions against an independent
// nearest-value search, the BlockAllocator that DeviceArena and the pinned pool
// share against a brute-force model of best fit, and the row-major -> cuBLAS
// column-major GEMM mapping and grouped-GEMM argument building, executed by a naive
// column-major GEMM and compared with the CPU reference ops.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/core/bf16.h"
#include "moeflex/core/block_allocator.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cuda/gemm_layout.h"
#include "moeflex/ops/grouped_linear.h"
#include "op_harness.h"

namespace moeflex::test {
namespace {

using ops::cuda::ColumnMajorGemm;
using ops::cuda::GroupedPass;
using ops::cuda::RowMajorGemm;

// ---------------------------------------------------------------------------------
// bf16

/// The value of bf16 bits as a double, extending the exponent past the largest
/// finite bf16 (so bits 0x7f80 read as 2^128: the next value up from 0x7f7f).
double bf16_value_extended(std::uint16_t bits) {
  const int sign = bits >> 15, e = (bits >> 7) & 0xff, m = bits & 0x7f;
  const double mag = e == 0 ? std::ldexp(double(m), -133) : std::ldexp(1.0 + m / 128.0, e - 127);
  return sign ? -mag : mag;
}

/// Nearest bf16 to a finite float by comparing the two neighbours in double (exact
/// for these values); ties go to the even mantissa. Independent of the bit trick.
std::uint16_t nearest_bf16_reference(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);  // truncation: toward zero
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);   // next away from zero
  const double x = f, dlo = std::abs(x - bf16_value_extended(lo)), dhi = std::abs(bf16_value_extended(hi) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

TEST(Bf16, EveryBf16RoundTripsExactlyThroughFloat) {
  int nans = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) {
      ++nans;
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f)))) << b;
      continue;
    }
    ASSERT_EQ(float_to_bf16_bits(f), b) << "bits " << b;
  }
  EXPECT_EQ(nans, 2 * 127);  // exponent 0xff with a non-zero 7-bit mantissa, both signs
}

TEST(Bf16, RoundsToNearestEvenLikeAnIndependentSearch) {
  // Ties: 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd): goes down;
  // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bf16_bits(-(1.0f + 3 * std::ldexp(1.0f, -8))), 0xbf82);
  // Just above a tie rounds up even from an even neighbour.
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  // Overflow: the largest float rounds to infinity, the largest bf16 stays.
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x7f7f0000u)), 0x7f7f);
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  // Signed zero and the smallest subnormals.
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x00008000u)), 0x0000);  // tie to even 0
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002);  // tie to even 2
  // NaN keeps its sign and stays NaN.
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::quiet_NaN()) & 0x8000, 0x8000);

  std::mt19937 gen(7);
  int checked = 0;
  for (int i = 0; i < 400000; ++i) {
    const std::uint32_t u = gen();
    const float f = std::bit_cast<float>(u);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(float_to_bf16_bits(f), nearest_bf16_reference(f)) << "float bits 0x" << std::hex << u;
    ++checked;
  }
  // Exact ties, which random bits almost never hit: low 16 bits 0x8000.
  for (int i = 0; i < 20000; ++i) {
    const std::uint32_t u = (gen() & 0xffff0000u) | 0x8000u;
    const float f = std::bit_cast<float>(u);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(float_to_bf16_bits(f), nearest_bf16_reference(f)) << "tie bits 0x" << std::hex << u;
  }
  EXPECT_GT(checked, 390000);
}

TEST(Bf16, RelativeRoundingErrorIsAtMostHalfAnUlp) {
  // bf16 keeps 8 significant bits, so |bf16(x) - x| <= 2^-8 |x| for normal x (unit
  // roundoff); a norm-wise error of a few of these is what the harness's 1e-2 allows.
  const auto v = random_vec(10000, 5, 100.0);
  const auto b = to_double(to_bf16(v));
  double worst = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double x = static_cast<float>(v[i]);
    worst = std::max(worst, std::abs(b[i] - x) / std::abs(x));
  }
  EXPECT_LE(worst, std::ldexp(1.0, -8));
  EXPECT_GT(worst, std::ldexp(1.0, -9));  // and the rounding really happened
}

// ---------------------------------------------------------------------------------
// BlockAllocator

TEST(BlockAllocator, BestFitSplitCoalesceAndFragmentationAtDeviceAlignment) {
  constexpr Bytes kA = 256;  // the device arena's alignment
  BlockAllocator a(kA * 100 + 17, kA);
  EXPECT_EQ(a.capacity(), kA * 100);  // rounded down to the alignment
  const Bytes p1 = a.allocate(kA * 10, MemCategory::weights, "p1");
  const Bytes p2 = a.allocate(kA * 5 - 3, MemCategory::activations, "p2");  // rounds up to 5 blocks
  const Bytes p3 = a.allocate(kA * 20, MemCategory::activations, "p3");
  const Bytes p4 = a.allocate(1, MemCategory::grads, "p4");  // one block
  EXPECT_EQ(p1, 0);
  EXPECT_EQ(p2, kA * 10);
  EXPECT_EQ(p3, kA * 15);
  EXPECT_EQ(p4, kA * 35);
  EXPECT_EQ(a.stats().stat(MemCategory::activations).current, kA * 25);
  EXPECT_EQ(a.stats().stat(MemCategory::grads).current, kA);
  EXPECT_EQ(a.in_use(), kA * 36);
  a.deallocate(p1, kA * 10, MemCategory::weights);
  a.deallocate(p3, kA * 20, MemCategory::activations);
  // Holes: 10 at 0, 20 at 15, 64 at 36. A request of 8 takes the 10-hole (best fit).
  const Bytes q = a.allocate(kA * 8, MemCategory::activations, "q");
  EXPECT_EQ(q, 0);
  // A request of 15 takes the 20-hole, not the larger tail.
  const Bytes r = a.allocate(kA * 15, MemCategory::activations, "r");
  EXPECT_EQ(r, kA * 15);
  // Fragmentation at the worst moment: after q, the highest used block (p4) ended at
  // 36 blocks with 14 in use.
  EXPECT_EQ(a.fragmentation_peak(), kA * (36 - 14));
  EXPECT_EQ(a.stats().stat(MemCategory::activations).peak, kA * 28);
  EXPECT_EQ(a.stats().stat(MemCategory::activations).allocated, kA * 48);
  EXPECT_EQ(a.stats().stat(MemCategory::activations).freed, kA * 20);
  for (auto [off, size, cat] : {std::tuple{q, kA * 8, MemCategory::activations},
                                std::tuple{p2, kA * 5 - 3, MemCategory::activations},
                                std::tuple{r, kA * 15, MemCategory::activations},
                                std::tuple{p4, Bytes(1), MemCategory::grads}})
    a.deallocate(off, size, cat);
  EXPECT_EQ(a.in_use(), 0);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), kA * 100);
}

TEST(BlockAllocator, WorkspaceComesFromTheTopEndOfTheHighestFreeBlockThatFits) {
  constexpr Bytes kA = 256;
  BlockAllocator a(kA * 100, kA);
  const Bytes w = a.allocate(kA * 10, MemCategory::weights, "w");
  const Bytes ws1 = a.allocate(kA * 5, MemCategory::workspace, "ws1");
  const Bytes act = a.allocate(kA * 20, MemCategory::activations, "act");
  EXPECT_EQ(w, 0);
  EXPECT_EQ(ws1, kA * 95);  // the top of the region
  EXPECT_EQ(act, kA * 10);  // long-lived blocks keep growing from below
  a.deallocate(w, kA * 10, MemCategory::weights);
  // Free: [0, 10) and [30, 95). Workspace takes the top end of the higher one...
  EXPECT_EQ(a.allocate(kA * 4, MemCategory::workspace, "ws2"), kA * 91);
  // ...and the next one again takes the top end of the highest block that fits, [30, 91).
  EXPECT_EQ(a.allocate(kA * 12, MemCategory::workspace, "ws3"), kA * 79);
  // Best fit for the others: a 9-block request takes the 10-block hole at 0.
  EXPECT_EQ(a.allocate(kA * 9, MemCategory::activations, "act2"), 0);
  // Fragmentation peaked when ws1 sat at the top with 15 blocks in use.
  EXPECT_EQ(a.fragmentation_peak(), kA * (100 - 15));
}


TEST(BlockAllocator, OutOfMemoryNamesTheNumbersAndInvalidFreesAreRefused) {
  BlockAllocator a(1024 * 8, 1024);
  std::vector<Bytes> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(1024, MemCategory::activations, "blk"));
  for (int i = 0; i < 8; i += 2) a.deallocate(blocks[std::size_t(i)], 1024, MemCategory::activations);
  try {
    a.allocate(2048, MemCategory::activations, "experts.fc1_out");
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested, 2048);
    EXPECT_EQ(e.free, 4096);
    EXPECT_EQ(e.largest_free_block, 1024);
    EXPECT_EQ(e.budget, 8192);
    EXPECT_EQ(e.op, "experts.fc1_out");
    EXPECT_NE(std::string(e.what()).find("experts.fc1_out"), std::string::npos);
  }
  EXPECT_EQ(a.in_use(), 4096);  // the failed request changed nothing
  EXPECT_THROW(a.deallocate(blocks[0], 1024, MemCategory::activations), Error);  // already free
  EXPECT_THROW(a.deallocate(blocks[1], 2048, MemCategory::activations), Error);  // wrong size
  EXPECT_THROW(a.deallocate(512, 1024, MemCategory::activations), Error);        // not a block
  EXPECT_EQ(a.in_use(), 4096);
  EXPECT_THROW(BlockAllocator(100, 256), ConfigError);  // not one block
  EXPECT_THROW(BlockAllocator(4096, 48), ConfigError);  // alignment not a power of two
}

TEST(BlockAllocator, RandomTraceMatchesABruteForceBestFitModel) {
  constexpr Bytes kA = 64, kCap = kA * 512;
  BlockAllocator a(kCap, kA);
  std::map<Bytes, Bytes> live;  // offset -> rounded size, the model's view
  std::mt19937 gen(11);
  int served = 0, refused = 0;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || gen() % 100 < 55) {
      const Bytes bytes = 1 + Bytes(gen() % (kA * 40));
      const Bytes size = (bytes + kA - 1) / kA * kA;
      // Model: the gaps between live blocks; the smallest that fits, lowest offset first.
      Bytes best_off = -1, best_size = std::numeric_limits<Bytes>::max(), cursor = 0, free_total = 0;
      auto consider = [&](Bytes off, Bytes gap) {
        free_total += gap;
        if (gap >= size && gap < best_size) best_off = off, best_size = gap;
      };
      for (auto [off, sz] : live) {
        if (off > cursor) consider(cursor, off - cursor);
        cursor = off + sz;
      }
      if (cursor < kCap) consider(cursor, kCap - cursor);
      if (best_off < 0) {
        EXPECT_THROW(a.allocate(bytes, MemCategory::activations, "x"), OutOfMemoryError);
        ++refused;
      } else {
        ASSERT_EQ(a.allocate(bytes, MemCategory::activations, "x"), best_off) << "step " << step;
        live[best_off] = size;
        ++served;
      }
      EXPECT_EQ(a.capacity() - a.in_use(), free_total - (best_off < 0 ? 0 : size));
    } else {
      auto it = live.begin();
      std::advance(it, gen() % live.size());
      a.deallocate(it->first, it->second, MemCategory::activations);
      live.erase(it);
    }
    Bytes sum = 0;
    for (auto [off, sz] : live) sum += sz;
    ASSERT_EQ(a.in_use(), sum);
  }
  EXPECT_GT(served, 1000);
  EXPECT_GT(refused, 10);  // the trace really ran into a full region
  for (auto [off, sz] : live) a.deallocate(off, sz, MemCategory::activations);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.stats().stat(MemCategory::activations).allocated, a.stats().stat(MemCategory::activations).freed);
}

// ---------------------------------------------------------------------------------
// GEMM layout and grouped-GEMM arguments

/// Naive column-major C = alpha op(F) op(S) + beta C, the way cuBLAS reads its
/// arguments: F is m x k after op, S is k x n after op, C is m x n with ldc.
void column_major_gemm(const ColumnMajorGemm& g, double alpha, const double* F, const double* S, double beta,
                       double* C) {
  for (std::int64_t j = 0; j < g.n; ++j) {
    for (std::int64_t i = 0; i < g.m; ++i) {
      double s = 0;
      for (std::int64_t p = 0; p < g.k; ++p) {
        const double f = g.trans_first ? F[p + i * g.ld_first] : F[i + p * g.ld_first];
        const double t = g.trans_second ? S[j + p * g.ld_second] : S[p + j * g.ld_second];
        s += f * t;
      }
      C[i + j * g.ldc] = alpha * s + (beta == 0 ? 0.0 : beta * C[i + j * g.ldc]);
    }
  }
}

/// Runs a row-major GEMM the way the CUDA backend hands it to cuBLAS.
void run_as_cublas(const RowMajorGemm& g, double alpha, const double* A, const double* B, double* C) {
  column_major_gemm(ops::cuda::to_column_major(g), alpha, B + g.b_offset, A + g.a_offset, g.beta,
                    C + g.c_offset);
}

TEST(GemmLayout, ColumnMajorCallComputesTheRowMajorProductForEveryTransposeAndStride) {
  const std::int64_t M = 5, N = 7, K = 4;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      RowMajorGemm g;
      g.trans_a = ta, g.trans_b = tb, g.M = M, g.N = N, g.K = K;
      g.lda = (ta ? M : K) + 3, g.ldb = (tb ? K : N) + 2, g.ldc = N + 1;
      g.beta = 0.5f;
      const auto A = random_vec(std::size_t((ta ? K : M) * g.lda), 1);
      const auto B = random_vec(std::size_t((tb ? N : K) * g.ldb), 2);
      auto C = random_vec(std::size_t(M * g.ldc), 3), ref = C;
      run_as_cublas(g, 1.5, A.data(), B.data(), C.data());
      ops::gemm<double>(ta, tb, M, N, K, 1.5, A.data(), g.lda, B.data(), g.ldb, 0.5, ref.data(), g.ldc);
      EXPECT_LT(rel_err(C, ref), 1e-14) << "ta=" << ta << " tb=" << tb;
      // The padding column of C is untouched.
      const auto C0 = random_vec(std::size_t(M * g.ldc), 3);
      for (std::int64_t i = 0; i < M; ++i) EXPECT_EQ(C[std::size_t(i * g.ldc + N)], C0[std::size_t(i * g.ldc + N)]);
    }
  }
}

TEST(GemmLayout, GroupedArgumentsReproduceTheCpuGroupedLinearWithEmptyAndSkewedExperts) {
  const std::int64_t E = 5, in = 6, out = 4;
  // Expert 0 empty, expert 2 takes most rows, expert 4 empty (last).
  const std::vector<std::int32_t> offsets = {0, 0, 2, 11, 12, 12};
  const std::int64_t rows = offsets.back();
  const auto x = random_vec(std::size_t(rows * in), 1), w = random_vec(std::size_t(E * out * in), 2);
  const auto dy = random_vec(std::size_t(rows * out), 3), dw0 = random_vec(std::size_t(E * out * in), 4);

  const auto fwd = ops::cuda::grouped_linear_gemms(GroupedPass::forward, offsets.data(), E, in, out);
  ASSERT_EQ(fwd.size(), 3u);  // experts 1, 2, 3
  EXPECT_EQ(fwd[0].group, 1);
  EXPECT_EQ(fwd[1].group, 2);
  EXPECT_EQ(fwd[1].M, 9);
  std::vector<double> y(std::size_t(rows * out), std::numeric_limits<double>::quiet_NaN()), y_ref(y.size());
  for (const auto& g : fwd) run_as_cublas(g, 1.0, x.data(), w.data(), y.data());
  ops::grouped_linear_forward<double>(x.data(), w.data(), y_ref.data(), offsets.data(), E, in, out);
  EXPECT_LT(rel_err(y, y_ref), 1e-14);

  std::vector<double> dx(std::size_t(rows * in), std::numeric_limits<double>::quiet_NaN()), dw = dw0;
  for (const auto& g : ops::cuda::grouped_linear_gemms(GroupedPass::backward_dx, offsets.data(), E, in, out))
    run_as_cublas(g, 1.0, dy.data(), w.data(), dx.data());
  const auto dw_gemms = ops::cuda::grouped_linear_gemms(GroupedPass::backward_dw, offsets.data(), E, in, out);
  for (const auto& g : dw_gemms) {
    EXPECT_EQ(g.beta, 1.0f);  // dw accumulates
    run_as_cublas(g, 1.0, dy.data(), x.data(), dw.data());
  }
  std::vector<double> dx_ref(dx.size()), dw_ref = dw0;
  ops::grouped_linear_backward<double>(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), offsets.data(),
                                       E, in, out);
  EXPECT_LT(rel_err(dx, dx_ref), 1e-14);
  EXPECT_LT(rel_err(dw, dw_ref), 1e-14);
  // Empty experts' dw is untouched (bit for bit), the others changed.
  for (std::int64_t i = 0; i < out * in; ++i) {
    EXPECT_EQ(dw[std::size_t(i)], dw0[std::size_t(i)]);
    EXPECT_EQ(dw[std::size_t(4 * out * in + i)], dw0[std::size_t(4 * out * in + i)]);
  }
  EXPECT_NE(dw[std::size_t(2 * out * in)], dw0[std::size_t(2 * out * in)]);
}

TEST(GemmLayout, GroupedArgumentsRefuseBadOffsets) {
  const std::vector<std::int32_t> decreasing = {0, 4, 3};
  EXPECT_THROW(ops::cuda::grouped_linear_gemms(GroupedPass::forward, decreasing.data(), 2, 8, 8), Error);
  const std::vector<std::int32_t> not_from_zero = {1, 4, 5};
  EXPECT_THROW(ops::cuda::grouped_linear_gemms(GroupedPass::forward, not_from_zero.data(), 2, 8, 8), Error);
  const std::vector<std::int32_t> all_empty = {0, 0, 0};
  EXPECT_TRUE(ops::cuda::grouped_linear_gemms(GroupedPass::backward_dw, all_empty.data(), 2, 8, 8).empty());
}

}  // namespace
}  // namespace moeflex::test
