// The op profiler: times every backend op of a training step and prices it with the
// cost model (see op_profiler.h).
#include "moeflex/profile/op_profiler.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <type_traits>

#include "moeflex/core/error.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/core/file_io.h"

namespace moeflex {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr Bytes kF = kActivationBytes;  // bytes per fp32 element

GemmLayout layout_of(bool trans_a, bool trans_b) {
  if (!trans_a && trans_b) return GemmLayout::nt;
  if (!trans_a && !trans_b) return GemmLayout::nn;
  if (trans_a && !trans_b) return GemmLayout::tn;
  return GemmLayout::any;
}

std::vector<std::int64_t> group_rows(const std::int32_t* host_offsets, std::int64_t E) {
  std::vector<std::int64_t> rows(std::size_t(std::max<std::int64_t>(E, 0)));
  for (std::int64_t e = 0; e < E; ++e) rows[std::size_t(e)] = host_offsets[e + 1] - host_offsets[e];
  return rows;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string layer_name(int layer) {
  if (layer == kHeadLayer) return "head";
  if (layer == kOpLayerEmbedding) return "embedding";
  if (layer == OpContext::kNoLayer) return "-";
  return std::to_string(layer);
}

}  // namespace

Seconds thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

const char* to_string(OpPhase phase) {
  switch (phase) {
    case OpPhase::forward: return "forward";
    case OpPhase::backward_input: return "backward_input";
    case OpPhase::backward_weight: return "backward_weight";
    case OpPhase::recompute: return "recompute";
    case OpPhase::optimizer: return "optimizer";
    case OpPhase::other: break;
  }
  return "other";
}

OpPhase parse_op_phase(const std::string& s) {
  for (OpPhase p : {OpPhase::forward, OpPhase::backward_input, OpPhase::backward_weight, OpPhase::recompute,
                    OpPhase::optimizer, OpPhase::other})
    if (s == to_string(p)) return p;
  throw DataError(fmt::format("op times: unknown phase '{}'", s));
}

// ---- aggregation ------------------------------------------------------------------

OpTimeSummary summarize_op_times(const std::vector<OpRecord>& records, bool use_cpu) {
  struct Acc {
    std::vector<double> measured, predicted;
    double rel_sum = 0;
    std::int64_t rel_n = 0;
  };
  std::map<std::string, Acc> by_kind;
  OpTimeSummary s;
  double abs_sum = 0;
  for (const OpRecord& r : records) {
    const double m = use_cpu ? r.cpu : r.wall;
    Acc& a = by_kind[r.kind];
    a.measured.push_back(m);
    a.predicted.push_back(r.predicted);
    if (m > 0) {
      a.rel_sum += std::abs(r.predicted - m) / m;
      a.rel_n += 1;
    }
    s.count += 1;
    s.measured_total += m;
    s.predicted_total += r.predicted;
    abs_sum += std::abs(r.predicted - m);
  }
  for (auto& [kind, a] : by_kind) {
    OpKindSummary k;
    k.kind = kind;
    k.count = std::int64_t(a.measured.size());
    for (double x : a.measured) k.measured_total += x;
    for (double x : a.predicted) k.predicted_total += x;
    k.measured_median = median(a.measured);
    k.predicted_median = median(a.predicted);
    k.mean_abs_rel_error = a.rel_n ? a.rel_sum / double(a.rel_n) : 0.0;
    s.kinds.push_back(std::move(k));
  }
  std::sort(s.kinds.begin(), s.kinds.end(),
            [](const OpKindSummary& a, const OpKindSummary& b) { return a.measured_total > b.measured_total; });
  if (s.measured_total > 0) {
    s.weighted_error = abs_sum / s.measured_total;
    s.total_error = (s.predicted_total - s.measured_total) / s.measured_total;
  }
  return s;
}

double step_time_error(const std::vector<StepTimeRecord>& steps, bool use_cpu) {
  double sum = 0;
  std::int64_t n = 0;
  for (const StepTimeRecord& s : steps) {
    const double m = use_cpu ? s.measured_cpu : s.measured_wall;
    if (m <= 0) continue;
    sum += std::abs(s.predicted - m) / m;
    n += 1;
  }
  return n ? sum / double(n) : 0.0;
}

// ---- the decorator ------------------------------------------------------------------

ProfilingBackend::ProfilingBackend(ops::Backend& inner, const CostModel& cost, int rank)
    : inner_(inner), cost_(cost), rank_(rank) {}

void ProfilingBackend::begin_step(std::int64_t step, TraceSink* trace) {
  if (recording_) records_.resize(step_first_record_);  // the previous step was dropped
  recording_ = true;
  step_ = step;
  trace_ = trace && trace->enabled() ? trace : nullptr;
  step_first_record_ = records_.size();
  op_context().profiling = true;
}

void ProfilingBackend::end_step(Seconds measured_wall, Seconds measured_cpu) {
  StepTimeRecord s;
  s.step = step_;
  s.rank = rank_;
  s.measured_wall = measured_wall;
  s.measured_cpu = measured_cpu;
  for (std::size_t i = step_first_record_; i < records_.size(); ++i) {
    s.ops_cpu += records_[i].cpu;
    s.ops_wall += records_[i].wall;
    s.predicted += records_[i].predicted;
    s.ops += 1;
  }
  steps_.push_back(s);
  recording_ = false;
  trace_ = nullptr;
  op_context().profiling = false;
}

template <class Fn>
auto ProfilingBackend::timed(const char* kind, std::vector<std::int64_t> shape, Seconds predicted, bool weight_only,
                             Fn&& fn) {
  if (!recording_) return fn();
  const OpContext& ctx = op_context();
  OpRecord r;
  r.kind = kind;
  r.shape = std::move(shape);
  r.phase = weight_only && ctx.phase == OpPhase::backward_input ? OpPhase::backward_weight : ctx.phase;
  r.layer = ctx.layer;
  r.microbatch = ctx.microbatch;
  r.stage = ctx.stage;
  r.action = ctx.action;
  r.step = step_;
  r.rank = rank_;
  r.predicted = predicted;
  auto finish = [&](Clock::time_point t0, Seconds c0) {
    r.cpu = thread_cpu_seconds() - c0;
    r.wall = std::chrono::duration<double>(Clock::now() - t0).count();
    r.start = t0;
    if (trace_) {
      const double start = trace_->to_us(t0);
      trace_->complete("ops", r.kind, start, r.wall * 1e6,
                       {{"phase", to_string(r.phase)},
                        {"layer", layer_name(r.layer)},
                        {"microbatch", r.microbatch},
                        {"cpu_us", r.cpu * 1e6},
                        {"predicted_us", r.predicted * 1e6},
                        {"shape", r.shape}});
    }
    records_.push_back(std::move(r));
  };
  // A device backend's ops return once their kernels are queued: wait for the compute
  // queue before and after, so that the wall time is the op's kernels (plus one
  // synchronisation's latency) rather than its launch; offloads and prefetches on the
  // copy streams go on overlapping.
  const bool device = !inner_.host_memory();
  if (device) inner_.synchronize_compute();
  const Seconds c0 = thread_cpu_seconds();
  const auto t0 = Clock::now();
  if constexpr (std::is_void_v<decltype(fn())>) {
    fn();
    if (device) inner_.synchronize_compute();
    finish(t0, c0);
  } else {
    auto v = fn();
    if (device) inner_.synchronize_compute();
    finish(t0, c0);
    return v;
  }
}

void ProfilingBackend::zero(void* dst, Bytes bytes) {
  timed("zero", {bytes}, cost_.elementwise(bytes), false, [&] { inner_.zero(dst, bytes); });
}
void ProfilingBackend::copy(void* dst, const void* src, Bytes bytes) {
  timed("copy", {bytes}, cost_.elementwise(2 * bytes), false, [&] { inner_.copy(dst, src, bytes); });
}
// On a host-memory backend these are plain memcpy calls on the compute thread (the
// model reads back the routing and the last logits), not the copy engine's offload
// copies that copy_h2d / copy_d2h price (their latency is a hand-off to its thread).
void ProfilingBackend::copy_from_host(void* dst, const void* src, Bytes bytes) {
  const Seconds p = inner_.host_memory() ? cost_.elementwise(2 * bytes) : cost_.copy_h2d(bytes);
  timed("copy_h2d", {bytes}, p, false, [&] { inner_.copy_from_host(dst, src, bytes); });
}
void ProfilingBackend::copy_to_host(void* dst, const void* src, Bytes bytes) {
  const Seconds p = inner_.host_memory() ? cost_.elementwise(2 * bytes) : cost_.copy_d2h(bytes);
  timed("copy_d2h", {bytes}, p, false, [&] { inner_.copy_to_host(dst, src, bytes); });
}

void ProfilingBackend::linear_forward(CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out) {
  timed("linear_forward", {n, in, out}, cost_.linear_forward(n, in, out), false,
        [&] { inner_.linear_forward(x, w, y, n, in, out); });
}

void ProfilingBackend::linear_backward(CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in,
                                       std::int64_t out, bool accumulate_dx) {
  const bool want_dx = bool(dx), want_dw = dw != nullptr;
  const char* kind = want_dx && want_dw ? "linear_backward" : want_dx ? "linear_backward_dx" : "linear_backward_dw";
  timed(kind, {n, in, out}, cost_.linear_backward(n, in, out, want_dx, want_dw), !want_dx,
        [&] { inner_.linear_backward(dy, x, w, dx, dw, n, in, out, accumulate_dx); });
}

void ProfilingBackend::gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, CView A,
                            std::int64_t lda, CView B, std::int64_t ldb, float beta, View C, std::int64_t ldc) {
  const GemmLayout layout = layout_of(ta, tb);
  const std::string kind = std::string("gemm_") + to_string(layout);
  timed(kind.c_str(), {M, N, K}, cost_.gemm(M, N, K, layout), false,
        [&] { inner_.gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
}

void ProfilingBackend::rmsnorm_forward(CView x, CView w, View y, float* rstd, std::int64_t n, std::int64_t d,
                                       float eps) {
  timed("rmsnorm_forward", {n, d}, cost_.rmsnorm_forward(n, d), false,
        [&] { inner_.rmsnorm_forward(x, w, y, rstd, n, d, eps); });
}
void ProfilingBackend::rmsnorm_backward(CView dy, CView x, CView w, const float* rstd, View dx, float* dw,
                                        std::int64_t n, std::int64_t d) {
  timed("rmsnorm_backward", {n, d}, cost_.rmsnorm_backward(n, d), false,
        [&] { inner_.rmsnorm_backward(dy, x, w, rstd, dx, dw, n, d); });
}
void ProfilingBackend::rope_forward(View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                                    double theta) {
  timed("rope_forward", {B, S, H, hd}, cost_.rope_forward(B, S, H, hd), false,
        [&] { inner_.rope_forward(x, B, S, H, hd, theta); });
}
void ProfilingBackend::rope_backward(View dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                                     double theta) {
  timed("rope_backward", {B, S, H, hd}, cost_.rope_backward(B, S, H, hd), false,
        [&] { inner_.rope_backward(dx, B, S, H, hd, theta); });
}
void ProfilingBackend::attention_forward(CView q, CView k, CView v, View out, View probs, std::int64_t B,
                                         std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t hd) {
  // Priced and keyed by the query heads: kv heads shared by a group change no FLOPs.
  timed("attention_forward", {B, S, H, hd}, cost_.attention_forward(B, S, H, hd), false,
        [&] { inner_.attention_forward(q, k, v, out, probs, B, S, H, Hkv, hd); });
}
void ProfilingBackend::attention_backward(CView dout, CView q, CView k, CView v, CView out, CView probs, View dq,
                                          View dk, View dv, View dprobs_ws, std::int64_t B, std::int64_t S,
                                          std::int64_t H, std::int64_t Hkv, std::int64_t hd) {
  timed("attention_backward", {B, S, H, hd}, cost_.attention_backward(B, S, H, hd), false,
        [&] { inner_.attention_backward(dout, q, k, v, out, probs, dq, dk, dv, dprobs_ws, B, S, H, Hkv, hd); });
}
void ProfilingBackend::swiglu_forward(CView gate, CView up, View out, std::int64_t n) {
  timed("swiglu_forward", {n}, cost_.swiglu_forward(n), false, [&] { inner_.swiglu_forward(gate, up, out, n); });
}
void ProfilingBackend::swiglu_backward(CView dout, CView gate, CView up, View dgate, View dup, std::int64_t n) {
  timed("swiglu_backward", {n}, cost_.swiglu_backward(n), false,
        [&] { inner_.swiglu_backward(dout, gate, up, dgate, dup, n); });
}
void ProfilingBackend::add_inplace(View y, CView x, std::int64_t n) {
  timed("add_inplace", {n}, cost_.add_inplace(n), false, [&] { inner_.add_inplace(y, x, n); });
}
void ProfilingBackend::cast(CView src, View dst, std::int64_t n) {
  timed("cast", {n}, cost_.elementwise(n * (dtype_size(src.dtype) + dtype_size(dst.dtype))), false,
        [&] { inner_.cast(src, dst, n); });
}
void ProfilingBackend::embedding_forward(const std::int32_t* ids, CView table, View out, std::int64_t n,
                                         std::int64_t d) {
  timed("embedding_forward", {n, d}, cost_.embedding_forward(n, d), false,
        [&] { inner_.embedding_forward(ids, table, out, n, d); });
}
void ProfilingBackend::embedding_backward(const std::int32_t* ids, CView dout, float* dtable, std::int64_t n,
                                          std::int64_t d) {
  timed("embedding_backward", {n, d}, cost_.embedding_backward(n, d), true,
        [&] { inner_.embedding_backward(ids, dout, dtable, n, d); });
}
double ProfilingBackend::cross_entropy_forward(CView logits, const std::int32_t* targets, View probs, float* losses,
                                               std::int64_t n, std::int64_t V) {
  return timed("cross_entropy_forward", {n, V}, cost_.cross_entropy_forward(n, V), false,
               [&] { return inner_.cross_entropy_forward(logits, targets, probs, losses, n, V); });
}
void ProfilingBackend::cross_entropy_backward(CView probs, const std::int32_t* targets, View dlogits, std::int64_t n,
                                              std::int64_t V, float scale) {
  timed("cross_entropy_backward", {n, V}, cost_.cross_entropy_backward(n, V), false,
        [&] { inner_.cross_entropy_backward(probs, targets, dlogits, n, V, scale); });
}
void ProfilingBackend::router_forward(CView logits, float* probs, std::int32_t* idx, float* w, std::int64_t n,
                                      std::int64_t E, std::int64_t k, const ops::RouterOptions& opt) {
  timed("router_forward", {n, E, k}, cost_.router_forward(n, E, k), false,
        [&] { inner_.router_forward(logits, probs, idx, w, n, E, k, opt); });
}
void ProfilingBackend::router_backward(const float* dw, const float* dprobs, const float* probs,
                                       const std::int32_t* idx, View dlogits, std::int64_t n, std::int64_t E,
                                       std::int64_t k, const ops::RouterOptions& opt) {
  timed("router_backward", {n, E, k}, cost_.router_backward(n, E, k), false,
        [&] { inner_.router_backward(dw, dprobs, probs, idx, dlogits, n, E, k, opt); });
}
double ProfilingBackend::aux_loss_forward(const float* probs, const std::int32_t* idx, std::int64_t n, std::int64_t E,
                                          std::int64_t k, double coef, ops::RouterScore score) {
  return timed("aux_loss_forward", {n, E, k}, cost_.aux_loss_forward(n, E, k), false,
               [&] { return inner_.aux_loss_forward(probs, idx, n, E, k, coef, score); });
}
void ProfilingBackend::aux_loss_backward(const std::int32_t* idx, const float* probs, float* dprobs, std::int64_t n,
                                         std::int64_t E, std::int64_t k, double coef, ops::RouterScore score) {
  timed("aux_loss_backward", {n, E, k}, cost_.aux_loss_backward(n, E, k), false,
        [&] { inner_.aux_loss_backward(idx, probs, dprobs, n, E, k, coef, score); });
}
double ProfilingBackend::z_loss_forward(CView logits, std::int64_t n, std::int64_t E, double coef) {
  return timed("z_loss_forward", {n, E}, cost_.z_loss_forward(n, E), false,
               [&] { return inner_.z_loss_forward(logits, n, E, coef); });
}
void ProfilingBackend::z_loss_backward(CView logits, View dlogits, std::int64_t n, std::int64_t E, double coef) {
  timed("z_loss_backward", {n, E}, cost_.z_loss_backward(n, E), false,
        [&] { inner_.z_loss_backward(logits, dlogits, n, E, coef); });
}
void ProfilingBackend::skew_router_logits(View logits, std::int64_t n, std::int64_t E, std::int64_t k,
                                          const ops::RouterSkew& skew) {
  timed("skew_router_logits", {n, E, k}, cost_.elementwise(2 * n * E * kF), false,
        [&] { inner_.skew_router_logits(logits, n, E, k, skew); });
}
std::int64_t ProfilingBackend::moe_plan_dispatch(const std::int32_t* idx, std::int64_t n, std::int64_t E,
                                                 std::int64_t k, std::int64_t cap, std::int32_t* counts,
                                                 std::int32_t* offsets, std::int32_t* slot_of,
                                                 std::int32_t* host_offsets) {
  // topk_idx read and slot_of written, [n, k] each.
  return timed("moe_plan_dispatch", {n, E, k}, cost_.elementwise(2 * n * k * kF), false, [&] {
    return inner_.moe_plan_dispatch(idx, n, E, k, cap, counts, offsets, slot_of, host_offsets);
  });
}
void ProfilingBackend::permute_forward(CView x, const std::int32_t* slot_of, View xp, std::int64_t n, std::int64_t k,
                                       std::int64_t d) {
  timed("permute_forward", {n, k, d}, cost_.permute_forward(n, k, d), false,
        [&] { inner_.permute_forward(x, slot_of, xp, n, k, d); });
}
void ProfilingBackend::permute_backward(CView dxp, const std::int32_t* slot_of, View dx, std::int64_t n, std::int64_t k,
                                        std::int64_t d) {
  timed("permute_backward", {n, k, d}, cost_.permute_backward(n, k, d), false,
        [&] { inner_.permute_backward(dxp, slot_of, dx, n, k, d); });
}
void ProfilingBackend::unpermute_forward(CView yp, const std::int32_t* slot_of, const float* w, View y, std::int64_t n,
                                         std::int64_t k, std::int64_t d) {
  timed("unpermute_forward", {n, k, d}, cost_.unpermute_forward(n, k, d), false,
        [&] { inner_.unpermute_forward(yp, slot_of, w, y, n, k, d); });
}
void ProfilingBackend::unpermute_backward(CView dy, CView yp, const std::int32_t* slot_of, const float* w, View dyp,
                                          float* dw, std::int64_t n, std::int64_t k, std::int64_t d) {
  timed("unpermute_backward", {n, k, d}, cost_.unpermute_backward(n, k, d), false,
        [&] { inner_.unpermute_backward(dy, yp, slot_of, w, dyp, dw, n, k, d); });
}
void ProfilingBackend::combine_topk_grad(CView dy, CView yp_rows, const std::int32_t* slot_of, float* dtopk_w,
                                         std::int64_t n, std::int64_t k, std::int64_t d, std::int64_t r0,
                                         std::int64_t rows) {
  timed("combine_topk_grad", {n, k, d, rows}, cost_.combine_topk_grad(n, k, d, rows), false,
        [&] { inner_.combine_topk_grad(dy, yp_rows, slot_of, dtopk_w, n, k, d, r0, rows); });
}
void ProfilingBackend::grouped_linear_forward(CView x, CView w, View y, const std::int32_t* offsets, std::int64_t E,
                                              std::int64_t in, std::int64_t out) {
  std::vector<std::int64_t> rows = group_rows(offsets, E);
  const Seconds p = cost_.grouped_linear_forward(rows, in, out);
  rows.push_back(in);
  rows.push_back(out);
  timed("grouped_linear_forward", std::move(rows), p, false,
        [&] { inner_.grouped_linear_forward(x, w, y, offsets, E, in, out); });
}
void ProfilingBackend::grouped_linear_backward(CView dy, CView x, CView w, View dx, float* dw,
                                               const std::int32_t* offsets, std::int64_t E, std::int64_t in,
                                               std::int64_t out) {
  const bool want_dx = bool(dx), want_dw = dw != nullptr;
  const char* kind = want_dx && want_dw ? "grouped_linear_backward"
                     : want_dx          ? "grouped_linear_backward_dx"
                                        : "grouped_linear_backward_dw";
  std::vector<std::int64_t> rows = group_rows(offsets, E);
  const Seconds p = cost_.grouped_linear_backward(rows, in, out, want_dx, want_dw);
  rows.push_back(in);
  rows.push_back(out);
  timed(kind, std::move(rows), p, !want_dx,
        [&] { inner_.grouped_linear_backward(dy, x, w, dx, dw, offsets, E, in, out); });
}
Seconds ProfilingBackend::kernel_time(const char* table, std::int64_t n, Bytes fallback_bytes) const {
  return cost_.profile().op_tables.count(table) ? cost_.op(table, 4 * n) : cost_.elementwise(fallback_bytes);
}
double ProfilingBackend::square_sum(const float* g, std::int64_t n) {
  return timed("square_sum", {n}, kernel_time(op_names::kSquareSum, n, n * kF), false,
               [&] { return inner_.square_sum(g, n); });
}
void ProfilingBackend::scale(float* g, std::int64_t n, float s) {
  timed("scale", {n}, kernel_time(op_names::kScale, n, 2 * n * kF), false, [&] { inner_.scale(g, n, s); });
}
void ProfilingBackend::adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2,
                             float eps, float decay, float step_size, float inv_sqrt_bc2) {
  // w, m, v read and written, g read: 7 arrays of n floats.
  timed("adamw", {n}, kernel_time(op_names::kAdamW, n, 7 * n * kF), false,
        [&] { inner_.adamw(w, g, m, v, n, b1, b2, eps, decay, step_size, inv_sqrt_bc2); });
}

ScopedBackendOverride::ScopedBackendOverride(ops::Backend* backend)
    : previous_(ops::set_backend_override(backend)) {}
ScopedBackendOverride::~ScopedBackendOverride() { ops::set_backend_override(previous_); }

// ---- files ------------------------------------------------------------------------

fs::path op_times_part_path(const fs::path& run_dir, int rank) {
  return run_dir / fmt::format("op_times.rank{}.json", rank);
}

void write_op_times_part(const fs::path& path, const std::vector<OpRecord>& records,
                         const std::vector<StepTimeRecord>& steps) {
  json ops = json::array(), st = json::array();
  for (const OpRecord& r : records)
    ops.push_back(json::array({r.kind, to_string(r.phase), r.layer, r.microbatch, r.stage, r.action, r.step, r.rank,
                               r.cpu, r.wall, r.predicted, r.shape}));
  for (const StepTimeRecord& s : steps)
    st.push_back(json::array(
        {s.step, s.rank, s.measured_wall, s.measured_cpu, s.ops_cpu, s.ops_wall, s.predicted, s.ops}));
  json doc = {{"ops", ops}, {"steps", st}};
  write_file_atomically(path, doc.dump());
}

namespace {

void read_part(const fs::path& path, std::vector<OpRecord>& records, std::vector<StepTimeRecord>& steps) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("op times: cannot read '{}'", path.string()));
  try {
    json doc = json::parse(in);
    for (const json& o : doc.at("ops")) {
      OpRecord r;
      r.kind = o.at(0).get<std::string>();
      r.phase = parse_op_phase(o.at(1).get<std::string>());
      r.layer = o.at(2).get<int>();
      r.microbatch = o.at(3).get<int>();
      r.stage = o.at(4).get<int>();
      r.action = o.at(5).get<int>();
      r.step = o.at(6).get<std::int64_t>();
      r.rank = o.at(7).get<int>();
      r.cpu = o.at(8).get<double>();
      r.wall = o.at(9).get<double>();
      r.predicted = o.at(10).get<double>();
      r.shape = o.at(11).get<std::vector<std::int64_t>>();
      records.push_back(std::move(r));
    }
    for (const json& o : doc.at("steps")) {
      StepTimeRecord s;
      s.step = o.at(0).get<std::int64_t>();
      s.rank = o.at(1).get<int>();
      s.measured_wall = o.at(2).get<double>();
      s.measured_cpu = o.at(3).get<double>();
      s.ops_cpu = o.at(4).get<double>();
      s.ops_wall = o.at(5).get<double>();
      s.predicted = o.at(6).get<double>();
      s.ops = o.at(7).get<std::int64_t>();
      steps.push_back(s);
    }
  } catch (const json::exception& e) {
    throw DataError(fmt::format("op times: '{}' is malformed: {}", path.string(), e.what()));
  }
}

