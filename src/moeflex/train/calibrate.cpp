// `moeflex calibrate`: measuring the HardwareProfile and validating the cost model.
//
// Phases and their shares of the measurement budget:
//   GEMMs       kGemmShare    lines along M (y = x w^T, NT as linear_forward) and along K
//                             (dw += dy^T x, TN as linear_backward) through every weight
//                             shape of the default model and a few larger ones, plus the
//                             per-head GEMMs of attention with their real strides
//   op tables   kOpShare      rmsnorm, swiglu, router, (un)permute, cross entropy over
//                             token counts; rope's tables and rotation; attention's
//                             softmax as what the whole op takes beyond its GEMMs
//   memory      the rest      an OpenMP triad (bandwidth, launch overhead) and memcpy
//                             between an arena block and a host buffer (copy tables
//                             from cache-resident sizes to past the last-level cache)
// Within a phase every measurement runs once (warm-up, and an estimate of its time),
// then the remaining share is split equally between the measurements, each repeated
// [1, kMaxRepeats] times in interleaved rounds (see run_jobs); its time is the
// median of those repeats. Isolated dips in a GEMM line or an op table are measured
// once more (run_series).
#include "moeflex/train/calibrate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <tuple>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/ops/attention.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/router.h"
#include "moeflex/ops/swiglu.h"

extern "C" void openblas_set_num_threads(int);

