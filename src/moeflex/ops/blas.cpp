// BLAS entry points for float and double (OpenBLAS on the CPU).
// Shapes: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major.
// C is written (beta = 0) or accumulated into (beta = 1); nothing else is touched.
// Determinism: OpenBLAS splits level-3 work over M and N, never over K, so for a
// fixed thread count every C element is summed in the same order on every call.
#include "moeflex/ops/blas.h"

#include <cblas.h>

#include <limits>
#include <string>
#include <type_traits>

#include "moeflex/core/error.h"

namespace moeflex::ops {
namespace {

/// cblas takes `blasint` (32-bit in the distribution builds); refuse what would wrap.
blasint to_blasint(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<blasint>::max()) {
    throw Error("gemm: " + std::string(what) + " = " + std::to_string(v) + " does not fit the BLAS integer type");
  }
  return static_cast<blasint>(v);
}

/// C = beta * C for K == 0, where the product is empty (BLAS implementations differ there).
template <typename T>
void scale_c(std::int64_t M, std::int64_t N, T beta, T* C, std::int64_t ldc) {
  for (std::int64_t i = 0; i < M; ++i) {
    T* row = C + i * ldc;
    for (std::int64_t j = 0; j < N; ++j) row[j] = beta == T(0) ? T(0) : beta * row[j];
  }
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const blasint m = to_blasint(M, "M"), n = to_blasint(N, "N"), k = to_blasint(K, "K");
  const blasint a_ld = to_blasint(lda, "lda"), b_ld = to_blasint(ldb, "ldb"), c_ld = to_blasint(ldc, "ldc");
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, A, a_ld, B, b_ld, beta, C, c_ld);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, A, a_ld, B, b_ld, beta, C, c_ld);
  }
}

template void gemm<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                          const float*, std::int64_t, float, float*, std::int64_t);
template void gemm<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double, const double*,
                           std::int64_t, const double*, std::int64_t, double, double*, std::int64_t);

}  // namespace moeflex::ops
