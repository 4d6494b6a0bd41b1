// MoE token dispatch on one rank: route -> permute -> (experts) -> unpermute/combine.
//   topk_idx, topk_w: [n, k]; slot_of: [n*k], the row of assignment (i, j) in the
//   expert-sorted buffer, or -1 when the assignment was dropped by the capacity.
//   counts: [E] kept rows per expert; offsets: [E+1] exclusive prefix sum of counts.
// Capacity (Switch Transformer): capacity = ceil(capacity_factor * n * k / E) rows per
// expert; assignments are taken in (token, slot) order and the rest dropped. A
// capacity_factor <= 0 means dropless. Rows inside an expert keep (token, slot) order.
#pragma once
#include <cstdint>

namespace moeflex::ops {

/// Rows per expert for a capacity factor (-1 when dropless).
std::int64_t expert_capacity(double capacity_factor, std::int64_t n, std::int64_t E, std::int64_t k);

/// Fills counts, offsets and slot_of; returns the number of dropped assignments.
std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                               std::int64_t capacity, std::int32_t* counts, std::int32_t* offsets,
                               std::int32_t* slot_of);

/// xp[slot_of[i*k+j], :] = x[i, :] for kept assignments. x: [n, d], xp: [offsets[E], d].  (=)
template <typename T>
void permute_forward(const T* x, const std::int32_t* slot_of, T* xp, std::int64_t n, std::int64_t k,
                     std::int64_t d);

/// dx[i, :] = sum_j dxp[slot_of[i*k+j], :] over kept j, in j order.  (=)
template <typename T>
void permute_backward(const T* dxp, const std::int32_t* slot_of, T* dx, std::int64_t n, std::int64_t k,
                      std::int64_t d);

/// y[i, :] = sum_j topk_w[i,j] * yp[slot_of[i*k+j], :] over kept j, in j order.  (=)
template <typename T>
void unpermute_forward(const T* yp, const std::int32_t* slot_of, const T* topk_w, T* y, std::int64_t n,
                       std::int64_t k, std::int64_t d);

/// dyp[slot] = topk_w[i,j] * dy[i] (=); dtopk_w[i,j] = <dy[i], yp[slot]> (=, 0 when dropped).
/// Rows of dyp not covered by any kept assignment are left untouched. dtopk_w may be
/// null: then yp is not read (combine_topk_grad computes it window by window).
template <typename T>
void unpermute_backward(const T* dy, const T* yp, const std::int32_t* slot_of, const T* topk_w, T* dyp,
                        T* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d);

/// The top-k weights' gradient for the rows [r0, r0 + rows) of the expert outputs:
/// dtopk_w[i,j] = <dy[i], yp_rows[slot - r0]> (=) for every assignment whose slot
/// lies in the window; the others are left untouched. yp_rows: [rows, d]. The same
/// sums, in the same order, as unpermute_backward's, so covering every row window
/// once gives its dtopk_w bit for bit (the backward's expert chunks do, when the
/// combine's input was not kept: model.cpp).
template <typename T>
void combine_topk_grad(const T* dy, const T* yp_rows, const std::int32_t* slot_of, T* dtopk_w, std::int64_t n,
                       std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows);

}  // namespace moeflex::ops