namespace moeflex {
namespace {

// ---- the default model (configs/default.toml) ------------------------------------
constexpr std::int64_t kHidden = 256;        // hidden_size
constexpr std::int64_t kExpertFfn = 384;     // moe_intermediate_size
constexpr std::int64_t kDenseFfn = 1024;     // intermediate_size
constexpr std::int64_t kVocab = 4096;        // vocab_size
constexpr std::int64_t kExperts = 8;         // num_experts
constexpr std::int64_t kTopK = 2;            // num_experts_per_tok
constexpr std::int64_t kSeq = 128;           // seq_len
constexpr std::int64_t kHeads = 4;           // num_attention_heads
constexpr std::int64_t kHeadDim = kHidden / kHeads;
constexpr double kRopeTheta = 10000.0;
constexpr float kRmsEps = 1e-5f;

// ---- budget ------------------------------------------------------------------------
constexpr double kMeasureShare = 0.8;   ///< of run_calibrate_command's budget; validation gets the rest
constexpr double kGemmShare = 0.55;     ///< of the measurement budget
constexpr double kOpShare = 0.35;       ///< of the measurement budget
constexpr int kMaxRepeats = 101;        ///< repeats of one measurement, at most
constexpr Seconds kRewarmBelow = 2e-3;  ///< jobs shorter than this run untimed before each timed run
constexpr double kBusyLoadPerCore = 0.5;  ///< load average per core above which calibrate warns
constexpr double kRecheckShare = 0.1;   ///< of a phase's budget, for measuring dips again
constexpr double kDipRatio = 0.8;       ///< a rate below this times both neighbours' is a dip
constexpr Bytes kColdRingBytes = 128 * kMiB;  ///< several times a large last-level cache

using Clock = std::chrono::steady_clock;

Seconds since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// One measurement: a kernel call, and after run_jobs its median time.
struct Job {
  std::function<void()> run;
  Seconds median = 0;
};

Seconds time_once(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return since(t0);
}

/// Warm-up pass over all jobs, then equal shares of what is left of `budget`. The
/// repeats are interleaved in rounds, each job's spread evenly over them, so that a
/// burst of load from elsewhere on the machine touches many jobs a little rather
/// than all repeats of one. A short job runs once untimed right before each timed
/// run, so its operands are as warm in the caches as in consecutive repeats (and as
/// after the op that produced them in a real step).
void run_jobs(std::vector<Job>& jobs, Seconds budget) {
  if (jobs.empty()) return;
  const auto t0 = Clock::now();
  const std::size_t n = jobs.size();
  std::vector<Seconds> warm(n);
  for (std::size_t i = 0; i < n; ++i) warm[i] = time_once(jobs[i].run);
  const Seconds share = std::max<Seconds>(0, budget - since(t0)) / double(n);
  std::vector<int> reps(n);
  std::vector<bool> rewarm(n);
  int rounds = 1;
  for (std::size_t i = 0; i < n; ++i) {
    rewarm[i] = warm[i] < kRewarmBelow;
    const Seconds visit = std::max(warm[i], 1e-7) * (rewarm[i] ? 2 : 1);
    reps[i] = std::clamp(int(share / visit), 1, kMaxRepeats);
    rounds = std::max(rounds, reps[i]);
  }
  // Rounds stop at the budget's end (a machine slower than its warm-up pass said);
  // a job that got no timed run keeps its warm-up time.
  std::vector<std::vector<Seconds>> times(n);
  bool over = false;
  for (int r = 0; r < rounds && !over; ++r) {
    for (std::size_t i = 0; i < n && !over; ++i) {
      // Job i takes part in reps[i] of the rounds, evenly spaced.
      if (std::int64_t(r) * reps[i] / rounds == std::int64_t(r + 1) * reps[i] / rounds) continue;
      if ((over = since(t0) >= budget)) break;
      if (rewarm[i]) jobs[i].run();
      times[i].push_back(time_once(jobs[i].run));
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<Seconds>& t = times[i];
    if (t.empty()) t.push_back(warm[i]);
    std::sort(t.begin(), t.end());
    const std::size_t m = t.size();
    jobs[i].median = m % 2 ? t[m / 2] : 0.5 * (t[m / 2 - 1] + t[m / 2]);
  }
}

/// One series of measurements whose rate (work / time) should change smoothly with
/// the work: a GEMM line, an op table. (work, index of the job) pairs.
using Series = std::vector<std::pair<double, std::size_t>>;

/// run_jobs with (1 - kRecheckShare) of the budget, then a second look at every job
/// whose rate dips below kDipRatio times both of its neighbours' in its series (an
/// isolated dip is load from elsewhere; a real cache or tiling step does not come
/// back up). It keeps the lower of its two medians: load only ever adds time.
void run_series(std::vector<Job>& jobs, const std::vector<Series>& series, Seconds budget) {
  run_jobs(jobs, (1.0 - kRecheckShare) * budget);
  std::vector<std::size_t> dips;
  for (Series s : series) {
    std::sort(s.begin(), s.end());
    for (std::size_t i = 1; i + 1 < s.size(); ++i) {
      const auto rate = [&](std::size_t j) { return s[j].first / jobs[s[j].second].median; };
      if (rate(i) < kDipRatio * std::min(rate(i - 1), rate(i + 1))) dips.push_back(s[i].second);
    }
  }
  if (dips.empty()) return;
  std::vector<Job> again;
  for (std::size_t i : dips) again.push_back({jobs[i].run});
  run_jobs(again, kRecheckShare * budget);
  for (std::size_t k = 0; k < dips.size(); ++k) jobs[dips[k]].median = std::min(jobs[dips[k]].median, again[k].median);
}

/// Deterministic values in [-0.5, 0.5) (no denormals, no NaN) for kernel inputs.
void fill(std::vector<float>& v, std::uint32_t seed) {
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (float& f : v) {
    x = x * 1664525u + 1013904223u;
    f = float(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
  }
}

std::vector<float> buffer(std::int64_t n, std::uint32_t seed) {
  std::vector<float> v(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));
  fill(v, seed);
  return v;
}

/// Weights and weight gradients are taken from this ring in consecutive slices, so
/// that each call's weight was last touched kColdRingBytes of weights ago: cold in
/// the caches, as in a training step, where all the other layers' weights pass
/// through between two uses of one. Activations stay warm, as after the op that
/// produced them.
class ColdRing {
 public:
  ColdRing() : data_(buffer(kColdRingBytes / kActivationBytes, 77)) {}
  /// The next n floats (n at most a quarter of the ring).
  float* next(std::int64_t n) {
    if (pos_ + n > std::int64_t(data_.size())) pos_ = 0;
    float* p = data_.data() + pos_;
    pos_ += (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
    return p;
  }

 private:
  static constexpr std::int64_t kSliceAlign = 16;  ///< floats: slices start on 64-byte lines
  std::vector<float> data_;
  std::int64_t pos_ = 0;
};

/// A dropless dispatch plan (moe_plan_dispatch's outputs) for a routing.
struct Routing {
  std::vector<std::int32_t> topk_idx, counts, offsets, slot_of;
  std::vector<float> topk_w;
};

/// Token i goes to experts (i + j) % E for j < k: every expert gets n*k/E rows.
Routing uniform_routing(std::int64_t n, std::int64_t E, std::int64_t k) {
  Routing r;
  r.topk_idx.resize(std::size_t(n * k));
  r.topk_w.assign(std::size_t(n * k), 1.0f / float(k));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < k; ++j) r.topk_idx[std::size_t(i * k + j)] = std::int32_t((i + j) % E);
  r.counts.resize(std::size_t(E));
  r.offsets.resize(std::size_t(E + 1));
  r.slot_of.resize(std::size_t(n * k));
  ops::moe_plan_dispatch(r.topk_idx.data(), n, E, k, -1, r.counts.data(), r.offsets.data(), r.slot_of.data());
  return r;
}

/// Least squares t = a + b x minimising relative residuals (weights 1/t^2), a >= 0, b > 0.
std::pair<Seconds, double> fit_affine(const std::vector<std::pair<double, Seconds>>& pts) {
  double sw = 0, swx = 0, swxx = 0, swt = 0, swxt = 0;
  for (auto [x, t] : pts) {
    const double w = 1.0 / std::max(t * t, 1e-30);
    sw += w, swx += w * x, swxx += w * x * x, swt += w * t, swxt += w * x * t;
  }
  const double det = sw * swxx - swx * swx;
  double a = det != 0 ? (swt * swxx - swx * swxt) / det : 0;
  double b = det != 0 ? (sw * swxt - swx * swt) / det : 0;
  if (a < 0 || det == 0) a = 0, b = swxt / swxx;
  if (!(b > 0)) {  // time did not grow with size: keep the largest point's rate
    const auto& last = *std::max_element(pts.begin(), pts.end());
    a = 0, b = last.second / last.first;
  }
  return {a, b};
}

int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_num_procs(); }

void set_threads(int threads) {
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

// ---- GEMM grid ------------------------------------------------------------------------

struct GemmShape {
  std::int64_t M, N, K;
  bool ta, tb;       // transposes as the real caller passes them
  std::int64_t lda, ldb, ldc;
  float beta;
};

std::vector<GemmShape> gemm_grid(bool full) {
  const std::vector<std::int64_t> xs =
      full ? std::vector<std::int64_t>{8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}
           : std::vector<std::int64_t>{16, 64, 256, 512, 1024, 2048};
  // Weight shapes [out, in] of the default model; y = x w^T has (N, K) = (out, in),
  // dx = dy w has (N, K) = (in, out), dw += dy^T x has (M, N) = (out, in).
  std::vector<std::pair<std::int64_t, std::int64_t>> weights = {
      {kHidden, kHidden}, {kExpertFfn, kHidden}, {kHidden, kExpertFfn}, {kDenseFfn, kHidden},
      {kHidden, kDenseFfn}, {kVocab, kHidden}, {kExperts, kHidden}};
  std::vector<std::pair<std::int64_t, std::int64_t>> nk = weights;
  nk.push_back({kHidden, kVocab});    // dx of the LM head
  nk.push_back({kHidden, kExperts});  // dx of the router
  if (full) {  // larger models
    for (auto w : {std::pair<std::int64_t, std::int64_t>{512, 512}, {1024, 1024}}) {
      weights.push_back(w);
      nk.push_back(w);
    }
  }
  std::vector<GemmShape> grid;
  for (auto [n, k] : nk)
    for (std::int64_t m : xs) grid.push_back({m, n, k, false, true, k, k, n, 0.0f});
  for (auto [m, n] : weights)
    for (std::int64_t k : xs) grid.push_back({m, n, k, true, false, m, n, n, 1.0f});
  // Attention, per head, with the strides of [B, S, H, hd] activations.
  const std::vector<std::int64_t> seqs = full ? std::vector<std::int64_t>{32, 64, 128, 256, 512}
                                              : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> hds = full ? std::vector<std::int64_t>{32, 64, 128} : std::vector<std::int64_t>{64};
  for (std::int64_t S : seqs) {
    for (std::int64_t hd : hds) {
      const std::int64_t ld = kHeads * hd;
      grid.push_back({S, S, hd, false, true, ld, ld, S, 0.0f});    // scores = q k^T
      grid.push_back({S, hd, S, false, false, S, ld, ld, 0.0f});   // out = P v
    }
  }
  return grid;
}

void measure_gemms(HardwareProfile& p, bool full, Seconds budget) {
  const std::vector<GemmShape> grid = gemm_grid(full);
  std::int64_t a_len = 0, b_len = 0, c_len = 0;
  for (const GemmShape& g : grid) {
    a_len = std::max(a_len, (g.ta ? g.K : g.M) * g.lda);
    b_len = std::max(b_len, (g.tb ? g.N : g.K) * g.ldb);
    c_len = std::max(c_len, g.M * g.ldc);
  }
  std::vector<float> A = buffer(a_len, 1), B = buffer(b_len, 2), C = buffer(c_len, 3);
  // The weight of y = x w^T (B) and the weight gradient of dw += dy^T x (C) come
  // cold from the ring; attention's operands are all activations.
  ColdRing ring;
  std::vector<Job> jobs;
  for (const GemmShape& g : grid) {
    const bool weight_b = !g.ta && g.tb && g.lda == g.K, weight_c = g.ta;
    jobs.push_back({[&A, &B, &C, &ring, g, weight_b, weight_c] {
      const float* b = weight_b ? ring.next(g.N * g.ldb) : B.data();
      float* c = weight_c ? ring.next(g.M * g.ldc) : C.data();
      ops::gemm<float>(g.ta, g.tb, g.M, g.N, g.K, 1.0f, A.data(), g.lda, b, g.ldb, g.beta, c, g.ldc);
    }});
  }
  // Series: the lines along M (NT) and along K (TN); attention's shapes stand alone.
  std::map<std::tuple<bool, std::int64_t, std::int64_t>, Series> lines;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const GemmShape& g = grid[i];
    const double f = 2.0 * double(g.M * g.N * g.K);
    if (!g.ta && g.tb && g.lda == g.K) lines[{false, g.N, g.K}].emplace_back(f, i);
    if (g.ta) lines[{true, g.M, g.N}].emplace_back(f, i);
  }
  std::vector<Series> series;
  for (auto& [key, line] : lines) series.push_back(std::move(line));
  run_series(jobs, series, budget);
  for (std::size_t i = 0; i < grid.size(); ++i)
    p.gemm.push_back({grid[i].M, grid[i].N, grid[i].K, 2.0 * double(grid[i].M * grid[i].N * grid[i].K) / jobs[i].median});
}

// ---- op tables ---------------------------------------------------------------------------

/// One op table under construction: jobs, their bytes, and an optional part of the
/// time that another model already accounts for (subtracted: the table keeps the rest).
struct TableSpec {
  std::string name;
  std::vector<Bytes> bytes;
  std::vector<Job> jobs;
  std::vector<std::function<Seconds(const CostModel&)>> known;  // empty or one per job
};

/// Stores the medians (minus the known parts, at least 0) as the op's table.
void store_table(HardwareProfile& p, const TableSpec& t, const CostModel* model) {
  std::vector<OpSample> pts;
  for (std::size_t i = 0; i < t.jobs.size(); ++i) {
    Seconds s = t.jobs[i].median;
    if (!t.known.empty()) s = std::max<Seconds>(0, s - t.known[i](*model));
    pts.push_back({t.bytes[i], s});
  }
  std::sort(pts.begin(), pts.end(), [](const OpSample& a, const OpSample& b) { return a.bytes < b.bytes; });
  std::vector<OpSample> merged;  // equal byte counts keep their mean
  for (std::size_t i = 0; i < pts.size();) {
    std::size_t j = i;
    Seconds sum = 0;
    while (j < pts.size() && pts[j].bytes == pts[i].bytes) sum += pts[j++].seconds;
    merged.push_back({pts[i].bytes, sum / double(j - i)});
    i = j;
  }
  p.op_tables[t.name] = std::move(merged);
}

/// Calls of the non-GEMM kernels on buffers that keep realistic contents however
/// often they are repeated: inputs are random and never written, saved tensors
/// (rstd, router probs and top-k) are valid outputs of their forward, outputs go
/// to scratch. Calibration and validation both time these very calls.
class OpBench {
 public:
  /// max_rows: tokens of the largest call; max_elems: elements of the largest flat
  /// operand ([n, d], [n*k, d], swiglu's [rows, f]); max_logits: n*V of the largest
  /// cross entropy.
  OpBench(std::int64_t max_rows, std::int64_t max_elems, std::int64_t max_logits)
      : in1_(buffer(max_elems, 101)),
        in2_(buffer(max_elems, 102)),
        out1_(buffer(max_elems, 103)),
        out2_(buffer(max_elems, 104)),
        w_(buffer(kHidden * 4, 105)),
        dw_(buffer(kHidden * 4, 106)),
        rstd_(buffer(max_rows, 107)),
        probs_(buffer(max_rows * kExperts, 108)),
        topk_w_(buffer(max_rows * kTopK, 109)),
        topk_idx_(std::size_t(max_rows * kTopK)),
        topk_scratch_(std::size_t(max_rows * kTopK)),
        logits_(buffer(max_logits, 110)),
        targets_(std::size_t(max_rows)) {
    for (std::size_t i = 0; i < targets_.size(); ++i) targets_[i] = std::int32_t((i * 2654435761u) % kVocab);
    ops::rmsnorm_forward(in1_.data(), w_.data(), out1_.data(), rstd_.data(), max_rows, kHidden, kRmsEps);
    ops::router_forward(in1_.data(), probs_.data(), topk_idx_.data(), topk_w_.data(), max_rows, kExperts, kTopK, true);
  }

