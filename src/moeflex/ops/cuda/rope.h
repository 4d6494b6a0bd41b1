// Rotary position embedding on the GPU (CPU reference: ops/rope.h), "rotate half"
// layout as in Hugging Face Llama: for i < hd/2, inv_freq_i = theta^(-2i/hd),
// angle = pos * inv_freq_i,
//   out[i]      = x[i] cos - x[i+hd/2] sin
//   out[i+hd/2] = x[i+hd/2] cos + x[i] sin
// x, dx: [batch, seq, heads, hd] of T (float or bf16), rotated in place; pos is the
// sequence index. forward: x = R x (=); backward: dx = R^T dx (=).
// The angle and its cos/sin are computed in double and rounded once to float, as
// the CPU reference does, so both use the same float tables. Device pointers; work is
// queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// x = R(pos) x in place. Throws Error when hd is odd.
template <typename T>
void rope_forward(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                  cudaStream_t stream);

/// dx = R(pos)^T dx in place (the inverse rotation). Throws Error when hd is odd.
template <typename T>
void rope_backward(T* dx, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                   cudaStream_t stream);

}  // namespace moeflex::ops::cuda
