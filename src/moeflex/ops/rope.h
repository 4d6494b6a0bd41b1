// Rotary position embedding (Su et al. 2021), "rotate half" layout as in
// Hugging Face Llama: for i < hd/2, inv_freq_i = theta^(-2i/hd), angle = pos*inv_freq_i,
//   out[i]      = x[i] cos - x[i+hd/2] sin
//   out[i+hd/2] = x[i+hd/2] cos + x[i] sin
// x: [batch, seq, heads, hd] in place, pos = sequence index (0-based).
// backward applies the inverse rotation to the gradient in place (=).
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void rope_forward(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta);

template <typename T>
void rope_backward(T* dx, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd,
                   double theta);

}  // namespace moeflex::ops