  std::function<void()> rmsnorm_forward(std::int64_t n, std::int64_t d) {
    return [this, n, d] { ops::rmsnorm_forward(in1_.data(), w_.data(), out1_.data(), out2_.data(), n, d, kRmsEps); };
  }
  std::function<void()> rmsnorm_backward(std::int64_t n, std::int64_t d) {
    return [this, n, d] {
      ops::rmsnorm_backward(in2_.data(), in1_.data(), w_.data(), rstd_.data(), out1_.data(), dw_.data(), n, d);
    };
  }
  std::function<void()> swiglu_forward(std::int64_t n) {
    return [this, n] { ops::swiglu_forward(in1_.data(), in2_.data(), out1_.data(), n); };
  }
  std::function<void()> swiglu_backward(std::int64_t n) {
    return [this, n] { ops::swiglu_backward(in2_.data(), in1_.data(), in2_.data(), out1_.data(), out2_.data(), n); };
  }
  std::function<void()> router_forward(std::int64_t n) {
    return [this, n] {
      ops::router_forward(in1_.data(), out1_.data(), topk_scratch_.data(), out2_.data(), n, kExperts, kTopK, true);
    };
  }
  std::function<void()> router_backward(std::int64_t n) {
    return [this, n] {
      ops::router_backward<float>(in2_.data(), nullptr, probs_.data(), topk_idx_.data(), out1_.data(), n, kExperts,
                                  kTopK, true);
    };
  }
  /// which: 0 permute forward, 1 permute backward, 2 unpermute forward, 3 unpermute backward.
  std::function<void()> permutation(int which, std::int64_t n, std::int64_t d) {
    auto r = std::make_shared<Routing>(uniform_routing(n, kExperts, kTopK));
    return [this, r, which, n, d] {
      const std::int32_t* slot = r->slot_of.data();
      switch (which) {
        case 0: ops::permute_forward(in1_.data(), slot, out1_.data(), n, kTopK, d); break;
        case 1: ops::permute_backward(in1_.data(), slot, out1_.data(), n, kTopK, d); break;
        case 2: ops::unpermute_forward(in1_.data(), slot, r->topk_w.data(), out1_.data(), n, kTopK, d); break;
        default:
          ops::unpermute_backward(in2_.data(), in1_.data(), slot, r->topk_w.data(), out1_.data(), out2_.data(), n,
                                  kTopK, d);
      }
    };
  }
  /// In place (probs alias logits), as the model's head calls it.
  std::function<void()> cross_entropy_forward(std::int64_t n, std::int64_t V) {
    return [this, n, V] {
      ops::cross_entropy_forward(logits_.data(), targets_.data(), logits_.data(), out2_.data(), n, V);
    };
  }
  /// In place with scale 1: the model's 1/n would shrink the repeated in-place
  /// results into denormals, which the real single call never meets; the
  /// arithmetic is the same.
  std::function<void()> cross_entropy_backward(std::int64_t n, std::int64_t V) {
    return [this, n, V] {
      ops::cross_entropy_backward(logits_.data(), targets_.data(), logits_.data(), n, V, 1.0f);
    };
  }

