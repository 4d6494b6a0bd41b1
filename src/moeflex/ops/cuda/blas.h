// cuBLAS for the CUDA backend: the handle (bound to a stream, its workspace taken
// from the DeviceArena so it is accounted), and row-major GEMMs in the three
// precisions of mixed-precision training, always with fp32 accumulation
// (CUBLAS_COMPUTE_32F; fp32 GEMMs do not use TF32):
//   gemm<float, float>   fp32 in, fp32 out
//   gemm<bf16, bf16>     bf16 in, bf16 out (activations, dx)
//   gemm<bf16, float>    bf16 in, fp32 out (weight gradients into fp32 master grads)
// Shapes: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major, strides in
// elements, as ops/blas.h; gemm_layout.h says how this becomes cuBLAS's
// column-major call. Dimensions must fit in int (cuBLAS's 32-bit API), else Error.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moeflex/core/bf16.h"
#include "moeflex/core/cuda/buffer.h"

namespace moeflex::ops::cuda {

/// How a grouped GEMM is issued: `automatic` uses cublasGemmGroupedBatchedEx when
/// cuBLAS supports the type combination and falls back to one cublasGemmEx per
/// group otherwise; `grouped` and `loop` force one of the two (tests compare them).
enum class GroupedGemmPath { automatic, grouped, loop };

/// "automatic", "grouped" or "loop".
const char* to_string(GroupedGemmPath path);

/// A cuBLAS handle on the current device, bound to one stream. Not thread-safe.
class Cublas {
 public:
  /// Largest number of groups one grouped GEMM may have (pointer arrays are
  /// preallocated for it).
  static constexpr int kMaxGroups = 4096;

  /// Creates the handle on `stream` with `workspace_bytes` of cuBLAS workspace and
  /// the grouped-GEMM pointer arrays, both allocated from `arena` (category
  /// workspace). Throws CudaError / OutOfMemoryError.
  Cublas(moeflex::cuda::DeviceArena& arena, cudaStream_t stream, Bytes workspace_bytes = 32 * kMiB);
  ~Cublas();
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;

  cublasHandle_t handle() const { return handle_; }
  cudaStream_t stream() const { return stream_; }
  /// Binds the handle to another stream.
  void set_stream(cudaStream_t stream);
  /// Device memory for 3 * kMaxGroups pointers (the grouped GEMM's A, B, C arrays).
  void** pointer_arrays() const { return pointers_.as<void*>(); }

  /// How the most recent grouped GEMM ran: grouped or loop.
  GroupedGemmPath last_grouped_path() const { return last_path_; }
  void set_last_grouped_path(GroupedGemmPath p) { last_path_ = p; }
  /// Whether cublasGemmGroupedBatchedEx refused this (input, output) cudaDataType
  /// pair before; automatic mode then goes straight to the loop.
  bool grouped_refused(int a_type, int c_type) const;
  void mark_grouped_refused(int a_type, int c_type);

 private:
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  moeflex::cuda::Buffer workspace_;
  moeflex::cuda::Buffer pointers_;
  GroupedGemmPath last_path_ = GroupedGemmPath::automatic;
  unsigned refused_ = 0;  // bit per (a_type, c_type) pair, see grouped_refused
};

/// Throws CudaError naming `what` when `status` is not CUBLAS_STATUS_SUCCESS.
void check_cublas(cublasStatus_t status, const char* what);

/// Row-major GEMM on the handle's stream (see the file comment). K == 0 scales C by
/// beta (only beta 0 and 1 are supported there).
template <typename TA, typename TC>
void gemm(Cublas& blas, bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
          const TA* A, std::int64_t lda, const TA* B, std::int64_t ldb, float beta, TC* C, std::int64_t ldc);

}  // namespace moeflex::ops::cuda
