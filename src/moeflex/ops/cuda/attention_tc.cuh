// Tensor-core flash attention for bf16 (WMMA, 16x16x16 bf16 tiles with fp32
// accumulation), causal, q [B, S, H, hd] and k, v [B, S, Hkv, hd] (grouped-query when
// Hkv < H); the semantics of attention.h.
//
// Work layout, the same in the three kernels: a block of 4 warps owns 64 rows of one
// head (query rows in forward and dq, key rows in dk/dv), each warp 16 of them, and
// stages 64-row tiles of the other operand in shared memory as bf16, the head
// dimension padded with zeros to HDP (a multiple of 16, <= 128). Score tiles
// (16 x 64 per warp) go through shared memory as fp32 for the elementwise work
// (mask, softmax, dS); the products that feed a matmul (P, dS) are rounded to bf16
// there, as in FlashAttention-2.
//   forward: S = Q K^T; online softmax per row (m, l); O = O * exp(m_old - m_new) + P V,
//     O in shared memory as fp32; out = O / l, lse = m + log l.
//   dq: two passes over the key tiles of a query block: the first sums
//     D_i = sum_j P_ij dP_ij in fp32 from the recomputed P and dP = dO V^T (exact,
//     where <dout_i, out_i> would use the rounded out); the second accumulates
//     dq_i += dS_ij k_j with dS = P (dP - D). Writes D for the dk/dv kernel.
//   dk/dv: per key block of one kv head, over the query tiles at or after it of each
//     query head that reads it: P^T and dS^T from S^T = K Q^T and dP^T = V dO^T;
//     dV += P^T dO, dK += dS^T Q.
// No atomics: deterministic. Exact where the math is: a row with one key (query 0)
// has P = 1 and dS = 0, so dq_0 = 0 and its dk contribution is 0 bit for bit.
//
// The kernels compile as CUDA (attention.cu) and, with MOEFLEX_WMMA_EMULATION
// defined, as host code over tests/wmma_emulation.h, which runs each CUDA thread of a
// block as a host thread: test_attention_tc checks their indexing, masking and
// exact zeros on the CPU in CI.
#pragma once

#ifdef MOEFLEX_WMMA_EMULATION
// The includer (tests/test_attention_tc.cpp) has included tests/wmma_emulation.h.
#else
#include <cuda_bf16.h>
#include <mma.h>
/// The kernel's dynamic shared memory (the emulation hands out a per-block buffer).
#define MOEFLEX_TC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
/// nvcc's loop unrolling (nothing in the emulation, whose compiler would warn).
#define MOEFLEX_TC_UNROLL _Pragma("unroll")
#endif

#include <cstdint>

