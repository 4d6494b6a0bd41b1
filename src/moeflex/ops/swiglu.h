// SwiGLU gating (Shazeer 2020): out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
//   gate, up, out: [n] elements (any shape flattened). backward: dgate, dup (=).
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, std::int64_t n);

template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, std::int64_t n);

}  // namespace moeflex::ops