 private:
  std::vector<float> in1_, in2_, out1_, out2_, w_, dw_, rstd_, probs_, topk_w_;
  std::vector<std::int32_t> topk_idx_, topk_scratch_;
  std::vector<float> logits_;
  std::vector<std::int32_t> targets_;
};

/// Calls of rope and attention with H = kHeads heads; each backward gets the
/// probabilities its own forward produced, computed when the call is made.
class AttentionBench {
 public:
  /// max_act: elements of the largest [B, S, H, hd] operand.
  explicit AttentionBench(std::int64_t max_act)
      : q_(buffer(max_act, 201)), k_(buffer(max_act, 202)), v_(buffer(max_act, 203)), dout_(buffer(max_act, 204)),
        o_(buffer(max_act, 205)), dq_(buffer(max_act, 206)), dk_(buffer(max_act, 207)), dv_(buffer(max_act, 208)),
        rot_(buffer(max_act, 209)) {}

  /// Rotates a buffer of its own (rotations keep it bounded).
  std::function<void()> rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    return [this, B, S, H, hd] { ops::rope_forward(rot_.data(), B, S, H, hd, kRopeTheta); };
  }
  std::function<void()> forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    auto probs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    return [this, probs, B, S, H, hd] {
      ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), probs->data(), B, S, H, hd);
    };
  }
  std::function<void()> backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    auto probs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    auto dprobs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), probs->data(), B, S, H, hd);
    return [this, probs, dprobs, B, S, H, hd] {
      ops::attention_backward(dout_.data(), q_.data(), k_.data(), v_.data(), probs->data(), dq_.data(), dk_.data(),
                              dv_.data(), dprobs->data(), B, S, H, hd);
    };
  }

 private:
  std::vector<float> q_, k_, v_, dout_, o_, dq_, dk_, dv_, rot_;
};

