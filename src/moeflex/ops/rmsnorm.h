// RMSNorm (Zhang & Sennrich 2019): y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
//   x, y, dx, dy: [n, d]; w, dw: [d]; rstd: [n] (saved by forward for backward).
//   backward: dx (=), dw (+=, rows summed in a fixed order).
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, std::int64_t n, std::int64_t d, T eps);

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, std::int64_t n,
                      std::int64_t d);

}  // namespace moeflex::ops
