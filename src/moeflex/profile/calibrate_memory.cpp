// The calibration's memory and per-step parameter phases: streaming y += x over
// sizes (the elementwise table, launch overhead, bandwidth), copies between an arena
// block and a host buffer (the copy tables and their affine fit), and the trainer's
// optimizer work (zero_grads, norm, clip, AdamW) over parameter counts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/ops/backend.h"
#include "moeflex/profile/calibrate_internal.h"

namespace moeflex::calibration {

void measure_memory(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra) {
  const std::map<std::string, std::set<Bytes>> held = held_out_op_bytes();
  const std::set<Bytes>& held_elementwise = held.at(op_names::kElementwise);
  // Streaming y += x in an OpenMP loop like the model's residual adds, over sizes
  // from L1-resident to well past the last-level cache: the elementwise table, its
  // smallest point the launch overhead, the slope over the largest the bandwidth.
  // Steps of sqrt(2) (full grid) resolve the bends where the operands outgrow L1,
  // L2 and the last-level cache.
  std::vector<std::int64_t> elems;
  for (double n = 256; n <= (full ? (16 << 20) : (4 << 20)); n *= full ? std::sqrt(2.0) : 4.0) {
    const std::int64_t e = std::llround(n / 16) * 16;
    if (!held_elementwise.count(op_bytes::add_inplace(e))) elems.push_back(e);
  }
  const std::int64_t big = elems.back();
  std::vector<float> y = buffer(big, 31), x = buffer(big, 32);
  std::vector<Job> mem_jobs;
  for (std::int64_t n : elems) {
    mem_jobs.push_back({[&y, &x, n] {
      float* py = y.data();
      const float* px = x.data();
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) py[i] += px[i];
    }});
  }

  // Copies between an arena block (the device) and a separate host buffer, one
  // thread, as the offload engine's copy worker does them, from cold caches: a
  // table over sizes from cache-resident to well past the last-level cache, and an
  // affine fit over it.
  std::vector<Bytes> sizes;
  for (Bytes s : full ? std::vector<Bytes>{256 * kKiB, 512 * kKiB, 1 * kMiB, 2 * kMiB, 4 * kMiB, 8 * kMiB, 16 * kMiB,
                                           32 * kMiB, 64 * kMiB}
                      : std::vector<Bytes>{512 * kKiB, 2 * kMiB, 8 * kMiB, 32 * kMiB})
    if (!held.at(op_names::kCopyH2D).count(s)) sizes.push_back(s);
  const Bytes max_bytes = sizes.back();
  Arena arena;
  void* dev = arena.allocate(max_bytes, MemCategory::workspace, "calibrate");
  std::vector<char> host(static_cast<std::size_t>(max_bytes));
  std::memset(dev, 1, static_cast<std::size_t>(max_bytes));
  std::memset(host.data(), 2, host.size());
  std::vector<Job> copy_jobs;
  for (Bytes s : sizes) {
    copy_jobs.push_back({[&, s] { std::memcpy(dev, host.data(), static_cast<std::size_t>(s)); }, 0, false});  // h2d
    copy_jobs.push_back({[&, s] { std::memcpy(host.data(), dev, static_cast<std::size_t>(s)); }, 0, false});  // d2h
  }
  std::vector<Job> jobs = mem_jobs;
  jobs.insert(jobs.end(), copy_jobs.begin(), copy_jobs.end());
  const std::size_t at = add_extra(jobs, extra);
  run_jobs(jobs, budget);
  take_extra(jobs, at, extra);
  arena.deallocate(dev, max_bytes, MemCategory::workspace);
  for (std::size_t i = 0; i < mem_jobs.size(); ++i) mem_jobs[i].time = jobs[i].time;
  for (std::size_t i = 0; i < copy_jobs.size(); ++i) copy_jobs[i].time = jobs[mem_jobs.size() + i].time;

  std::vector<OpSample> table;
  for (std::size_t i = 0; i < elems.size(); ++i) table.push_back({op_bytes::add_inplace(elems[i]), mem_jobs[i].time});
  p.launch_overhead = mem_jobs[0].time;
  std::vector<std::pair<double, Seconds>> tail;
  for (std::size_t i = elems.size() - std::min<std::size_t>(3, elems.size()); i < elems.size(); ++i)
    tail.emplace_back(double(table[i].bytes), table[i].seconds);
  p.memory_bandwidth = 1.0 / fit_affine(tail).second;
  p.op_tables[op_names::kElementwise] = std::move(table);

  std::vector<std::pair<double, Seconds>> h2d, d2h;
  std::vector<OpSample> h2d_table, d2h_table;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    h2d.emplace_back(double(sizes[i]), copy_jobs[2 * i].time);
    d2h.emplace_back(double(sizes[i]), copy_jobs[2 * i + 1].time);
    h2d_table.push_back({sizes[i], copy_jobs[2 * i].time});
    d2h_table.push_back({sizes[i], copy_jobs[2 * i + 1].time});
  }
  const auto [lat_h2d, per_byte_h2d] = fit_affine(h2d);
  const auto [lat_d2h, per_byte_d2h] = fit_affine(d2h);
  p.h2d_bandwidth = 1.0 / per_byte_h2d;
  p.d2h_bandwidth = 1.0 / per_byte_d2h;
  p.copy_latency = 0.5 * (lat_h2d + lat_d2h);
  p.op_tables[op_names::kCopyH2D] = std::move(h2d_table);
  p.op_tables[op_names::kCopyD2H] = std::move(d2h_table);
}

// ---- per-step parameter work -----------------------------------------------------------

