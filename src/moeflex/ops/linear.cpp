// Linear layer without bias, PyTorch weight layout.
//   forward:  y[n,out] = x[n,in] @ w[out,in]^T                       (y  =)
//   backward: dx[n,in] = dy[n,out] @ w            (= or += by flag)  (dx)
//             dw[out,in] += dy^T @ x                                 (dw +=)
// Each is one row-major GEMM; OpenBLAS threads it.
#include "moeflex/ops/linear.h"

#include "moeflex/ops/blas.h"

namespace moeflex::ops {

template <typename T>
void linear_forward(const T* x, const T* w, T* y, std::int64_t n, std::int64_t in, std::int64_t out) {
  gemm<T>(false, true, n, out, in, T(1), x, in, w, in, T(0), y, out);
}

template <typename T>
void linear_backward(const T* dy, const T* x, const T* w, T* dx, T* dw, std::int64_t n, std::int64_t in,
                     std::int64_t out, bool accumulate_dx) {
  if (dx != nullptr) gemm<T>(false, false, n, in, out, T(1), dy, out, w, in, accumulate_dx ? T(1) : T(0), dx, in);
  if (dw != nullptr) gemm<T>(true, false, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
}

template void linear_forward<float>(const float*, const float*, float*, std::int64_t, std::int64_t, std::int64_t);
template void linear_forward<double>(const double*, const double*, double*, std::int64_t, std::int64_t,
                                     std::int64_t);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                     std::int64_t, std::int64_t, bool);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*,
                                      std::int64_t, std::int64_t, std::int64_t, bool);

}  // namespace moeflex::ops
