// Cross-entropy kernels. Semantics: cross_entropy.h.
#include "moeflex/ops/cuda/cross_entropy.h"

#include <cfloat>

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

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

__global__ void cross_entropy_forward_kernel(const float* logits, const std::int32_t* __restrict__ targets,
                                             float* probs, float* __restrict__ losses, std::int64_t V) {
  __shared__ float scratch[32];
  const std::int64_t i = blockIdx.x;
  const float* x = logits + i * V;
  float* p = probs + i * V;
  // Read before any thread writes p (which may alias x): the writes come after
  // block_max's __syncthreads.
  const float xt = x[targets[i]];
  float m = -FLT_MAX;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
  m = block_max(m, scratch);
  float s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float e = expf(x[j] - m);
    p[j] = e;
    s += e;
  }
  s = detail::block_sum(s, scratch);
  const float inv = 1.0f / s;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) p[j] *= inv;
  if (threadIdx.x == 0) losses[i] = logf(s) - (xt - m);
}

__global__ void cross_entropy_backward_kernel(const float* probs, const std::int32_t* __restrict__ targets,
                                              float* dlogits, std::int64_t n, std::int64_t V, float scale) {
  const std::int64_t total = n * V;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / V, j = e % V;
    dlogits[e] = (probs[e] - (j == targets[i] ? 1.0f : 0.0f)) * scale;
  }
}

}  // namespace

void cross_entropy_forward(const float* logits, const std::int32_t* targets, float* probs, float* losses,
                           std::int64_t n, std::int64_t V, cudaStream_t stream) {
  if (n <= 0) return;
  cross_entropy_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits, targets, probs, losses, V);
  MOEFLEX_CHECK_LAUNCH("cross_entropy_forward");
}

void cross_entropy_backward(const float* probs, const std::int32_t* targets, float* dlogits, std::int64_t n,
                            std::int64_t V, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  cross_entropy_backward_kernel<<<detail::grid_for(n * V, 256), 256, 0, stream>>>(probs, targets, dlogits, n, V,
                                                                                   scale);
  MOEFLEX_CHECK_LAUNCH("cross_entropy_backward");
}

}  // namespace moeflex::ops::cuda