namespace {

/// Numels of the default model's parameter tensors of one MoE layer, in the order
/// MoEModel creates them (input norm, q, k, v, o, post-attention norm, router, the
/// grouped experts' gate, up and down projections): an optimizer_step sample cycles
/// through them, so that it makes as many kernel calls per parameter as the model.
const std::vector<std::int64_t> kLayerParamNumels = {kHidden,           kHidden * kHidden,
                                                     kHidden * kHidden, kHidden * kHidden,
                                                     kHidden * kHidden, kHidden,
                                                     kExperts * kHidden, kExperts * kExpertFfn * kHidden,
                                                     kExperts * kExpertFfn * kHidden, kExperts * kExpertFfn * kHidden};

/// The trainer's per-step work on `count` parameters held as w, g, m, v (each
/// `count` floats), split into tensors of kLayerParamNumels in turn: zero_grads
/// (Tensor::zero, a memset of every g), the global norm's square sums
/// (Backend::square_sum), the clip's scaling (Backend::scale; the sim_check runs
/// clip every step, their norms being above grad_clip) and AdamW::step
/// (Backend::adamw with its constants of step 10). Unlike the real step, g is
/// still zero when the norm reads it: the kernels' speed does not depend on the
/// values, and v stays non-negative.
class OptimizerBench {
 public:
  explicit OptimizerBench(std::int64_t max_count)
      : w_(buffer(max_count, 301)), g_(buffer(max_count, 302)), m_(buffer(max_count, 303)), v_(buffer(max_count, 304)) {
    for (float& x : v_) x = std::abs(x) * 1e-2f;
  }
  std::function<void()> step(std::int64_t count) {
    std::vector<std::pair<std::int64_t, std::int64_t>> tensors;  // (offset, numel)
    for (std::int64_t at = 0, i = 0; at < count; ++i) {
      const std::int64_t n = std::min(kLayerParamNumels[std::size_t(i) % kLayerParamNumels.size()], count - at);
      tensors.emplace_back(at, n);
      at += n;
    }
    return [this, tensors] {
      ops::Backend& be = ops::cpu_backend();
      for (auto [at, n] : tensors) std::memset(g_.data() + at, 0, sizeof(float) * std::size_t(n));
      double sq = 0;
      for (auto [at, n] : tensors) sq += be.square_sum(g_.data() + at, n);
      const float scale = float(1.0 / (std::sqrt(sq) + 1.0));
      for (auto [at, n] : tensors) be.scale(g_.data() + at, n, scale);
      const double bc1 = 1 - std::pow(0.9, 10.0), bc2 = 1 - std::pow(0.95, 10.0);
      for (auto [at, n] : tensors)
        be.adamw(w_.data() + at, g_.data() + at, m_.data() + at, v_.data() + at, n, 0.9f, 0.95f, 1e-8f,
                 float(1 - 2e-3 * 0.1), float(2e-3 / bc1), float(1 / std::sqrt(bc2)));
      sink_ = sq;
    };
  }
  /// One call of one optimizer kernel (op_names::kAdamW, kSquareSum or kScale) on
  /// the first n floats.
  std::function<void()> kernel(const std::string& name, std::int64_t n) {
    return [this, name, n] {
      ops::Backend& be = ops::cpu_backend();
      if (name == op_names::kAdamW)
        be.adamw(w_.data(), g_.data(), m_.data(), v_.data(), n, 0.9f, 0.95f, 1e-8f, float(1 - 2e-3 * 0.1), 2e-3f, 1.0f);
      else if (name == op_names::kSquareSum)
        sink_ = be.square_sum(g_.data(), n);
      else
        be.scale(g_.data(), n, 0.999f);
    };
  }

 private:
  std::vector<float> w_, g_, m_, v_;
  volatile double sink_ = 0;
};

}  // namespace

/// The optimizer_step table (op_names::kOptimizerStep): one rank's per-step
/// parameter work against 4 x parameters bytes, over parameter counts around the
/// default model's per-rank shares (4.4 M to 10.8 M in the sim_check layouts),
/// timed from evicted caches like every job (the parameters' state outgrows the
/// caches anyway: 16 B per parameter).
void measure_optimizer(HardwareProfile& p, bool full, Seconds budget) {
  const std::vector<std::int64_t> counts = full ? std::vector<std::int64_t>{1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 3 << 22}
                                                : std::vector<std::int64_t>{1 << 20, 1 << 22};
  OptimizerBench bench(counts.back());
  std::vector<Job> jobs;
  for (std::int64_t c : counts) jobs.push_back({bench.step(c), 0, false});
  // The kernels one by one, one call on one tensor of n floats (the op profiler and
  // the cost model price single calls with these), over the default model's tensor sizes.
  const std::vector<std::int64_t> ns = full ? std::vector<std::int64_t>{kHidden, 1 << 14, kHidden * kHidden, 1 << 18,
                                                                          kExperts * kExpertFfn * kHidden, 1 << 22}
                                            : std::vector<std::int64_t>{kHidden * kHidden, kExperts * kExpertFfn * kHidden};
  const char* kernels[] = {op_names::kAdamW, op_names::kSquareSum, op_names::kScale};
  for (const char* k : kernels)
    for (std::int64_t n : ns) jobs.push_back({bench.kernel(k, n), 0, true});
  run_jobs(jobs, budget);
  std::vector<OpSample> table;
  for (std::size_t i = 0; i < counts.size(); ++i) table.push_back({4 * counts[i], jobs[i].time});
  p.op_tables[op_names::kOptimizerStep] = std::move(table);
  std::size_t j = counts.size();
  for (const char* k : kernels) {
    std::vector<OpSample> t;
    for (std::int64_t n : ns) t.push_back({4 * n, jobs[j++].time});
    p.op_tables[k] = std::move(t);
  }
}

}  // namespace moeflex::calibration
