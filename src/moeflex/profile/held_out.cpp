// The held-out checks of the time model (see held_out.h): the shapes the grids leave
// out, the held-out invocations and their buffers, the report's rows, and validate().
#include "moeflex/profile/held_out.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/linear.h"

namespace moeflex {
namespace calibration {

/// Every GEMM the held-out linear and grouped linear invocations run.
std::set<GemmKey> held_out_gemms() {
  std::set<GemmKey> keys;
  const auto add_linear = [&](std::int64_t n, std::int64_t in, std::int64_t out) {
    for (const GemmShape& g : {linear_forward_gemm(n, in, out), linear_dx_gemm(n, in, out), linear_dw_gemm(n, in, out)})
      keys.insert(key_of(g));
  };
  for (const HeldLinear& l : kHeldLinears) add_linear(l.n, l.in, l.out);
  for (const auto& rows : kHeldExpertRows)
    for (std::int64_t r : rows)
      if (r > 0) add_linear(r, kHidden, kExpertFfn), add_linear(r, kExpertFfn, kHidden);
  return keys;
}

/// Every (op table, bytes) point the held-out invocations of the other ops look up.
std::map<std::string, std::set<Bytes>> held_out_op_bytes() {
  std::map<std::string, std::set<Bytes>> b;
  const std::int64_t d = kHidden, H = kHeads, hd = kHeadDim;
  for (std::int64_t n : {kHeldTokens[0], kHeldTokens[1], kHeldRmsnormLarge}) {
    b[op_names::kRmsnormForward].insert(op_bytes::rmsnorm_forward(n, d));
    b[op_names::kRmsnormBackward].insert(op_bytes::rmsnorm_backward(n, d));
  }
  for (auto [B, S] : kHeldAttention) {
    b[op_names::kRope].insert(op_bytes::rope(B, S, H, hd));
    b[op_names::kRopeTables].insert(op_bytes::rope_tables(S, hd));
    b[op_names::kAttentionForward].insert(op_bytes::attention_softmax_forward(1, S, 1));
    b[op_names::kAttentionBackward].insert(op_bytes::attention_softmax_forward(1, S, 1));
  }
  for (std::int64_t rows : kHeldSwigluRows) {
    b[op_names::kSwigluForward].insert(op_bytes::swiglu_forward(rows * kExpertFfn));
    b[op_names::kSwigluBackward].insert(op_bytes::swiglu_backward(rows * kExpertFfn));
  }
  for (std::int64_t n : kHeldTokens) {
    b[op_names::kRouterForward].insert(op_bytes::router_forward(n, kExperts, kTopK));
    b[op_names::kRouterBackward].insert(op_bytes::router_backward(n, kExperts, kTopK));
    for (const char* op : {op_names::kPermuteForward, op_names::kPermuteBackward, op_names::kUnpermuteForward,
                           op_names::kUnpermuteBackward})
      b[op].insert(op_bytes::permute(n, kTopK, d));
    b[op_names::kCrossEntropyForward].insert(op_bytes::cross_entropy(n, kVocab));
    b[op_names::kCrossEntropyBackward].insert(op_bytes::cross_entropy(n, kVocab));
  }
  for (std::int64_t n : kHeldElementwiseRows) b[op_names::kElementwise].insert(op_bytes::add_inplace(n * d));
  for (Bytes s : kHeldCopyBytes) b[op_names::kCopyH2D].insert(s), b[op_names::kCopyD2H].insert(s);
  return b;
}

HeldOut::HeldOut() {
  const std::int64_t d = kHidden, H = kHeads, hd = kHeadDim;
  std::vector<Case>& cases = gemm_cases;

  // GEMM-based ops: read-only inputs, outputs to scratch, weights and weight
  // gradients cold from a ring (as in the calibration, and in a real step).
  std::int64_t act = 0;
  for (const HeldLinear& l : kHeldLinears) act = std::max(act, l.n * std::max(l.in, l.out));
  for (const auto& rows : kHeldExpertRows)
    act = std::max(act, std::accumulate(rows.begin(), rows.end(), std::int64_t(0)) * kExpertFfn);
  x_ = buffer(act, 41), dy_ = buffer(act, 42), y_ = buffer(act, 43), dx_ = buffer(act, 44);
  float *x = x_.data(), *dy = dy_.data(), *y = y_.data(), *dx = dx_.data();
  ColdRing& ring = ring_;
  for (const HeldLinear& l : kHeldLinears) {
    const std::int64_t n = l.n, in = l.in, out = l.out;
    const std::string shape = fmt::format("n={} in={} out={}{}", n, in, out, l.note);
    cases.push_back({"linear_forward", shape,
                     [=, &ring] { ops::linear_forward(x, ring.next(out * in), y, n, in, out); },
                     [=](const CostModel& m) { return m.linear_forward(n, in, out); }});
    cases.push_back({"linear_backward", shape,
                     [=, &ring] {
                       ops::linear_backward(dy, x, ring.next(out * in), dx, ring.next(out * in), n,
                                            in, out);
                     },
                     [=](const CostModel& m) { return m.linear_backward(n, in, out); }});
  }
  std::vector<std::vector<std::int32_t>>& offsets = offsets_;
  for (const auto& rows : kHeldExpertRows) {
    std::vector<std::int32_t> o = {0};
    for (std::int64_t c : rows) o.push_back(o.back() + std::int32_t(c));
    offsets.push_back(std::move(o));
  }
  for (std::size_t r = 0; r < kHeldExpertRows.size(); ++r) {
    const std::vector<std::int64_t>& rows = kHeldExpertRows[r];
    const std::int32_t* off = offsets[r].data();
    for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{d, kExpertFfn}, {kExpertFfn, d}}) {
      const std::string shape = fmt::format("rows=[{}] in={} out={}", fmt::join(rows, ","), in, out);
      cases.push_back({"grouped_linear_forward", shape,
                       [=, &ring] {
                         ops::grouped_linear_forward(x, ring.next(kExperts * out * in), y, off, kExperts,
                                                     in, out);
                       },
                       [rows, in, out](const CostModel& m) { return m.grouped_linear_forward(rows, in, out); }});
      cases.push_back({"grouped_linear_backward", shape,
                       [=, &ring] {
                         ops::grouped_linear_backward(dy, x, ring.next(kExperts * out * in), dx,
                                                      ring.next(kExperts * out * in), off, kExperts, in, out);
                       },
                       [rows, in, out](const CostModel& m) { return m.grouped_linear_backward(rows, in, out); }});
    }
  }