json summary_json(const OpTimeSummary& s) {
  json kinds = json::array();
  for (const OpKindSummary& k : s.kinds)
    kinds.push_back({{"kind", k.kind},
                     {"count", k.count},
                     {"measured_median_s", k.measured_median},
                     {"predicted_median_s", k.predicted_median},
                     {"measured_total_s", k.measured_total},
                     {"predicted_total_s", k.predicted_total},
                     {"mean_abs_rel_error", k.mean_abs_rel_error}});
  return {{"count", s.count},
          {"measured_total_s", s.measured_total},
          {"predicted_total_s", s.predicted_total},
          {"weighted_error", s.weighted_error},
          {"total_error", s.total_error},
          {"kinds", kinds}};
}

}  // namespace

namespace {

/// The time model judged on what it can predict: each (kind, shape)'s median.
struct ShapeErrors {
  /// Time-weighted mean over (kind, shape) of |predicted median - measured median| /
  /// measured median (weight: the shape's measured total).
  double median_error = 0;
  /// sum over ops |measured - its shape's measured median| / sum measured: the op
  /// error of a model that knew every shape's median exactly (run-to-run noise).
  double noise_floor = 0;
};

ShapeErrors shape_median_errors(
    const std::map<std::pair<std::string, std::vector<std::int64_t>>, std::vector<OpRecord>>& by_shape,
    bool use_cpu) {
  double weight = 0, median_sum = 0, noise_sum = 0;
  for (const auto& [key, rs] : by_shape) {
    std::vector<double> measured, predicted;
    for (const OpRecord& r : rs) {
      measured.push_back(use_cpu ? r.cpu : r.wall);
      predicted.push_back(r.predicted);
    }
    const double mm = median(measured), pm = median(predicted);
    double total = 0;
    for (double m : measured) {
      total += m;
      noise_sum += std::abs(m - mm);
    }
    if (mm > 0) median_sum += total * std::abs(pm - mm) / mm;
    weight += total;
  }
  if (weight <= 0) return {};
  return {median_sum / weight, noise_sum / weight};
}

}  // namespace

