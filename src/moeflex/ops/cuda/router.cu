// Router kernels: one warp per row, lane l owns experts l, l+32, ... (at most 32).
// forward: warp max and sum give the softmax; top-k is k rounds of a warp arg-max
// over the experts not yet taken (a per-lane bit mask), comparing (prob desc, index
// asc), so ties go to the lower index as on the CPU.
// backward: every lane computes the k coefficients of the renormalised top-k
// gradient itself (k is small), so g_e needs no scatter; then the softmax Jacobian.
#include "moeflex/ops/cuda/router.h"

#include <climits>
#include <string>

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kRowsPerBlock = 4;  // warps per block

template <typename T>
__global__ void router_forward_kernel(const T* __restrict__ logits, float* __restrict__ probs,
                                      std::int32_t* __restrict__ topk_idx, float* __restrict__ topk_w,
                                      std::int64_t n, int E, int k, bool norm) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (row >= n) return;
  const T* l = logits + row * E;
  float* p = probs + row * E;
  float m = -INFINITY;
  for (int e = lane; e < E; e += detail::kWarp) m = fmaxf(m, to_f(l[e]));
  m = detail::warp_max(m);
  float s = 0.0f;
  for (int e = lane; e < E; e += detail::kWarp) {
    const float v = expf(to_f(l[e]) - m);
    p[e] = v;
    s += v;
  }
  s = detail::warp_sum(s);
  const float inv = 1.0f / s;
  for (int e = lane; e < E; e += detail::kWarp) p[e] *= inv;  // each lane rereads only its own writes

  std::int32_t* idx = topk_idx + row * k;
  float* w = topk_w + row * k;
  unsigned taken = 0;  // bit t: expert lane + 32 t is already selected
  float wsum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best = -1.0f;  // probabilities are >= 0, so any expert beats this
    int best_e = INT_MAX;
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) {
      if ((taken >> t) & 1u) continue;
      const float v = p[e];
      if (v > best || (v == best && e < best_e)) best = v, best_e = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(detail::kFullMask, best, o);
      const int oe = __shfl_xor_sync(detail::kFullMask, best_e, o);
      if (ov > best || (ov == best && oe < best_e)) best = ov, best_e = oe;
    }
    if (best_e % detail::kWarp == lane) taken |= 1u << (best_e / detail::kWarp);
    if (lane == 0) {
      idx[j] = best_e;
      w[j] = best;
    }
    wsum += best;
  }
  if (norm && lane == 0) {
    const float inv_sw = 1.0f / wsum;
    for (int j = 0; j < k; ++j) w[j] *= inv_sw;
  }
}

template <typename T>
__global__ void router_backward_kernel(const float* __restrict__ dtopk_w, const float* __restrict__ dprobs_extra,
                                       const float* __restrict__ probs, const std::int32_t* __restrict__ topk_idx,
                                       T* __restrict__ dlogits, std::int64_t n, int E, int k, bool norm) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (row >= n) return;
  const float* p = probs + row * E;
  const float* dw = dtopk_w + row * k;
  const std::int32_t* idx = topk_idx + row * k;
  // w_j = p_j / S  =>  dp_j = (dw_j - sum_l dw_l w_l) / S; without renormalisation dp_j = dw_j.
  float inv_S = 1.0f, dot = 0.0f;
  if (norm) {
    float S = 0.0f;
    for (int j = 0; j < k; ++j) S += p[idx[j]];
    inv_S = 1.0f / S;
    for (int j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] * inv_S);
  }
  auto g_of = [&](int e) {
    float g = dprobs_extra ? dprobs_extra[row * E + e] : 0.0f;
    for (int j = 0; j < k; ++j)
      if (idx[j] == e) g += norm ? (dw[j] - dot) * inv_S : dw[j];
    return g;
  };
  float pg = 0.0f;
  for (int e = lane; e < E; e += detail::kWarp) pg += p[e] * g_of(e);
  pg = detail::warp_sum(pg);
  T* d = dlogits + row * E;
  for (int e = lane; e < E; e += detail::kWarp) d[e] = from_f<T>(p[e] * (g_of(e) - pg));
}

void check_router_shape(std::int64_t E, std::int64_t k) {
  if (E <= 0 || E > kRouterMaxExperts)
    throw Error("router (CUDA): num_experts " + std::to_string(E) + " must be in [1, " +
                std::to_string(kRouterMaxExperts) + "]");
  if (k <= 0 || k > E)
    throw Error("router (CUDA): num_experts_per_tok " + std::to_string(k) + " must be in [1, num_experts " +
                std::to_string(E) + "]");
}

}  // namespace

template <typename T>
void router_forward(const T* logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, bool norm_topk_prob, cudaStream_t stream) {
  check_router_shape(E, k);
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
  router_forward_kernel<T><<<blocks, kRowsPerBlock * detail::kWarp, 0, stream>>>(logits, probs, topk_idx, topk_w, n,
                                                                                int(E), int(k), norm_topk_prob);
  MOEFLEX_CHECK_LAUNCH("router_forward");
}

template <typename T>
void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                     const std::int32_t* topk_idx, T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                     bool norm_topk_prob, cudaStream_t stream) {
  check_router_shape(E, k);
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
  router_backward_kernel<T><<<blocks, kRowsPerBlock * detail::kWarp, 0, stream>>>(
      dtopk_w, dprobs_extra, probs, topk_idx, dlogits, n, int(E), int(k), norm_topk_prob);
  MOEFLEX_CHECK_LAUNCH("router_backward");
}

#define MOEFLEX_INSTANTIATE_CUDA_ROUTER(T)                                                                         \
  template void router_forward<T>(const T*, float*, std::int32_t*, float*, std::int64_t, std::int64_t,          \
                                  std::int64_t, bool, cudaStream_t);                                            \
  template void router_backward<T>(const float*, const float*, const float*, const std::int32_t*, T*,           \
                                   std::int64_t, std::int64_t, std::int64_t, bool, cudaStream_t);
MOEFLEX_INSTANTIATE_CUDA_ROUTER(float)
MOEFLEX_INSTANTIATE_CUDA_ROUTER(bf16)
#undef MOEFLEX_INSTANTIATE_CUDA_ROUTER

}  // namespace moeflex::ops::cuda
