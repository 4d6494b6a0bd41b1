// Typed errors for the CUDA runtime: every failing call becomes a CudaError whose
// message names the call, the CUDA error and where it happened.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "moeflex/core/error.h"

namespace moeflex::cuda {

/// A failed CUDA runtime, cuBLAS or NCCL call, or a failed kernel launch. The
/// message names the call, the library's error name and text, and the source line.
class CudaError : public Error {
 public:
  using Error::Error;
};

/// Throws CudaError for `err` (which must not be cudaSuccess); `what` is the failing
/// expression, file/line where it was checked.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);

/// Throws CudaError if the last kernel launch on this thread failed (bad
/// configuration, too much shared memory, no kernel image for the device). Does not
/// wait for the kernel; errors inside a running kernel appear at the next sync.
void check_launch(const char* kernel, const char* file, int line);

}  // namespace moeflex::cuda

/// Throws moeflex::cuda::CudaError when the CUDA runtime call `expr` fails.
#define MOEFLEX_CUDA_CHECK(expr)                                                     \
  do {                                                                               \
    const cudaError_t moeflex_cuda_err_ = (expr);                                    \
    if (moeflex_cuda_err_ != cudaSuccess)                                            \
      ::moeflex::cuda::throw_cuda_error(moeflex_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Checks the launch of the kernel named `name` just issued.
#define MOEFLEX_CHECK_LAUNCH(name) ::moeflex::cuda::check_launch(name, __FILE__, __LINE__)
