// Embedding kernels. Semantics: embedding.h.
#include "moeflex/ops/cuda/embedding.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

__global__ void embedding_forward_kernel(const std::int32_t* __restrict__ ids, const float* __restrict__ table,
                                         float* __restrict__ out, std::int64_t n, std::int64_t d) {
  const std::int64_t total = n * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / d, j = e % d;
    out[e] = table[std::int64_t(ids[i]) * d + j];
  }
}

// One thread per column j: walks every token in order, so each dtable element is
// written by one thread only, in token order.
__global__ void embedding_backward_kernel(const std::int32_t* __restrict__ ids, const float* __restrict__ dout,
                                          float* __restrict__ dtable, std::int64_t n, std::int64_t d) {
  const std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= d) return;
  for (std::int64_t i = 0; i < n; ++i) dtable[std::int64_t(ids[i]) * d + j] += dout[i * d + j];
}

}  // namespace

void embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t n, std::int64_t d,
                       cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  embedding_forward_kernel<<<detail::grid_for(n * d, 256), 256, 0, stream>>>(ids, table, out, n, d);
  MOEFLEX_CHECK_LAUNCH("embedding_forward");
}

void embedding_backward(const std::int32_t* ids, const float* dout, float* dtable, std::int64_t n, std::int64_t d,
                        cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  const unsigned blocks = static_cast<unsigned>((d + 127) / 128);
  embedding_backward_kernel<<<blocks, 128, 0, stream>>>(ids, dout, dtable, n, d);
  MOEFLEX_CHECK_LAUNCH("embedding_backward");
}

}  // namespace moeflex::ops::cuda
