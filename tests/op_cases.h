// The op-case registry (STYLE habit 4, after ggml's tests/test-backend-ops.cpp): one
// case per op family and shape, written once against ops::Backend, run by every mode:
//   OpCase.Gradients      (test_op_cases)      CPU backward vs central finite differences
//                                             of the CPU forward, fp32;
//   OpCase.CudaMatchesCpu (test_cuda_op_cases) CUDA forward and backward vs the CPU
//                                             backend, fp32 and bf16 (skips without a GPU);
//   OpCaseBf16.CpuMatchesFp32 (test_op_cases)  the CPU bf16 path vs its fp32 run;
//   OpCaseTiming.Cpu / OpCaseTiming.Cuda      median time and GFLOP/s per case (only with
//                                             MOEFLEX_OP_TIMING=1; a table, no assertion).
// A new op is one more case in op_cases_dense.cpp or op_cases_moe.cpp (docs/testing.md).
//
// A case declares its tensors (TensorSpec): inputs with fixed pseudo-random values,
// the outputs its forward writes, the seeds (the gradient reaching an output, a
// fixed random probe) and the gradients its backward writes, "=" (pre-filled with
// NaN, so an element the op forgets shows) or "+=" (pre-filled with random values,
// and the increment is what is checked). The probe loss of the Gradients mode is
//   L = forward's return value (a loss it computes) + sum over seeds <output, seed>,
// so every seed is exactly dL/d(output) and every gradient must be dL/d(input).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/tensor.h"
#include "moeflex/ops/backend.h"

namespace moeflex::test {

/// Storage of a case tensor.
enum class Elem {
  act,       ///< the dtype under test (f32, or bf16 in the bf16 run): activations, weights
  f32,       ///< always fp32 (ops/backend.h's float* arguments: weight gradients, rstd, router probs)
  i32,       ///< int32 in backend memory (top-k indices, slot_of)
  host_i32,  ///< int32 on the host for every backend (token ids, targets, grouped-GEMM offsets)
};

/// What the harness does with a tensor.
enum class Role {
  input,    ///< set to `init` before every forward; differentiable when a gradient names it
  output,   ///< written by the forward; NaN before it; compared across backends
  saved,    ///< written by the forward for the backward (rstd, probs); compared unless !compare
  scratch,  ///< workspace of the op; never compared
  seed,     ///< dL/d(output `of`), read by the backward; `init` is the probe
  grad,     ///< dL/d(input `of`), written by the backward
};

struct TensorSpec {
  std::string name;
  Elem elem = Elem::act;
  std::int64_t numel = 0;
  Role role = Role::input;
  /// Values set before each forward (input, seed, the prior of a "+=" gradient); empty:
  /// NaN bytes (every byte 0xff).
  std::vector<double> init;
  /// input of a grad; output of a seed.
  std::string of;
  /// grad: "+=" (init holds the prior; the increment is checked).
  bool accumulate = false;
  /// seed: the backward overwrites it with the gradient of input `grad_of` (in-place
  /// backward ops such as RoPE's).
  std::string grad_of;
  /// Compared across backends after the forward: outputs and saved tensors unless
  /// their layouts differ (CUDA attention keeps only the logsumexp in `probs`), and
  /// inputs that the forward overwrites (in_place). Gradients are always compared.
  bool compare = true;
};

/// Tolerances and finite-difference step of a case, with the reason for them.
struct Tolerance {
  double fd_eps = 1e-2;  ///< central-difference step (absolute; case inputs are of scale 1 to 4)
  double fd = 5e-4;      ///< relative error in norm, analytic vs finite differences (fp32)
  double f32 = 1e-5;     ///< relative error in norm, CUDA vs CPU in fp32
  double bf16 = 1e-2;    ///< relative error in norm, CUDA vs CPU in bf16
  const char* why = "";  ///< why this step and these tolerances
};

class OpTensors;

/// One registered op case.
struct OpCase {
  std::string name;   ///< unique, [A-Za-z0-9_] (the test's parameter name)
  std::string shape;  ///< "n=5,d=12" (printed)
  /// Makes the tensors and their values (fixed pseudo-random: a pure function).
  std::function<std::vector<TensorSpec>()> build;
  /// Runs the op; returns the loss it computes (0 when none).
  std::function<double(ops::Backend&, OpTensors&)> forward;
  /// Runs the op's backward; empty for forward-only ops (add_inplace, cast, the plan).
  std::function<void(ops::Backend&, OpTensors&)> backward;
  Tolerance tol;
  double forward_flops = 0;   ///< floating-point operations of one forward (0: data movement)
  double backward_flops = 0;  ///< of one backward
  /// A training-like shape for the timing figures: compared across backends and
  /// dtypes like the others, but not by finite differences (two forwards per checked
  /// element would dominate the suite's time).
  bool timing_size = false;
};

/// Test parameters print as the case's shape (in ctest's names:
/// "OpCase.Gradients/rmsnorm_small  # GetParam() = n=5,d=12").
inline void PrintTo(const OpCase* c, std::ostream* os) { *os << c->shape; }

/// Every registered case (dense then MoE), in a fixed order.
const std::vector<OpCase>& op_cases();
/// The cases the Gradients mode checks: those with a backward, at small shapes.
std::vector<const OpCase*> op_cases_for_gradients();
/// Every case, as test parameters.
std::vector<const OpCase*> all_op_case_pointers();

/// The tensors of one case on one backend, of one activation dtype.
class OpTensors {
 public:
  OpTensors(ops::Backend& backend, Arena& arena, DType act, std::vector<TensorSpec> specs);