  // The other kernels, on the same benches as the calibration.
  std::vector<Case>& ops = op_cases;
  const std::int64_t max_tokens = std::max(kHeldRmsnormLarge, *std::max_element(kHeldTokens.begin(), kHeldTokens.end()));
  const std::int64_t max_swiglu = *std::max_element(kHeldSwigluRows.begin(), kHeldSwigluRows.end()) * kExpertFfn;
  bench_ = std::make_unique<OpBench>(max_tokens, std::max({max_tokens * d, max_tokens * kTopK * d, max_swiglu}),
                                     max_tokens * kVocab);
  OpBench& b = *bench_;
  for (std::int64_t n : {kHeldTokens[0], kHeldTokens[1], kHeldRmsnormLarge}) {
    const std::string shape = fmt::format("n={} d={}", n, d);
    ops.push_back({"rmsnorm_forward", shape, b.rmsnorm_forward(n, d), [=](const CostModel& m) { return m.rmsnorm_forward(n, d); }});
    ops.push_back({"rmsnorm_backward", shape, b.rmsnorm_backward(n, d), [=](const CostModel& m) { return m.rmsnorm_backward(n, d); }});
  }
  std::int64_t max_att = 0;
  for (auto [B, S] : kHeldAttention) max_att = std::max(max_att, B * S * H * hd);
  att_ = std::make_unique<AttentionBench>(max_att);
  AttentionBench& att = *att_;
  for (auto [B, S] : kHeldAttention) {
    const std::string shape = fmt::format("B={} S={} H={} hd={}", B, S, H, hd);
    ops.push_back({"rope", shape, att.rope(B, S, H, hd), [=](const CostModel& m) { return m.rope(B, S, H, hd); }});
    ops.push_back({"attention_forward", shape, att.forward(B, S, H, hd), [=](const CostModel& m) { return m.attention_forward(B, S, H, hd); }});
    ops.push_back({"attention_backward", shape, att.backward(B, S, H, hd), [=](const CostModel& m) { return m.attention_backward(B, S, H, hd); }});
  }
  for (std::int64_t expert_rows : kHeldSwigluRows) {
    const std::int64_t n = expert_rows * kExpertFfn;
    const std::string shape = fmt::format("rows={} f={}", expert_rows, kExpertFfn);
    ops.push_back({"swiglu_forward", shape, b.swiglu_forward(n), [=](const CostModel& m) { return m.swiglu_forward(n); }});
    ops.push_back({"swiglu_backward", shape, b.swiglu_backward(n), [=](const CostModel& m) { return m.swiglu_backward(n); }});
  }
  for (std::int64_t n : kHeldTokens) {
    const std::string rshape = fmt::format("n={} E={} k={}", n, kExperts, kTopK);
    ops.push_back({"router_forward", rshape, b.router_forward(n), [=](const CostModel& m) { return m.router_forward(n, kExperts, kTopK); }});
    ops.push_back({"router_backward", rshape, b.router_backward(n), [=](const CostModel& m) { return m.router_backward(n, kExperts, kTopK); }});
    const std::string pshape = fmt::format("n={} k={} d={}", n, kTopK, d);
    ops.push_back({"permute_forward", pshape, b.permutation(0, n, d), [=](const CostModel& m) { return m.permute_forward(n, kTopK, d); }});
    ops.push_back({"permute_backward", pshape, b.permutation(1, n, d), [=](const CostModel& m) { return m.permute_backward(n, kTopK, d); }});
    ops.push_back({"unpermute_forward", pshape, b.permutation(2, n, d), [=](const CostModel& m) { return m.unpermute_forward(n, kTopK, d); }});
    ops.push_back({"unpermute_backward", pshape, b.permutation(3, n, d), [=](const CostModel& m) { return m.unpermute_backward(n, kTopK, d); }});
    const std::string cshape = fmt::format("n={} V={}", n, kVocab);
    ops.push_back({"cross_entropy_forward", cshape, b.cross_entropy_forward(n, kVocab),
                     [=](const CostModel& m) { return m.cross_entropy_forward(n, kVocab); }});
    ops.push_back({"cross_entropy_backward", cshape, b.cross_entropy_backward(n, kVocab),
                     [=](const CostModel& m) { return m.cross_entropy_backward(n, kVocab); }});
  }
  // Residual adds (y += x over [n, d]), priced as generic elementwise work.
  const std::int64_t max_add = *std::max_element(kHeldElementwiseRows.begin(), kHeldElementwiseRows.end()) * d;
  add_y_ = buffer(max_add, 45), add_x_ = buffer(max_add, 46);
  float* add_y = add_y_.data();
  const float* add_x = add_x_.data();
  for (std::int64_t rows : kHeldElementwiseRows) {
    const std::int64_t n = rows * d;
    memory_cases.push_back({"elementwise (y += x)", fmt::format("n={} d={}", rows, d),
                            [=] {
#pragma omp parallel for schedule(static)
                              for (std::int64_t i = 0; i < n; ++i) add_y[i] += add_x[i];
                            },
                            [=](const CostModel& m) { return m.elementwise(op_bytes::add_inplace(n)); }});
  }