std::vector<TableSpec> plain_op_tables(OpBench& b, const std::vector<std::int64_t>& tokens,
                                       const std::vector<std::int64_t>& ce_tokens) {
  std::vector<TableSpec> specs;
  auto add = [&](const char* name) -> TableSpec& {
    specs.push_back({name, {}, {}, {}});
    return specs.back();
  };
  const std::int64_t d = kHidden;
  {
    TableSpec& f = add(op_names::kRmsnormForward);
    for (std::int64_t n : tokens) f.bytes.push_back(op_bytes::rmsnorm_forward(n, d)), f.jobs.push_back({b.rmsnorm_forward(n, d)});
  }
  {
    TableSpec& f = add(op_names::kRmsnormBackward);
    for (std::int64_t n : tokens) f.bytes.push_back(op_bytes::rmsnorm_backward(n, d)), f.jobs.push_back({b.rmsnorm_backward(n, d)});
  }
  // SwiGLU over expert FFN rows (n*k/2 rows: two experts' worth of a uniform
  // routing); the smallest counts fall under the kernel's parallel threshold, as
  // small experts do.
  std::vector<std::int64_t> swiglu_rows = {16, 32, 64};
  for (std::int64_t n : tokens) swiglu_rows.push_back(n * kTopK / 2);
  std::sort(swiglu_rows.begin(), swiglu_rows.end());
  swiglu_rows.erase(std::unique(swiglu_rows.begin(), swiglu_rows.end()), swiglu_rows.end());
  {
    TableSpec& f = add(op_names::kSwigluForward);
    for (std::int64_t rows : swiglu_rows)
      f.bytes.push_back(op_bytes::swiglu_forward(rows * kExpertFfn)), f.jobs.push_back({b.swiglu_forward(rows * kExpertFfn)});
  }
  {
    TableSpec& f = add(op_names::kSwigluBackward);
    for (std::int64_t rows : swiglu_rows)
      f.bytes.push_back(op_bytes::swiglu_backward(rows * kExpertFfn)), f.jobs.push_back({b.swiglu_backward(rows * kExpertFfn)});
  }
  {
    TableSpec& f = add(op_names::kRouterForward);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::router_forward(n, kExperts, kTopK)), f.jobs.push_back({b.router_forward(n)});
  }
  {
    TableSpec& f = add(op_names::kRouterBackward);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::router_backward(n, kExperts, kTopK)), f.jobs.push_back({b.router_backward(n)});
  }
  const char* perm_names[] = {op_names::kPermuteForward, op_names::kPermuteBackward, op_names::kUnpermuteForward,
                              op_names::kUnpermuteBackward};
  for (int which = 0; which < 4; ++which) {
    TableSpec& f = add(perm_names[which]);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::permute(n, kTopK, d)), f.jobs.push_back({b.permutation(which, n, d)});
  }
  {
    TableSpec& f = add(op_names::kCrossEntropyForward);
    for (std::int64_t n : ce_tokens)
      f.bytes.push_back(op_bytes::cross_entropy(n, kVocab)), f.jobs.push_back({b.cross_entropy_forward(n, kVocab)});
  }
  {
    TableSpec& f = add(op_names::kCrossEntropyBackward);
    for (std::int64_t n : ce_tokens)
      f.bytes.push_back(op_bytes::cross_entropy(n, kVocab)), f.jobs.push_back({b.cross_entropy_backward(n, kVocab)});
  }
  return specs;
}

void measure_ops(HardwareProfile& p, bool full, Seconds budget) {
  const std::vector<std::int64_t> tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048, 4096, 8192}
                                                : std::vector<std::int64_t>{128, 512, 1024, 2048, 4096};
  const std::vector<std::int64_t> ce_tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048}
                                                   : std::vector<std::int64_t>{128, 512, 1024, 2048};
  const std::vector<std::int64_t> batches = full ? std::vector<std::int64_t>{1, 2, 4, 8, 16, 32}
                                                 : std::vector<std::int64_t>{1, 4, 8, 16};
  const std::vector<std::int64_t> table_seqs = full ? std::vector<std::int64_t>{32, 64, 128, 256, 512}
                                                    : std::vector<std::int64_t>{64, 128, 256};
  const std::int64_t max_n = tokens.back(), max_b = batches.back();
  OpBench b(max_n, std::max(max_n * kTopK * kHidden, max_n * kTopK / 2 * kExpertFfn), ce_tokens.back() * kVocab);
  const std::int64_t S = kSeq, H = kHeads, hd = kHeadDim;
  AttentionBench att(std::max(max_b * S * H * hd, table_seqs.back() * hd));

  // Stage 1: tables that depend on nothing else, and rope's cos/sin tables (one head
  // of one sequence: the rotation itself is a small part, subtracted at bandwidth).
  std::vector<TableSpec> specs = plain_op_tables(b, tokens, ce_tokens);
  TableSpec rope_tables{op_names::kRopeTables, {}, {}, {}};
  for (std::int64_t s : table_seqs) {
    rope_tables.bytes.push_back(op_bytes::rope_tables(s, hd));
    rope_tables.jobs.push_back({att.rope(1, s, 1, hd)});
    rope_tables.known.push_back(
        [s, hd](const CostModel& m) { return double(op_bytes::rope(1, s, 1, hd)) / m.profile().memory_bandwidth; });
  }
  // Stage 2: what rope and attention take beyond the parts stage 1 and the GEMMs price.
  TableSpec rope{op_names::kRope, {}, {}, {}};
  TableSpec att_f{op_names::kAttentionSoftmaxForward, {}, {}, {}};
  TableSpec att_b{op_names::kAttentionSoftmaxBackward, {}, {}, {}};
  for (std::int64_t B : batches) {
    rope.bytes.push_back(op_bytes::rope(B, S, H, hd));
    rope.jobs.push_back({att.rope(B, S, H, hd)});
    rope.known.push_back([S, hd](const CostModel& m) { return m.op(op_names::kRopeTables, op_bytes::rope_tables(S, hd)); });
    att_f.bytes.push_back(op_bytes::attention_softmax_forward(B, S, H));
    att_f.jobs.push_back({att.forward(B, S, H, hd)});
    att_f.known.push_back([B, S, H, hd](const CostModel& m) { return double(B * H) * (m.gemm(S, S, hd) + m.gemm(S, hd, S)); });
    att_b.bytes.push_back(op_bytes::attention_softmax_backward(B, S, H));
    att_b.jobs.push_back({att.backward(B, S, H, hd)});
    att_b.known.push_back(
        [B, S, H, hd](const CostModel& m) { return double(B * H) * (3 * m.gemm(S, hd, S) + m.gemm(S, S, hd)); });
  }

  std::size_t n_jobs = rope_tables.jobs.size() + rope.jobs.size() + att_f.jobs.size() + att_b.jobs.size();
  for (const TableSpec& s : specs) n_jobs += s.jobs.size();
  const Seconds per_job = budget / double(n_jobs);

  const auto measure = [per_job](TableSpec& t) {
    Series one;
    for (std::size_t i = 0; i < t.jobs.size(); ++i) one.emplace_back(double(t.bytes[i]), i);
    run_series(t.jobs, {one}, per_job * double(t.jobs.size()));
  };
  for (TableSpec& s : specs) measure(s);
  measure(rope_tables);
  for (const TableSpec& s : specs) store_table(p, s, nullptr);
  {
    const CostModel stage1(p);
    store_table(p, rope_tables, &stage1);
  }
  for (TableSpec* s : {&rope, &att_f, &att_b}) measure(*s);
  const CostModel stage2(p);
  for (TableSpec* s : {&rope, &att_f, &att_b}) store_table(p, *s, &stage2);
}

