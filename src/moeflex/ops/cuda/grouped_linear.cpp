#include "moeflex/ops/cuda/grouped_linear.h"

#include <fmt/format.h>

#include <type_traits>
#include <vector>

#include "moeflex/core/cuda/cuda_check.h"
#include "moeflex/ops/cuda/gemm_layout.h"

namespace moeflex::ops::cuda {
namespace {

template <typename T>
constexpr cudaDataType_t data_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else return CUDA_R_16BF;
}

/// One cublasGemmEx per group, through the row-major gemm().
template <typename TA, typename TC>
void run_loop(Cublas& blas, const std::vector<RowMajorGemm>& gemms, const TA* A, const TA* B, TC* C) {
  for (const auto& g : gemms)
    gemm<TA, TC>(blas, g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, A + g.a_offset, g.lda, B + g.b_offset, g.ldb,
                 g.beta, C + g.c_offset, g.ldc);
  blas.set_last_grouped_path(GroupedGemmPath::loop);
}

/// One cublasGemmGroupedBatchedEx call; returns its status (not checked here).
template <typename TA, typename TC>
cublasStatus_t run_grouped(Cublas& blas, const std::vector<RowMajorGemm>& gemms, const TA* A, const TA* B, TC* C) {
  const std::size_t G = gemms.size();
  std::vector<cublasOperation_t> op_first(G), op_second(G);
  std::vector<int> m(G), n(G), k(G), ld_first(G), ld_second(G), ldc(G), group_size(G, 1);
  std::vector<float> alpha(G, 1.0f), beta(G);
  std::vector<const void*> ptrs(3 * G);  // [first..., second..., C...]
  for (std::size_t i = 0; i < G; ++i) {
    const RowMajorGemm& g = gemms[i];
    const ColumnMajorGemm c = to_column_major(g);
    op_first[i] = c.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
    op_second[i] = c.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = static_cast<int>(c.m), n[i] = static_cast<int>(c.n), k[i] = static_cast<int>(c.k);
    ld_first[i] = static_cast<int>(c.ld_first), ld_second[i] = static_cast<int>(c.ld_second);
    ldc[i] = static_cast<int>(c.ldc);
    beta[i] = g.beta;
    ptrs[i] = B + g.b_offset;          // cuBLAS's A: our B (operands swapped)
    ptrs[G + i] = A + g.a_offset;      // cuBLAS's B: our A
    ptrs[2 * G + i] = C + g.c_offset;
  }
  void** d_ptrs = blas.pointer_arrays();
  // From pageable memory: the runtime stages the copy before returning, and it runs
  // on the handle's stream before the GEMM that reads it.
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                                     blas.stream()));
  return cublasGemmGroupedBatchedEx(blas.handle(), op_first.data(), op_second.data(), m.data(), n.data(), k.data(),
                                    alpha.data(), const_cast<const void* const*>(d_ptrs), data_type<TA>(),
                                    ld_first.data(), const_cast<const void* const*>(d_ptrs + G), data_type<TA>(),
                                    ld_second.data(), beta.data(), d_ptrs + 2 * G, data_type<TC>(), ldc.data(),
                                    static_cast<int>(G), group_size.data(), CUBLAS_COMPUTE_32F);
}

template <typename TA, typename TC>
void run(Cublas& blas, const std::vector<RowMajorGemm>& gemms, const TA* A, const TA* B, TC* C,
         GroupedGemmPath path) {
  if (gemms.empty()) return;
  if (gemms.size() > static_cast<std::size_t>(Cublas::kMaxGroups))
    throw Error(fmt::format("grouped GEMM: {} groups exceed the {} the handle holds", gemms.size(),
                            Cublas::kMaxGroups));
  const int at = data_type<TA>(), ct = data_type<TC>();
  if (path == GroupedGemmPath::loop || (path == GroupedGemmPath::automatic && blas.grouped_refused(at, ct))) {
    run_loop(blas, gemms, A, B, C);
    return;
  }
  const cublasStatus_t status = run_grouped(blas, gemms, A, B, C);
  if (status == CUBLAS_STATUS_SUCCESS) {
    blas.set_last_grouped_path(GroupedGemmPath::grouped);
    return;
  }
  const bool refused = status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
                       status == CUBLAS_STATUS_ARCH_MISMATCH;
  if (path == GroupedGemmPath::automatic && refused) {
    blas.mark_grouped_refused(at, ct);
    run_loop(blas, gemms, A, B, C);
    return;
  }
  check_cublas(status, "cublasGemmGroupedBatchedEx");
}

}  // namespace

template <typename T>
void grouped_linear_forward(Cublas& blas, const T* x, const T* w, T* y, const std::int32_t* host_offsets,
                            std::int64_t E, std::int64_t in, std::int64_t out, GroupedGemmPath path) {
  run<T, T>(blas, grouped_linear_gemms(GroupedPass::forward, host_offsets, E, in, out), x, w, y, path);
}

template <typename T>
void grouped_linear_backward(Cublas& blas, const T* dy, const T* x, const T* w, T* dx, float* dw,
                             const std::int32_t* host_offsets, std::int64_t E, std::int64_t in, std::int64_t out,
                             GroupedGemmPath path) {
  if (dx) run<T, T>(blas, grouped_linear_gemms(GroupedPass::backward_dx, host_offsets, E, in, out), dy, w, dx, path);
  if (dw)
    run<T, float>(blas, grouped_linear_gemms(GroupedPass::backward_dw, host_offsets, E, in, out), dy, x, dw, path);
}

template void grouped_linear_forward<float>(Cublas&, const float*, const float*, float*, const std::int32_t*,
                                            std::int64_t, std::int64_t, std::int64_t, GroupedGemmPath);
template void grouped_linear_forward<bf16>(Cublas&, const bf16*, const bf16*, bf16*, const std::int32_t*,
                                           std::int64_t, std::int64_t, std::int64_t, GroupedGemmPath);
template void grouped_linear_backward<float>(Cublas&, const float*, const float*, const float*, float*, float*,
                                             const std::int32_t*, std::int64_t, std::int64_t, std::int64_t,
                                             GroupedGemmPath);
template void grouped_linear_backward<bf16>(Cublas&, const bf16*, const bf16*, const bf16*, bf16*, float*,
                                            const std::int32_t*, std::int64_t, std::int64_t, std::int64_t,
                                            GroupedGemmPath);

}  // namespace moeflex::ops::cuda
