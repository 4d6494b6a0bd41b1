// RoPE kernel. Shapes and semantics: rope.h.
// One thread per (token, i < hd/2): it computes the angle's cos/sin once (double
// pow and sincos, rounded to float) and rotates pair i of every head of its token.
#include "moeflex/ops/cuda/rope.h"

#include <string>

#include "moeflex/ops/cuda/device_common.cuh"

namespace moeflex::ops::cuda {
namespace {

using detail::from_f;
using detail::to_f;

template <typename T>
__global__ void rope_kernel(T* __restrict__ x, std::int64_t tokens, std::int64_t seq, std::int64_t heads,
                            std::int64_t hd, double theta, float sign) {
  const std::int64_t half = hd / 2;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < tokens * half;
       idx += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t token = idx / half, i = idx % half;
    const std::int64_t pos = token % seq;
    const double inv_freq = pow(theta, -double(2 * i) / double(hd));
    double s = 0, c = 0;
    sincos(double(pos) * inv_freq, &s, &c);
    const float cf = static_cast<float>(c), sf = sign * static_cast<float>(s);
    for (std::int64_t h = 0; h < heads; ++h) {
      T* lo = x + (token * heads + h) * hd;
      const float a = to_f(lo[i]), b = to_f(lo[i + half]);
      lo[i] = from_f<T>(a * cf - b * sf);
      lo[i + half] = from_f<T>(b * cf + a * sf);
    }
  }
}

template <typename T>
void rope_apply(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                float sign, cudaStream_t stream, const char* name) {
  if (hd % 2 != 0) throw Error("rope: head_dim " + std::to_string(hd) + " must be even");
  const std::int64_t tokens = batch * seq;
  if (tokens <= 0 || heads <= 0 || hd <= 0) return;
  rope_kernel<T><<<detail::grid_for(tokens * (hd / 2), 256), 256, 0, stream>>>(x, tokens, seq, heads, hd, theta,
                                                                               sign);
  MOEFLEX_CHECK_LAUNCH(name);
}

}  // namespace

template <typename T>
void rope_forward(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                  cudaStream_t stream) {
  rope_apply(x, batch, seq, heads, hd, theta, 1.0f, stream, "rope_forward");
}

template <typename T>
void rope_backward(T* dx, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd, double theta,
                   cudaStream_t stream) {
  rope_apply(dx, batch, seq, heads, hd, theta, -1.0f, stream, "rope_backward");
}

template void rope_forward<float>(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double,
                                  cudaStream_t);
template void rope_forward<bf16>(bf16*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double, cudaStream_t);
template void rope_backward<float>(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double,
                                   cudaStream_t);
template void rope_backward<bf16>(bf16*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, double,
                                  cudaStream_t);

}  // namespace moeflex::ops::cuda