// ---- memory and copies ---------------------------------------------------------------------

void measure_memory(HardwareProfile& p, bool full, Seconds budget) {
  // Streaming triad a = b + s*c, in an OpenMP loop like the elementwise kernels: the
  // smallest size gives the launch overhead, the slope over the large ones (well past
  // the caches) the bandwidth.
  const std::vector<std::int64_t> sizes_f = full ? std::vector<std::int64_t>{64, 1 << 20, 4 << 20, 8 << 20}
                                                 : std::vector<std::int64_t>{64, 1 << 20, 4 << 20};
  const std::int64_t big = sizes_f.back();
  std::vector<float> a = buffer(big, 31), bb = buffer(big, 32), c = buffer(big, 33);
  auto triad = [&](std::int64_t n) {
    float* pa = a.data();
    const float* pb = bb.data();
    const float* pc = c.data();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 0.5f * pc[i];
  };
  std::vector<Job> mem_jobs;
  for (std::int64_t n : sizes_f) mem_jobs.push_back({[&triad, n] { triad(n); }});
  run_jobs(mem_jobs, 0.4 * budget);
  p.launch_overhead = mem_jobs[0].median;
  std::vector<std::pair<double, Seconds>> triad_pts;
  for (std::size_t i = 1; i < sizes_f.size(); ++i)
    triad_pts.emplace_back(double(3 * sizes_f[i] * kActivationBytes), mem_jobs[i].median);
  p.memory_bandwidth = 1.0 / fit_affine(triad_pts).second;

  // Copies between an arena block (the device) and a separate host buffer, one
  // thread, as the offload engine's copy worker does them: a table over sizes from
  // cache-resident to well past the last-level cache, and an affine fit over it.
  const std::vector<Bytes> sizes =
      full ? std::vector<Bytes>{256 * kKiB, 1 * kMiB, 2 * kMiB, 4 * kMiB, 8 * kMiB, 16 * kMiB, 32 * kMiB, 64 * kMiB}
           : std::vector<Bytes>{1 * kMiB, 4 * kMiB, 16 * kMiB, 32 * kMiB};
  const Bytes max_bytes = sizes.back();
  Arena arena;
  void* dev = arena.allocate(max_bytes, MemCategory::workspace, "calibrate");
  std::vector<char> host(static_cast<std::size_t>(max_bytes));
  std::memset(dev, 1, static_cast<std::size_t>(max_bytes));
  std::memset(host.data(), 2, host.size());
  std::vector<Job> copy_jobs;
  for (Bytes s : sizes) {
    copy_jobs.push_back({[&, s] { std::memcpy(dev, host.data(), static_cast<std::size_t>(s)); }});  // h2d
    copy_jobs.push_back({[&, s] { std::memcpy(host.data(), dev, static_cast<std::size_t>(s)); }});  // d2h
  }
  run_jobs(copy_jobs, 0.6 * budget);
  arena.deallocate(dev, max_bytes, MemCategory::workspace);
  std::vector<std::pair<double, Seconds>> h2d, d2h;
  std::vector<OpSample> h2d_table, d2h_table;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    h2d.emplace_back(double(sizes[i]), copy_jobs[2 * i].median);
    d2h.emplace_back(double(sizes[i]), copy_jobs[2 * i + 1].median);
    h2d_table.push_back({sizes[i], copy_jobs[2 * i].median});
    d2h_table.push_back({sizes[i], copy_jobs[2 * i + 1].median});
  }
  const auto [lat_h2d, per_byte_h2d] = fit_affine(h2d);
  const auto [lat_d2h, per_byte_d2h] = fit_affine(d2h);
  p.h2d_bandwidth = 1.0 / per_byte_h2d;
  p.d2h_bandwidth = 1.0 / per_byte_d2h;
  p.copy_latency = 0.5 * (lat_h2d + lat_d2h);
  p.op_tables[op_names::kCopyH2D] = std::move(h2d_table);
  p.op_tables[op_names::kCopyD2H] = std::move(d2h_table);
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "this-machine";
  return buf;
}

