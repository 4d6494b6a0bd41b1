// Internal helpers for the CPU op kernels: an exp that the compiler can vectorise,
// and reductions whose summation order is written out in the source.
//
// Why not `#pragma omp simd reduction`: the compiler may then peel iterations for
// alignment, and the peel count depends on the buffer's address, so the same values
// at a different arena offset could sum to a different float. Here every reduction
// uses kLanes fixed partial sums (element j goes to lane j % kLanes) combined in a
// fixed order, so a result depends only on the values, not on the address, the
// vector width the compiler picks, or the thread count.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace moeflex::ops::detail {

/// Partial sums per reduction; 16 floats fill one AVX-512 register or two AVX2 ones.
inline constexpr int kLanes = 16;

/// exp for float without a libm call, so loops around it vectorise (glibc's vector
/// expf is only declared under -ffast-math). Cody-Waite reduction x = n ln2 + r,
/// |r| <= ln2/2, then the degree-7 Taylor polynomial (truncation < 1e-8 relative):
/// about 1-2 ulp. Overflows to +inf above 88.72 as expf does; below -87.34, where expf
/// returns a subnormal, returns 0 (subnormal arithmetic is slow and these
/// probabilities are below 1.2e-38 anyway).
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // few mantissa bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMin = -87.33654f;     // log(FLT_MIN)
  constexpr float kMax = 88.72283f;      // log(FLT_MAX)
  const float xc = std::min(std::max(x, kMin), kMax);
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // n is in [-126, 128]; 2^128 is not a float, so scale by two halves of n.
  const std::int32_t ni = static_cast<std::int32_t>(n);
  const std::int32_t n1 = ni >> 1, n2 = ni - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  float y = (p * s1) * s2;
  y = x < kMin ? 0.0f : y;
  y = x > kMax ? std::numeric_limits<float>::infinity() : y;
  return y;
}

/// exp in the op's precision: the vectorisable one for float; libm for double
/// (double is the reference precision of the tests, where accuracy beats speed).
template <typename T>
inline T vexp(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_f32(x);
  } else {
    return std::exp(x);
  }
}

/// sum_{j<n} term(j) in a fixed order: kLanes partial sums, then lanes 0..kLanes-1
/// added pairwise. `term` may have side effects (e.g. store exp(x_j)); it is called
/// once per j in increasing j.
template <typename T, typename F>
inline T lane_sum(std::int64_t n, F&& term) {
  T acc[kLanes] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += term(j + l);
  }
  const int rest = static_cast<int>(n - j);  // < kLanes
  for (int l = 0; l < rest; ++l) acc[l] += term(j + l);
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

/// max_{j<n} x[j] (n >= 1). Max is exact and order-independent, so this may use any
/// grouping; GCC does not vectorise a max over separate lanes (it keeps 16 scalar
/// maxss), hence the explicit 64-byte vector type, which the compiler lowers to
/// whatever the target has.
template <typename T>
inline T lane_max(const T* x, std::int64_t n) {
  typedef T Vec __attribute__((vector_size(64)));
  constexpr std::int64_t kWidth = 64 / sizeof(T);
  T m = x[0];
  std::int64_t j = 0;
  if (n >= kWidth) {
    Vec acc;
    std::memcpy(&acc, x, sizeof(Vec));
    for (j = kWidth; j + kWidth <= n; j += kWidth) {
      Vec v;
      std::memcpy(&v, x + j, sizeof(Vec));
      acc = v > acc ? v : acc;
    }
    for (int l = 0; l < kWidth; ++l) m = std::max(m, acc[l]);
  }
  const int rest = static_cast<int>(n - j);  // < kWidth
  for (int l = 0; l < rest; ++l) m = std::max(m, x[j + l]);
  return m;
}

}  // namespace moeflex::ops::detail
