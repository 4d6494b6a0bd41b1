// Residual add, casts and gradient accumulation (grid-stride). Semantics: residual.h.
#include "moeflex/ops/cuda/residual.h"

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

template <typename S, typename D>
__global__ void cast_kernel(const S* __restrict__ src, D* __restrict__ dst, std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<D>(to_f(src[i]));
}

template <typename T>
__global__ void accumulate_kernel(const T* __restrict__ src, float* __restrict__ dst, std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    dst[i] += to_f(src[i]);
}

}  // namespace

template <typename T>
void residual_add(const T* a, const T* b, T* out, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_kernel<T><<<detail::grid_for(n, 256), 256, 0, stream>>>(a, b, out, n);
  MOEFLEX_CHECK_LAUNCH("residual_add");
}

void cast(const float* src, bf16* dst, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_kernel<float, bf16><<<detail::grid_for(n, 256), 256, 0, stream>>>(src, dst, n);
  MOEFLEX_CHECK_LAUNCH("cast f32->bf16");
}

void cast(const bf16* src, float* dst, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_kernel<bf16, float><<<detail::grid_for(n, 256), 256, 0, stream>>>(src, dst, n);
  MOEFLEX_CHECK_LAUNCH("cast bf16->f32");
}

template <typename T>
void accumulate(const T* src, float* dst, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  accumulate_kernel<T><<<detail::grid_for(n, 256), 256, 0, stream>>>(src, dst, n);
  MOEFLEX_CHECK_LAUNCH("accumulate");
}

template void residual_add<float>(const float*, const float*, float*, std::int64_t, cudaStream_t);
template void residual_add<bf16>(const bf16*, const bf16*, bf16*, std::int64_t, cudaStream_t);
template void accumulate<float>(const float*, float*, std::int64_t, cudaStream_t);
template void accumulate<bf16>(const bf16*, float*, std::int64_t, cudaStream_t);

}  // namespace moeflex::ops::cuda
