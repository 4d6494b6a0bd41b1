// Linear layer without bias, PyTorch weight layout.
//   forward:  y[n,out] = x[n,in] @ w[out,in]^T                       (y  =)
//   backward: dx[n,in] = dy[n,out] @ w            (= or += by flag)  (dx)
//             dw[out,in] += dy^T @ x                                 (dw +=)
// FLOPs: forward 2*n*in*out, backward 4*n*in*out.
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void linear_forward(const T* x, const T* w, T* y, std::int64_t n, std::int64_t in, std::int64_t out);

/// dx or dw may be null to skip them. accumulate_dx: dx += instead of dx =.
template <typename T>
void linear_backward(const T* dy, const T* x, const T* w, T* dx, T* dw, std::int64_t n, std::int64_t in,
                     std::int64_t out, bool accumulate_dx = false);

}  // namespace moeflex::ops
