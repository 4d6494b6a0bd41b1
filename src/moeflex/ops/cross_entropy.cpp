// Softmax cross-entropy over a vocabulary, mean over tokens.
//   logits, probs, dlogits: [n, V]; targets: [n] in [0, V); losses: [n].
//   forward:  probs (=) = softmax(logits), may alias logits;
//             losses (=) = logsumexp(logits_i) - logits[i, t_i];
//             returns mean_i losses, summed in double in token order.
//   backward: dlogits (=) = (probs - onehot(t)) * scale, may alias probs.
// The loss is taken as log(sum) - (x_t - max) rather than -log(p_t), which keeps its
// precision when p_t underflows.
#include "moeflex/ops/cross_entropy.h"

#include <cmath>
#include <string>

#include "moeflex/core/error.h"
#include "moeflex/ops/vec_math.h"

namespace moeflex::ops {
namespace {

void check_targets(const std::int32_t* targets, std::int64_t n, std::int64_t V) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (targets[i] < 0 || targets[i] >= V) {
      throw DataError("cross_entropy: target " + std::to_string(targets[i]) + " at position " + std::to_string(i) +
                      " is outside [0, " + std::to_string(V) + ")");
    }
  }
}

}  // namespace

template <typename T>
double cross_entropy_forward(const T* logits, const std::int32_t* targets, T* probs, T* losses, std::int64_t n,
                             std::int64_t V) {
  check_targets(targets, n, V);
  // One row per iteration: max, then exp stored and summed, then normalise in place,
  // each pass over a row that stays in L2.
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* x = logits + i * V;
    T* p = probs + i * V;
    const T m = detail::lane_max(x, V);
    const T xt = x[targets[i]];  // read before p overwrites an aliased x
    const T sum = detail::lane_sum<T>(V, [&](std::int64_t j) {
      const T e = detail::vexp(x[j] - m);
      p[j] = e;
      return e;
    });
    const T inv = T(1) / sum;
    for (std::int64_t j = 0; j < V; ++j) p[j] *= inv;
    losses[i] = std::log(sum) - (xt - m);
  }
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) total += double(losses[i]);
  return n > 0 ? total / double(n) : 0.0;
}

template <typename T>
void cross_entropy_backward(const T* probs, const std::int32_t* targets, T* dlogits, std::int64_t n, std::int64_t V,
                            T scale) {
  check_targets(targets, n, V);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T* p = probs + i * V;
    T* g = dlogits + i * V;
    const std::int64_t t = targets[i];
    const T pt = p[t];  // read before g overwrites an aliased p
    for (std::int64_t j = 0; j < V; ++j) g[j] = p[j] * scale;
    g[t] = (pt - T(1)) * scale;
  }
}

template double cross_entropy_forward<float>(const float*, const std::int32_t*, float*, float*, std::int64_t,
                                             std::int64_t);
template double cross_entropy_forward<double>(const double*, const std::int32_t*, double*, double*, std::int64_t,
                                              std::int64_t);
template void cross_entropy_backward<float>(const float*, const std::int32_t*, float*, std::int64_t, std::int64_t,
                                            float);
template void cross_entropy_backward<double>(const double*, const std::int32_t*, double*, std::int64_t,
                                             std::int64_t, double);

}  // namespace moeflex::ops
