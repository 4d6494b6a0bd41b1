// The time model's report card on a real run (`moeflex train --profile-ops`): every
// op the model, the stash and the optimizer call through ops::Backend is timed
// (thread CPU time and wall time; on a device backend the wall time waits for the
// op's kernels, its thread CPU time is the host's launch and wait) and priced by the
// CostModel at the same shapes, labelled with its phase (forward, backward-input,
// backward-weight, recompute, optimizer), layer, micro-batch and plan action
// (core/op_context.h).
//
// How it hooks in: ProfilingBackend is a Backend that forwards every call to the
// run's real backend and times it. ScopedBackendOverride makes ops::backend_of()
// hand it out while the run's model and optimizer are built and run, so the
// engine's code is unchanged and a run without the flag never goes through it.
//
// What each op is priced as (predict_op below, with the CostModel methods
// model/layer_cost.cpp prices the same ops with):
// - GEMMs by their layout: linear forward nt, linear dx nn, linear dW tn, grouped
//   linear per non-empty group, gemm(trans_a, trans_b) as called;
// - op families with a CostModel method (rmsnorm, rope, attention, swiglu, router,
//   permute, unpermute, cross entropy) by it;
// - other streaming work (add_inplace, embedding, aux and z losses, dispatch
//   planning, zero, copies, square_sum, scale, AdamW) by CostModel::elementwise of
//   the bytes it reads plus writes, as layer_cost prices it.
// Host <-> device copies inside the model (reading back the last logits) are priced
// as copies. The EP all-to-alls and pipeline messages are not backend ops: they are
// in the step time, not in the op records.
#pragma once
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/core/op_context.h"
#include "moeflex/ops/backend.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/profile/trace_sink.h"

namespace moeflex {

/// "forward", "backward_input", "backward_weight", "recompute", "optimizer", "other".
const char* to_string(OpPhase phase);
/// The inverse of to_string; throws DataError naming an unknown phase.
OpPhase parse_op_phase(const std::string& s);

/// CPU seconds the calling thread has used (CLOCK_THREAD_CPUTIME_ID).
Seconds thread_cpu_seconds();

/// One executed op.
struct OpRecord {
  std::string kind;               ///< e.g. "linear_forward", "linear_backward_dw", "gemm_nt", "attention_backward"
  std::vector<std::int64_t> shape;  ///< the call's extents, as its Backend method takes them (see ProfilingBackend)
  OpPhase phase = OpPhase::other;
  int layer = OpContext::kNoLayer;
  int microbatch = -1;
  int stage = -1;
  int action = -1;                ///< index in the rank's plan actions
  std::int64_t step = 0;          ///< 1-based training step
  int rank = 0;
  Seconds cpu = 0;                ///< thread CPU time of the call
  Seconds wall = 0;               ///< wall time of the call (on a device backend: of its kernels, synchronised)
  Seconds predicted = 0;          ///< CostModel time for the same op and shape
  std::chrono::steady_clock::time_point start;  ///< for the trace (not serialized)
};

/// One training step of one rank: what was measured and what the model predicts.
struct StepTimeRecord {
  std::int64_t step = 0;
  int rank = 0;
  Seconds measured_wall = 0;      ///< the step's wall time: forward/backward, gradient reduction, clipping, AdamW
  Seconds measured_cpu = 0;       ///< the step thread's CPU time over the same span
  Seconds ops_cpu = 0;            ///< sum of the step's op CPU times
  Seconds ops_wall = 0;           ///< sum of the step's op wall times
  Seconds predicted = 0;          ///< sum of the step's op predictions: the rank's plan priced op by op
  std::int64_t ops = 0;           ///< ops recorded in the step
};

/// Aggregates of one op kind.
struct OpKindSummary {
  std::string kind;
  std::int64_t count = 0;
  Seconds measured_median = 0;   ///< median of the measured times (the chosen clock)
  Seconds predicted_median = 0;  ///< median of the predictions
  Seconds measured_total = 0;
  Seconds predicted_total = 0;
  /// mean over the ops of |predicted - measured| / measured (ops measured at 0 s skipped)
  double mean_abs_rel_error = 0;
};

/// Aggregates of a set of op records.
struct OpTimeSummary {
  std::vector<OpKindSummary> kinds;  ///< by descending measured_total
  std::int64_t count = 0;
  Seconds measured_total = 0;
  Seconds predicted_total = 0;
  /// Time-weighted mean absolute op error: sum |predicted - measured| / sum measured.
  double weighted_error = 0;
  /// (sum predicted - sum measured) / sum measured: the model's net bias.
  double total_error = 0;
};

/// Summarises `records` by kind, measuring with thread CPU time (use_cpu) or wall
/// time. Medians of an even count are the mean of the two middle values.
OpTimeSummary summarize_op_times(const std::vector<OpRecord>& records, bool use_cpu);

/// Mean over steps of |predicted - measured| / measured, measured = the step's wall
/// time (use_cpu false) or its thread CPU time; 0 for no steps.
double step_time_error(const std::vector<StepTimeRecord>& steps, bool use_cpu);

/// The Backend decorator that records every op (see the file comment). Ops run only
/// between begin_step() and end_step() are recorded; others are just forwarded.
/// Runs on the step's thread only (the copy engine never calls backend ops).
class ProfilingBackend final : public ops::Backend {
 public:
  /// `inner` runs the ops; `cost` prices them. Both must outlive this object.
  ProfilingBackend(ops::Backend& inner, const CostModel& cost, int rank);

