// Token embedding on the GPU (CPU reference: ops/embedding.h), fp32.
//   ids: [n] int32 in [0, V) (device memory); table, dtable: [V, d]; out, dout: [n, d].
//   forward:  out[i] (=) = table[ids[i]].
//   backward: dtable[ids[i]] += dout[i] (+=), one thread per column walking the
//             tokens in order: no atomics, so repeated ids add up in token order
//             (deterministic, and the same order as the CPU reference).
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeflex::ops::cuda {

/// out (=) = table[ids].
void embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t n, std::int64_t d,
                       cudaStream_t stream);

/// dtable (+=) scatter of dout by ids.
void embedding_backward(const std::int32_t* ids, const float* dout, float* dtable, std::int64_t n, std::int64_t d,
                        cudaStream_t stream);

}  // namespace moeflex::ops::cuda
