// MoE token dispatch on one GPU (CPU reference: ops/moe_dispatch.h): the capacity
// plan, permute into the expert-sorted buffer and unpermute (weighted combine).
//   topk_idx: [n, k] int32; topk_w, dtopk_w: [n, k] float (the router runs in fp32);
//   slot_of: [n*k] int32, the row of assignment (i, j) in the expert-sorted buffer or
//   -1 when dropped; counts: [E], offsets: [E+1] int32.
//   x, dx, y, dy: [n, d] of T; xp, dxp, yp, dyp: [offsets[E], d] of T (float or bf16).
//   moe_plan_dispatch: counts, offsets, slot_of (=), exactly the CPU plan: ranks in
//     (token, slot) order, capacity = ceil(cf * n * k / E) (ops::expert_capacity),
//     dropless when capacity < 0.
//   permute_forward:    xp[slot] = x[i] (=)         permute_backward:  dx[i] = sum_j dxp[slot] (=)
//   unpermute_forward:  y[i] = sum_j w_ij yp[slot] (=)
//   unpermute_backward: dyp[slot] = w_ij dy[i] (=); dtopk_w[i,j] = <dy[i], yp[slot]> (=, 0 when dropped)
// Sums over j run in j order in float, one thread per output element: deterministic.
// Device pointers; queued on `stream`. moe_plan_dispatch synchronizes the stream: it
// returns the offsets on the host, which the grouped GEMM needs as its group sizes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/core/units.h"

namespace moeflex::ops::cuda {

/// Bytes of device workspace moe_plan_dispatch needs.
constexpr Bytes moe_plan_workspace_bytes() { return 2 * sizeof(std::int64_t); }

/// Fills counts, offsets and slot_of on the device and host_offsets [E+1] on the
/// host; returns the number of dropped assignments. Throws Error when an expert
/// index is outside [0, E) or n * k exceeds the int32 slot index.
std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                               std::int64_t capacity, std::int32_t* counts, std::int32_t* offsets,
                               std::int32_t* slot_of, std::int32_t* host_offsets, void* workspace,
                               cudaStream_t stream);

/// xp[slot_of[i*k+j]] (=) = x[i] for kept assignments.
template <typename T>
void permute_forward(const T* x, const std::int32_t* slot_of, T* xp, std::int64_t n, std::int64_t k, std::int64_t d,
                     cudaStream_t stream);

/// dx[i] (=) = sum over kept j, in j order, of dxp[slot_of[i*k+j]].
template <typename T>
void permute_backward(const T* dxp, const std::int32_t* slot_of, T* dx, std::int64_t n, std::int64_t k,
                      std::int64_t d, cudaStream_t stream);

/// y[i] (=) = sum over kept j, in j order, of topk_w[i,j] * yp[slot_of[i*k+j]].
template <typename T>
void unpermute_forward(const T* yp, const std::int32_t* slot_of, const float* topk_w, T* y, std::int64_t n,
                       std::int64_t k, std::int64_t d, cudaStream_t stream);

/// dyp[slot] (=) = topk_w[i,j] dy[i]; dtopk_w[i,j] (=) = <dy[i], yp[slot]>, 0 when
/// dropped. Rows of dyp not covered by any kept assignment are left untouched.
template <typename T>
void unpermute_backward(const T* dy, const T* yp, const std::int32_t* slot_of, const float* topk_w, T* dyp,
                        float* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d, cudaStream_t stream);

/// dtopk_w[i,j] (=) = <dy[i], yp_rows[slot - r0]> for the slots in [r0, r0 + rows),
/// others untouched (ops::combine_topk_grad), summed as unpermute_backward sums
/// (same threads, same block reduction): equal bits.
template <typename T>
void combine_topk_grad(const T* dy, const T* yp_rows, const std::int32_t* slot_of, float* dtopk_w, std::int64_t n,
                       std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
