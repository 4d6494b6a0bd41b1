// Softmax cross-entropy over a vocabulary, mean over tokens.
//   logits: [n, V]; targets: [n] in [0, V).
//   forward: probs[n,V] = softmax(logits) (probs may alias logits); losses[n] = -log probs[i, t_i];
//            returns the mean loss (summed in a fixed order).
//   backward: dlogits = (probs - onehot(t)) * scale (=; may alias probs). scale is usually 1/n_total.
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
double cross_entropy_forward(const T* logits, const std::int32_t* targets, T* probs, T* losses, std::int64_t n,
                             std::int64_t V);

template <typename T>
void cross_entropy_backward(const T* probs, const std::int32_t* targets, T* dlogits, std::int64_t n, std::int64_t V,
                            T scale);

}  // namespace moeflex::ops
