// BLAS entry points for float and double (OpenBLAS on the CPU).
// Shapes: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major.
#pragma once
#include <cstdint>
#include <string>

namespace moeflex::ops {

/// Row-major GEMM through cblas_{s,d}gemm. lda/ldb/ldc are row strides in elements.
template <typename T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
          const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc);

/// The kernel set ("core") OpenBLAS chose for this process when it was loaded, e.g.
/// "SkylakeX", "Haswell", "Prescott" (`openblas_get_corename`).
std::string blas_core_name();

/// What this CPU can run, as far as the choice of BLAS kernels goes.
struct CpuIsa {
  bool avx2_fma = false;  ///< AVX2 and FMA3
  bool avx512 = false;    ///< AVX-512 F, CD, BW, DQ and VL (SkylakeX's set)
};

/// This process's CPU (`__builtin_cpu_supports`).
CpuIsa this_cpu_isa();

/// The OpenBLAS core to force (OPENBLAS_CORETYPE) instead of `chosen`, or "" when
/// OpenBLAS's choice stands. OpenBLAS's DYNAMIC_ARCH builds pick kernels by CPU family
/// and model when they are loaded, and a model they do not know gets their generic SSE3
/// kernels, "Prescott" (Debian 12's 0.3.21 on an Emerald Rapids Xeon, family 6 model
/// 207, does; its GEMMs then run 3x slower than on its AVX-512 kernels). Only that
/// fallback is overridden: "SkylakeX" where the CPU has AVX-512, "Haswell" where it has
/// AVX2 and FMA; a real Prescott-class CPU has neither and keeps "Prescott".
std::string blas_core_override(const std::string& chosen, const CpuIsa& isa);

/// Restarts the process (execv of its own file, /proc/self/exe's target, with the same
/// argv) with OPENBLAS_CORETYPE set to blas_core_override(blas_core_name(),
/// this_cpu_isa()) when that is not empty and OPENBLAS_CORETYPE is unset or empty (a
/// user's own choice, or an earlier restart's, stands). Call first in main, before MPI
/// or threads start: OpenBLAS reads the variable only when it is loaded. Prints one
/// line to stderr (rank 0 under mpirun) saying so; if the exec fails, or the program was
/// started through the dynamic loader (ld.so PROGRAM, where the argv would not restart
/// it), it says so and returns to go on as it is. Never throws.
void restart_with_fast_blas_kernels(char** argv);

}  // namespace moeflex::ops
