#include "moeflex/ops/cuda/blas.h"

#include <fmt/format.h>

#include <limits>
#include <type_traits>

#include "moeflex/core/cuda/cuda_check.h"
#include "moeflex/ops/cuda/gemm_layout.h"

namespace moeflex::ops::cuda {

using moeflex::cuda::CudaError;

namespace {

template <typename T>
constexpr cudaDataType_t data_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else return CUDA_R_16BF;
}

int as_int(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw Error(fmt::format("cuBLAS GEMM: {} = {} is outside cuBLAS's int range", what, v));
  return static_cast<int>(v);
}

/// Bit index of an (input, output) type pair for Cublas::grouped_refused.
unsigned pair_bit(int a_type, int c_type) {
  const unsigned a = a_type == CUDA_R_32F ? 0u : 1u, c = c_type == CUDA_R_32F ? 0u : 1u;
  return 1u << (a * 2 + c);
}

}  // namespace

const char* to_string(GroupedGemmPath path) {
  switch (path) {
    case GroupedGemmPath::automatic: return "automatic";
    case GroupedGemmPath::grouped: return "grouped";
    case GroupedGemmPath::loop: return "loop";
  }
  return "?";
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw CudaError(fmt::format("cuBLAS error {} ({}) in {}", cublasGetStatusName(status),
                                cublasGetStatusString(status), what));
}

Cublas::Cublas(moeflex::cuda::DeviceArena& arena, cudaStream_t stream, Bytes workspace_bytes)
    : stream_(stream),
      workspace_(arena, workspace_bytes, MemCategory::workspace, "cublas.workspace"),
      pointers_(arena, Bytes(3) * kMaxGroups * Bytes(sizeof(void*)), MemCategory::workspace,
                "cublas.grouped_pointers") {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  try {
    check_cublas(cublasSetStream(handle_, stream_), "cublasSetStream");
    check_cublas(cublasSetWorkspace(handle_, workspace_.data(), static_cast<std::size_t>(workspace_.bytes())),
                 "cublasSetWorkspace");
    check_cublas(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
    // Full fp32 for fp32 GEMMs: no TF32 (the harness holds fp32 to 1e-5).
    check_cublas(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  } catch (...) {
    cublasDestroy(handle_);
    throw;
  }
}

Cublas::~Cublas() {
  if (handle_) cublasDestroy(handle_);
}

void Cublas::set_stream(cudaStream_t stream) {
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  // cublasSetStream resets the workspace to the default pool: set ours again.
  check_cublas(cublasSetWorkspace(handle_, workspace_.data(), static_cast<std::size_t>(workspace_.bytes())),
               "cublasSetWorkspace");
  stream_ = stream;
}

bool Cublas::grouped_refused(int a_type, int c_type) const { return (refused_ & pair_bit(a_type, c_type)) != 0; }

void Cublas::mark_grouped_refused(int a_type, int c_type) { refused_ |= pair_bit(a_type, c_type); }

template <typename TA, typename TC>
void gemm(Cublas& blas, bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
          const TA* A, std::int64_t lda, const TA* B, std::int64_t ldb, float beta, TC* C, std::int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (beta == 1.0f) return;
    if (beta != 0.0f) throw Error(fmt::format("cuBLAS GEMM: K = 0 with beta = {} is not supported", beta));
    MOEFLEX_CUDA_CHECK(cudaMemset2DAsync(C, static_cast<std::size_t>(ldc) * sizeof(TC), 0,
                                         static_cast<std::size_t>(N) * sizeof(TC), static_cast<std::size_t>(M),
                                         blas.stream()));
    return;
  }
  RowMajorGemm g;
  g.trans_a = trans_a, g.trans_b = trans_b, g.M = M, g.N = N, g.K = K, g.lda = lda, g.ldb = ldb, g.ldc = ldc;
  const ColumnMajorGemm c = to_column_major(g);
  check_cublas(cublasGemmEx(blas.handle(), c.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N,
                            c.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N, as_int(c.m, "N"), as_int(c.n, "M"),
                            as_int(c.k, "K"), &alpha, B, data_type<TA>(), as_int(c.ld_first, "ldb"), A,
                            data_type<TA>(), as_int(c.ld_second, "lda"), &beta, C, data_type<TC>(),
                            as_int(c.ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

template void gemm<float, float>(Cublas&, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                                 std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);
template void gemm<bf16, bf16>(Cublas&, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const bf16*,
                               std::int64_t, const bf16*, std::int64_t, float, bf16*, std::int64_t);
template void gemm<bf16, float>(Cublas&, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const bf16*,
                                std::int64_t, const bf16*, std::int64_t, float, float*, std::int64_t);

}  // namespace moeflex::ops::cuda