  /// Starts recording step `step` (1-based); with `trace` non-null its ops also go to
  /// the trace's "ops" track.
  /// A step begun but never ended (dropped after an OOM) loses its records here.
  void begin_step(std::int64_t step, TraceSink* trace);
  /// Ends the step, with its measured wall and thread CPU seconds; appends its
  /// StepTimeRecord.
  void end_step(Seconds measured_wall, Seconds measured_cpu);
  bool recording() const { return recording_; }

  const std::vector<OpRecord>& records() const { return records_; }
  const std::vector<StepTimeRecord>& steps() const { return steps_; }
  const CostModel& cost() const { return cost_; }

  // ---- Device ----
  DeviceKind kind() const override { return inner_.kind(); }
  std::string describe() const override { return inner_.describe(); }
  bool host_memory() const override { return inner_.host_memory(); }
  void zero(void* dst, Bytes bytes) override;
  void copy(void* dst, const void* src, Bytes bytes) override;
  void copy_from_host(void* dst, const void* src, Bytes bytes) override;
  void copy_to_host(void* dst, const void* src, Bytes bytes) override;
  void synchronize() override { inner_.synchronize(); }
  void synchronize_compute() override { inner_.synchronize_compute(); }
  std::shared_ptr<DeviceEvent> copy_async(void* dst, const void* src, Bytes bytes, bool to_host) override {
    return inner_.copy_async(dst, src, bytes, to_host);
  }
  void* host_alloc(Bytes bytes) override { return inner_.host_alloc(bytes); }
  void host_free(void* p, Bytes bytes) override { inner_.host_free(p, bytes); }

