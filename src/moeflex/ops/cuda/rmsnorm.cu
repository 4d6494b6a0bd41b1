// RMSNorm kernels. Shapes and semantics: rmsnorm.h.
// forward: one warp per row (the row's sum of squares is a warp reduction).
// backward: one block per chunk of kRowsPerChunk rows; for each row the block
//   reduces dot(dy * w, x), writes dx, and adds dy * x * rstd into the chunk's
//   partial dw row in workspace (each thread owns fixed columns, so no races);
//   a second kernel sums the partial rows in chunk order into dw.
#include "moeflex/ops/cuda/rmsnorm.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kRowsPerWarpBlock = 8;  // forward: 8 warps per block, one row each
constexpr int kBackwardThreads = 256;
/// Rows per partial dw row: at most kMaxChunks chunks so the workspace stays
/// bounded, at least kMinRowsPerChunk rows per chunk.
constexpr std::int64_t kMaxChunks = 512;
constexpr std::int64_t kMinRowsPerChunk = 8;

std::int64_t rows_per_chunk(std::int64_t n) {
  const std::int64_t r = (n + kMaxChunks - 1) / kMaxChunks;
  return r < kMinRowsPerChunk ? kMinRowsPerChunk : r;
}

template <typename T>
__global__ void rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                       float* __restrict__ rstd, std::int64_t n, std::int64_t d, float eps) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerWarpBlock + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (row >= n) return;
  const T* xr = x + row * d;
  float ss = 0.0f;
  for (std::int64_t j = lane; j < d; j += detail::kWarp) {
    const float v = to_f(xr[j]);
    ss += v * v;
  }
  ss = detail::warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(d) + eps);
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * d;
  for (std::int64_t j = lane; j < d; j += detail::kWarp) yr[j] = from_f<T>((to_f(xr[j]) * r) * to_f(w[j]));
}

template <typename T>
__global__ void rmsnorm_backward_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                             const T* __restrict__ w, const float* __restrict__ rstd,
                                             T* __restrict__ dx, float* __restrict__ partial, std::int64_t n,
                                             std::int64_t d, std::int64_t chunk_rows) {
  __shared__ float scratch[32];
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t i0 = chunk * chunk_rows;
  const std::int64_t i1 = i0 + chunk_rows < n ? i0 + chunk_rows : n;
  float* pdw = partial + chunk * d;
  for (std::int64_t i = i0; i < i1; ++i) {
    const T* dyi = dy + i * d;
    const T* xi = x + i * d;
    float dot = 0.0f;
    for (std::int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += (to_f(dyi[j]) * to_f(w[j])) * to_f(xi[j]);
    dot = detail::block_sum(dot, scratch);
    const float r = rstd[i];
    const float c = r * r * dot / float(d);
    T* dxi = dx + i * d;
    for (std::int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const float g = to_f(dyi[j]), xv = to_f(xi[j]);
      dxi[j] = from_f<T>(r * (g * to_f(w[j]) - xv * c));
      const float contrib = g * (xv * r);
      pdw[j] = (i == i0) ? contrib : pdw[j] + contrib;
    }
  }
}

__global__ void rmsnorm_dw_sum_kernel(const float* __restrict__ partial, float* __restrict__ dw, std::int64_t chunks,
                                      std::int64_t d) {
  for (std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < d;
       j += std::int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (std::int64_t c = 0; c < chunks; ++c) acc += partial[c * d + j];
    dw[j] += acc;
  }
}

}  // namespace

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, std::int64_t n, std::int64_t d, float eps,
                     cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kRowsPerWarpBlock - 1) / kRowsPerWarpBlock);
  rmsnorm_forward_kernel<T><<<blocks, kRowsPerWarpBlock * detail::kWarp, 0, stream>>>(x, w, y, rstd, n, d, eps);
  MOEFLEX_CHECK_LAUNCH("rmsnorm_forward");
}

Bytes rmsnorm_backward_workspace_bytes(std::int64_t n, std::int64_t d) {
  if (n <= 0 || d <= 0) return 0;
  const std::int64_t chunks = (n + rows_per_chunk(n) - 1) / rows_per_chunk(n);
  return chunks * d * Bytes(sizeof(float));
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw, float* workspace,
                      std::int64_t n, std::int64_t d, cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  const std::int64_t chunk_rows = rows_per_chunk(n);
  const std::int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
  rmsnorm_backward_rows_kernel<T><<<static_cast<unsigned>(chunks), kBackwardThreads, 0, stream>>>(
      dy, x, w, rstd, dx, workspace, n, d, chunk_rows);
  MOEFLEX_CHECK_LAUNCH("rmsnorm_backward_rows");
  rmsnorm_dw_sum_kernel<<<detail::grid_for(d, 256), 256, 0, stream>>>(workspace, dw, chunks, d);
  MOEFLEX_CHECK_LAUNCH("rmsnorm_dw_sum");
}

template void rmsnorm_forward<float>(const float*, const float*, float*, float*, std::int64_t, std::int64_t, float,
                                     cudaStream_t);
template void rmsnorm_forward<bf16>(const bf16*, const bf16*, bf16*, float*, std::int64_t, std::int64_t, float,
                                    cudaStream_t);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*, float*, float*, float*,
                                      std::int64_t, std::int64_t, cudaStream_t);
template void rmsnorm_backward<bf16>(const bf16*, const bf16*, const bf16*, const float*, bf16*, float*, float*,
                                     std::int64_t, std::int64_t, cudaStream_t);

}  // namespace moeflex::ops::cuda