/// The 1-minute load average from /proc/loadavg, or -1 where there is none.
double load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

std::string format_seconds(Seconds s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

}  // namespace

HardwareProfile calibrate(int threads, Seconds budget) {
  threads = resolve_threads(threads);
  set_threads(threads);
  const bool full = budget >= kFullGridMinBudget;
  HardwareProfile p;
  p.name = fmt::format("{} cpu ({} threads)", host_name(), threads);
  p.threads = threads;
  // Memory first: the op tables' stage 1 reads the bandwidth.
  measure_memory(p, full, (1.0 - kGemmShare - kOpShare) * budget);
  measure_gemms(p, full, kGemmShare * budget);
  measure_ops(p, full, kOpShare * budget);
  return p;
}

void write_profile(const HardwareProfile& profile, const std::filesystem::path& path) { profile.save(path); }

double CalibrationRow::relative_error() const {
  return measured > 0 ? std::abs(predicted - measured) / measured : 0.0;
}

CalibrationReport validate(const HardwareProfile& profile, int threads, Seconds budget) {
  set_threads(resolve_threads(threads));
  const CostModel model(profile);
  const std::int64_t d = kHidden, H = kHeads, hd = kHeadDim;
  // Held out: 5 and 10 sequences per micro-batch (640 and 1280 tokens), attention at
  // 96 and 160 positions, skewed expert counts with an idle expert, copies of 3 and
  // 24 MiB: no GEMM shape or op size here is a point of the calibration grid.
  const std::int64_t n1 = 5 * kSeq, n2 = 10 * kSeq;
  const std::vector<std::int64_t> skew = {412, 97, 0, 233, 61, 301, 152, 24};  // sum = n1 * k
  std::vector<std::int32_t> offsets = {0};
  for (std::int64_t c : skew) offsets.push_back(offsets.back() + std::int32_t(c));
  const std::int64_t rows = offsets.back();
  const std::string skew_text = fmt::format("rows=[{}]", fmt::join(skew, ","));

  struct Case {
    std::string op, shape;
    std::function<void()> run;
    Seconds predicted;
  };
  std::vector<Case> cases;

  // GEMM-based ops: read-only inputs, outputs to scratch, weights and weight
  // gradients cold from a ring (as in the calibration, and in a real step).
  const std::int64_t act = std::max({n2 * kDenseFfn, n1 * kVocab, rows * kExpertFfn});
  std::vector<float> x = buffer(act, 41), dy = buffer(act, 42), y = buffer(act, 43), dx = buffer(act, 44);
  ColdRing ring;
  auto linear_cases = [&](std::int64_t n, std::int64_t in, std::int64_t out, const char* note, bool backward) {
    const std::string shape = fmt::format("n={} in={} out={}{}", n, in, out, note);
    cases.push_back({"linear_forward", shape,
                     [&, n, in, out] { ops::linear_forward(x.data(), ring.next(out * in), y.data(), n, in, out); },
                     model.linear_forward(n, in, out)});
    if (backward)
      cases.push_back({"linear_backward", shape,
                       [&, n, in, out] {
                         ops::linear_backward(dy.data(), x.data(), ring.next(out * in), dx.data(), ring.next(out * in), n,
                                              in, out);
                       },
                       model.linear_backward(n, in, out)});
  };
  linear_cases(n1, d, d, "", true);
  linear_cases(n2, d, d, "", true);
  linear_cases(n2, d, kDenseFfn, "", true);
  linear_cases(n1, d, kVocab, " (head)", true);
  linear_cases(n2, d, kExperts, " (router)", false);
  for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{d, kExpertFfn}, {kExpertFfn, d}}) {
    const std::string shape = fmt::format("{} in={} out={}", skew_text, in, out);
    cases.push_back({"grouped_linear_forward", shape,
                     [&, in, out] {
                       ops::grouped_linear_forward(x.data(), ring.next(kExperts * out * in), y.data(), offsets.data(),
                                                   kExperts, in, out);
                     },
                     model.grouped_linear_forward(skew, in, out)});
    cases.push_back({"grouped_linear_backward", shape,
                     [&, in, out] {
                       ops::grouped_linear_backward(dy.data(), x.data(), ring.next(kExperts * out * in), dx.data(),
                                                    ring.next(kExperts * out * in), offsets.data(), kExperts, in, out);
                     },
                     model.grouped_linear_backward(skew, in, out)});
  }

  // The other kernels, on the same benches as the calibration.
  const std::int64_t n3 = 3 * n2;
  OpBench b(n3, std::max({n3 * d, n1 * kTopK * d, 700 * kExpertFfn}), n1 * kVocab);
  for (std::int64_t n : {n1, n3}) {
    const std::string shape = fmt::format("n={} d={}", n, d);
    cases.push_back({"rmsnorm_forward", shape, b.rmsnorm_forward(n, d), model.rmsnorm_forward(n, d)});
    cases.push_back({"rmsnorm_backward", shape, b.rmsnorm_backward(n, d), model.rmsnorm_backward(n, d)});
  }
  AttentionBench att(5 * kSeq * H * hd);
  for (auto [B, S] : {std::pair<std::int64_t, std::int64_t>{5, kSeq}, {4, 96}, {2, 160}}) {
    const std::string shape = fmt::format("B={} S={} H={} hd={}", B, S, H, hd);
    cases.push_back({"rope", shape, att.rope(B, S, H, hd), model.rope(B, S, H, hd)});
    cases.push_back({"attention_forward", shape, att.forward(B, S, H, hd), model.attention_forward(B, S, H, hd)});
    cases.push_back({"attention_backward", shape, att.backward(B, S, H, hd), model.attention_backward(B, S, H, hd)});
  }
  for (std::int64_t expert_rows : {rows / 2, std::int64_t(700)}) {
    const std::int64_t n = expert_rows * kExpertFfn;
    const std::string shape = fmt::format("rows={} f={}", expert_rows, kExpertFfn);
    cases.push_back({"swiglu_forward", shape, b.swiglu_forward(n), model.swiglu_forward(n)});
    cases.push_back({"swiglu_backward", shape, b.swiglu_backward(n), model.swiglu_backward(n)});
  }
  const std::string rshape = fmt::format("n={} E={} k={}", n1, kExperts, kTopK);
  cases.push_back({"router_forward", rshape, b.router_forward(n1), model.router_forward(n1, kExperts, kTopK)});
  cases.push_back({"router_backward", rshape, b.router_backward(n1), model.router_backward(n1, kExperts, kTopK)});
  const std::string pshape = fmt::format("n={} k={} d={}", n1, kTopK, d);
  cases.push_back({"permute_forward", pshape, b.permutation(0, n1, d), model.permute_forward(n1, kTopK, d)});
  cases.push_back({"permute_backward", pshape, b.permutation(1, n1, d), model.permute_backward(n1, kTopK, d)});
  cases.push_back({"unpermute_forward", pshape, b.permutation(2, n1, d), model.unpermute_forward(n1, kTopK, d)});
  cases.push_back({"unpermute_backward", pshape, b.permutation(3, n1, d), model.unpermute_backward(n1, kTopK, d)});
  const std::string cshape = fmt::format("n={} V={}", n1, kVocab);
  cases.push_back({"cross_entropy_forward", cshape, b.cross_entropy_forward(n1, kVocab), model.cross_entropy_forward(n1, kVocab)});
  cases.push_back({"cross_entropy_backward", cshape, b.cross_entropy_backward(n1, kVocab), model.cross_entropy_backward(n1, kVocab)});

  // Copies between an arena block and a host buffer.
  Arena arena;
  const Bytes copy_max = 24 * kMiB;
  void* dev = arena.allocate(copy_max, MemCategory::workspace, "calibrate");
  std::vector<char> host(static_cast<std::size_t>(copy_max), 1);
  std::memset(dev, 2, static_cast<std::size_t>(copy_max));
  for (Bytes s : {3 * kMiB, 24 * kMiB}) {
    cases.push_back({"copy_h2d", format_bytes(s), [&, s] { std::memcpy(dev, host.data(), std::size_t(s)); }, model.copy_h2d(s)});
    cases.push_back({"copy_d2h", format_bytes(s), [&, s] { std::memcpy(host.data(), dev, std::size_t(s)); }, model.copy_d2h(s)});
  }

  std::vector<Job> jobs;
  for (const Case& c : cases) jobs.push_back({c.run});
  run_jobs(jobs, budget);
  arena.deallocate(dev, copy_max, MemCategory::workspace);

  CalibrationReport report;
  double sum = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    CalibrationRow row{cases[i].op, cases[i].shape, jobs[i].median, cases[i].predicted};
    sum += row.relative_error();
    report.rows.push_back(std::move(row));
  }
  report.mean_abs_relative_error = report.rows.empty() ? 0 : sum / double(report.rows.size());
  return report;
}

