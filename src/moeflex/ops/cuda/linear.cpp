#include "moeflex/ops/cuda/linear.h"

namespace moeflex::ops::cuda {

template <typename T>
void linear_forward(Cublas& blas, const T* x, const T* w, T* y, std::int64_t n, std::int64_t in, std::int64_t out) {
  gemm<T, T>(blas, false, true, n, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

template <typename T>
void linear_backward(Cublas& blas, const T* dy, const T* x, const T* w, T* dx, float* dw, std::int64_t n,
                     std::int64_t in, std::int64_t out, bool accumulate_dx) {
  if (dx != nullptr) gemm<T, T>(blas, false, false, n, in, out, 1.0f, dy, out, w, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  if (dw != nullptr) gemm<T, float>(blas, true, false, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

template void linear_forward<float>(Cublas&, const float*, const float*, float*, std::int64_t, std::int64_t,
                                    std::int64_t);
template void linear_forward<bf16>(Cublas&, const bf16*, const bf16*, bf16*, std::int64_t, std::int64_t,
                                   std::int64_t);
template void linear_backward<float>(Cublas&, const float*, const float*, const float*, float*, float*, std::int64_t,
                                     std::int64_t, std::int64_t, bool);
template void linear_backward<bf16>(Cublas&, const bf16*, const bf16*, const bf16*, bf16*, float*, std::int64_t,
                                    std::int64_t, std::int64_t, bool);

}  // namespace moeflex::ops::cuda