  // ---- Backend ----
  void linear_forward(CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out) override;
  void linear_backward(CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in,
                       std::int64_t out, bool accumulate_dx) override;
  void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, CView A,
            std::int64_t lda, CView B, std::int64_t ldb, float beta, View C, std::int64_t ldc) override;
  void rmsnorm_forward(CView x, CView w, View y, float* rstd, std::int64_t n, std::int64_t d, float eps) override;
  void rmsnorm_backward(CView dy, CView x, CView w, const float* rstd, View dx, float* dw, std::int64_t n,
                        std::int64_t d) override;
  void rope_forward(View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double theta) override;
  void rope_backward(View dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double theta) override;
  void attention_forward(CView q, CView k, CView v, View out, View probs, std::int64_t B, std::int64_t S,
                         std::int64_t H, std::int64_t Hkv, std::int64_t hd) override;
  void attention_backward(CView dout, CView q, CView k, CView v, CView out, CView probs, View dq, View dk, View dv,
                          View dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                          std::int64_t hd) override;
  void swiglu_forward(CView gate, CView up, View out, std::int64_t n) override;
  void swiglu_backward(CView dout, CView gate, CView up, View dgate, View dup, std::int64_t n) override;
  void add_inplace(View y, CView x, std::int64_t n) override;
  void cast(CView src, View dst, std::int64_t n) override;
  void embedding_forward(const std::int32_t* host_ids, CView table, View out, std::int64_t n, std::int64_t d) override;
  void embedding_backward(const std::int32_t* host_ids, CView dout, float* dtable, std::int64_t n,
                          std::int64_t d) override;
  double cross_entropy_forward(CView logits, const std::int32_t* host_targets, View probs, float* losses,
                               std::int64_t n, std::int64_t V) override;
  void cross_entropy_backward(CView probs, const std::int32_t* host_targets, View dlogits, std::int64_t n,
                              std::int64_t V, float scale) override;
  void router_forward(CView logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n, std::int64_t E,
                      std::int64_t k, const ops::RouterOptions& opt) override;
  void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                       const std::int32_t* topk_idx, View dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                       const ops::RouterOptions& opt) override;
  double aux_loss_forward(const float* probs, const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                          std::int64_t k, double coef, ops::RouterScore score) override;
  void aux_loss_backward(const std::int32_t* topk_idx, const float* probs, float* dprobs, std::int64_t n,
                         std::int64_t E, std::int64_t k, double coef, ops::RouterScore score) override;
  double z_loss_forward(CView logits, std::int64_t n, std::int64_t E, double coef) override;
  void z_loss_backward(CView logits, View dlogits, std::int64_t n, std::int64_t E, double coef) override;
  void skew_router_logits(View logits, std::int64_t n, std::int64_t E, std::int64_t k,
                          const ops::RouterSkew& skew) override;
  std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                                 std::int64_t capacity, std::int32_t* counts, std::int32_t* offsets,
                                 std::int32_t* slot_of, std::int32_t* host_offsets) override;
  void permute_forward(CView x, const std::int32_t* slot_of, View xp, std::int64_t n, std::int64_t k,
                       std::int64_t d) override;
  void permute_backward(CView dxp, const std::int32_t* slot_of, View dx, std::int64_t n, std::int64_t k,
                        std::int64_t d) override;
  void unpermute_forward(CView yp, const std::int32_t* slot_of, const float* topk_w, View y, std::int64_t n,
                         std::int64_t k, std::int64_t d) override;
  void unpermute_backward(CView dy, CView yp, const std::int32_t* slot_of, const float* topk_w, View dyp,
                          float* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d) override;
  void combine_topk_grad(CView dy, CView yp_rows, const std::int32_t* slot_of, float* dtopk_w, std::int64_t n,
                         std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows) override;
  void grouped_linear_forward(CView x, CView w, View y, const std::int32_t* host_offsets, std::int64_t E,
                              std::int64_t in, std::int64_t out) override;
  void grouped_linear_backward(CView dy, CView x, CView w, View dx, float* dw, const std::int32_t* host_offsets,
                               std::int64_t E, std::int64_t in, std::int64_t out) override;
  double square_sum(const float* g, std::int64_t n) override;
  void scale(float* g, std::int64_t n, float scale) override;
  void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps, float decay,
             float step_size, float inv_sqrt_bc2) override;

 private:
  /// Times fn() and records it as `kind` with `shape`, priced `predicted`; `weight_only`
  /// marks a weight-gradient op (its phase is backward_weight inside a fused backward).
  template <class Fn>
  auto timed(const char* kind, std::vector<std::int64_t> shape, Seconds predicted, bool weight_only, Fn&& fn);
  /// One optimizer kernel call on n floats: the profile's table for it (x = 4 n;
  /// measured by calibrate), else streaming `fallback_bytes`.
  Seconds kernel_time(const char* table, std::int64_t n, Bytes fallback_bytes) const;

  ops::Backend& inner_;
  const CostModel& cost_;
  int rank_;
  bool recording_ = false;
  std::int64_t step_ = 0;
  std::size_t step_first_record_ = 0;
  TraceSink* trace_ = nullptr;
  std::vector<OpRecord> records_;
  std::vector<StepTimeRecord> steps_;
};

/// While alive, ops::backend_of() returns `backend` for every arena (see
/// ops::set_backend_override); restores the previous override when it ends.
class ScopedBackendOverride {
 public:
  explicit ScopedBackendOverride(ops::Backend* backend);
  ~ScopedBackendOverride();
  ScopedBackendOverride(const ScopedBackendOverride&) = delete;
  ScopedBackendOverride& operator=(const ScopedBackendOverride&) = delete;

 private:
  ops::Backend* previous_;
};

/// The per-rank part file of op_times.json: <run>/op_times.rank<R>.json.
std::filesystem::path op_times_part_path(const std::filesystem::path& run_dir, int rank);

/// Writes this rank's records and steps to `path` (JSON; compact).
void write_op_times_part(const std::filesystem::path& path, const std::vector<OpRecord>& records,
                         const std::vector<StepTimeRecord>& steps);

/// Reads the parts, summarises them (skipping steps < first_step) and returns the
/// op_times.json document. Measured times are thread CPU time (use_cpu: one thread
/// per rank, the clock calibrate measures with) or wall time, "clock" says which:
/// "op_error" (summarize_op_times' weighted_error; "op_error_wall" on the wall clock),
/// "op_total_error" (its net bias), "op_median_error" (time-weighted over (kind,
/// shape): |predicted median - measured median| / measured median), "op_noise_floor"
/// (sum |measured - its shape's measured median| / sum measured: the op error left
/// to a model that knew every shape's median), "step_error" (step_time_error on that clock;
/// "step_error_wall" on the wall clock, "step_error_ops" against the sum of the step's
/// measured ops, i.e. without the time spent outside ops), "ops" and "ops_wall" (the
/// kinds' tables), "shapes" (per kind and shape), "phases", "steps".
/// Throws DataError naming a missing or malformed part.
nlohmann::json summarize_op_time_parts(const std::vector<std::filesystem::path>& parts, std::int64_t first_step,
                                       bool use_cpu);

}  // namespace moeflex
