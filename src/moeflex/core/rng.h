// Deterministic counter-based random numbers: the same (seed, stream, index)
// always gives the same value, whatever the thread count or call order.
#pragma once
#include <cmath>
#include <cstdint>

namespace moeflex {

/// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Uniform in [0, 1) from (seed, stream, index).
inline double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  std::uint64_t h = mix64(seed ^ mix64(stream * 0x632BE59BD9B4E019ull + mix64(index)));
  return double(h >> 11) * (1.0 / 9007199254740992.0);
}

/// Standard normal from (seed, stream, index) by Box-Muller.
inline double normal01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  double u1 = uniform01(seed, stream, 2 * index);
  double u2 = uniform01(seed, stream, 2 * index + 1);
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// A small sequential generator (for sampling and data order).
class Rng {
 public:
  explicit Rng(std::uint64_t seed, std::uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  double uniform() { return uniform01(seed_, stream_, counter_++); }
  std::uint64_t next_u64() { return mix64(seed_ ^ mix64(stream_ + 0x1234567ull) ^ mix64(counter_++)); }
  std::uint64_t counter() const { return counter_; }
  void set_counter(std::uint64_t c) { counter_ = c; }

 private:
  std::uint64_t seed_, stream_, counter_ = 0;
};

}  // namespace moeflex
