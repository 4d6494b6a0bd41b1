// MoE dispatch kernels. Semantics: moe_dispatch.h.
// The plan, deterministically and without sorting:
//   1. one block per expert e scans all n*k assignments in index order, in chunks of
//      the block size; a warp ballot and a block prefix over warps give each
//      assignment to e its rank among earlier ones (written into slot_of), and the
//      block's running total is e's count. (E passes over the indices: cheap next to
//      the expert GEMMs, and exactly the CPU's (token, slot) order.)
//   2. one thread applies the capacity, counts the drops and scans the offsets.
//   3. one thread per assignment turns its rank into offsets[e] + rank, or -1.
// permute/unpermute: one block per token (or per assignment for permute_forward),
// threads over the hidden dimension.
#include "moeflex/ops/cuda/moe_dispatch.h"

#include <limits>
#include <string>

#include "moeflex/core/cuda/cuda_check.h"
#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kPlanThreads = 256;
constexpr int kRowThreads = 128;

__global__ void plan_rank_kernel(const std::int32_t* __restrict__ idx, std::int64_t total, std::int64_t E,
                                 std::int32_t* __restrict__ rank, std::int32_t* __restrict__ counts,
                                 std::int64_t* __restrict__ scalars) {
  __shared__ int warp_total[kPlanThreads / detail::kWarp];
  const int e = blockIdx.x, lane = threadIdx.x % detail::kWarp, warp = threadIdx.x / detail::kWarp;
  const unsigned lanes_below = (1u << lane) - 1u;
  int running = 0;
  for (std::int64_t base = 0; base < total; base += kPlanThreads) {
    const std::int64_t a = base + threadIdx.x;
    const int v = a < total ? idx[a] : -1;
    if (e == 0 && a < total && (v < 0 || v >= E)) scalars[1] = 1;  // bad index: reported by the host
    const bool mine = a < total && v == e;
    const unsigned ballot = __ballot_sync(detail::kFullMask, mine);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, chunk = 0;
    for (int w = 0; w < kPlanThreads / detail::kWarp; ++w) {
      before += w < warp ? warp_total[w] : 0;
      chunk += warp_total[w];
    }
    if (mine) rank[a] = running + before + __popc(ballot & lanes_below);
    running += chunk;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
  if (threadIdx.x == 0) counts[e] = running;
}

__global__ void plan_offsets_kernel(std::int32_t* counts, std::int32_t* offsets, std::int64_t E, std::int64_t capacity,
                                    std::int64_t* scalars) {
  std::int64_t dropped = 0;
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t c = counts[e];
    const std::int64_t kept = capacity < 0 || c <= capacity ? c : capacity;
    dropped += c - kept;
    counts[e] = static_cast<std::int32_t>(kept);
    offsets[e + 1] = static_cast<std::int32_t>(offsets[e] + kept);
  }
  scalars[0] = dropped;
}

__global__ void plan_slots_kernel(const std::int32_t* __restrict__ idx, const std::int32_t* __restrict__ offsets,
                                  std::int32_t* __restrict__ slot_of, std::int64_t total, std::int64_t E,
                                  std::int64_t capacity) {
  for (std::int64_t a = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < total;
       a += std::int64_t(gridDim.x) * blockDim.x) {
    const int e = idx[a];
    if (e < 0 || e >= E) continue;  // reported as an error by the host
    const int r = slot_of[a];
    slot_of[a] = capacity < 0 || r < capacity ? offsets[e] + r : -1;
  }
}

template <typename T>
__global__ void permute_forward_kernel(const T* __restrict__ x, const std::int32_t* __restrict__ slot_of,
                                       T* __restrict__ xp, std::int64_t k, std::int64_t d) {
  const std::int64_t a = blockIdx.x;
  const int s = slot_of[a];
  if (s < 0) return;
  const T* src = x + (a / k) * d;
  T* dst = xp + std::int64_t(s) * d;
  for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
}

