// Causal multi-head attention on the GPU: our own flash-attention kernels (Dao et al.
// 2022, FlashAttention-2's split of the backward), so the S x S probabilities are
// never stored. CPU reference: ops/attention.h (which does store them).
//   q, out, dout, dq: [B, S, H, hd] and k, v, dk, dv: [B, S, Hkv, hd] of T (float or
//     bf16), token-major with heads interleaved, as the CPU op; grouped-query attention
//     (Ainslie et al. 2023) when Hkv < H: query head h reads kv head h / (H / Hkv), and
//     dk, dv sum over the H / Hkv query heads of a group (one block per key tile owns
//     the whole group, so still no atomics);
//   lse: [B, H, S] float, saved by forward: logsumexp of row i's scaled scores,
//     so backward rebuilds P_ij = exp(q_i k_j / sqrt(hd) - lse_i) exactly.
//   forward:  out (=) = softmax(q k^T / sqrt(hd) + causal mask) v, online softmax.
//   backward: D_i = <dout_i, out_i>; dS = P * (dout v^T - D); dq (=) = dS k / sqrt(hd);
//             dk (=) = dS^T q / sqrt(hd); dv (=) = P^T dout. dq in one kernel (blocks of
//             query rows), dk and dv in another (blocks of key rows): no atomics, so
//             the results are deterministic.
// bf16 runs on the tensor cores (attention_tc.cuh: WMMA tiles, P and dS rounded to
// bf16 for their matmuls as in FlashAttention-2, and D summed exactly from P and dP
// rather than from the rounded out) unless MOEFLEX_ATTENTION_KERNEL=simt; fp32 on
// the CUDA cores as above.
// Float accumulation throughout (expf, not __expf). hd <= 128 (kAttentionMaxHeadDim),
// Hkv a positive divisor of H, and B * H <= 65535, else Error. Device pointers; queued on `stream`.
// FLOPs (causal, counted as the useful half): forward 2*B*H*S*S*hd, backward 2.5x that.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/core/units.h"

namespace moeflex::ops::cuda {

/// Largest head dimension the kernels hold in registers (4 values per lane).
constexpr std::int64_t kAttentionMaxHeadDim = 128;

/// out (=) and lse (=) of causal attention. Throws Error for hd > 128, H % Hkv != 0 or
/// B * H > 65535.
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, float* lse, std::int64_t B, std::int64_t S,
                       std::int64_t H, std::int64_t Hkv, std::int64_t hd, cudaStream_t stream);

/// Bytes of device workspace attention_backward needs (D, one float per row).
Bytes attention_backward_workspace_bytes(std::int64_t B, std::int64_t S, std::int64_t H);

/// dq (=), dk (=), dv (=); `out` and `lse` are the forward's outputs for these q, k, v,
/// `workspace` holds attention_backward_workspace_bytes(B, S, H).
template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const float* lse, T* dq,
                        T* dk, T* dv, float* workspace, std::int64_t B, std::int64_t S, std::int64_t H,
                        std::int64_t Hkv, std::int64_t hd, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
