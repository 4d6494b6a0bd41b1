// Cross-entropy kernels. Semantics: cross_entropy.h.
// forward: three passes over the row (max, sum of exponentials, normalised write),
// so a bf16 probability is rounded once from the fp32 value, and every read of an
// aliased row comes before the first write (block_sum's barrier separates them; in
// the last pass each thread reads and writes only its own elements).
#include "moeflex/ops/cuda/cross_entropy.h"

#include <cfloat>

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kThreads = 256;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % detail::kWarp, warp = threadIdx.x / detail::kWarp;
  const int warps = blockDim.x / detail::kWarp;
  v = detail::warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < warps ? scratch[lane] : -FLT_MAX;
  return detail::warp_max(t);
}

template <typename T>
__global__ void cross_entropy_forward_kernel(const T* logits, const std::int32_t* __restrict__ targets, T* probs,
                                             float* __restrict__ losses, std::int64_t V) {
  __shared__ float scratch[32];
  const std::int64_t i = blockIdx.x;
  const T* x = logits + i * V;
  T* p = probs + i * V;
  const float xt = to_f(x[targets[i]]);
  float m = -FLT_MAX;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f(x[j]));
  m = block_max(m, scratch);
  float s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f(x[j]) - m);
  s = detail::block_sum(s, scratch);
  const float inv = 1.0f / s;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) p[j] = from_f<T>(expf(to_f(x[j]) - m) * inv);
  if (threadIdx.x == 0) losses[i] = logf(s) - (xt - m);
}

template <typename T>
__global__ void cross_entropy_backward_kernel(const T* probs, const std::int32_t* __restrict__ targets, T* dlogits,
                                              std::int64_t n, std::int64_t V, float scale) {
  const std::int64_t total = n * V;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / V, j = e % V;
    dlogits[e] = from_f<T>((to_f(probs[e]) - (j == targets[i] ? 1.0f : 0.0f)) * scale);
  }
}

}  // namespace

template <typename T>
void cross_entropy_forward(const T* logits, const std::int32_t* targets, T* probs, float* losses, std::int64_t n,
                           std::int64_t V, cudaStream_t stream) {
  if (n <= 0) return;
  cross_entropy_forward_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits, targets, probs, losses,
                                                                                      V);
  MOEFLEX_CHECK_LAUNCH("cross_entropy_forward");
}

template <typename T>
void cross_entropy_backward(const T* probs, const std::int32_t* targets, T* dlogits, std::int64_t n,
                            std::int64_t V, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  cross_entropy_backward_kernel<T><<<detail::grid_for(n * V, 256), 256, 0, stream>>>(probs, targets, dlogits, n, V,
                                                                                      scale);
  MOEFLEX_CHECK_LAUNCH("cross_entropy_backward");
}

#define MOEFLEX_INSTANTIATE_CUDA_CE(T)                                                                          \
  template void cross_entropy_forward<T>(const T*, const std::int32_t*, T*, float*, std::int64_t, std::int64_t,  \
                                         cudaStream_t);                                                         \
  template void cross_entropy_backward<T>(const T*, const std::int32_t*, T*, std::int64_t, std::int64_t, float, \
                                          cudaStream_t);
MOEFLEX_INSTANTIATE_CUDA_CE(float)
MOEFLEX_INSTANTIATE_CUDA_CE(bf16)
#undef MOEFLEX_INSTANTIATE_CUDA_CE

}  // namespace moeflex::ops::cuda
