// How the CUDA backend's row-major GEMMs become cuBLAS's column-major calls, and the
// per-expert GEMMs of the grouped expert linear layer. Plain C++ with no CUDA
// dependency, so the argument building is tested on the CPU (test_backend_host).
//
// Row-major to column-major: a row-major r x c matrix with row stride ld is, read
// column-major, its transpose (c x r, leading dimension ld). So the row-major
//   C[M,N] = op_a(A) op_b(B)
// is the column-major C^T[N,M] = op_b(B)^T op_a(A)^T: cuBLAS is called with the
// operands swapped (B first), the same transpose flags, m = N, n = M, k = K, and
// the row strides as leading dimensions.
//
// Grouped expert linear (ops/grouped_linear.h): x [rows, in] sorted by expert with
// offsets [E+1], w [E, out, in], y [rows, out]; for each expert e with rows_e > 0:
//   forward:     y_e  = x_e  @ w_e^T   (row-major gemm N,T: rows x out x in),   beta 0
//   backward dx: dx_e = dy_e @ w_e     (row-major gemm N,N: rows x in x out),   beta 0
//   backward dw: dw_e += dy_e^T @ x_e  (row-major gemm T,N: out x in x rows),   beta 1
// Experts without rows get no GEMM (their dw_e is left unchanged; dx/y rows of an
// empty expert do not exist).
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex::ops::cuda {

/// One row-major GEMM C = alpha op_a(A) op_b(B) + beta C, operands given as element
/// offsets from their buffers' bases; strides are row strides in elements.
struct RowMajorGemm {
  bool trans_a = false, trans_b = false;
  std::int64_t M = 0, N = 0, K = 0;
  std::int64_t a_offset = 0, lda = 0;
  std::int64_t b_offset = 0, ldb = 0;
  std::int64_t c_offset = 0, ldc = 0;
  float beta = 0.0f;
  std::int64_t group = -1;  ///< the expert, for grouped GEMMs; -1 otherwise
};

/// The same GEMM as cuBLAS sees it (column-major). `first` is the operand cuBLAS
/// calls A (our B), `second` the one it calls B (our A).
struct ColumnMajorGemm {
  bool trans_first = false, trans_second = false;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t ld_first = 0, ld_second = 0, ldc = 0;
};

/// The column-major call computing the row-major `g` (see the file comment).
inline ColumnMajorGemm to_column_major(const RowMajorGemm& g) {
  ColumnMajorGemm c;
  c.trans_first = g.trans_b;
  c.trans_second = g.trans_a;
  c.m = g.N;
  c.n = g.M;
  c.k = g.K;
  c.ld_first = g.ldb;
  c.ld_second = g.lda;
  c.ldc = g.ldc;
  return c;
}

/// Which GEMM of the grouped expert linear layer.
enum class GroupedPass { forward, backward_dx, backward_dw };

/// One RowMajorGemm per expert with rows (see the file comment), in expert order.
/// Operand offsets are in elements of: forward A=x, B=w, C=y; backward_dx A=dy,
/// B=w, C=dx; backward_dw A=dy, B=x, C=dw. Throws Error when offsets are not
/// non-decreasing from 0 or a dimension exceeds cuBLAS's 32-bit int arguments.
inline std::vector<RowMajorGemm> grouped_linear_gemms(GroupedPass pass, const std::int32_t* offsets,
                                                      std::int64_t E, std::int64_t in, std::int64_t out) {
  if (offsets[0] != 0) throw Error("grouped GEMM: offsets[0] is " + std::to_string(offsets[0]) + ", not 0");
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  if (in > kIntMax || out > kIntMax)
    throw Error("grouped GEMM: in " + std::to_string(in) + " / out " + std::to_string(out) +
                " exceed cuBLAS's int range");
  std::vector<RowMajorGemm> gemms;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t begin = offsets[e], rows = std::int64_t(offsets[e + 1]) - begin;
    if (rows < 0)
      throw Error("grouped GEMM: offsets decrease at expert " + std::to_string(e) + " (" +
                  std::to_string(offsets[e]) + " -> " + std::to_string(offsets[e + 1]) + ")");
    if (rows == 0) continue;
    RowMajorGemm g;
    g.group = e;
    switch (pass) {
      case GroupedPass::forward:  // y_e = x_e @ w_e^T
        g.trans_a = false, g.trans_b = true;
        g.M = rows, g.N = out, g.K = in;
        g.a_offset = begin * in, g.lda = in;
        g.b_offset = e * out * in, g.ldb = in;
        g.c_offset = begin * out, g.ldc = out;
        g.beta = 0.0f;
        break;
      case GroupedPass::backward_dx:  // dx_e = dy_e @ w_e
        g.trans_a = false, g.trans_b = false;
        g.M = rows, g.N = in, g.K = out;
        g.a_offset = begin * out, g.lda = out;
        g.b_offset = e * out * in, g.ldb = in;
        g.c_offset = begin * in, g.ldc = in;
        g.beta = 0.0f;
        break;
      case GroupedPass::backward_dw:  // dw_e += dy_e^T @ x_e
        g.trans_a = true, g.trans_b = false;
        g.M = out, g.N = in, g.K = rows;
        g.a_offset = begin * out, g.lda = out;
        g.b_offset = begin * in, g.ldb = in;
        g.c_offset = e * out * in, g.ldc = in;
        g.beta = 1.0f;
        break;
    }
    gemms.push_back(g);
  }
  return gemms;
}

}  // namespace moeflex::ops::cuda
