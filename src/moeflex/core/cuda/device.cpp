#include "moeflex/core/cuda/device.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::cuda {

void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw CudaError(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err), cudaGetErrorString(err),
                              what, file, line));
}

void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw CudaError(fmt::format("CUDA error {} ({}) launching kernel {} at {}:{}", cudaGetErrorName(err),
                                cudaGetErrorString(err), kernel, file, line));
}

namespace {
cudaError_t query_count(int& n) {
  n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  cudaGetLastError();  // a failed query must not poison later calls' error state
  if (err != cudaSuccess) n = 0;
  return err;
}
}  // namespace

int device_count() {
  int n = 0;
  query_count(n);
  return n;
}

std::string no_device_reason() {
  int n = 0;
  const cudaError_t err = query_count(n);
  if (err != cudaSuccess) return fmt::format("{}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
  return n == 0 ? "cudaGetDeviceCount reports 0 devices" : "";
}

DeviceInfo device_info(int index) {
  cudaDeviceProp p{};
  MOEFLEX_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  DeviceInfo info;
  info.index = index;
  info.name = p.name;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.multiprocessors = p.multiProcessorCount;
  info.total_memory = static_cast<Bytes>(p.totalGlobalMem);
  info.l2_bytes = p.l2CacheSize;
  info.shared_per_block_optin = static_cast<Bytes>(p.sharedMemPerBlockOptin);
  MOEFLEX_CUDA_CHECK(cudaRuntimeGetVersion(&info.runtime_version));
  MOEFLEX_CUDA_CHECK(cudaDriverGetVersion(&info.driver_version));
  return info;
}

std::string describe(const DeviceInfo& i) {
  return fmt::format("{}, cc {}.{}, {} SMs, {}, L2 {}, driver {}.{}, runtime {}.{}", i.name, i.cc_major, i.cc_minor,
                     i.multiprocessors, format_bytes(i.total_memory), format_bytes(i.l2_bytes),
                     i.driver_version / 1000, i.driver_version % 1000 / 10, i.runtime_version / 1000,
                     i.runtime_version % 1000 / 10);
}

void set_device(int index) { MOEFLEX_CUDA_CHECK(cudaSetDevice(index)); }

}  // namespace moeflex::cuda
