// BLAS entry points for float and double (OpenBLAS on the CPU).
// Shapes: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major.
// C is written (beta = 0) or accumulated into (beta = 1); nothing else is touched.
// Determinism: OpenBLAS splits level-3 work over M and N, never over K, so for a
// fixed thread count every C element is summed in the same order on every call.
#include "moeflex/ops/blas.h"

#include <cblas.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>
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

std::string blas_core_name() {
  const char* name = openblas_get_corename();
  return name ? std::string(name) : std::string();
}

CpuIsa this_cpu_isa() {
  __builtin_cpu_init();
  CpuIsa isa;
  isa.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  isa.avx512 = isa.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
  return isa;
}

std::string blas_core_override(const std::string& chosen, const CpuIsa& isa) {
  // OpenBLAS spells its cores in mixed case; its fallback is "Prescott".
  if (strcasecmp(chosen.c_str(), "prescott") != 0) return "";
  if (isa.avx512) return "SkylakeX";
  if (isa.avx2_fma) return "Haswell";
  return "";
}

void restart_with_fast_blas_kernels(char** argv) {
  if (const char* v = std::getenv("OPENBLAS_CORETYPE"); v && *v) return;  // the user's choice (an empty one is none)
  const std::string chosen = blas_core_name();
  const std::string core = blas_core_override(chosen, this_cpu_isa());
  if (core.empty()) return;
  // Before MPI_Init the rank is only in the launcher's environment (Open MPI, PMIx, Slurm).
  bool first = true;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* r = std::getenv(v)) {
      first = std::strcmp(r, "0") == 0;
      break;
    }
  // The program's file: exec'd by its own path, so that the process keeps its name
  // (exec of /proc/self/exe would call it "exe"). Started through the dynamic loader
  // (ld.so PROGRAM), /proc/self/exe is the loader, which this argv would not start.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  const char* base = std::strrchr(self, '/');
  base = base ? base + 1 : self;
  // (Messages with stdio, not fmt: a closed or full stderr must not stop the run.)
  if (std::strncmp(base, "ld-", 3) == 0 || std::strncmp(base, "ld.so", 5) == 0) {
    if (first)
      std::fprintf(stderr,
                   "moeflex: warning: OpenBLAS took its SSE3 kernels (%s) for this unknown CPU model; set "
                   "OPENBLAS_CORETYPE=%s for its fast ones\n",
                   chosen.c_str(), core.c_str());
    return;
  }
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  if (first)
    std::fprintf(stderr,
                 "moeflex: OpenBLAS took its SSE3 kernels (%s) for this unknown CPU model; restarting with "
                 "OPENBLAS_CORETYPE=%s\n",
                 chosen.c_str(), core.c_str());
  std::fflush(stderr);
  execv(self, argv);
  execv("/proc/self/exe", argv);  // the file was replaced or deleted meanwhile: its mapping
  const int err = errno;
  unsetenv("OPENBLAS_CORETYPE");
  if (first)
    std::fprintf(stderr, "moeflex: warning: could not restart (%s); going on with OpenBLAS's %s kernels\n",
                 std::strerror(err), chosen.c_str());
}

}  // namespace moeflex::ops
