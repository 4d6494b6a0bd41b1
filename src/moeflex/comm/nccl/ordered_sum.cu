// The rank-order fold of the NCCL backend's deterministic sums (see
// nccl_communicator.h): out[i] = ((b_0[i] + b_1[i]) + b_2[i]) + ..., one thread per
// element, so the bits equal the MPI backend's CPU fold.
#include "moeflex/comm/nccl/nccl_communicator.h"
#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::comm::detail {
namespace {

template <class T>
__global__ void ordered_sum_kernel(const T* __restrict__ blocks, T* __restrict__ out, int parts, std::int64_t len) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < len;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    T s = blocks[i];
    for (int q = 1; q < parts; ++q) s += blocks[std::int64_t(q) * len + i];
    out[i] = s;
  }
}

}  // namespace

template <class T>
void ordered_sum(const T* blocks, T* out, int parts, std::int64_t len, cudaStream_t stream) {
  if (len <= 0 || parts <= 0) return;
  std::int64_t grid = (len + 255) / 256;
  if (grid > 65535 * 8) grid = 65535 * 8;
  ordered_sum_kernel<T><<<static_cast<unsigned>(grid), 256, 0, stream>>>(blocks, out, parts, len);
  MOEFLEX_CHECK_LAUNCH("ordered_sum");
}

template void ordered_sum<float>(const float*, float*, int, std::int64_t, cudaStream_t);
template void ordered_sum<double>(const double*, double*, int, std::int64_t, cudaStream_t);

}  // namespace moeflex::comm::detail