template <typename T>
__global__ void permute_backward_kernel(const T* __restrict__ dxp, const std::int32_t* __restrict__ slot_of,
                                        T* __restrict__ dx, std::int64_t k, std::int64_t d) {
  const std::int64_t i = blockIdx.x;
  for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) {
      const int s = slot_of[i * k + j];
      if (s >= 0) acc += to_f(dxp[std::int64_t(s) * d + c]);
    }
    dx[i * d + c] = from_f<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_forward_kernel(const T* __restrict__ yp, const std::int32_t* __restrict__ slot_of,
                                         const float* __restrict__ topk_w, T* __restrict__ y, std::int64_t k,
                                         std::int64_t d) {
  const std::int64_t i = blockIdx.x;
  for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) {
      const int s = slot_of[i * k + j];
      if (s >= 0) acc += topk_w[i * k + j] * to_f(yp[std::int64_t(s) * d + c]);
    }
    y[i * d + c] = from_f<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_backward_kernel(const T* __restrict__ dy, const T* __restrict__ yp,
                                          const std::int32_t* __restrict__ slot_of, const float* __restrict__ topk_w,
                                          T* __restrict__ dyp, float* __restrict__ dtopk_w, std::int64_t k,
                                          std::int64_t d) {
  __shared__ float scratch[32];
  const std::int64_t i = blockIdx.x;
  const T* g = dy + i * d;
  for (std::int64_t j = 0; j < k; ++j) {
    const int s = slot_of[i * k + j];  // the same for every thread: the branch is block-uniform
    if (s < 0) {
      if (dtopk_w && threadIdx.x == 0) dtopk_w[i * k + j] = 0.0f;  // (null: windows give it)
      continue;
    }
    const float w = topk_w[i * k + j];
    T* dst = dyp + std::int64_t(s) * d;
    if (!dtopk_w) {  // (uniform: a kernel argument) the top-k gradient comes window by window
      for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = from_f<T>(w * to_f(g[c]));
      continue;
    }
    const T* src = yp + std::int64_t(s) * d;
    float dot = 0.0f;
    for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      const float gc = to_f(g[c]);
      dst[c] = from_f<T>(w * gc);
      dot += gc * to_f(src[c]);
    }
    dot = detail::block_sum(dot, scratch);
    if (threadIdx.x == 0) dtopk_w[i * k + j] = dot;
  }
}

// One block per token, as unpermute_backward_kernel, whose dot it repeats term for
// term for the slots of the window.
template <typename T>
__global__ void combine_topk_grad_kernel(const T* __restrict__ dy, const T* __restrict__ yp_rows,
                                         const std::int32_t* __restrict__ slot_of, float* __restrict__ dtopk_w,
                                         std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows) {
  __shared__ float scratch[32];
  const std::int64_t i = blockIdx.x;
  const T* g = dy + i * d;
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int64_t s = slot_of[i * k + j];  // block-uniform
    if (s < r0 || s >= r0 + rows) continue;
    const T* src = yp_rows + (s - r0) * d;
    float dot = 0.0f;
    for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) dot += to_f(g[c]) * to_f(src[c]);
    dot = detail::block_sum(dot, scratch);
    if (threadIdx.x == 0) dtopk_w[i * k + j] = dot;
  }
}

}  // namespace

std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                               std::int64_t capacity, std::int32_t* counts, std::int32_t* offsets,
                               std::int32_t* slot_of, std::int32_t* host_offsets, void* workspace,
                               cudaStream_t stream) {
  const std::int64_t total = n * k;
  if (total > std::numeric_limits<std::int32_t>::max())
    throw Error("moe_plan_dispatch: " + std::to_string(total) +
                " assignments (tokens * top-k) do not fit the int32 slot index");
  if (E <= 0 || E > std::numeric_limits<int>::max())
    throw Error("moe_plan_dispatch: num_experts " + std::to_string(E) + " out of range");
  auto* scalars = static_cast<std::int64_t*>(workspace);
  MOEFLEX_CUDA_CHECK(cudaMemsetAsync(scalars, 0, moe_plan_workspace_bytes(), stream));
  plan_rank_kernel<<<static_cast<unsigned>(E), kPlanThreads, 0, stream>>>(topk_idx, total, E, slot_of, counts,
                                                                          scalars);
  MOEFLEX_CHECK_LAUNCH("moe_plan_rank");
  plan_offsets_kernel<<<1, 1, 0, stream>>>(counts, offsets, E, capacity, scalars);
  MOEFLEX_CHECK_LAUNCH("moe_plan_offsets");
  if (total > 0) {
    plan_slots_kernel<<<detail::grid_for(total, 256), 256, 0, stream>>>(topk_idx, offsets, slot_of, total, E,
                                                                         capacity);
    MOEFLEX_CHECK_LAUNCH("moe_plan_slots");
  }
  std::int64_t host_scalars[2] = {0, 0};
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(host_offsets, offsets, sizeof(std::int32_t) * std::size_t(E + 1),
                                     cudaMemcpyDeviceToHost, stream));
  MOEFLEX_CUDA_CHECK(
      cudaMemcpyAsync(host_scalars, scalars, sizeof(host_scalars), cudaMemcpyDeviceToHost, stream));
  MOEFLEX_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host_scalars[1] != 0)
    throw Error("moe_plan_dispatch: an expert index in topk_idx is outside [0, " + std::to_string(E) + ")");
  return host_scalars[0];
}

