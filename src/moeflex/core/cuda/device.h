// CUDA devices: how many there are (without throwing when there is no driver, so
// tests can skip) and what each one is.
#pragma once
#include <string>

#include "moeflex/core/units.h"

namespace moeflex::cuda {

/// Number of usable CUDA devices: 0 when there is no GPU, no driver, or a driver
/// older than the runtime. Never throws, and clears the runtime's error state.
int device_count();

/// A one-line reason why device_count() is 0 ("no CUDA-capable device is
/// detected", "CUDA driver version is insufficient..."), or "" when devices exist.
std::string no_device_reason();

/// What a device is, from cudaGetDeviceProperties.
struct DeviceInfo {
  int index = 0;
  std::string name;              ///< e.g. "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;  ///< compute capability
  int multiprocessors = 0;
  Bytes total_memory = 0;         ///< global memory, bytes
  Bytes l2_bytes = 0;
  Bytes shared_per_block_optin = 0;  ///< max dynamic shared memory per block after opt-in
  int runtime_version = 0;        ///< e.g. 13000
  int driver_version = 0;
};

/// Properties of device `index`; throws CudaError when it does not exist.
DeviceInfo device_info(int index);

/// "NVIDIA H200, cc 9.0, 132 SMs, 139.8 GiB, driver 13.0, runtime 13.0".
std::string describe(const DeviceInfo& info);

/// Makes `index` the calling thread's current device; throws CudaError.
void set_device(int index);

}  // namespace moeflex::cuda
