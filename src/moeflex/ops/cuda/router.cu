// Router kernels: one warp per row, lane l owns experts l, l+32, ... (at most 32).
// forward: warp max and sum give the softmax (or each lane its sigmoids); with
// group-limited routing every lane computes all group scores by warp reductions and
// picks the same topk_group groups; top-k is k rounds of a warp arg-max over the
// allowed experts not yet taken (a per-lane bit mask), comparing (choice desc, index
// asc), so ties go to the lower index as on the CPU.
// backward: every lane computes the k coefficients of the renormalised top-k
// gradient itself (k is small), so g_e needs no scatter; then the scores' derivative.
#include "moeflex/ops/cuda/router.h"

#include <climits>
#include <string>

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kRowsPerBlock = 4;  // warps per block

/// The router's rules as kernel arguments (RouterOptions has host-only members).
struct KernelRule {
  bool sigmoid = false, norm = true, top2 = false;
  float scaling = 1.0f;
  int n_group = 1, topk_group = 1;  // n_group 1: no group limit
  const float* bias = nullptr;
};

KernelRule kernel_rule(const RouterOptions& o) {
  KernelRule r;
  r.sigmoid = o.score == RouterScore::sigmoid;
  r.norm = o.norm_topk_prob;
  r.top2 = o.group_score == GroupScore::top2_sum;
  r.scaling = float(o.routed_scaling_factor);
  r.n_group = o.group_limited() ? int(o.n_group) : 1;
  r.topk_group = int(o.topk_group);
  r.bias = o.bias;
  return r;
}

/// (a1 >= a2) merged with (b1 >= b2): the two largest of the four.
__device__ __forceinline__ void top2_merge(float& a1, float& a2, float b1, float b2) {
  if (b1 > a1) {
    a2 = fmaxf(a1, b2);
    a1 = b1;
  } else {
    a2 = fmaxf(a2, b1);
  }
}

/// Bit g set for the topk_group groups of best score (max, or the sum of the two best
/// choice scores), ties to the lower group; the same mask in every lane. c[t] is the
/// lane's choice score of expert lane + 32 t.
__device__ unsigned chosen_groups(const float* c, int lane, int E, const KernelRule& r) {
  const int G = E / r.n_group;
  float score[kRouterMaxGroups];
  for (int g = 0; g < r.n_group; ++g) {
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp)
      if (e / G == g) top2_merge(b1, b2, c[t], -INFINITY);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float o1 = __shfl_xor_sync(detail::kFullMask, b1, o);
      const float o2 = __shfl_xor_sync(detail::kFullMask, b2, o);
      top2_merge(b1, b2, o1, o2);
    }
    score[g] = r.top2 ? b1 + b2 : b1;
  }
  unsigned chosen = 0;
  for (int j = 0; j < r.topk_group; ++j) {
    int best = -1;
    for (int g = 0; g < r.n_group; ++g)
      if (!((chosen >> g) & 1u) && (best < 0 || score[g] > score[best])) best = g;
    chosen |= 1u << best;
  }
  return chosen;
}

template <typename T>
__global__ void router_forward_kernel(const T* __restrict__ logits, float* __restrict__ probs,
                                      std::int32_t* __restrict__ topk_idx, float* __restrict__ topk_w,
                                      std::int64_t n, int E, int k, KernelRule r) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (row >= n) return;
  const T* l = logits + row * E;
  float* p = probs + row * E;
  float pv[32], c[32];  // this lane's scores and choice scores, expert lane + 32 t
  if (r.sigmoid) {
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) pv[t] = 1.0f / (1.0f + expf(-to_f(l[e])));
  } else {
    float m = -INFINITY;
    for (int e = lane; e < E; e += detail::kWarp) m = fmaxf(m, to_f(l[e]));
    m = detail::warp_max(m);
    float s = 0.0f;
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) {
      pv[t] = expf(to_f(l[e]) - m);
      s += pv[t];
    }
    s = detail::warp_sum(s);
    const float inv = 1.0f / s;
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) pv[t] *= inv;
  }
  for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) {
    p[e] = pv[t];
    c[t] = pv[t] + (r.bias ? r.bias[e] : 0.0f);
  }
  const int G = E / r.n_group;
  const unsigned groups = r.n_group > 1 ? chosen_groups(c, lane, E, r) : 1u;

  std::int32_t* idx = topk_idx + row * k;
  float* w = topk_w + row * k;
  unsigned taken = 0;  // bit t: expert lane + 32 t is already selected
  float wsum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY, best_p = 0.0f;
    int best_e = INT_MAX;
    for (int t = 0, e = lane; e < E; ++t, e += detail::kWarp) {
      if (((taken >> t) & 1u) || !((groups >> (e / G)) & 1u)) continue;
      if (c[t] > best || (c[t] == best && e < best_e)) best = c[t], best_e = e, best_p = pv[t];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(detail::kFullMask, best, o);
      const int oe = __shfl_xor_sync(detail::kFullMask, best_e, o);
      const float op = __shfl_xor_sync(detail::kFullMask, best_p, o);
      if (ov > best || (ov == best && oe < best_e)) best = ov, best_e = oe, best_p = op;
    }
    if (best_e % detail::kWarp == lane) taken |= 1u << (best_e / detail::kWarp);
    if (lane == 0) {
      idx[j] = best_e;
      w[j] = best_p;  // the weight is the unbiased score
    }
    wsum += best_p;
  }
  const float scale = r.norm ? r.scaling / wsum : r.scaling;
  if (scale != 1.0f && lane == 0)
    for (int j = 0; j < k; ++j) w[j] *= scale;
}

