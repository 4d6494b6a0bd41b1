// SwiGLU kernels (grid-stride, one element per thread step). Semantics: swiglu.h.
#include "moeflex/ops/cuda/swiglu.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                                      std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float g = to_f(gate[i]);
    out[i] = from_f<T>((g * sigmoid(g)) * to_f(up[i]));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                                       std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float g = to_f(gate[i]), s = sigmoid(g), dy = to_f(dout[i]);
    dgate[i] = from_f<T>((dy * to_f(up[i])) * (s * (1.0f + g * (1.0f - s))));
    dup[i] = from_f<T>(dy * (g * s));
  }
}

}  // namespace

template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  swiglu_forward_kernel<T><<<detail::grid_for(n, 256), 256, 0, stream>>>(gate, up, out, n);
  MOEFLEX_CHECK_LAUNCH("swiglu_forward");
}

template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, std::int64_t n,
                     cudaStream_t stream) {
  if (n <= 0) return;
  swiglu_backward_kernel<T><<<detail::grid_for(n, 256), 256, 0, stream>>>(dout, gate, up, dgate, dup, n);
  MOEFLEX_CHECK_LAUNCH("swiglu_backward");
}

template void swiglu_forward<float>(const float*, const float*, float*, std::int64_t, cudaStream_t);
template void swiglu_forward<bf16>(const bf16*, const bf16*, bf16*, std::int64_t, cudaStream_t);
template void swiglu_backward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                     cudaStream_t);
template void swiglu_backward<bf16>(const bf16*, const bf16*, const bf16*, bf16*, bf16*, std::int64_t,
                                    cudaStream_t);

}  // namespace moeflex::ops::cuda
