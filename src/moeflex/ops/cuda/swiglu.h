// SwiGLU gating on the GPU (CPU reference: ops/swiglu.h): out = silu(gate) * up,
// silu(x) = x * sigmoid(x).
//   gate, up, out, dout, dgate, dup: [n] of T (float or bf16), any shape flattened.
//   forward: out (=).  backward: dgate (=) = dout * up * s * (1 + gate * (1 - s)),
//   dup (=) = dout * silu(gate), with s = sigmoid(gate) recomputed (not saved).
// Float arithmetic with expf (not the fast __expf). Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// out (=) = silu(gate) * up over n elements.
template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, std::int64_t n, cudaStream_t stream);

/// dgate (=) and dup (=) from dout.
template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, std::int64_t n,
                     cudaStream_t stream);

}  // namespace moeflex::ops::cuda
