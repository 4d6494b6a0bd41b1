// bfloat16 on the host: the storage type of the CUDA backend's weights and
// activations, and the conversions the op harness uses to feed and read it.
//
// bf16 is the upper half of an IEEE float (1 sign, 8 exponent, 7 mantissa bits).
// float -> bf16 rounds to nearest, ties to even, as CUDA's __float2bfloat16_rn:
// finite values that round past the largest bf16 become infinity; NaN stays NaN
// (a quiet NaN with the input's sign). bf16 -> float is exact.
#pragma once
#include <bit>
#include <cstdint>
#include <vector>

namespace moeflex {

/// A bfloat16 value: 2 bytes, the same layout as CUDA's __nv_bfloat16, so device
/// buffers of either type are the same bytes.
struct bf16 {
  std::uint16_t bits;  // no initializer: trivial, so it can live in __shared__ and memcpy
};
static_assert(sizeof(bf16) == 2);

/// Round-to-nearest-even conversion of a float to bf16 bits.
constexpr std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN: keep the sign, set the quiet bit
    return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  // Adding 0x7fff plus the lowest kept bit rounds the dropped 16 bits to nearest,
  // ties to the even result; a carry into the exponent is the correct rounding up
  // (to the next binade, or to infinity past the largest finite value).
  const std::uint32_t lsb = (u >> 16) & 1u;
  return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
}

/// Exact conversion of bf16 bits to float.
constexpr float bf16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// bf16 nearest to `f` (ties to even).
constexpr bf16 to_bf16(float f) { return bf16{float_to_bf16_bits(f)}; }
/// The float value of `b` (exact).
constexpr float to_float(bf16 b) { return bf16_bits_to_float(b.bits); }

/// Element-wise to_bf16 of a vector of floats or doubles (doubles are first
/// rounded to float, as a device upload of float data would be).
template <typename T>
std::vector<bf16> to_bf16(const std::vector<T>& v) {
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(static_cast<float>(v[i]));
  return out;
}

/// Element-wise exact widening of bf16 values to double.
inline std::vector<double> to_double(const std::vector<bf16>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_float(v[i]);
  return out;
}

}  // namespace moeflex
