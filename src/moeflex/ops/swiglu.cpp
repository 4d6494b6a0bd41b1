// SwiGLU gating (Shazeer 2020): out = silu(gate) * up, silu(x) = x * sigmoid(x).
//   gate, up, out, dout, dgate, dup: [n] elements (any shape flattened).
//   forward:  out (=).
//   backward: dup (=) = dout * silu(gate);
//             dgate (=) = dout * up * s * (1 + gate * (1 - s)), s = sigmoid(gate).
// sigmoid is recomputed in the backward rather than saved: one exp per element is
// cheaper than another [n] activation. The float exp is detail::exp_f32, so these
// loops vectorise.
#include "moeflex/ops/swiglu.h"

#include "moeflex/ops/vec_math.h"

namespace moeflex::ops {
namespace {

/// Elements below which a parallel region costs more than it saves.
constexpr std::int64_t kParallelMinElements = 1 << 15;

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + detail::vexp(-x));
}

}  // namespace

template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (std::int64_t i = 0; i < n; ++i) out[i] = (gate[i] * sigmoid(gate[i])) * up[i];
}

template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (std::int64_t i = 0; i < n; ++i) {
    const T g = gate[i], s = sigmoid(g), dy = dout[i];
    dgate[i] = (dy * up[i]) * (s * (T(1) + g * (T(1) - s)));
    dup[i] = dy * (g * s);
  }
}

template void swiglu_forward<float>(const float*, const float*, float*, std::int64_t);
template void swiglu_forward<double>(const double*, const double*, double*, std::int64_t);
template void swiglu_backward<float>(const float*, const float*, const float*, float*, float*, std::int64_t);
template void swiglu_backward<double>(const double*, const double*, const double*, double*, double*, std::int64_t);

}  // namespace moeflex::ops
