// Causal multi-head scaled dot-product attention (Vaswani et al. 2017), grouped-query
// when Hkv < H (Ainslie et al. 2023; H a multiple of Hkv, query head h reads kv head
// h / (H / Hkv)).
//   q, out:       [B, S, H, hd]  (token-major, heads interleaved, as a linear layer writes them)
//   k, v:         [B, S, Hkv, hd]
//   probs:        [B, H, S, S]   softmax(q k^T / sqrt(hd) + causal mask), saved for backward;
//                                entries above the diagonal are written as 0.
//   backward: dq (=) [B, S, H, hd], dk, dv (=) [B, S, Hkv, hd] (summed over each kv head's
//             query heads); dprobs_ws: [B, H, S, S] scratch given by the caller.
// FLOPs: forward ~ 4*B*H*S*S*hd (full, the causal half is not skipped by BLAS).
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* probs, std::int64_t B, std::int64_t S,
                       std::int64_t H, std::int64_t Hkv, std::int64_t hd);

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* probs, T* dq, T* dk, T* dv,
                        T* dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                        std::int64_t hd);

}  // namespace moeflex::ops
