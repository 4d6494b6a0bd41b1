// Grouped GEMM over experts with variable row counts (one GEMM per non-empty group).
//   x: [rows, in] sorted by expert, offsets: [E+1]; w: [E, out, in]; y: [rows, out].
//   forward:  y[o_e:o_{e+1}] = x[o_e:o_{e+1}] @ w_e^T            (=)
//   backward: dx = dy @ w_e (=); dw_e += dy_e^T @ x_e (+=); dx or dw may be null.
// FLOPs: forward 2*rows*in*out.
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void grouped_linear_forward(const T* x, const T* w, T* y, const std::int32_t* offsets, std::int64_t E,
                            std::int64_t in, std::int64_t out);

template <typename T>
void grouped_linear_backward(const T* dy, const T* x, const T* w, T* dx, T* dw, const std::int32_t* offsets,
                             std::int64_t E, std::int64_t in, std::int64_t out);

/// Sequential-experts reference (tests only): for every token i and kept slot j,
/// y[i] += topk_w[i,j] * W2_e (silu(W1_e x_i) * (W3_e x_i)) with e = topk_idx[i,j], one
/// matrix-vector product at a time. y: [n, d] (=). w1, w3: [E, f, d]; w2: [E, d, f].
template <typename T>
void moe_experts_reference(const T* x, const std::int32_t* topk_idx, const T* topk_w, const std::int32_t* slot_of,
                           const T* w1, const T* w3, const T* w2, T* y, std::int64_t n, std::int64_t d,
                           std::int64_t f, std::int64_t k);

}  // namespace moeflex::ops
