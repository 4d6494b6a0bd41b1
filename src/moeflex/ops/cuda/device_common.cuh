// Device-side helpers shared by the CUDA kernels (included by .cu files only):
// float <-> storage-type conversion, warp and block reductions, launch sizing.
// Arithmetic is float everywhere: bf16 is only a storage format, widened on load
// and rounded to nearest even (__float2bfloat16_rn) on store.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::ops::cuda::detail {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(moeflex::bf16 x) { return __bfloat162float(__ushort_as_bfloat16(x.bits)); }

/// Converts a float to the storage type T (round to nearest even for bf16).
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ moeflex::bf16 from_f<moeflex::bf16>(float x) {
  moeflex::bf16 b;
  b.bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  return b;
}

/// Sum over the 32 lanes of a warp; every lane gets the same result (a fixed
/// butterfly order, so the bits do not depend on scheduling).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

/// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Sum over all threads of a block (blockDim.x a multiple of 32, at most 1024);
/// every thread gets the result. `scratch` holds 32 floats of shared memory.
/// Contains __syncthreads: call it from every thread of the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(t);
}

/// Blocks of `threads` covering `n` items, capped for grid-stride loops.
inline unsigned grid_for(std::int64_t n, int threads, std::int64_t cap = 65535LL * 8) {
  std::int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return static_cast<unsigned>(g);
}

}  // namespace moeflex::ops::cuda::detail