int run_calibrate_command(const std::string& out_path, int threads, double budget_seconds, bool report_and_write) {
  check_config(budget_seconds > 0, fmt::format("--seconds must be > 0 (got {})", budget_seconds));
  threads = resolve_threads(threads);
  // A peer under mpirun measures alongside rank 0 (so that the profile sees the
  // cores' shared memory bandwidth as training ranks do) and reports nothing.
  if (!report_and_write) {
    const HardwareProfile profile = calibrate(threads, kMeasureShare * budget_seconds);
    (void)validate(profile, threads, (1.0 - kMeasureShare) * budget_seconds);
    return 0;
  }
  fmt::print("moeflex calibrate: {} threads, budget {:.0f} s ({} grid)\n", threads, budget_seconds,
             budget_seconds >= kFullGridMinBudget ? "full" : "coarse");
  // Other work on the cores makes every multi-threaded kernel wait for descheduled
  // threads: the profile then describes a busy machine.
  if (const double load = load_average(); load > kBusyLoadPerCore * omp_get_num_procs())
    fmt::print("warning: the machine is busy (load average {:.1f} on {} cores): timings will be noisy and the "
               "profile pessimistic; calibrate on an idle machine for a faithful one\n",
               load, omp_get_num_procs());
  std::fflush(stdout);
  const auto t0 = Clock::now();
  const HardwareProfile profile = calibrate(threads, kMeasureShare * budget_seconds);
  const Seconds t_measure = since(t0);
  fmt::print("measured {} GEMM shapes, {} op tables, memory {:.1f} GB/s, copies {:.1f}/{:.1f} GB/s (h2d/d2h) in {:.1f} s\n",
             profile.gemm.size(), profile.op_tables.size(), profile.memory_bandwidth / 1e9, profile.h2d_bandwidth / 1e9,
             profile.d2h_bandwidth / 1e9, t_measure);
  const CalibrationReport report = validate(profile, threads, (1.0 - kMeasureShare) * budget_seconds);
  fmt::print("\nheld-out op invocations (cost model vs this machine):\n");
  fmt::print("{:<24} {:<44} {:>12} {:>12} {:>8}\n", "op", "shape", "measured", "predicted", "error");
  for (const CalibrationRow& r : report.rows)
    fmt::print("{:<24} {:<44} {:>12} {:>12} {:>7.1f}%\n", r.op, r.shape, format_seconds(r.measured),
               format_seconds(r.predicted), 100.0 * r.relative_error());
  fmt::print("mean absolute relative error: {:.2f}% over {} invocations\n", 100.0 * report.mean_abs_relative_error,
             report.rows.size());
  write_profile(profile, out_path);
  fmt::print("wrote {} ({:.1f} s in all)\n", out_path, since(t0));
  return 0;
}

}  // namespace moeflex