  DType act() const { return act_; }
  View v(std::string_view name);
  CView c(std::string_view name) { return v(name); }
  float* f(std::string_view name) { return v(name).f32(); }
  /// int32 data (backend memory for i32, host memory for host_i32).
  std::int32_t* i(std::string_view name);
  std::int64_t numel(std::string_view name) const { return spec(name).numel; }

  const std::vector<TensorSpec>& specs() const { return specs_; }
  const TensorSpec& spec(std::string_view name) const;
  /// Every tensor to its spec's init (NaN bytes where none).
  void reset();
  /// Sets one tensor to `values` (rounded to its storage type).
  void set(std::string_view name, const std::vector<double>& values);
  /// One tensor's values, widened to double.
  std::vector<double> read(std::string_view name) const;
  /// The spec's init as stored (rounded to the tensor's type), as reset() sets it.
  std::vector<double> stored_init(std::string_view name) const;

 private:
  struct Slot {
    Tensor tensor;                   // backend memory (act, f32, i32)
    std::vector<std::int32_t> host;  // host_i32
  };
  std::size_t index(std::string_view name) const;
  DType dtype_of(Elem e) const;

  ops::Backend& backend_;
  DType act_;
  std::vector<TensorSpec> specs_;
  std::vector<Slot> slots_;
};

// --- helpers for writing cases -------------------------------------------------------

/// An input (random values in [-scale, scale) from `stream`).
TensorSpec input(std::string name, Elem elem, std::int64_t numel, std::uint64_t stream, double scale = 1.0);
/// An input with the given values.
TensorSpec input_values(std::string name, Elem elem, std::vector<double> values);
/// An input the forward overwrites in place (RoPE's x, add_inplace's y): random like
/// input(), and compared across backends after the forward like an output.
TensorSpec in_place(std::string name, Elem elem, std::int64_t numel, std::uint64_t stream, double scale = 1.0);
TensorSpec output(std::string name, Elem elem, std::int64_t numel);
TensorSpec saved(std::string name, Elem elem, std::int64_t numel, bool compare = true);
TensorSpec scratch(std::string name, Elem elem, std::int64_t numel);
/// The probe dL/d(output `of`), random from `stream`.
TensorSpec seed(std::string name, std::string of, Elem elem, std::int64_t numel, std::uint64_t stream);
/// The probe dL/d(output `of`) that the backward turns, in place, into dL/d(input
/// `grad_of`) (RoPE's backward).
TensorSpec seed_in_place(std::string name, std::string of, std::string grad_of, Elem elem, std::int64_t numel,
                         std::uint64_t stream);
/// dL/d(input `of`) written "=".
TensorSpec grad(std::string name, std::string of, Elem elem, std::int64_t numel);
/// dL/d(input `of`) accumulated "+=" onto random prior values from `stream`.
TensorSpec grad_acc(std::string name, std::string of, Elem elem, std::int64_t numel, std::uint64_t stream);

/// Top-k routing with a hot expert (`hot` takes the first slot of about 70% of the
/// tokens) and `cold` experts at the end of the range that no token picks; the k
/// experts of a token are distinct. Pure function of its arguments.
std::vector<std::int32_t> skewed_topk(std::int64_t n, std::int64_t E, std::int64_t k, std::int32_t hot,
                                      std::int64_t cold, std::uint64_t stream);
/// Router logits [n, E] whose top-k is that of skewed_topk, with every gap between a
/// row's sorted logits at least `gap`, so finite-difference steps below gap/2 never
/// change the selection.
std::vector<double> separated_router_logits(std::int64_t n, std::int64_t E, std::int64_t k, std::int32_t hot,
                                            std::int64_t cold, double gap, std::uint64_t stream);

/// A case named `name` at `shape` (the rest filled in by the caller).
inline OpCase new_case(std::string name, std::string shape) {
  OpCase c;
  c.name = std::move(name);
  c.shape = std::move(shape);
  return c;
}

/// `c` marked as a timing-size case (OpCase::timing_size).
inline OpCase at_timing_size(OpCase c) {
  c.timing_size = true;
  return c;
}

/// "n=5,d=12".
std::string shape_of(std::initializer_list<std::pair<const char*, std::int64_t>> dims);

/// The case lists of the two families (op_cases_dense.cpp, op_cases_moe.cpp).
void add_dense_cases(std::vector<OpCase>& cases);
void add_moe_cases(std::vector<OpCase>& cases);

// --- what the modes share ----------------------------------------------------------------

/// The input a tensor is the gradient of: `of` of a grad, `grad_of` of an in-place
/// seed; empty for every other tensor.
std::string gradient_input(const TensorSpec& t);
/// What the backward wrote into gradient `t`: its values, less the prior ones for "+=".
std::vector<double> gradient_written(const OpTensors& tensors, const TensorSpec& t);

/// One run of a case: a backend, its arena, and the activation dtype.
struct OpRun {
  ops::Backend& backend;
  Arena& arena;
  DType act;
};
/// Runs `c` on `tested` and on `reference` from the same inputs (act inputs rounded
/// to the tested dtype, so the reference sees what the tested run sees) and checks
/// the forward's scalar, every compared forward result and every gradient (the
/// increment of "+="), relative error in norm within `tol`, integers exactly. Each
/// run does its own forward before its backward.
void expect_runs_match(const OpCase& c, OpRun tested, OpRun reference, double tol);

/// The host arena the CPU runs allocate from (unlimited), made once per process.
Arena& cpu_arena();
/// A case's test-parameter name (its name).
inline std::string op_case_name(const ::testing::TestParamInfo<const OpCase*>& info) { return info.param->name; }

/// Median milliseconds of `run` on `backend` (synchronized after each call), after
/// two warm-up calls; runs until 5 runs and 0.2 s, at most 200 runs.
double median_ms(ops::Backend& backend, const std::function<void()>& run);

/// One row of a timing table.
struct TimingRow {
  std::string device, dtype, name, shape;
  double forward_ms = 0, backward_ms = -1;  ///< -1: no backward
  double forward_flops = 0, backward_flops = 0;
};
/// Times the forward and the backward of `c` on `backend`.
TimingRow time_case(const OpCase& c, ops::Backend& backend, Arena& arena, DType act);
/// Prints rows as a table (ms and GFLOP/s; "-" for data-movement ops).
void print_timing_table(const std::vector<TimingRow>& rows);
/// Keeps `row` for the table printed when the test program ends.
void record_timing(const TimingRow& row);
/// True when MOEFLEX_OP_TIMING=1 (or any value but 0) is set.
bool timing_requested();

}  // namespace moeflex::test
