// Rotary position embedding (Su et al. 2021), "rotate half" layout as in
// Hugging Face Llama: for i < hd/2, inv_freq_i = theta^(-2i/hd), angle = pos*inv_freq_i,
//   out[i]      = x[i] cos - x[i+hd/2] sin
//   out[i+hd/2] = x[i+hd/2] cos + x[i] sin
// x, dx: [batch, seq, heads, hd], rotated in place, pos = sequence index (0-based).
//   forward: x = R(pos) x (=, in place).
//   backward: dx = R(pos)^T dx (=, in place): the same rotation with sin negated,
//            since R is orthogonal.
// The angles and their cos/sin are computed in double and rounded once to T, so the
// float tables are the correctly rounded values of the formula.
#include "moeflex/ops/rope.h"

#include <cmath>
#include <string>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex::ops {
namespace {

/// cos and sin tables [seq, hd/2].
template <typename T>
void rope_tables(std::int64_t seq, std::int64_t half, double theta, std::vector<T>& cos_t, std::vector<T>& sin_t) {
  cos_t.resize(static_cast<std::size_t>(seq * half));
  sin_t.resize(static_cast<std::size_t>(seq * half));
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -double(2 * i) / double(2 * half));
  for (std::int64_t p = 0; p < seq; ++p) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = double(p) * inv_freq[i];
      cos_t[p * half + i] = static_cast<T>(std::cos(angle));
      sin_t[p * half + i] = static_cast<T>(std::sin(angle));
    }
  }
}

/// Rotates every head of every token by its position; sign = +1 forward, -1 backward.
template <typename T>
void rope_apply(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                T sign) {
  if (hd % 2 != 0) throw Error("rope: head_dim " + std::to_string(hd) + " must be even");
  const std::int64_t half = hd / 2;
  std::vector<T> cos_t, sin_t;
  rope_tables(seq, half, theta, cos_t, sin_t);
#pragma omp parallel for schedule(static)
  for (std::int64_t bs = 0; bs < batch * seq; ++bs) {
    const std::int64_t p = bs % seq;
    const T* c = cos_t.data() + p * half;
    const T* s = sin_t.data() + p * half;
    for (std::int64_t h = 0; h < heads; ++h) {
      T* lo = x + (bs * heads + h) * hd;
      T* hi = lo + half;
      for (std::int64_t i = 0; i < half; ++i) {
        const T a = lo[i], b = hi[i], si = sign * s[i];
        lo[i] = a * c[i] - b * si;
        hi[i] = b * c[i] + a * si;
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta) {
  rope_apply(x, batch, seq, heads, hd, theta, T(1));
}

template <typename T>
void rope_backward(T* dx, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd,
                   double theta) {
  rope_apply(dx, batch, seq, heads, hd, theta, T(-1));
}

template void rope_forward<float>(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);
template void rope_forward<double>(double*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);
template void rope_backward<float>(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);
template void rope_backward<double>(double*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);

}  // namespace moeflex::ops
