// BLAS entry points for float and double (OpenBLAS on the CPU).
// Shapes: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major.
#pragma once
#include <cstdint>

namespace moeflex::ops {

/// Row-major GEMM through cblas_{s,d}gemm. lda/ldb/ldc are row strides in elements.
template <typename T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
          const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc);

}  // namespace moeflex::ops