template <typename T>
__global__ void router_backward_kernel(const float* __restrict__ dtopk_w, const float* __restrict__ dprobs_extra,
                                       const float* __restrict__ probs, const std::int32_t* __restrict__ topk_idx,
                                       T* __restrict__ dlogits, std::int64_t n, int E, int k, KernelRule r) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (row >= n) return;
  const float* p = probs + row * E;
  const float* dw = dtopk_w + row * k;
  const std::int32_t* idx = topk_idx + row * k;
  // w_j = c p_j / S  =>  dp_j = c (dw_j - sum_l dw_l p_l / S) / S; without renormalisation dp_j = c dw_j.
  float inv_S = 1.0f, dot = 0.0f;
  if (r.norm) {
    float S = 0.0f;
    for (int j = 0; j < k; ++j) S += p[idx[j]];
    inv_S = 1.0f / S;
    for (int j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] * inv_S);
  }
  auto g_of = [&](int e) {
    float g = dprobs_extra ? dprobs_extra[row * E + e] : 0.0f;
    for (int j = 0; j < k; ++j)
      if (idx[j] == e) g += r.scaling * (r.norm ? (dw[j] - dot) * inv_S : dw[j]);
    return g;
  };
  T* d = dlogits + row * E;
  if (r.sigmoid) {
    for (int e = lane; e < E; e += detail::kWarp) d[e] = from_f<T>(p[e] * (1.0f - p[e]) * g_of(e));
    return;
  }
  float pg = 0.0f;
  for (int e = lane; e < E; e += detail::kWarp) pg += p[e] * g_of(e);
  pg = detail::warp_sum(pg);
  for (int e = lane; e < E; e += detail::kWarp) d[e] = from_f<T>(p[e] * (g_of(e) - pg));
}

void check_router_shape(std::int64_t E, std::int64_t k, const RouterOptions& opt) {
  if (E <= 0 || E > kRouterMaxExperts)
    throw Error("router (CUDA): num_experts " + std::to_string(E) + " must be in [1, " +
                std::to_string(kRouterMaxExperts) + "]");
  if (k <= 0 || k > E)
    throw Error("router (CUDA): num_experts_per_tok " + std::to_string(k) + " must be in [1, num_experts " +
                std::to_string(E) + "]");
  if (!opt.group_limited()) return;
  if (opt.n_group > kRouterMaxGroups)
    throw Error("router (CUDA): n_group " + std::to_string(opt.n_group) + " exceeds " +
                std::to_string(kRouterMaxGroups));
  const std::int64_t G = E % opt.n_group == 0 ? E / opt.n_group : 0;
  if (G == 0 || opt.topk_group < 1 || opt.topk_group * G < k || (opt.group_score == GroupScore::top2_sum && G < 2))
    throw Error("router (CUDA): n_group " + std::to_string(opt.n_group) + " and topk_group " +
                std::to_string(opt.topk_group) + " do not make groups of num_experts " + std::to_string(E) +
                " that hold num_experts_per_tok " + std::to_string(k));
}

}  // namespace

template <typename T>
void router_forward(const T* logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                    std::int64_t E, std::int64_t k, const RouterOptions& opt, cudaStream_t stream) {
  check_router_shape(E, k, opt);
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
  router_forward_kernel<T><<<blocks, kRowsPerBlock * detail::kWarp, 0, stream>>>(logits, probs, topk_idx, topk_w, n,
                                                                                int(E), int(k), kernel_rule(opt));
  MOEFLEX_CHECK_LAUNCH("router_forward");
}

template <typename T>
void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                     const std::int32_t* topk_idx, T* dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                     const RouterOptions& opt, cudaStream_t stream) {
  check_router_shape(E, k, opt);
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
  router_backward_kernel<T><<<blocks, kRowsPerBlock * detail::kWarp, 0, stream>>>(
      dtopk_w, dprobs_extra, probs, topk_idx, dlogits, n, int(E), int(k), kernel_rule(opt));
  MOEFLEX_CHECK_LAUNCH("router_backward");
}

#define MOEFLEX_INSTANTIATE_CUDA_ROUTER(T)                                                                         \
  template void router_forward<T>(const T*, float*, std::int32_t*, float*, std::int64_t, std::int64_t,          \
                                  std::int64_t, const RouterOptions&, cudaStream_t);                            \
  template void router_backward<T>(const float*, const float*, const float*, const std::int32_t*, T*,           \
                                   std::int64_t, std::int64_t, std::int64_t, const RouterOptions&, cudaStream_t);
MOEFLEX_INSTANTIATE_CUDA_ROUTER(float)
MOEFLEX_INSTANTIATE_CUDA_ROUTER(bf16)
#undef MOEFLEX_INSTANTIATE_CUDA_ROUTER

}  // namespace moeflex::ops::cuda
