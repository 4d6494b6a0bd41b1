// Flash-attention kernels. Shapes and semantics: attention.h.
//
// Layout of the work, the same in all three kernels: lanes run over the head
// dimension (lane l holds elements l, l+32, l+64, l+96 of a row in registers), a
// warp owns kRowsPerWarp rows (query rows in forward and dq, key rows in dk/dv),
// and a block of kWarps warps stages tiles of kTile rows of the other operand in
// shared memory as float. A dot product of two rows is a warp reduction.
//   forward: for each key tile, each query row computes the tile's 32 scores (lane j
//     keeps score j), updates its running max m and sum l once per tile (online
//     softmax), rescales its output accumulator and adds P V. Saves lse = m + log l.
//   dq: for each key j <= i: p = exp(s - lse_i), dp = <dout_i, v_j>,
//     ds = p (dp - D_i), dq_i += ds k_j.
//   dk/dv: for each query i >= j: the same p and ds; dv_j += p dout_i, dk_j += ds q_i.
// D_i = sum_j p_ij dp_ij = <dout_i, out_i>. In fp32 a row-dot kernel takes it from
// `out`. In bf16 `out` is rounded (relative 2^-9), and dp - D cancels where a row's
// softmax is peaked: with D from the rounded out, dk was 1% off at S = 2 (found on an
// H200). So in bf16 the dq kernel sums D_i = sum_j p dp in fp32 over the row it walks
// anyway, keeps dq_i = sum_j p dp k_j - D_i sum_j p k_j, and writes D for dk/dv.
// Causality: tiles wholly above the diagonal are skipped; masked scores are -inf.
#include "moeflex/ops/cuda/attention.h"

#include <cstdlib>
#include <string>
#include <type_traits>

#include "moeflex/ops/cuda/attention_tc.cuh"
#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

constexpr int kMaxHd = static_cast<int>(kAttentionMaxHeadDim);
constexpr int kDPerLane = kMaxHd / detail::kWarp;  // 4
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // 16 rows per block
constexpr int kTile = 32;                          // rows of the staged operand per tile
constexpr int kThreads = kWarps * detail::kWarp;

/// Element (s, d) of head (b, h) in a [B, S, H, hd] tensor: base + s * stride + d
/// (shared with the tensor-core kernels, attention_tc.cuh).
using HeadView = tc::TcHead;
using tc::tc_head;

/// Loads rows [r0, r0 + kTile) of one head into a float tile (zeros past S or hd).
template <typename T>
__device__ __forceinline__ void load_tile(float (*tile)[kMaxHd], const T* __restrict__ src, HeadView hv,
                                          std::int64_t r0, std::int64_t S, int hd) {
  for (int idx = threadIdx.x; idx < kTile * kMaxHd; idx += blockDim.x) {
    const int j = idx / kMaxHd, d = idx % kMaxHd;
    const std::int64_t r = r0 + j;
    tile[j][d] = (r < S && d < hd) ? to_f(src[hv.base + r * hv.stride + d]) : 0.0f;
  }
}

/// Loads one row into this lane's registers (zeros past hd or for rows past S).
template <typename T>
__device__ __forceinline__ void load_row(float (&dst)[kDPerLane], const T* __restrict__ src, HeadView hv,
                                         std::int64_t r, std::int64_t S, int hd, int lane) {
#pragma unroll
  for (int t = 0; t < kDPerLane; ++t) {
    const int d = lane + t * detail::kWarp;
    dst[t] = (r < S && d < hd) ? to_f(src[hv.base + r * hv.stride + d]) : 0.0f;
  }
}

