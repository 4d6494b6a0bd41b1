// The op-case registry's CUDA modes (op_cases.h, docs/testing.md); built only with
// the CUDA backend, and every test skips with "skipped: no GPU (...)" without one.
//   OpCase.CudaMatchesCpu: every case on the CUDA backend and on the CPU backend
//     from the same inputs, in fp32 and in bf16: the forward's loss, its outputs,
//     saved tensors and in-place inputs, then every gradient of the backward (the
//     increment of "+=" ones), each within the case's tolerance for the dtype
//     (relative error in norm; integers exactly). Each backend runs its own forward
//     before its backward (the CUDA attention saves a different `probs`).
//   OpCaseTiming.Cuda: with MOEFLEX_OP_TIMING=1, median time and GFLOP/s per case.
#include <gtest/gtest.h>

#include "cuda_harness.h"
#include "moeflex/ops/cuda/backend.h"
#include "op_cases.h"

namespace {

namespace mt = moeflex::test;
using moeflex::Arena;
using moeflex::Bytes;
using moeflex::DType;
using moeflex::ops::Backend;

/// The CUDA backend and its arena (256 MiB), made once per process.
moeflex::ops::DeviceContext& cuda_context() {
  static moeflex::ops::DeviceContext ctx = [] {
    moeflex::ops::cuda::CudaContextOptions options;
    options.budget = Bytes(256) << 20;
    return moeflex::ops::cuda::make_cuda_context(options);
  }();
  return ctx;
}

class OpCase : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCase, CudaMatchesCpu) {
  MOEFLEX_REQUIRE_GPU();
  const mt::OpCase& c = *GetParam();
  Backend& gpu = *cuda_context().backend;
  for (DType act : {DType::f32, DType::bf16})
    mt::expect_runs_match(c, {gpu, *cuda_context().arena, act}, {moeflex::ops::cpu_backend(), mt::cpu_arena(), act},
                          act == DType::bf16 ? c.tol.bf16 : c.tol.f32);
}

class OpCaseTiming : public ::testing::TestWithParam<const mt::OpCase*> {};

TEST_P(OpCaseTiming, Cuda) {
  if (!mt::timing_requested()) GTEST_SKIP() << "timing mode: set MOEFLEX_OP_TIMING=1";
  MOEFLEX_REQUIRE_GPU();
  for (DType act : {DType::f32, DType::bf16})
    mt::record_timing(mt::time_case(*GetParam(), *cuda_context().backend, *cuda_context().arena, act));
}

INSTANTIATE_TEST_SUITE_P(, OpCase, ::testing::ValuesIn(mt::all_op_case_pointers()), mt::op_case_name);
INSTANTIATE_TEST_SUITE_P(, OpCaseTiming, ::testing::ValuesIn(mt::all_op_case_pointers()), mt::op_case_name);

}  // namespace