namespace moeflex::ops::cuda::tc {

#ifdef MOEFLEX_WMMA_EMULATION
namespace wm = moeflex::emu::wmma;
using bfr = moeflex::emu::bfr;
using emu::bfr_to_float;
using emu::float_to_bfr;
#else
namespace wm = nvcuda::wmma;
using bfr = __nv_bfloat16;
__device__ __forceinline__ float bfr_to_float(bfr x) { return __bfloat162float(x); }
__device__ __forceinline__ bfr float_to_bfr(float x) { return __float2bfloat16(x); }
#endif

constexpr int kRows = 64;     ///< rows a block owns, and rows of a staged tile
constexpr int kWarpRows = 16;  ///< rows a warp owns (one WMMA tile)
constexpr int kThreads = 128;  ///< 4 warps

/// head_dim rounded up to the WMMA tile (16).
constexpr int padded_head_dim(std::int64_t hd) { return int((hd + 15) / 16 * 16); }

/// The padded head dimensions the kernels are instantiated for (attention.cu): the
/// smallest of 32, 48, 64, 96 and 128 that holds hd (hd <= 128).
constexpr int instantiated_head_dim(std::int64_t hd) {
  return hd <= 32 ? 32 : hd <= 48 ? 48 : hd <= 64 ? 64 : hd <= 96 ? 96 : 128;
}

/// Element (s, d) of head bh = b * H + h in [B, S, H, hd]: base + s * stride + d.
struct TcHead {
  std::int64_t base, stride;
};
__device__ __forceinline__ TcHead tc_head(std::int64_t bh, std::int64_t S, std::int64_t H, int hd) {
  const std::int64_t b = bh / H, h = bh % H;
  return {b * S * H * hd + h * hd, H * hd};
}
/// The key/value head query head bh = b * H + h reads in [B, S, Hkv, hd]: kv head
/// h / (H / Hkv) of sequence b (grouped-query attention; Hkv = H: the same head).
__device__ __forceinline__ TcHead tc_kv_head(std::int64_t bh, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                                             int hd) {
  const std::int64_t b = bh / H, g = (bh % H) / (H / Hkv);
  return {b * S * Hkv * hd + g * hd, Hkv * hd};
}

/// Rows [r0, r0 + 64) of one head into a [64][HDP] bf16 tile, zeros past S or hd.
template <int HDP>
__device__ __forceinline__ void tc_load_tile(bfr* tile, const bfr* __restrict__ src, TcHead h, std::int64_t r0,
                                             std::int64_t S, int hd) {
  for (int idx = threadIdx.x; idx < kRows * HDP; idx += kThreads) {
    const int j = idx / HDP, d = idx % HDP;
    const std::int64_t r = r0 + j;
    tile[idx] = (r < S && d < hd) ? src[h.base + r * h.stride + d] : float_to_bfr(0.0f);
  }
}

/// C[16][64] (fp32, row stride 64) = A[16][HDP] B^T where B is [64][HDP]: A's rows
/// against B's rows (S = Q K^T, S^T = K Q^T, dP = dO V^T, dP^T = V dO^T).
template <int HDP>
__device__ __forceinline__ void tc_rows_dot_rows(float* C, const bfr* A, const bfr* B) {
MOEFLEX_TC_UNROLL
  for (int n = 0; n < kRows / 16; ++n) {
    wm::fragment<wm::accumulator, 16, 16, 16, float> c;
    wm::fill_fragment(c, 0.0f);
MOEFLEX_TC_UNROLL
    for (int kk = 0; kk < HDP / 16; ++kk) {
      wm::fragment<wm::matrix_a, 16, 16, 16, bfr, wm::row_major> a;
      wm::fragment<wm::matrix_b, 16, 16, 16, bfr, wm::col_major> b;
      wm::load_matrix_sync(a, A + kk * 16, HDP);
      wm::load_matrix_sync(b, B + n * 16 * HDP + kk * 16, HDP);
      wm::mma_sync(c, a, b, c);
    }
    wm::store_matrix_sync(C + n * 16, c, kRows, wm::mem_row_major);
  }
}

/// acc[n] += P[16][64] (bf16, row stride 64) x V[64][HDP] (bf16) for each 16-column
/// slice n of HDP.
template <int HDP>
__device__ __forceinline__ void tc_acc_p_times(wm::fragment<wm::accumulator, 16, 16, 16, float> (&acc)[HDP / 16],
                                               const bfr* P, const bfr* V) {
MOEFLEX_TC_UNROLL
  for (int kk = 0; kk < kRows / 16; ++kk) {
    wm::fragment<wm::matrix_a, 16, 16, 16, bfr, wm::row_major> a;
    wm::load_matrix_sync(a, P + kk * 16, kRows);
MOEFLEX_TC_UNROLL
    for (int n = 0; n < HDP / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, bfr, wm::row_major> b;
      wm::load_matrix_sync(b, V + kk * 16 * HDP + n * 16, HDP);
      wm::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

/// Shared memory of each kernel, in bytes, for a padded head dimension HDP.
constexpr int tc_forward_smem(int HDP) {
  return 3 * kRows * HDP * 2 + kRows * kRows * 4 + kRows * kRows * 2 + kRows * HDP * 4 + 3 * kRows * 4;
}
constexpr int tc_dq_smem(int HDP) {
  return 4 * kRows * HDP * 2 + 2 * kRows * kRows * 4 + kRows * kRows * 2 + 2 * kRows * 4;
}
constexpr int tc_dkdv_smem(int HDP) {
  return 4 * kRows * HDP * 2 + 2 * kRows * kRows * 4 + 2 * kRows * kRows * 2 + 2 * kRows * 4;
}

/// Forward: out (=) and lse (=). Grid (ceil(S / 64), B * H), 128 threads,
/// tc_forward_smem(HDP) bytes of dynamic shared memory.
template <int HDP>
__global__ void __launch_bounds__(kThreads)
    tc_attention_forward(const bfr* __restrict__ q, const bfr* __restrict__ k, const bfr* __restrict__ v,
                         bfr* __restrict__ out, float* __restrict__ lse, std::int64_t S, std::int64_t H,
                         std::int64_t Hkv, int hd, float scale) {
  MOEFLEX_TC_SMEM(tc_smem);
  bfr* Qs = reinterpret_cast<bfr*>(tc_smem);  // [64][HDP]
  bfr* Ks = Qs + kRows * HDP;                  // [64][HDP]
  bfr* Vs = Ks + kRows * HDP;                  // [64][HDP]
  float* Sb = reinterpret_cast<float*>(Vs + kRows * HDP);  // [64][64] scores
  bfr* Pb = reinterpret_cast<bfr*>(Sb + kRows * kRows);    // [64][64] P in bf16
  float* Ob = reinterpret_cast<float*>(Pb + kRows * kRows);  // [64][HDP] output accumulator
  float* row_m = Ob + kRows * HDP;
  float* row_l = row_m + kRows;
  float* row_c = row_l + kRows;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t bh = blockIdx.y;
  const TcHead h = tc_head(bh, S, H, hd), kvh = tc_kv_head(bh, S, H, Hkv, hd);
  const std::int64_t q0 = std::int64_t(blockIdx.x) * kRows;
  tc_load_tile<HDP>(Qs, q, h, q0, S, hd);
  for (int i = threadIdx.x; i < kRows * HDP; i += kThreads) Ob[i] = 0.0f;
  if (threadIdx.x < kRows) {
    row_m[threadIdx.x] = -INFINITY;
    row_l[threadIdx.x] = 0.0f;
  }
  const int w0 = warp * kWarpRows;  // the warp's first row in the block
  float* Sw = Sb + w0 * kRows;
  bfr* Pw = Pb + w0 * kRows;
  float* Ow = Ob + w0 * HDP;
  const std::int64_t q_end = q0 + kRows < S ? q0 + kRows : S;
  for (std::int64_t k0 = 0; k0 < q_end; k0 += kRows) {
    __syncthreads();  // the previous tile's K and V are no longer read
    tc_load_tile<HDP>(Ks, k, kvh, k0, S, hd);
    tc_load_tile<HDP>(Vs, v, kvh, k0, S, hd);
    __syncthreads();
    tc_rows_dot_rows<HDP>(Sw, Qs + w0 * HDP, Ks);
    __syncwarp();
    if (lane < kWarpRows) {  // lane r: row w0 + r
      const int r = w0 + lane;
      const std::int64_t row = q0 + r;
      float* s = Sw + lane * kRows;
      const float m_old = row_m[r];
      float m_new = m_old;
      for (int j = 0; j < kRows; ++j) {
        const std::int64_t key = k0 + j;
        // Not fused with the subtraction below: the backward rebuilds the same value.
        const float x = (row < S && key <= row) ? __fmul_rn(s[j], scale) : -INFINITY;
        s[j] = x;
        m_new = fmaxf(m_new, x);
      }
      float sum = 0.0f;
      for (int j = 0; j < kRows; ++j) {
        const float p = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
        Pw[lane * kRows + j] = float_to_bfr(p);
        sum += p;
      }
      const float c = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
      row_c[r] = c;
      row_m[r] = m_new;
      row_l[r] = row_l[r] * c + sum;
    }
    __syncwarp();
    for (int i = lane; i < kWarpRows * HDP; i += 32) Ow[i] *= row_c[w0 + i / HDP];
    __syncwarp();
    wm::fragment<wm::accumulator, 16, 16, 16, float> acc[HDP / 16];
MOEFLEX_TC_UNROLL
    for (int n = 0; n < HDP / 16; ++n) wm::load_matrix_sync(acc[n], Ow + n * 16, HDP, wm::mem_row_major);
    tc_acc_p_times<HDP>(acc, Pw, Vs);
MOEFLEX_TC_UNROLL
    for (int n = 0; n < HDP / 16; ++n) wm::store_matrix_sync(Ow + n * 16, acc[n], HDP, wm::mem_row_major);
    __syncwarp();
  }
  for (int i = lane; i < kWarpRows * HDP; i += 32) {
    const int r = w0 + i / HDP, d = i % HDP;
    const std::int64_t row = q0 + r;
    if (row < S && d < hd) out[h.base + row * h.stride + d] = float_to_bfr(Ow[i] / row_l[r]);
  }
  if (lane < kWarpRows) {
    const int r = w0 + lane;
    const std::int64_t row = q0 + r;
    if (row < S) lse[bh * S + row] = row_m[r] + logf(row_l[r]);
  }
}

/// dq (=) and D (=, [B, H, S] fp32, for tc_attention_dkdv). Grid (ceil(S / 64), B * H),
/// 128 threads, tc_dq_smem(HDP) bytes of dynamic shared memory.
template <int HDP>
__global__ void __launch_bounds__(kThreads)
    tc_attention_dq(const bfr* __restrict__ q, const bfr* __restrict__ k, const bfr* __restrict__ v,
                    const bfr* __restrict__ dout, const float* __restrict__ lse, float* __restrict__ D,
                    bfr* __restrict__ dq, std::int64_t S, std::int64_t H, std::int64_t Hkv, int hd,
                    float scale) {
  MOEFLEX_TC_SMEM(tc_smem);
  bfr* Qs = reinterpret_cast<bfr*>(tc_smem);  // [64][HDP]
  bfr* dOs = Qs + kRows * HDP;                 // [64][HDP]
  bfr* Ks = dOs + kRows * HDP;                 // [64][HDP]
  bfr* Vs = Ks + kRows * HDP;                  // [64][HDP]
  float* Sb = reinterpret_cast<float*>(Vs + kRows * HDP);  // [64][64]
  float* dPb = Sb + kRows * kRows;                         // [64][64]
  bfr* dSb = reinterpret_cast<bfr*>(dPb + kRows * kRows);  // [64][64]
  float* row_lse = reinterpret_cast<float*>(dSb + kRows * kRows);
  float* row_D = row_lse + kRows;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t bh = blockIdx.y;
  const TcHead h = tc_head(bh, S, H, hd), kvh = tc_kv_head(bh, S, H, Hkv, hd);
  const std::int64_t q0 = std::int64_t(blockIdx.x) * kRows;
  tc_load_tile<HDP>(Qs, q, h, q0, S, hd);
  tc_load_tile<HDP>(dOs, dout, h, q0, S, hd);
  if (threadIdx.x < kRows) {
    const std::int64_t row = q0 + threadIdx.x;
    row_lse[threadIdx.x] = row < S ? lse[bh * S + row] : 0.0f;
    row_D[threadIdx.x] = 0.0f;
  }
  const int w0 = warp * kWarpRows;
  float* Sw = Sb + w0 * kRows;
  float* dPw = dPb + w0 * kRows;
  bfr* dSw = dSb + w0 * kRows;
  const std::int64_t q_end = q0 + kRows < S ? q0 + kRows : S;
  wm::fragment<wm::accumulator, 16, 16, 16, float> acc[HDP / 16];
MOEFLEX_TC_UNROLL
  for (int n = 0; n < HDP / 16; ++n) wm::fill_fragment(acc[n], 0.0f);
  for (int pass = 0; pass < 2; ++pass) {  // 0: D; 1: dq
    for (std::int64_t k0 = 0; k0 < q_end; k0 += kRows) {
      __syncthreads();
      tc_load_tile<HDP>(Ks, k, kvh, k0, S, hd);
      tc_load_tile<HDP>(Vs, v, kvh, k0, S, hd);
      __syncthreads();
      tc_rows_dot_rows<HDP>(Sw, Qs + w0 * HDP, Ks);
      tc_rows_dot_rows<HDP>(dPw, dOs + w0 * HDP, Vs);
      __syncwarp();
      if (lane < kWarpRows) {
        const int r = w0 + lane;
        const std::int64_t row = q0 + r;
        const float* s = Sw + lane * kRows;
        const float* dp = dPw + lane * kRows;
        const float l = row_lse[r], Dr = row_D[r];
        float sum = 0.0f;
        for (int j = 0; j < kRows; ++j) {
          const std::int64_t key = k0 + j;
          const bool live = row < S && key <= row;
          const float p = live ? expf(__fmul_rn(s[j], scale) - l) : 0.0f;
          if (pass == 0) {
            sum += p * dp[j];
          } else {
            dSw[lane * kRows + j] = float_to_bfr(live && row > 0 ? p * (dp[j] - Dr) : 0.0f);
          }
        }
        if (pass == 0) row_D[r] = Dr + sum;
      }
      __syncwarp();
      if (pass == 1) tc_acc_p_times<HDP>(acc, dSw, Ks);
    }
  }
  __syncthreads();  // K and V tiles are done: their space holds the fp32 dq rows
  float* dQb = reinterpret_cast<float*>(Ks);  // [64][HDP] fp32 = the K and V tiles' bytes
  float* dQw = dQb + w0 * HDP;
MOEFLEX_TC_UNROLL
  for (int n = 0; n < HDP / 16; ++n) wm::store_matrix_sync(dQw + n * 16, acc[n], HDP, wm::mem_row_major);
  __syncwarp();
  for (int i = lane; i < kWarpRows * HDP; i += 32) {
    const int r = w0 + i / HDP, d = i % HDP;
    const std::int64_t row = q0 + r;
    if (row < S && d < hd) dq[h.base + row * h.stride + d] = float_to_bfr(dQw[i] * scale);
  }
  if (lane < kWarpRows) {
    const std::int64_t row = q0 + w0 + lane;
    if (row < S) D[bh * S + row] = row_D[w0 + lane];
  }
}

/// dk (=) and dv (=), from D of tc_attention_dq, each kv head's summed over the
/// H / Hkv query heads that read it. Grid (ceil(S / 64), B * Hkv), 128 threads,
/// tc_dkdv_smem(HDP) bytes of dynamic shared memory.
template <int HDP>
__global__ void __launch_bounds__(kThreads)
    tc_attention_dkdv(const bfr* __restrict__ q, const bfr* __restrict__ k, const bfr* __restrict__ v,
                      const bfr* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ D,
                      bfr* __restrict__ dk, bfr* __restrict__ dv, std::int64_t S, std::int64_t H,
                      std::int64_t Hkv, int hd, float scale) {
  MOEFLEX_TC_SMEM(tc_smem);
  bfr* Ks = reinterpret_cast<bfr*>(tc_smem);  // [64][HDP] this block's keys
  bfr* Vs = Ks + kRows * HDP;                  // [64][HDP]
  bfr* Qs = Vs + kRows * HDP;                  // [64][HDP] query tile
  bfr* dOs = Qs + kRows * HDP;                 // [64][HDP]
  float* Sb = reinterpret_cast<float*>(dOs + kRows * HDP);  // [64 keys][64 queries]
  float* dPb = Sb + kRows * kRows;
  bfr* Pb = reinterpret_cast<bfr*>(dPb + kRows * kRows);
  bfr* dSb = Pb + kRows * kRows;
  float* col_lse = reinterpret_cast<float*>(dSb + kRows * kRows);
  float* col_D = col_lse + kRows;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t bg = blockIdx.y, group = H / Hkv;  // kv head g = bg % Hkv of sequence bg / Hkv
  const TcHead kvh = tc_head(bg, S, Hkv, hd);
  const std::int64_t key0 = std::int64_t(blockIdx.x) * kRows;
  tc_load_tile<HDP>(Ks, k, kvh, key0, S, hd);
  tc_load_tile<HDP>(Vs, v, kvh, key0, S, hd);
  const int w0 = warp * kWarpRows;
  float* Sw = Sb + w0 * kRows;
  float* dPw = dPb + w0 * kRows;
  bfr* Pw = Pb + w0 * kRows;
  bfr* dSw = dSb + w0 * kRows;
  wm::fragment<wm::accumulator, 16, 16, 16, float> dk_acc[HDP / 16], dv_acc[HDP / 16];
MOEFLEX_TC_UNROLL
  for (int n = 0; n < HDP / 16; ++n) {
    wm::fill_fragment(dk_acc[n], 0.0f);
    wm::fill_fragment(dv_acc[n], 0.0f);
  }
  // The query tiles at or after the block's keys, of each query head of kv head g in turn.
  const std::int64_t tiles = (S - key0 + kRows - 1) / kRows;
  for (std::int64_t tile = 0; tile < group * tiles; ++tile) {
    const std::int64_t q0 = key0 + (tile % tiles) * kRows;
    const std::int64_t bh = (bg / Hkv) * H + (bg % Hkv) * group + tile / tiles;
    const TcHead h = tc_head(bh, S, H, hd);
    __syncthreads();
    tc_load_tile<HDP>(Qs, q, h, q0, S, hd);
    tc_load_tile<HDP>(dOs, dout, h, q0, S, hd);
    if (threadIdx.x < kRows) {
      const std::int64_t r = q0 + threadIdx.x;
      col_lse[threadIdx.x] = r < S ? lse[bh * S + r] : 0.0f;
      col_D[threadIdx.x] = r < S ? D[bh * S + r] : 0.0f;
    }
    __syncthreads();
    tc_rows_dot_rows<HDP>(Sw, Ks + w0 * HDP, Qs);
    tc_rows_dot_rows<HDP>(dPw, Vs + w0 * HDP, dOs);
    __syncwarp();
    if (lane < kWarpRows) {  // lane r: key w0 + r of the block
      const std::int64_t key = key0 + w0 + lane;
      const float* s = Sw + lane * kRows;
      const float* dp = dPw + lane * kRows;
      for (int i = 0; i < kRows; ++i) {
        const std::int64_t query = q0 + i;
        const bool live = key < S && query < S && query >= key;
        const float p = live ? expf(__fmul_rn(s[i], scale) - col_lse[i]) : 0.0f;
        Pw[lane * kRows + i] = float_to_bfr(p);
        dSw[lane * kRows + i] = float_to_bfr(live && query > 0 ? p * (dp[i] - col_D[i]) : 0.0f);
      }
    }
    __syncwarp();
    tc_acc_p_times<HDP>(dv_acc, Pw, dOs);
    tc_acc_p_times<HDP>(dk_acc, dSw, Qs);
  }
  __syncthreads();  // the query tiles are done: their space holds the fp32 dk, dv rows
  float* dKb = reinterpret_cast<float*>(Qs);  // [64][HDP] fp32 = the Q and dO tiles' bytes
  float* dKw = dKb + w0 * HDP;
MOEFLEX_TC_UNROLL
  for (int n = 0; n < HDP / 16; ++n) wm::store_matrix_sync(dKw + n * 16, dk_acc[n], HDP, wm::mem_row_major);
  __syncwarp();
  for (int i = lane; i < kWarpRows * HDP; i += 32) {
    const int r = w0 + i / HDP, d = i % HDP;
    const std::int64_t key = key0 + r;
    if (key < S && d < hd) dk[kvh.base + key * kvh.stride + d] = float_to_bfr(dKw[i] * scale);
  }
  __syncwarp();
MOEFLEX_TC_UNROLL
  for (int n = 0; n < HDP / 16; ++n) wm::store_matrix_sync(dKw + n * 16, dv_acc[n], HDP, wm::mem_row_major);
  __syncwarp();
  for (int i = lane; i < kWarpRows * HDP; i += 32) {
    const int r = w0 + i / HDP, d = i % HDP;
    const std::int64_t key = key0 + r;
    if (key < S && d < hd) dv[kvh.base + key * kvh.stride + d] = float_to_bfr(dKw[i]);
  }
}

}  // namespace moeflex::ops::cuda::tc