template <typename T>
void permute_forward(const T* x, const std::int32_t* slot_of, T* xp, std::int64_t n, std::int64_t k, std::int64_t d,
                     cudaStream_t stream) {
  if (n * k <= 0 || d <= 0) return;
  permute_forward_kernel<T><<<static_cast<unsigned>(n * k), kRowThreads, 0, stream>>>(x, slot_of, xp, k, d);
  MOEFLEX_CHECK_LAUNCH("permute_forward");
}

template <typename T>
void permute_backward(const T* dxp, const std::int32_t* slot_of, T* dx, std::int64_t n, std::int64_t k,
                      std::int64_t d, cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  permute_backward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(dxp, slot_of, dx, k, d);
  MOEFLEX_CHECK_LAUNCH("permute_backward");
}

template <typename T>
void unpermute_forward(const T* yp, const std::int32_t* slot_of, const float* topk_w, T* y, std::int64_t n,
                       std::int64_t k, std::int64_t d, cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  unpermute_forward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(yp, slot_of, topk_w, y, k, d);
  MOEFLEX_CHECK_LAUNCH("unpermute_forward");
}

template <typename T>
void unpermute_backward(const T* dy, const T* yp, const std::int32_t* slot_of, const float* topk_w, T* dyp,
                        float* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d, cudaStream_t stream) {
  if (n <= 0) return;
  unpermute_backward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(dy, yp, slot_of, topk_w, dyp,
                                                                                      dtopk_w, k, d);
  MOEFLEX_CHECK_LAUNCH("unpermute_backward");
}

template <typename T>
void combine_topk_grad(const T* dy, const T* yp_rows, const std::int32_t* slot_of, float* dtopk_w, std::int64_t n,
                       std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return;
  combine_topk_grad_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(dy, yp_rows, slot_of, dtopk_w, k,
                                                                                     d, r0, rows);
  MOEFLEX_CHECK_LAUNCH("combine_topk_grad");
}

#define MOEFLEX_INSTANTIATE_CUDA_DISPATCH(T)                                                                      \
  template void permute_forward<T>(const T*, const std::int32_t*, T*, std::int64_t, std::int64_t, std::int64_t,  \
                                   cudaStream_t);                                                                 \
  template void permute_backward<T>(const T*, const std::int32_t*, T*, std::int64_t, std::int64_t, std::int64_t, \
                                    cudaStream_t);                                                                \
  template void unpermute_forward<T>(const T*, const std::int32_t*, const float*, T*, std::int64_t, std::int64_t, \
                                     std::int64_t, cudaStream_t);                                                 \
  template void unpermute_backward<T>(const T*, const T*, const std::int32_t*, const float*, T*, float*,          \
                                      std::int64_t, std::int64_t, std::int64_t, cudaStream_t);                      \
  template void combine_topk_grad<T>(const T*, const T*, const std::int32_t*, float*, std::int64_t, std::int64_t,  \
                                     std::int64_t, std::int64_t, std::int64_t, cudaStream_t);

MOEFLEX_INSTANTIATE_CUDA_DISPATCH(float)
MOEFLEX_INSTANTIATE_CUDA_DISPATCH(bf16)
#undef MOEFLEX_INSTANTIATE_CUDA_DISPATCH

}  // namespace moeflex::ops::cuda