  // Copies between an arena block and a host buffer, from cold caches.
  copy_max_ = *std::max_element(kHeldCopyBytes.begin(), kHeldCopyBytes.end());
  dev_ = arena_.allocate(copy_max_, MemCategory::workspace, "calibrate");
  host_.assign(static_cast<std::size_t>(copy_max_), 1);
  std::memset(dev_, 2, static_cast<std::size_t>(copy_max_));
  char* host = host_.data();
  void* dev = dev_;
  for (Bytes s : kHeldCopyBytes) {
    memory_cases.push_back({"copy_h2d", format_bytes(s), [=] { std::memcpy(dev, host, std::size_t(s)); },
                            [=](const CostModel& m) { return m.copy_h2d(s); }, false});
    memory_cases.push_back({"copy_d2h", format_bytes(s), [=] { std::memcpy(host, dev, std::size_t(s)); },
                            [=](const CostModel& m) { return m.copy_d2h(s); }, false});
  }
}

/// The report of `cases` timed in `jobs` (one job per case, in order), predicted by `model`.
void add_rows(CalibrationReport& report, const std::vector<HeldOut::Case>& cases, const std::vector<Job>& jobs,
              const CostModel& model) {
  for (std::size_t i = 0; i < cases.size(); ++i)
    report.rows.push_back({cases[i].op, cases[i].shape, jobs[i].time, cases[i].predict(model), jobs[i].spread});
}

void finish_report(CalibrationReport& report) {
  double sum = 0, spread = 0;
  for (const CalibrationRow& row : report.rows) sum += row.relative_error(), spread += row.spread;
  report.mean_abs_relative_error = report.rows.empty() ? 0 : sum / double(report.rows.size());
  report.mean_spread = report.rows.empty() ? 0 : spread / double(report.rows.size());
}

}  // namespace calibration

using namespace calibration;  // the harness and the held-out set (calibrate_internal.h)

double CalibrationRow::relative_error() const {
  return measured > 0 ? std::abs(predicted - measured) / measured : 0.0;
}

CalibrationReport validate(const HardwareProfile& profile, int threads, Seconds budget) {
  set_threads(resolve_threads(threads));
  const CostModel model(profile);
  HeldOut held;
  std::vector<HeldOut::Case> cases = held.gemm_cases;
  cases.insert(cases.end(), held.op_cases.begin(), held.op_cases.end());
  cases.insert(cases.end(), held.memory_cases.begin(), held.memory_cases.end());
  std::vector<Job> jobs = HeldOut::jobs_of(cases);
  run_jobs(jobs, budget);
  CalibrationReport report;
  add_rows(report, cases, jobs, model);
  finish_report(report);
  return report;
}

}  // namespace moeflex
