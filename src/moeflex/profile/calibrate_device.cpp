// A device's HardwareProfile, measured through its backend (see calibrate_device.h).
#include "moeflex/profile/calibrate_device.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/core/tensor.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/profile/calibrate_shapes.h"

namespace moeflex {
namespace {

using calibration::Clock;
using calibration::GemmShape;
using calibration::since;

/// Shares of the budget by phase (the rest: elementwise and copies).
constexpr double kGemmShare = 0.55;
constexpr double kAttentionShare = 0.2;
constexpr double kOpShare = 0.1;  ///< RMSNorm and SwiGLU tables
/// Calls per batch, at most (a tiny kernel then takes ~1 ms a batch on a GPU).
constexpr int kMaxCallsPerBatch = 200;
/// Attention tables: sequence lengths from this to the model's, in steps of 2x.
constexpr std::int64_t kMinAttentionSeq = 64;

/// Times calls of one kernel on the backend's compute stream (see the file comment
/// of calibrate_device.h); `share` seconds are spent on it.
Seconds time_calls(ops::Backend& be, const std::function<void()>& fn, Seconds share) {
  fn();  // warm-up: first-call setup (cuBLAS heuristics, module loading)
  be.synchronize_compute();
  Clock::time_point t0 = Clock::now();
  fn();
  be.synchronize_compute();
  const Seconds one = std::max(since(t0), 1e-7);
  const int calls = int(std::clamp(share / kDeviceBatches / one, 1.0, double(kMaxCallsPerBatch)));
  std::vector<Seconds> per_call;
  for (int b = 0; b < kDeviceBatches; ++b) {
    t0 = Clock::now();
    for (int i = 0; i < calls; ++i) fn();
    be.synchronize_compute();
    per_call.push_back(since(t0) / calls);
  }
  return calibration::quantile(per_call, 0.5);
}

/// Token counts of the GEMM lines: powers of 2 from 32 to 4x the micro-batch's
/// expert assignments (a routing spike), and the micro-batch's own count.
std::vector<std::int64_t> token_counts(const DeviceCalibrationShapes& s) {
  const std::int64_t tokens = s.micro_batch_size * s.seq_len;
  const std::int64_t top =
      std::max<std::int64_t>(64, 4 * tokens * std::max<std::int64_t>(s.model.num_experts_per_tok, 1));
  std::set<std::int64_t> n;
  for (std::int64_t x = 32; x <= top; x *= 2) n.insert(x);
  n.insert(tokens);
  return {n.begin(), n.end()};
}

/// Weight shapes [out, in] of the model's linear layers (one entry per distinct shape).
std::vector<std::pair<std::int64_t, std::int64_t>> weight_shapes(const ModelConfig& m) {
  const std::int64_t d = m.hidden_size, attn = m.num_attention_heads * m.head_dim();
  std::set<std::pair<std::int64_t, std::int64_t>> w = {{attn, d}, {d, attn}, {m.vocab_size, d}};
  if (m.has_dense_layers() || m.num_experts == 0)
    w.insert({m.intermediate_size, d}), w.insert({d, m.intermediate_size});
  if (m.num_experts > 0) {
    w.insert({m.moe_intermediate_size, d});
    w.insert({d, m.moe_intermediate_size});
    w.insert({m.num_experts, d});
    if (m.shared_width() > 0) w.insert({m.shared_width(), d}), w.insert({d, m.shared_width()});
  }
  return {w.begin(), w.end()};
}

/// A tensor of `numel` fp32 elements of calibration::buffer's values (through the
/// device's copy when its memory is not the host's).
Tensor filled(Arena& arena, ops::Backend& be, std::int64_t numel, std::uint32_t seed, const char* name) {
  Tensor t(arena, {numel}, MemCategory::workspace, name);
  const std::vector<float> host = calibration::buffer(numel, seed);
  const Bytes bytes = numel * Bytes(sizeof(float));
  if (be.host_memory())
    std::memcpy(t.raw(), host.data(), std::size_t(bytes));
  else
    be.copy_from_host(t.raw(), host.data(), bytes);
  return t;
}

void measure_gemms(HardwareProfile& p, ops::DeviceContext& ctx, ops::Backend& be, const DeviceCalibrationShapes& s,
                   Seconds budget) {
  std::vector<GemmShape> grid;
  for (auto [out, in] : weight_shapes(s.model))
    for (std::int64_t n : token_counts(s))
      for (const GemmShape& g : {calibration::linear_forward_gemm(n, in, out), calibration::linear_dx_gemm(n, in, out),
                                 calibration::linear_dw_gemm(n, in, out)})
        grid.push_back(g);
  std::int64_t a_len = 0, b_len = 0, c_len = 0;
  for (const GemmShape& g : grid) {
    a_len = std::max(a_len, (g.ta ? g.K : g.M) * g.lda);
    b_len = std::max(b_len, (g.tb ? g.N : g.K) * g.ldb);
    c_len = std::max(c_len, g.M * g.ldc);
  }
  Tensor A = filled(*ctx.arena, be, a_len, 1, "calibrate.A"), B = filled(*ctx.arena, be, b_len, 2, "calibrate.B"),
         C = filled(*ctx.arena, be, c_len, 3, "calibrate.C");
  const Seconds share = budget / double(grid.size());
  for (const GemmShape& g : grid) {
    const Seconds t = time_calls(
        be, [&] { be.gemm(g.ta, g.tb, g.M, g.N, g.K, 1.0f, A.f32(), g.lda, B.f32(), g.ldb, g.beta, C.f32(), g.ldc); },
        share);
    p.gemm.push_back({g.M, g.N, g.K, g.flops() / t, g.layout()});
  }
}

void measure_attention(HardwareProfile& p, ops::DeviceContext& ctx, ops::Backend& be, const DeviceCalibrationShapes& s,
                       Seconds budget) {
  const std::int64_t B = s.micro_batch_size, H = s.model.num_attention_heads, hd = s.model.head_dim();
  std::set<std::int64_t> seqs = {s.seq_len};
  for (std::int64_t S = kMinAttentionSeq; S < s.seq_len; S *= 2) seqs.insert(S);
  const std::int64_t S_max = *seqs.rbegin(), act = B * S_max * H * hd, probs = B * H * S_max * S_max;
  Arena& a = *ctx.arena;
  Tensor q = filled(a, be, act, 11, "calibrate.q"), k = filled(a, be, act, 12, "calibrate.k"),
         v = filled(a, be, act, 13, "calibrate.v"), o = filled(a, be, act, 14, "calibrate.o"),
         dout = filled(a, be, act, 15, "calibrate.dout"), dq = filled(a, be, act, 16, "calibrate.dq"),
         dk = filled(a, be, act, 17, "calibrate.dk"), dv = filled(a, be, act, 18, "calibrate.dv");
  Tensor P(a, {probs}, MemCategory::workspace, "calibrate.probs"),
      dP(a, {probs}, MemCategory::workspace, "calibrate.dprobs");
  const Seconds share = budget / double(2 * seqs.size());
  std::vector<OpSample> fwd, bwd;
  for (std::int64_t S : seqs) {
    const Bytes key = op_bytes::attention_softmax_forward(1, S, 1);
    const double heads = double(B * H);
    const Seconds tf = time_calls(
        be, [&] { be.attention_forward(q.f32(), k.f32(), v.f32(), o.f32(), P.f32(), B, S, H, H, hd); }, share);
    be.attention_forward(q.f32(), k.f32(), v.f32(), o.f32(), P.f32(), B, S, H, H, hd);  // the backward's saved state
    const Seconds tb = time_calls(
        be,
        [&] {
          be.attention_backward(dout.f32(), q.f32(), k.f32(), v.f32(), o.f32(), P.f32(), dq.f32(), dk.f32(), dv.f32(),
                                dP.f32(), B, S, H, H, hd);
        },
        share);
    fwd.push_back({key, tf / heads});
    bwd.push_back({key, tb / heads});
  }
  p.op_tables[op_names::kAttentionForward] = std::move(fwd);
  p.op_tables[op_names::kAttentionBackward] = std::move(bwd);
}

/// RMSNorm over [n, hidden] and SwiGLU over n x the experts' width (the dense MLP's
/// for a dense model), forward and backward, along the token counts of the GEMM lines.
void measure_ops(HardwareProfile& p, ops::DeviceContext& ctx, ops::Backend& be, const DeviceCalibrationShapes& s,
                 Seconds budget) {
  const std::vector<std::int64_t> ns = token_counts(s);
  const std::int64_t d = s.model.hidden_size, n_max = ns.back();
  const std::int64_t f = s.model.num_experts > 0 ? s.model.moe_intermediate_size : s.model.intermediate_size;
  const std::int64_t big = std::max(n_max * d, n_max * f);
  Arena& a = *ctx.arena;
  Tensor x = filled(a, be, big, 31, "calibrate.x"), y = filled(a, be, big, 32, "calibrate.y"),
         z = filled(a, be, big, 33, "calibrate.z"), dx = filled(a, be, big, 34, "calibrate.dx"),
         dz = filled(a, be, big, 35, "calibrate.dz"), w = filled(a, be, d, 36, "calibrate.w"),
         dw = filled(a, be, d, 37, "calibrate.dw"), rstd = filled(a, be, n_max, 38, "calibrate.rstd");
  const Seconds share = budget / double(4 * ns.size());
  std::vector<OpSample> rf, rb, sf, sb;
  for (std::int64_t n : ns) {
    const float eps = float(s.model.rms_norm_eps);
    rf.push_back({op_bytes::rmsnorm_forward(n, d),
                  time_calls(
                      be, [&] { be.rmsnorm_forward(x.f32(), w.f32(), y.f32(), rstd.f32(), n, d, eps); }, share)});
    rb.push_back({op_bytes::rmsnorm_backward(n, d),
                  time_calls(
                      be, [&] { be.rmsnorm_backward(y.f32(), x.f32(), w.f32(), rstd.f32(), dx.f32(), dw.f32(), n, d); },
                      share)});
    const std::int64_t e = n * f;
    sf.push_back(
        {op_bytes::swiglu_forward(e), time_calls(
                                          be, [&] { be.swiglu_forward(x.f32(), y.f32(), z.f32(), e); }, share)});
    sb.push_back({op_bytes::swiglu_backward(e),
                  time_calls(
                      be, [&] { be.swiglu_backward(z.f32(), x.f32(), y.f32(), dx.f32(), dz.f32(), e); }, share)});
  }
  p.op_tables[op_names::kRmsnormForward] = std::move(rf);
  p.op_tables[op_names::kRmsnormBackward] = std::move(rb);
  p.op_tables[op_names::kSwigluForward] = std::move(sf);
  p.op_tables[op_names::kSwigluBackward] = std::move(sb);
}

void measure_memory(HardwareProfile& p, ops::DeviceContext& ctx, ops::Backend& be, Seconds budget) {
  // y += x from 1 Ki to 16 Mi elements (64 MiB per operand: past any GPU's L2), 2x steps.
  std::vector<std::int64_t> elems;
  for (std::int64_t n = 1 << 10; n <= (std::int64_t(1) << 24); n *= 2) elems.push_back(n);
  // Copies from 256 KiB to 256 MiB, 2x steps.
  std::vector<Bytes> sizes;
  for (Bytes b = 256 * kKiB; b <= 256 * kMiB; b *= 2) sizes.push_back(b);
  const Seconds share = budget / double(elems.size() + 2 * sizes.size());

  Tensor y = filled(*ctx.arena, be, elems.back(), 21, "calibrate.y"),
         x = filled(*ctx.arena, be, elems.back(), 22, "calibrate.x");
  std::vector<OpSample> table;
  for (std::int64_t n : elems)
    table.push_back({op_bytes::add_inplace(n), time_calls(
                                                   be, [&] { be.add_inplace(y.f32(), x.f32(), n); }, share)});
  p.launch_overhead = table.front().seconds;
  std::vector<std::pair<double, Seconds>> tail;
  for (std::size_t i = table.size() - 3; i < table.size(); ++i)
    tail.emplace_back(double(table[i].bytes), table[i].seconds);
  p.memory_bandwidth = 1.0 / calibration::fit_affine(tail).second;
  p.op_tables[op_names::kElementwise] = std::move(table);
  x.reset();
  y.reset();

  const Bytes max_bytes = sizes.back();
  Tensor dev(*ctx.arena, {max_bytes / Bytes(sizeof(float))}, MemCategory::workspace, "calibrate.copy");
  void* host = be.host_alloc(max_bytes);
  std::memset(host, 1, std::size_t(max_bytes));
  std::vector<OpSample> h2d, d2h;
  try {
    for (Bytes b : sizes) {
      for (bool to_host : {false, true}) {
        void* dst = to_host ? host : dev.raw();
        const void* src = to_host ? static_cast<const void*>(dev.raw()) : host;
        const Seconds t = time_calls(
            be,
            [&] {
              if (be.host_memory())
                std::memcpy(dst, src, std::size_t(b));
              else
                be.copy_async(dst, src, b, to_host)->synchronize();
            },
            share);
        (to_host ? d2h : h2d).push_back({b, t});
      }
    }
  } catch (...) {
    be.host_free(host, max_bytes);
    throw;
  }
  be.host_free(host, max_bytes);
  std::vector<std::pair<double, Seconds>> fh, fd;
  for (const OpSample& o : h2d) fh.emplace_back(double(o.bytes), o.seconds);
  for (const OpSample& o : d2h) fd.emplace_back(double(o.bytes), o.seconds);
  const auto [lat_h, per_h] = calibration::fit_affine(fh);
  const auto [lat_d, per_d] = calibration::fit_affine(fd);
  p.h2d_bandwidth = 1.0 / per_h;
  p.d2h_bandwidth = 1.0 / per_d;
  p.copy_latency = 0.5 * (lat_h + lat_d);
  p.op_tables[op_names::kCopyH2D] = std::move(h2d);
  p.op_tables[op_names::kCopyD2H] = std::move(d2h);
}

}  // namespace

HardwareProfile calibrate_device(ops::DeviceContext& ctx, const DeviceCalibrationShapes& shapes, Seconds budget,
                                 bool progress) {
  check_config(budget > 0 && std::isfinite(budget), fmt::format("calibration budget {} s must be > 0", budget));
  check_config(shapes.micro_batch_size >= 1 && shapes.seq_len >= 1,
               fmt::format("calibrate: micro_batch_size {} and seq_len {} must be >= 1", shapes.micro_batch_size,
                           shapes.seq_len));
  shapes.model.validate();
  check_config(ctx.arena != nullptr, "calibrate: the device context has no arena");
  ops::Backend& be = ctx.backend ? *ctx.backend : ops::cpu_backend();
  HardwareProfile p;
  p.device = to_string(be.kind());
  p.name = fmt::format("{} (moeflex calibrate --device {})", be.describe(), p.device);
  p.threads = 1;
  const Clock::time_point t0 = Clock::now();
  auto phase = [&](const char* what) {
    if (progress) fmt::print("calibrate --device {}: {} ({:.1f} s)\n", p.device, what, since(t0));
    std::fflush(stdout);
  };
  phase("GEMMs");
  measure_gemms(p, ctx, be, shapes, kGemmShare * budget);
  phase("attention");
  measure_attention(p, ctx, be, shapes, kAttentionShare * budget);
  phase("RMSNorm and SwiGLU");
  measure_ops(p, ctx, be, shapes, kOpShare * budget);
  phase("elementwise and copies");
  measure_memory(p, ctx, be, (1 - kGemmShare - kAttentionShare - kOpShare) * budget);
  phase("done");
  (void)CostModel(p);  // the profile must make a cost model (positive rates and bandwidths)
  return p;
}

}  // namespace moeflex