json summarize_op_time_parts(const std::vector<fs::path>& parts, std::int64_t first_step, bool use_cpu) {
  std::vector<OpRecord> all;
  std::vector<StepTimeRecord> all_steps;
  for (const fs::path& p : parts) read_part(p, all, all_steps);
  std::vector<OpRecord> records;
  std::vector<StepTimeRecord> steps;
  for (OpRecord& r : all)
    if (r.step >= first_step) records.push_back(std::move(r));
  for (const StepTimeRecord& s : all_steps)
    if (s.step >= first_step) steps.push_back(s);
  const OpTimeSummary main = summarize_op_times(records, use_cpu);
  const OpTimeSummary wall = summarize_op_times(records, false);
  json phases = json::object();
  for (OpPhase ph : {OpPhase::forward, OpPhase::backward_input, OpPhase::backward_weight, OpPhase::recompute,
                     OpPhase::optimizer, OpPhase::other}) {
    std::vector<OpRecord> sub;
    for (const OpRecord& r : records)
      if (r.phase == ph) sub.push_back(r);
    if (sub.empty()) continue;
    const OpTimeSummary s = summarize_op_times(sub, use_cpu);
    phases[to_string(ph)] = {{"count", s.count},
                             {"measured_total_s", s.measured_total},
                             {"predicted_total_s", s.predicted_total},
                             {"weighted_error", s.weighted_error},
                             {"total_error", s.total_error}};
  }
  json st = json::array();
  for (const StepTimeRecord& s : steps)
    st.push_back({{"step", s.step},
                  {"rank", s.rank},
                  {"measured_wall_s", s.measured_wall},
                  {"measured_cpu_s", s.measured_cpu},
                  {"ops_cpu_s", s.ops_cpu},
                  {"ops_wall_s", s.ops_wall},
                  {"predicted_s", s.predicted},
                  {"ops", s.ops}});
  std::vector<StepTimeRecord> ops_as_measured = steps;  // the step's ops' own sum: time outside ops removed
  for (StepTimeRecord& s : ops_as_measured) s.measured_wall = use_cpu ? s.ops_cpu : s.ops_wall;
  // Per kind and shape (the diagnosis of a kind's error: which sizes it misses).
  std::map<std::pair<std::string, std::vector<std::int64_t>>, std::vector<OpRecord>> by_shape;
  for (const OpRecord& r : records) by_shape[{r.kind, r.shape}].push_back(r);
  json shapes = json::array();
  const ShapeErrors shape_errors = shape_median_errors(by_shape, use_cpu);
  for (const auto& [key, rs] : by_shape) {
    const OpTimeSummary s = summarize_op_times(rs, use_cpu);
    shapes.push_back({{"kind", key.first},
                      {"shape", key.second},
                      {"count", s.count},
                      {"measured_median_s", s.kinds[0].measured_median},
                      {"predicted_median_s", s.kinds[0].predicted_median},
                      {"measured_total_s", s.measured_total},
                      {"predicted_total_s", s.predicted_total}});
  }
  return {{"clock", use_cpu ? "thread_cpu" : "wall"},
          {"first_step", first_step},
          {"op_error", main.weighted_error},
          {"op_error_wall", wall.weighted_error},
          {"op_total_error", main.total_error},
          {"op_median_error", shape_errors.median_error},
          {"op_noise_floor", shape_errors.noise_floor},
          {"step_error", step_time_error(steps, use_cpu)},
          {"step_error_wall", step_time_error(steps, false)},
          {"step_error_ops", step_time_error(ops_as_measured, false)},
          {"ops", summary_json(main)},
          {"shapes", shapes},
          {"ops_wall", summary_json(wall)},
          {"phases", phases},
          {"steps", st}};
}

}  // namespace moeflex
