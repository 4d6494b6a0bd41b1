// The optimizer's element-wise work on the GPU (CPU reference: the CPU backend's
// adamw / square_sum / scale, ops/backend.cpp, used by train/optimizer.h), fp32.
//   adamw: m, v, w updated in place (=) with the float constants the host computed:
//     m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//     w = w * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps).
//   square_sum_partials: partial[c] (=) = sum of g[j]^2 in double over the chunk
//     [c*4096, (c+1)*4096), one block per chunk in a fixed tree order; the host
//     adds the partials in chunk order (as the CPU code does).
//   scale: g *= s.
// Device pointers; queued on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeflex::ops::cuda {

/// Elements per partial sum of square_sum_partials (the CPU code's chunk).
constexpr std::int64_t kSquareSumChunk = 4096;

void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps, float decay,
           float step_size, float inv_sqrt_bc2, cudaStream_t stream);

/// partial: ceil(n / kSquareSumChunk) doubles.
void square_sum_partials(const float* g, std::int64_t n, double* partial, cudaStream_t stream);

void scale(float* g, std::int64_t n, float s, cudaStream_t stream);

}  // namespace moeflex::ops::cuda
