// Optimizer kernels. Semantics: optimizer.h.
#include "moeflex/ops/cuda/optimizer.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

__global__ void adamw_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, std::int64_t n, float b1, float b2, float eps, float decay,
                             float step_size, float inv_sqrt_bc2) {
  for (std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += std::int64_t(gridDim.x) * blockDim.x) {
    const float gj = g[j];
    const float mj = __fadd_rn(__fmul_rn(b1, m[j]), __fmul_rn(1.0f - b1, gj));
    const float vj = __fadd_rn(__fmul_rn(b2, v[j]), __fmul_rn(__fmul_rn(1.0f - b2, gj), gj));
    m[j] = mj;
    v[j] = vj;
    const float denom = __fadd_rn(__fmul_rn(sqrtf(vj), inv_sqrt_bc2), eps);
    w[j] = __fsub_rn(__fmul_rn(w[j], decay), __fdiv_rn(__fmul_rn(step_size, mj), denom));
  }
}

constexpr int kSumThreads = 256;

__global__ void square_sum_kernel(const float* __restrict__ g, std::int64_t n, double* __restrict__ partial) {
  __shared__ double s[kSumThreads];
  const std::int64_t begin = std::int64_t(blockIdx.x) * kSquareSumChunk;
  const std::int64_t end = begin + kSquareSumChunk < n ? begin + kSquareSumChunk : n;
  double acc = 0;
  for (std::int64_t j = begin + threadIdx.x; j < end; j += kSumThreads) acc += double(g[j]) * double(g[j]);
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kSumThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

__global__ void scale_kernel(float* __restrict__ g, std::int64_t n, float s) {
  for (std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += std::int64_t(gridDim.x) * blockDim.x)
    g[j] *= s;
}

}  // namespace

void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps, float decay,
           float step_size, float inv_sqrt_bc2, cudaStream_t stream) {
  if (n <= 0) return;
  adamw_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(w, g, m, v, n, b1, b2, eps, decay, step_size,
                                                             inv_sqrt_bc2);
  MOEFLEX_CHECK_LAUNCH("adamw");
}

void square_sum_partials(const float* g, std::int64_t n, double* partial, cudaStream_t stream) {
  if (n <= 0) return;
  const std::int64_t chunks = (n + kSquareSumChunk - 1) / kSquareSumChunk;
  square_sum_kernel<<<static_cast<unsigned>(chunks), kSumThreads, 0, stream>>>(g, n, partial);
  MOEFLEX_CHECK_LAUNCH("square_sum");
}

void scale(float* g, std::int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  scale_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(g, n, s);
  MOEFLEX_CHECK_LAUNCH("scale");
}

}  // namespace moeflex::ops::cuda