/// <row, tile[j]> over the head dimension, reduced over the warp.
__device__ __forceinline__ float dot_tile_row(const float (&row)[kDPerLane], const float (*tile)[kMaxHd], int j,
                                              int lane) {
  float part = 0.0f;
#pragma unroll
  for (int t = 0; t < kDPerLane; ++t) part += row[t] * tile[j][lane + t * detail::kWarp];
  return detail::warp_sum(part);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                                     const T* __restrict__ v, T* __restrict__ out,
                                                                     float* __restrict__ lse, std::int64_t S,
                                                                     std::int64_t H, std::int64_t Hkv, int hd,
                                                                     float scale) {
  __shared__ float ks[kTile][kMaxHd];
  __shared__ float vs[kTile][kMaxHd];
  const std::int64_t bh = blockIdx.y;
  const HeadView hv = tc_head(bh, S, H, hd), kvh = tc::tc_kv_head(bh, S, H, Hkv, hd);
  const int warp = threadIdx.x / detail::kWarp, lane = threadIdx.x % detail::kWarp;
  const std::int64_t row0 = std::int64_t(blockIdx.x) * kBlockRows + warp * kRowsPerWarp;

  float qr[kRowsPerWarp][kDPerLane], o[kRowsPerWarp][kDPerLane], m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    load_row(qr[rr], q, hv, row0 + rr, S, hd, lane);
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) o[rr][t] = 0.0f;
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
  }
  const std::int64_t block_end = std::int64_t(blockIdx.x + 1) * kBlockRows;
  const std::int64_t block_last = (block_end < S ? block_end : S) - 1;
  for (std::int64_t k0 = 0; k0 <= block_last; k0 += kTile) {
    load_tile(ks, k, kvh, k0, S, hd);
    load_tile(vs, v, kvh, k0, S, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const std::int64_t row = row0 + rr;
      if (row >= S || k0 > row) continue;  // warp-uniform
      float my_s = -INFINITY;
      for (int j = 0; j < kTile; ++j) {
        float sc = dot_tile_row(qr[rr], ks, j, lane) * scale;
        if (k0 + j > row) sc = -INFINITY;  // causal mask (also covers keys past S)
        if (lane == j) my_s = sc;
      }
      const float m_new = fmaxf(m[rr], detail::warp_max(my_s));  // finite: key k0 <= row is in the tile
      const float corr = expf(m[rr] - m_new);
      const float p = expf(my_s - m_new);
      l[rr] = l[rr] * corr + detail::warp_sum(p);
#pragma unroll
      for (int t = 0; t < kDPerLane; ++t) o[rr][t] *= corr;
      for (int j = 0; j < kTile; ++j) {
        const float pj = __shfl_sync(detail::kFullMask, p, j);
#pragma unroll
        for (int t = 0; t < kDPerLane; ++t) o[rr][t] += pj * vs[j][lane + t * detail::kWarp];
      }
      m[rr] = m_new;
    }
    __syncthreads();
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t row = row0 + rr;
    if (row >= S) continue;
    const float inv = 1.0f / l[rr];
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) {
      const int d = lane + t * detail::kWarp;
      if (d < hd) out[hv.base + row * hv.stride + d] = from_f<T>(o[rr][t] * inv);
    }
    if (lane == 0) lse[bh * S + row] = m[rr] + logf(l[rr]);
  }
}

