// Token embedding on the GPU (CPU reference: ops/embedding.h).
//   ids: [n] int32 in [0, V) (device memory); table: [V, d], out, dout: [n, d] of T
//   (float, or bf16: the working copy of the table); dtable: [V, d] float (the fp32
//   gradient).
//   forward:  out[i] (=) = table[ids[i]] (a copy).
//   backward: dtable[ids[i]] += dout[i] (+=, in float), one thread per column walking
//             the tokens in order: no atomics, so repeated ids add up in token order
//             (deterministic, and the same order as the CPU reference).
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"

namespace moeflex::ops::cuda {

/// out (=) = table[ids].
template <typename T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, std::int64_t n, std::int64_t d,
                       cudaStream_t stream);

/// dtable (+=) scatter of dout by ids.
template <typename T>
void embedding_backward(const std::int32_t* ids, const T* dout, float* dtable, std::int64_t n, std::int64_t d,
                        cudaStream_t stream);

}  // namespace moeflex::ops::cuda
