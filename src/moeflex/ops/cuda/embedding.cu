// Embedding kernels. Semantics: embedding.h.
#include "moeflex/ops/cuda/embedding.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::to_f;

template <typename T>
__global__ void embedding_forward_kernel(const std::int32_t* __restrict__ ids, const T* __restrict__ table,
                                         T* __restrict__ out, std::int64_t n, std::int64_t d) {
  const std::int64_t total = n * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / d, j = e % d;
    out[e] = table[std::int64_t(ids[i]) * d + j];
  }
}

// One thread per column j: walks every token in order, so each dtable element is
// written by one thread only, in token order.
template <typename T>
__global__ void embedding_backward_kernel(const std::int32_t* __restrict__ ids, const T* __restrict__ dout,
                                          float* __restrict__ dtable, std::int64_t n, std::int64_t d) {
  const std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= d) return;
  for (std::int64_t i = 0; i < n; ++i) dtable[std::int64_t(ids[i]) * d + j] += to_f(dout[i * d + j]);
}

}  // namespace

template <typename T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, std::int64_t n, std::int64_t d,
                       cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  embedding_forward_kernel<T><<<detail::grid_for(n * d, 256), 256, 0, stream>>>(ids, table, out, n, d);
  MOEFLEX_CHECK_LAUNCH("embedding_forward");
}

template <typename T>
void embedding_backward(const std::int32_t* ids, const T* dout, float* dtable, std::int64_t n, std::int64_t d,
                        cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  const unsigned blocks = static_cast<unsigned>((d + 127) / 128);
  embedding_backward_kernel<T><<<blocks, 128, 0, stream>>>(ids, dout, dtable, n, d);
  MOEFLEX_CHECK_LAUNCH("embedding_backward");
}

template void embedding_forward<float>(const std::int32_t*, const float*, float*, std::int64_t, std::int64_t,
                                       cudaStream_t);
template void embedding_forward<bf16>(const std::int32_t*, const bf16*, bf16*, std::int64_t, std::int64_t,
                                      cudaStream_t);
template void embedding_backward<float>(const std::int32_t*, const float*, float*, std::int64_t, std::int64_t,
                                        cudaStream_t);
template void embedding_backward<bf16>(const std::int32_t*, const bf16*, float*, std::int64_t, std::int64_t,
                                       cudaStream_t);

}  // namespace moeflex::ops::cuda