/// D_i = <dout_i, out_i>, one warp per row (b, h, i).
template <typename T>
__global__ void attention_rowdot_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                                        float* __restrict__ D, std::int64_t rows, std::int64_t S, std::int64_t H,
                                        int hd) {
  const std::int64_t r = std::int64_t(blockIdx.x) * kWarps + threadIdx.x / detail::kWarp;
  const int lane = threadIdx.x % detail::kWarp;
  if (r >= rows) return;
  const std::int64_t bh = r / S, i = r % S;
  const HeadView hv = tc_head(bh, S, H, hd);
  float s = 0.0f;
  for (int d = lane; d < hd; d += detail::kWarp) {
    const std::int64_t at = hv.base + i * hv.stride + d;
    s += to_f(dout[at]) * to_f(out[at]);
  }
  s = detail::warp_sum(s);
  if (lane == 0) D[r] = s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 const T* __restrict__ dout, const float* __restrict__ lse, float* __restrict__ D,
                                 T* __restrict__ dq, std::int64_t S, std::int64_t H, std::int64_t Hkv, int hd,
                                 float scale) {
  // bf16: D is this kernel's output (exact in fp32); fp32: its input (row-dot kernel).
  constexpr bool kSumD = std::is_same_v<T, bf16>;
  __shared__ float ks[kTile][kMaxHd];
  __shared__ float vs[kTile][kMaxHd];
  const std::int64_t bh = blockIdx.y;
  const HeadView hv = tc_head(bh, S, H, hd), kvh = tc::tc_kv_head(bh, S, H, Hkv, hd);
  const int warp = threadIdx.x / detail::kWarp, lane = threadIdx.x % detail::kWarp;
  const std::int64_t row0 = std::int64_t(blockIdx.x) * kBlockRows + warp * kRowsPerWarp;

  float qr[kRowsPerWarp][kDPerLane], dor[kRowsPerWarp][kDPerLane], acc[kRowsPerWarp][kDPerLane];
  float pk[kRowsPerWarp][kDPerLane];  // kSumD: sum_j p k_j
  float lse_r[kRowsPerWarp], D_r[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t row = row0 + rr;
    load_row(qr[rr], q, hv, row, S, hd, lane);
    load_row(dor[rr], dout, hv, row, S, hd, lane);
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) acc[rr][t] = pk[rr][t] = 0.0f;
    lse_r[rr] = row < S ? lse[bh * S + row] : 0.0f;
    D_r[rr] = kSumD || row >= S ? 0.0f : D[bh * S + row];
  }
  const std::int64_t block_end = std::int64_t(blockIdx.x + 1) * kBlockRows;
  const std::int64_t block_last = (block_end < S ? block_end : S) - 1;
  for (std::int64_t k0 = 0; k0 <= block_last; k0 += kTile) {
    load_tile(ks, k, kvh, k0, S, hd);
    load_tile(vs, v, kvh, k0, S, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const std::int64_t row = row0 + rr;
      if (row >= S) continue;
      for (int j = 0; j < kTile && k0 + j <= row; ++j) {  // warp-uniform bound
        const float p = expf(dot_tile_row(qr[rr], ks, j, lane) * scale - lse_r[rr]);
        const float dp = dot_tile_row(dor[rr], vs, j, lane);
        if constexpr (kSumD) {
          const float pdp = p * dp;
          D_r[rr] += pdp;  // warp-uniform: p and dp are warp reductions
#pragma unroll
          for (int t = 0; t < kDPerLane; ++t) {
            const float kj = ks[j][lane + t * detail::kWarp];
            acc[rr][t] += pdp * kj;
            pk[rr][t] += p * kj;
          }
        } else {
          const float ds = p * (dp - D_r[rr]);
#pragma unroll
          for (int t = 0; t < kDPerLane; ++t) acc[rr][t] += ds * ks[j][lane + t * detail::kWarp];
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t row = row0 + rr;
    if (row >= S) continue;
    if constexpr (kSumD) {
      if (lane == 0) D[bh * S + row] = D_r[rr];
    }
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) {
      const int d = lane + t * detail::kWarp;
      // kSumD: no fused multiply-add in the difference, so that a row whose keys give
      // acc == D * pk exactly (one key: acc = round(p dp k), D pk = the same) gets 0;
      // row 0 attends to itself only, and a softmax of one score has zero gradient.
      const float g = !kSumD ? acc[rr][t] : row == 0 ? 0.0f : __fsub_rn(acc[rr][t], __fmul_rn(D_r[rr], pk[rr][t]));
      if (d < hd) dq[hv.base + row * hv.stride + d] = from_f<T>(g * scale);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                   const T* __restrict__ dout, const float* __restrict__ lse,
                                   const float* __restrict__ D, T* __restrict__ dk, T* __restrict__ dv,
                                   std::int64_t S, std::int64_t H, std::int64_t Hkv, int hd, float scale) {
  __shared__ float qs[kTile][kMaxHd];
  __shared__ float dos[kTile][kMaxHd];
  __shared__ float lse_s[kTile];
  __shared__ float D_s[kTile];
  const std::int64_t bg = blockIdx.y, group = H / Hkv;  // kv head bg % Hkv of sequence bg / Hkv
  const HeadView kvh = tc_head(bg, S, Hkv, hd);
  const int warp = threadIdx.x / detail::kWarp, lane = threadIdx.x % detail::kWarp;
  const std::int64_t key_block = std::int64_t(blockIdx.x) * kBlockRows;
  const std::int64_t key0 = key_block + warp * kRowsPerWarp;

  float kr[kRowsPerWarp][kDPerLane], vr[kRowsPerWarp][kDPerLane];
  float dk_acc[kRowsPerWarp][kDPerLane], dv_acc[kRowsPerWarp][kDPerLane];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    load_row(kr[rr], k, kvh, key0 + rr, S, hd, lane);
    load_row(vr[rr], v, kvh, key0 + rr, S, hd, lane);
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) dk_acc[rr][t] = dv_acc[rr][t] = 0.0f;
  }
  // Queries i >= key: from the tile holding the block's first key, of each query head
  // of the kv head in turn.
  const std::int64_t first = key_block / kTile * kTile, tiles = (S - first + kTile - 1) / kTile;
  for (std::int64_t tile = 0; tile < group * tiles; ++tile) {
    const std::int64_t q0 = first + (tile % tiles) * kTile;
    const std::int64_t bh = (bg / Hkv) * H + (bg % Hkv) * group + tile / tiles;
    const HeadView hv = tc_head(bh, S, H, hd);
    load_tile(qs, q, hv, q0, S, hd);
    load_tile(dos, dout, hv, q0, S, hd);
    for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
      const std::int64_t r = q0 + i;
      lse_s[i] = r < S ? lse[bh * S + r] : 0.0f;
      D_s[i] = r < S ? D[bh * S + r] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const std::int64_t key = key0 + rr;
      if (key >= S) continue;
      for (int i = 0; i < kTile && q0 + i < S; ++i) {  // warp-uniform bounds
        if (q0 + i < key) continue;                     // causal: only queries at or after the key
        const float p = expf(dot_tile_row(kr[rr], qs, i, lane) * scale - lse_s[i]);
#pragma unroll
        for (int t = 0; t < kDPerLane; ++t) dv_acc[rr][t] += p * dos[i][lane + t * detail::kWarp];
        const float dp = dot_tile_row(vr[rr], dos, i, lane);
        const float ds = p * (dp - D_s[i]);
#pragma unroll
        for (int t = 0; t < kDPerLane; ++t) dk_acc[rr][t] += ds * qs[i][lane + t * detail::kWarp];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t key = key0 + rr;
    if (key >= S) continue;
#pragma unroll
    for (int t = 0; t < kDPerLane; ++t) {
      const int d = lane + t * detail::kWarp;
      if (d < hd) {
        dk[kvh.base + key * kvh.stride + d] = from_f<T>(dk_acc[rr][t] * scale);
        dv[kvh.base + key * kvh.stride + d] = from_f<T>(dv_acc[rr][t]);
      }
    }
  }
}

void check_attention_shape(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t hd) {
  if (Hkv <= 0 || H % Hkv != 0)
    throw Error("attention (CUDA): " + std::to_string(H) + " query heads cannot share " + std::to_string(Hkv) +
                " key/value heads (need a positive divisor)");
  if (hd <= 0 || hd > kAttentionMaxHeadDim)
    throw Error("attention (CUDA): head_dim " + std::to_string(hd) + " must be in [1, " +
                std::to_string(kAttentionMaxHeadDim) + "]");
  if (B * H > 65535)
    throw Error("attention (CUDA): batch * heads = " + std::to_string(B * H) + " exceeds 65535");
}

// --- bf16 on the tensor cores (attention_tc.cuh) ---

/// Whether bf16 attention runs on the tensor-core kernels: yes unless
/// MOEFLEX_ATTENTION_KERNEL=simt asks for the CUDA-core kernels above (for
/// comparison), or the card cannot give a block `smem_bytes` of shared memory.
bool use_tensor_cores(int smem_bytes) {
  static const bool simt = [] {
    const char* e = std::getenv("MOEFLEX_ATTENTION_KERNEL");
    return e != nullptr && std::string(e) == "simt";
  }();
  static const int optin = [] {
    int dev = 0, v = 0;
    MOEFLEX_CUDA_CHECK(cudaGetDevice(&dev));
    MOEFLEX_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return v;
  }();
  return !simt && smem_bytes <= optin;
}

const tc::bfr* as_tc(const bf16* p) { return reinterpret_cast<const tc::bfr*>(p); }
tc::bfr* as_tc(bf16* p) { return reinterpret_cast<tc::bfr*>(p); }

template <int HDP>
void tc_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, std::int64_t B, std::int64_t S,
                std::int64_t H, std::int64_t Hkv, std::int64_t hd, cudaStream_t stream) {
  constexpr int smem = tc::tc_forward_smem(HDP);
  MOEFLEX_CUDA_CHECK(
      cudaFuncSetAttribute(tc::tc_attention_forward<HDP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>((S + tc::kRows - 1) / tc::kRows), static_cast<unsigned>(B * H));
  tc::tc_attention_forward<HDP><<<grid, tc::kThreads, smem, stream>>>(as_tc(q), as_tc(k), as_tc(v), as_tc(out), lse,
                                                                       S, H, Hkv, int(hd), 1.0f / sqrtf(float(hd)));
  MOEFLEX_CHECK_LAUNCH("attention_forward (tensor cores)");
}

template <int HDP>
void tc_backward(const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, bf16* dq, bf16* dk,
                 bf16* dv, float* D, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                 std::int64_t hd, cudaStream_t stream) {
  constexpr int smem_dq = tc::tc_dq_smem(HDP), smem_dkdv = tc::tc_dkdv_smem(HDP);
  MOEFLEX_CUDA_CHECK(
      cudaFuncSetAttribute(tc::tc_attention_dq<HDP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_dq));
  MOEFLEX_CUDA_CHECK(
      cudaFuncSetAttribute(tc::tc_attention_dkdv<HDP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_dkdv));
  const dim3 grid(static_cast<unsigned>((S + tc::kRows - 1) / tc::kRows), static_cast<unsigned>(B * H));
  const float scale = 1.0f / sqrtf(float(hd));
  tc::tc_attention_dq<HDP><<<grid, tc::kThreads, smem_dq, stream>>>(as_tc(q), as_tc(k), as_tc(v), as_tc(dout), lse,
                                                                     D, as_tc(dq), S, H, Hkv, int(hd), scale);
  MOEFLEX_CHECK_LAUNCH("attention_backward dq (tensor cores)");
  const dim3 grid_kv(grid.x, static_cast<unsigned>(B * Hkv));  // one block per key tile of a kv head
  tc::tc_attention_dkdv<HDP><<<grid_kv, tc::kThreads, smem_dkdv, stream>>>(
      as_tc(q), as_tc(k), as_tc(v), as_tc(dout), lse, D, as_tc(dk), as_tc(dv), S, H, Hkv, int(hd), scale);
  MOEFLEX_CHECK_LAUNCH("attention_backward dk/dv (tensor cores)");
}

/// Runs fn<HDP>() for hd's instantiated padded head dimension.
template <class Fn>
void with_head_dim(std::int64_t hd, Fn&& fn) {
  switch (tc::instantiated_head_dim(hd)) {
    case 32: fn.template operator()<32>(); break;
    case 48: fn.template operator()<48>(); break;
    case 64: fn.template operator()<64>(); break;
    case 96: fn.template operator()<96>(); break;
    default: fn.template operator()<128>(); break;
  }
}

}  // namespace

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, float* lse, std::int64_t B, std::int64_t S,
                       std::int64_t H, std::int64_t Hkv, std::int64_t hd, cudaStream_t stream) {
  check_attention_shape(B, S, H, Hkv, hd);
  if (B <= 0 || S <= 0 || H <= 0) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_tensor_cores(tc::tc_forward_smem(tc::instantiated_head_dim(hd)))) {
      with_head_dim(hd, [&]<int HDP>() { tc_forward<HDP>(q, k, v, out, lse, B, S, H, Hkv, hd, stream); });
      return;
    }
  }
  const dim3 grid(static_cast<unsigned>((S + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(B * H));
  attention_forward_kernel<T><<<grid, kThreads, 0, stream>>>(q, k, v, out, lse, S, H, Hkv, int(hd),
                                                             1.0f / sqrtf(float(hd)));
  MOEFLEX_CHECK_LAUNCH("attention_forward");
}

Bytes attention_backward_workspace_bytes(std::int64_t B, std::int64_t S, std::int64_t H) {
  return B * H * S * Bytes(sizeof(float));
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const float* lse, T* dq,
                        T* dk, T* dv, float* workspace, std::int64_t B, std::int64_t S, std::int64_t H,
                        std::int64_t Hkv, std::int64_t hd, cudaStream_t stream) {
  check_attention_shape(B, S, H, Hkv, hd);
  if (B <= 0 || S <= 0 || H <= 0) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_tensor_cores(tc::tc_dkdv_smem(tc::instantiated_head_dim(hd)))) {
      with_head_dim(hd, [&]<int HDP>() {
        tc_backward<HDP>(dout, q, k, v, lse, dq, dk, dv, workspace, B, S, H, Hkv, hd, stream);
      });
      return;
    }
  }
  const std::int64_t rows = B * H * S;
  if constexpr (!std::is_same_v<T, bf16>) {  // bf16: the dq kernel writes D (see the top)
    attention_rowdot_kernel<T><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        dout, out, workspace, rows, S, H, int(hd));
    MOEFLEX_CHECK_LAUNCH("attention_rowdot");
  }
  const dim3 grid(static_cast<unsigned>((S + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(B * H));
  const float scale = 1.0f / sqrtf(float(hd));
  attention_backward_dq_kernel<T><<<grid, kThreads, 0, stream>>>(q, k, v, dout, lse, workspace, dq, S, H, Hkv,
                                                                 int(hd), scale);
  MOEFLEX_CHECK_LAUNCH("attention_backward_dq");
  const dim3 grid_kv(grid.x, static_cast<unsigned>(B * Hkv));  // one block per key tile of a kv head
  attention_backward_dkdv_kernel<T><<<grid_kv, kThreads, 0, stream>>>(q, k, v, dout, lse, workspace, dk, dv, S, H,
                                                                      Hkv, int(hd), scale);
  MOEFLEX_CHECK_LAUNCH("attention_backward_dkdv");
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                       std::int64_t, std::int64_t, std::int64_t, std::int64_t, cudaStream_t);
template void attention_forward<bf16>(const bf16*, const bf16*, const bf16*, bf16*, float*, std::int64_t,
                                      std::int64_t, std::int64_t, std::int64_t, std::int64_t, cudaStream_t);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                        const float*, float*, float*, float*, float*, std::int64_t, std::int64_t,
                                        std::int64_t, std::int64_t, std::int64_t, cudaStream_t);
template void attention_backward<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                       const float*, bf16*, bf16*, bf16*, float*, std::int64_t, std::int64_t,
                                       std::int64_t, std::int64_t, std::int64_t, cudaStream_t);

}  // namespace moeflex::ops::cuda
