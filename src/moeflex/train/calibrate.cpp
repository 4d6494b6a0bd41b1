// `moeflex calibrate`: measuring the HardwareProfile and validating the cost model.
//
// Phases and their shares of the budget:
//   memory      the rest      y += x over sizes from L1-resident to past the last-level
//                             cache (the elementwise table; launch overhead, bandwidth)
//                             and memcpy between an arena block and a host buffer
//                             (copy tables), both with sqrt(2)..2x steps
//   GEMMs       kGemmShare    every linear layer's three GEMMs (y = x w^T nt, dx = dy w
//                             nn, dw += dy^T x tn) along the token count, for every
//                             weight shape of the default model and two larger ones,
//                             plus the per-head GEMMs of attention with their strides
//   op tables   kOpShare      rmsnorm, swiglu, router, (un)permute, cross entropy over
//                             token counts; rope's tables and rotation; attention,
//                             forward and backward, on one sequence over lengths
//   optimizer   kOptimizerShare  (on top) the trainer's per-step parameter work
//                             (zero_grads, norm, clip, AdamW) over parameter counts
//   link        (on top, under mpirun only, about 0.1 s) all-to-all between the
//                             ranks over sizes: latency and bandwidth (measure_link)
// Within a phase every measurement runs once (warm-up, and an estimate of its time),
// then the remaining share is split equally between the measurements, each repeated
// [kMinRepeats, kMaxRepeats] times in interleaved rounds, each timed run from evicted
// caches (see run_jobs); its time is the median of those repeats. Isolated dips in a
// GEMM line or an op table are measured once more (run_series).
//
// The held-out invocations (kHeldLinears and the rest) are timed in the rounds of the
// phase that prices them (calibrate_and_validate), so that a burst of load from
// elsewhere touches both alike; the grids leave out every shape and size they use.
#include "moeflex/train/calibrate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <memory>
#include <atomic>
#include <thread>
#include <tuple>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/wait_policy.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/ops/attention.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/router.h"
#include "moeflex/ops/swiglu.h"
#include "moeflex/train/calibrate_shapes.h"
#include "moeflex/train/safetensors.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace moeflex {
namespace {

using calibration::buffer;
using calibration::Clock;
using calibration::fill;
using calibration::fit_affine;
using calibration::GemmShape;
using calibration::linear_dw_gemm;
using calibration::linear_dx_gemm;
using calibration::linear_forward_gemm;
using calibration::quantile;
using calibration::since;

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
constexpr std::int64_t kMicroBatch = 8;      // micro_batch_size
constexpr std::int64_t kAttentionTableBatch = 4;  // sequences per call of the attention tables

// ---- the held-out set (validate) ---------------------------------------------------
// The shapes a training step of the default model runs (a micro-batch of 1024 tokens,
// 256 rows per expert under uniform routing, 2048 expert rows in all), and shapes
// beside them (5 and 10 sequences, attention at 80 and 160 positions, skewed expert
// rows with an idle expert). The calibration never runs any of them: its grids drop
// every GEMM shape (held_out_gemms) and op-table size (held_out_op_bytes) that a
// held-out invocation looks up.
constexpr std::int64_t kTrainTokens = kMicroBatch * kSeq;
const std::vector<std::int64_t> kHeldTokens = {kTrainTokens, 5 * kSeq};
constexpr std::int64_t kHeldRmsnormLarge = 30 * kSeq;
/// (n, in, out, note, with backward) of the held-out linear layers.
struct HeldLinear {
  std::int64_t n, in, out;
  const char* note;
};
const std::vector<HeldLinear> kHeldLinears = {
    {kTrainTokens, kHidden, kHidden, " (q/k/v/o)"}, {kTrainTokens, kHidden, kExperts, " (router)"},
    {kTrainTokens, kHidden, kVocab, " (head)"},     {5 * kSeq, kHidden, kHidden, ""},
    {10 * kSeq, kHidden, kDenseFfn, ""},             {5 * kSeq, kHidden, kVocab, " (head)"}};
/// Expert rows: uniform routing of a training micro-batch, and a skewed one of 640 tokens.
const std::vector<std::vector<std::int64_t>> kHeldExpertRows = {
    std::vector<std::int64_t>(std::size_t(kExperts), kTrainTokens * kTopK / kExperts),
    {412, 97, 0, 233, 61, 301, 152, 24}};
const std::vector<std::pair<std::int64_t, std::int64_t>> kHeldAttention = {{kMicroBatch, kSeq}, {4, 80}, {2, 160}};
const std::vector<std::int64_t> kHeldSwigluRows = {kTrainTokens * kTopK, 700};
/// Elementwise passes y += x (the residual adds) over [n, d].
const std::vector<std::int64_t> kHeldElementwiseRows = {kTrainTokens, kTrainTokens * kTopK};
const std::vector<Bytes> kHeldCopyBytes = {1 * kMiB, 3 * kMiB, 24 * kMiB};

// ---- budget ------------------------------------------------------------------------
constexpr double kGemmShare = 0.55;     ///< of the measurement budget
constexpr double kOpShare = 0.35;       ///< of the measurement budget
/// Of the measurement budget, on top of the others (a few seconds): the optimizer_step table.
constexpr double kOptimizerShare = 0.04;
constexpr int kMaxRepeats = 101;        ///< repeats of one measurement, at most
constexpr int kPreemptedRetries = 3;    ///< attempts at a visit the scheduler interrupts (the last one counts)
constexpr double kWallBudgetFactor = 3;  ///< wall time a phase may take, in budgets (see run_jobs)
constexpr int kMinRepeats = 5;          ///< repeats of one measurement, at least (while the budget lasts)
constexpr Seconds kTimeSharingSeconds = 1.5;       ///< each phase of measure_time_sharing, at most
constexpr double kTimeSharingBudgetShare = 0.025;  ///< and at most this share of the budget
constexpr Seconds kNapCostSeconds = 0.3;           ///< each phase of measure_nap_cost (4 phases), at most
constexpr double kTimeSharingFloor = 0.8;          ///< below: not time slicing's loss (a busy host, a CPU quota)
/// A measurement's time is this quantile of its repeats (the median; a lower
/// quartile, which shrugs off more of the load from elsewhere, was no steadier on a
/// busy 2-core machine).
constexpr double kTimeQuantile = 0.5;
/// Jobs at least this long are not run untimed before each timed run: their own
/// first touches of the activations cost under 1% of their time.
constexpr Seconds kRewarmBelow = 5e-3;
constexpr double kRecheckShare = 0.1;   ///< of a phase's budget, for measuring dips again
constexpr double kDipRatio = 0.8;       ///< a rate below this times both neighbours' is a dip
constexpr Bytes kColdRingBytes = 128 * kMiB;  ///< several times a large last-level cache

/// One measurement: a kernel call, and after run_jobs its time (the kTimeQuantile
/// of its repeats).
struct Job {
  std::function<void()> run;
  Seconds time = 0;
  /// The operands' state in the caches at the timed call (see run_jobs): true, as
  /// after the op that produced them (a kernel); false, cold (a copy of data that
  /// was produced long before, as the offload engine's).
  bool warm = true;
  /// After run_jobs: |time of the even repeats - time of the odd ones| / time, an
  /// estimate of the measurement's own noise.
  double spread = 0;
};

/// Which clock times a job. With one thread every kernel runs on the calling thread,
/// and that thread's CPU time (CLOCK_THREAD_CPUTIME_ID) is what the kernel took
/// without the slices the scheduler gave other processes meanwhile: on a shared
/// machine a call of a few ms is descheduled at least once in most repeats, which
/// doubles its wall time but not its CPU time. On an idle machine the two agree.
/// With several threads a kernel's time is that of its slowest thread, which only
/// the wall clock sees.
bool g_thread_cpu_clock = false;

Seconds thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

Seconds time_once(const std::function<void()>& fn) {
  if (g_thread_cpu_clock) {
    const Seconds c0 = thread_cpu_seconds();
    fn();
    return thread_cpu_seconds() - c0;
  }
  const auto t0 = Clock::now();
  fn();
  return since(t0);
}

/// Evicts the caches: reads a buffer of kEvictL3Multiple times the last-level cache
/// (every core's share when there are several threads, so that each private cache
/// is swept too). A read walk leaves no dirty lines behind to be written back
/// during the next timed call.
class CacheEvictor {
 public:
  CacheEvictor() {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 <= 0) l3 = long(kDefaultL3Bytes);
    const Bytes bytes = std::clamp<Bytes>(Bytes(kEvictL3Multiple * double(l3)), 16 * kMiB, 512 * kMiB);
    lines_.resize(std::size_t(bytes / kCacheLine));
  }
  void evict() {
    // One byte per 64-byte line would leave 63 of them to the prefetcher; a whole
    // line per element makes every element a distinct line.
    std::int64_t sum = 0;
    const std::int64_t n = std::int64_t(lines_.size());
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (std::int64_t i = 0; i < n; ++i) sum += lines_[std::size_t(i)].v[0];
    sink_ = sum;
  }
  /// The time of one evict(), measured on first use.
  Seconds cost() {
    if (cost_ < 0) {
      evict();
      cost_ = time_once([this] { evict(); });
    }
    return cost_;
  }

 private:
  static constexpr Bytes kCacheLine = 64;
  static constexpr Bytes kDefaultL3Bytes = 32 * kMiB;
  static constexpr double kEvictL3Multiple = 1.5;
  struct alignas(64) Line {
    std::int64_t v[8] = {1, 0, 0, 0, 0, 0, 0, 0};
  };
  std::vector<Line> lines_;
  volatile std::int64_t sink_ = 0;
  Seconds cost_ = -1;
};

/// Involuntary context switches of this process so far (all its threads).
long involuntary_switches() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_nivcsw;
}

CacheEvictor& evictor() {
  static CacheEvictor e;
  return e;
}

/// Warm-up pass over all jobs, then equal shares of what is left of `budget`. The
/// repeats are interleaved in rounds, each job's spread evenly over them, so that a
/// burst of load from elsewhere on the machine touches many jobs a little rather
/// than all repeats of one. Every timed call starts from the same cache state
/// whatever ran before it (another job, another phase, validation's other ops):
/// the caches are evicted, then a warm job runs once untimed, so that its
/// activations are in the caches as after the op that produced them in a real step
/// (weights, taken from a ColdRing, stay cold), while a cold job, and any job of at
/// least kRewarmBelow (whose warm-up pass says so), is timed right after the
/// eviction.
void run_jobs(std::vector<Job>& jobs, Seconds budget) {
  if (jobs.empty()) return;
  const auto t0 = Clock::now();
  // The budget is spent in the clock the jobs are timed by: with one thread its CPU
  // time, so that a busy machine stretches the calibration instead of thinning its
  // repeats, up to kWallBudgetFactor times the budget in wall time.
  const Seconds c0 = g_thread_cpu_clock ? thread_cpu_seconds() : 0;
  const auto spent = [&] { return g_thread_cpu_clock ? thread_cpu_seconds() - c0 : since(t0); };
  const std::size_t n = jobs.size();
  CacheEvictor& ev = evictor();
  const Seconds evict_cost = ev.cost();
  std::vector<Seconds> warm(n);
  for (std::size_t i = 0; i < n; ++i) warm[i] = time_once(jobs[i].run);
  const Seconds share = std::max<Seconds>(0, budget - spent()) / double(n);
  std::vector<int> reps(n);
  int rounds = 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (warm[i] >= kRewarmBelow) jobs[i].warm = false;
    const Seconds visit = evict_cost + std::max(warm[i], 1e-7) * (jobs[i].warm ? 2 : 1);
    reps[i] = std::clamp(int(share / visit), kMinRepeats, kMaxRepeats);
    rounds = std::max(rounds, reps[i]);
  }
  // Rounds stop at the budget's end (a machine slower than its warm-up pass said);
  // a job that got no timed run keeps its warm-up time.
  // Each round visits the jobs in a fresh order (a fixed seed): what runs before a
  // job leaves traces that eviction does not undo (on a shared 2-core machine, jobs
  // visited right after the heaviest GEMM lines came out ~15% slow), and a fixed
  // order would turn them into a bias of the jobs at one place in the list.
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::mt19937 shuffle_rng(20261129u);
  std::vector<std::vector<Seconds>> times(n);
  bool over = false;
  for (int r = 0; r < rounds && !over; ++r) {
    std::shuffle(order.begin(), order.end(), shuffle_rng);
    for (std::size_t i : order) {
      if (over) break;
      // Job i takes part in reps[i] of the rounds, evenly spaced.
      if (std::int64_t(r) * reps[i] / rounds == std::int64_t(r + 1) * reps[i] / rounds) continue;
      if ((over = spent() >= budget || since(t0) >= kWallBudgetFactor * budget)) break;
      // A visit of a short job during which the scheduler ran another process on
      // this core is measured again: that process may have evicted what the
      // untimed run warmed (on a busy machine this is what makes short memory-bound
      // ops bimodal). A long job is interrupted in most visits anyway, and the
      // caches it loses are a small part of its time.
      Seconds t = 0;
      const int attempts = warm[i] < kRewarmBelow ? kPreemptedRetries : 1;
      for (int attempt = 0; attempt < attempts; ++attempt) {
        ev.evict();
        const long switches = involuntary_switches();
        if (jobs[i].warm) jobs[i].run();
        t = time_once(jobs[i].run);
        if (involuntary_switches() == switches) break;
      }
      times[i].push_back(t);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<Seconds>& t = times[i];
    if (t.empty()) t.push_back(warm[i]);
    std::vector<Seconds> halves[2];
    for (std::size_t k = 0; k < t.size(); ++k) halves[k % 2].push_back(t[k]);
    jobs[i].time = quantile(t, kTimeQuantile);
    jobs[i].spread = halves[1].empty() ? 0.0
                                       : std::abs(quantile(halves[0], kTimeQuantile) - quantile(halves[1], kTimeQuantile)) /
                                             jobs[i].time;
  }
}

/// Appends `extra` (may be null) to `jobs`, to be timed in the same rounds; returns
/// where they start, for take_extra.
std::size_t add_extra(std::vector<Job>& jobs, const std::vector<Job>* extra) {
  const std::size_t at = jobs.size();
  if (extra) jobs.insert(jobs.end(), extra->begin(), extra->end());
  return at;
}

/// Copies the times (and spreads) of the jobs add_extra appended at `at` back into `extra`.
void take_extra(const std::vector<Job>& jobs, std::size_t at, std::vector<Job>* extra) {
  if (!extra) return;
  for (std::size_t i = 0; i < extra->size(); ++i) (*extra)[i].time = jobs[at + i].time, (*extra)[i].spread = jobs[at + i].spread;
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
      const auto rate = [&](std::size_t j) { return s[j].first / jobs[s[j].second].time; };
      if (rate(i) < kDipRatio * std::min(rate(i - 1), rate(i + 1))) dips.push_back(s[i].second);
    }
  }
  if (dips.empty()) return;
  std::vector<Job> again;
  for (std::size_t i : dips) again.push_back({jobs[i].run, 0, jobs[i].warm});
  run_jobs(again, kRecheckShare * budget);
  for (std::size_t k = 0; k < dips.size(); ++k) jobs[dips[k]].time = std::min(jobs[dips[k]].time, again[k].time);
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

int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_num_procs(); }

void set_threads(int threads) {
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  g_thread_cpu_clock = threads == 1;
}

// ---- GEMM grid ------------------------------------------------------------------------

/// (layout, M, N, K) of a GEMM: the calibration never measures a held-out one.
using GemmKey = std::tuple<GemmLayout, std::int64_t, std::int64_t, std::int64_t>;
GemmKey key_of(const GemmShape& g) { return {g.layout(), g.M, g.N, g.K}; }

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

std::vector<GemmShape> gemm_grid(bool full) {
  const std::vector<std::int64_t> xs =
      full ? std::vector<std::int64_t>{8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}
           : std::vector<std::int64_t>{16, 64, 256, 512, 1024, 2048};
  // Weight shapes [out, in] of the default model: every linear layer's three GEMMs
  // along the token count (M of y and dx, K of dw), the other two extents fixed.
  std::vector<std::pair<std::int64_t, std::int64_t>> weights = {
      {kHidden, kHidden}, {kExpertFfn, kHidden}, {kHidden, kExpertFfn}, {kDenseFfn, kHidden},
      {kHidden, kDenseFfn}, {kVocab, kHidden}, {kExperts, kHidden}};
  if (full) {  // larger models
    weights.push_back({512, 512});
    weights.push_back({1024, 1024});
  }
  const std::set<GemmKey> held = held_out_gemms();
  std::vector<GemmShape> grid;
  const auto add = [&](const GemmShape& g) {
    if (!held.count(key_of(g))) grid.push_back(g);
  };
  for (auto [out, in] : weights) {
    for (std::int64_t n : xs) {
      add(linear_forward_gemm(n, in, out));
      add(linear_dx_gemm(n, in, out));
      add(linear_dw_gemm(n, in, out));
    }
  }
  // Attention, per head, with the strides of [B, S, H, hd] activations: scores =
  // q k^T (nt), out = P v (nn), dV = P^T dO (tn).
  // (Per-head shapes vary in two extents at once, so they have no lines: sqrt(2)
  // steps in S keep the nearest-sample lookup close.)
  const std::vector<std::int64_t> seqs = full ? std::vector<std::int64_t>{32, 48, 64, 96, 128, 192, 256, 384, 512}
                                              : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> hds = full ? std::vector<std::int64_t>{32, 64, 128} : std::vector<std::int64_t>{64};
  for (std::int64_t S : seqs) {
    for (std::int64_t hd : hds) {
      const std::int64_t ld = kHeads * hd;
      add({S, S, hd, false, true, ld, ld, S, 0.0f, 0});
      add({S, hd, S, false, false, S, ld, ld, 0.0f, 0});
      add({S, hd, S, true, false, S, ld, ld, 0.0f, 0});
    }
  }
  return grid;
}

void measure_gemms(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra) {
  const std::vector<GemmShape> grid = gemm_grid(full);
  std::int64_t a_len = 0, b_len = 0, c_len = 0;
  for (const GemmShape& g : grid) {
    a_len = std::max(a_len, (g.ta ? g.K : g.M) * g.lda);
    b_len = std::max(b_len, (g.tb ? g.N : g.K) * g.ldb);
    c_len = std::max(c_len, g.M * g.ldc);
  }
  std::vector<float> A = buffer(a_len, 1), B = buffer(b_len, 2), C = buffer(c_len, 3);
  // Weights (B of y and dx) and weight gradients (C of dw) come cold from the ring;
  // attention's operands are all activations.
  ColdRing ring;
  std::vector<Job> jobs;
  for (const GemmShape& g : grid) {
    jobs.push_back({[&A, &B, &C, &ring, g] {
      const float* b = g.weight == 'b' ? ring.next((g.tb ? g.N : g.K) * g.ldb) : B.data();
      float* c = g.weight == 'c' ? ring.next(g.M * g.ldc) : C.data();
      ops::gemm<float>(g.ta, g.tb, g.M, g.N, g.K, 1.0f, A.data(), g.lda, b, g.ldb, g.beta, c, g.ldc);
    }});
  }
  // Series: each linear layer's lines along its token count; attention's shapes stand alone.
  std::map<std::tuple<GemmLayout, std::int64_t, std::int64_t>, Series> lines;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const GemmShape& g = grid[i];
    if (!g.weight) continue;
    const double f = 2.0 * double(g.M * g.N * g.K);
    if (g.layout() == GemmLayout::tn) lines[{g.layout(), g.M, g.N}].emplace_back(f, i);
    else lines[{g.layout(), g.N, g.K}].emplace_back(f, i);
  }
  std::vector<Series> series;
  for (auto& [key, line] : lines) series.push_back(std::move(line));
  const std::size_t at = add_extra(jobs, extra);
  run_series(jobs, series, budget);
  take_extra(jobs, at, extra);
  for (std::size_t i = 0; i < grid.size(); ++i)
    p.gemm.push_back({grid[i].M, grid[i].N, grid[i].K, 2.0 * double(grid[i].M * grid[i].N * grid[i].K) / jobs[i].time,
                      grid[i].layout()});
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

/// Removes the points of `t` whose size a held-out invocation of its op looks up.
void drop_held_out(TableSpec& t, const std::map<std::string, std::set<Bytes>>& held) {
  auto it = held.find(t.name);
  if (it == held.end()) return;
  TableSpec kept{t.name, {}, {}, {}};
  for (std::size_t i = 0; i < t.bytes.size(); ++i) {
    if (it->second.count(t.bytes[i])) continue;
    kept.bytes.push_back(t.bytes[i]);
    kept.jobs.push_back(std::move(t.jobs[i]));
    if (!t.known.empty()) kept.known.push_back(std::move(t.known[i]));
  }
  t = std::move(kept);
}

/// Stores the medians (minus the known parts, at least 0) as the op's table.
void store_table(HardwareProfile& p, const TableSpec& t, const CostModel* model) {
  std::vector<OpSample> pts;
  for (std::size_t i = 0; i < t.jobs.size(); ++i) {
    Seconds s = t.jobs[i].time;
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

void measure_ops(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra) {
  const std::vector<std::int64_t> tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048, 4096, 8192}
                                                : std::vector<std::int64_t>{128, 512, 1024, 2048, 4096};
  const std::vector<std::int64_t> ce_tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048}
                                                   : std::vector<std::int64_t>{128, 512, 1024, 2048};
  const std::vector<std::int64_t> batches = full ? std::vector<std::int64_t>{1, 2, 4, 8, 16, 32}
                                                 : std::vector<std::int64_t>{1, 4, 8, 16};
  const std::vector<std::int64_t> table_seqs = full ? std::vector<std::int64_t>{32, 64, 128, 256, 512}
                                                    : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> att_seqs = full ? std::vector<std::int64_t>{32, 48, 64, 96, 128, 192, 256, 384, 512}
                                                  : std::vector<std::int64_t>{64, 96, 128, 192, 256};
  const std::int64_t max_n = tokens.back(), max_b = batches.back();
  OpBench b(max_n, std::max(max_n * kTopK * kHidden, max_n * kTopK / 2 * kExpertFfn), ce_tokens.back() * kVocab);
  const std::int64_t S = kSeq, H = kHeads, hd = kHeadDim;
  AttentionBench att(std::max({max_b * S * H * hd, table_seqs.back() * hd, kAttentionTableBatch * att_seqs.back() * H * hd}));

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
  // Stage 2: what rope takes beyond its tables.
  TableSpec rope{op_names::kRope, {}, {}, {}};
  for (std::int64_t B : batches) {
    rope.bytes.push_back(op_bytes::rope(B, S, H, hd));
    rope.jobs.push_back({att.rope(B, S, H, hd)});
    rope.known.push_back([S, hd](const CostModel& m) { return m.op(op_names::kRopeTables, op_bytes::rope_tables(S, hd)); });
  }
  // Attention, whole, on kAttentionTableBatch sequences of the model's heads over
  // sequence lengths, stored per head: the kernel runs B x H independent heads (a
  // batch of one sequence would keep q, k and v in L2, which a micro-batch does not).
  TableSpec att_f{op_names::kAttentionForward, {}, {}, {}};
  TableSpec att_b{op_names::kAttentionBackward, {}, {}, {}};
  for (std::int64_t s : att_seqs) {
    att_f.bytes.push_back(op_bytes::attention_softmax_forward(1, s, 1));
    att_f.jobs.push_back({att.forward(kAttentionTableBatch, s, H, hd)});
    att_b.bytes.push_back(op_bytes::attention_softmax_forward(1, s, 1));
    att_b.jobs.push_back({att.backward(kAttentionTableBatch, s, H, hd)});
  }
  // The held-out sizes stay held out.
  const std::map<std::string, std::set<Bytes>> held = held_out_op_bytes();
  for (TableSpec* t : {&rope_tables, &rope, &att_f, &att_b}) drop_held_out(*t, held);
  for (TableSpec& t : specs) drop_held_out(t, held);

  // All tables' jobs are timed together, in one set of interleaved rounds.
  std::vector<TableSpec*> all;
  for (TableSpec& s : specs) all.push_back(&s);
  for (TableSpec* s : {&rope_tables, &rope, &att_f, &att_b}) all.push_back(s);
  std::vector<Job> jobs;
  std::vector<Series> series;
  for (TableSpec* t : all) {
    Series one;
    for (std::size_t i = 0; i < t->jobs.size(); ++i) {
      one.emplace_back(double(t->bytes[i]), jobs.size());
      jobs.push_back(t->jobs[i]);
    }
    series.push_back(std::move(one));
  }
  const std::size_t at = add_extra(jobs, extra);
  run_series(jobs, series, budget);
  take_extra(jobs, at, extra);
  std::size_t next = 0;
  for (TableSpec* t : all)
    for (Job& j : t->jobs) j.time = jobs[next++].time;

  for (const TableSpec& s : specs) store_table(p, s, nullptr);
  for (const TableSpec* t : {&att_f, &att_b}) {
    store_table(p, *t, nullptr);
    for (OpSample& pt : p.op_tables[t->name]) pt.seconds /= double(kAttentionTableBatch * H);
  }
  {
    const CostModel stage1(p);
    store_table(p, rope_tables, &stage1);
  }
  const CostModel stage2(p);
  store_table(p, rope, &stage2);
}

// ---- memory and copies ---------------------------------------------------------------------

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

// ---- the link between ranks ---------------------------------------------------------------

/// Bytes to every peer of the all-to-all samples of measure_link.
const std::vector<Bytes> kLinkBytes = {4 * kKiB, 64 * kKiB, 256 * kKiB, 1 * kMiB, 4 * kMiB};
constexpr int kLinkRepeats = 15;  ///< timed exchanges per size; the median counts
/// The ring of exchange buffers measure_link rotates through: larger than the last-level
/// cache of a current CPU, so that each exchange starts cold.
constexpr Bytes kLinkRingBytes = 256 * kMiB;

/// Under mpirun with two ranks or more: the link between the ranks as moeflex's
/// communicator drives it. An all-to-all-v (the expert dispatch's collective) of b
/// bytes to every peer, for b in kLinkBytes, each timed on the wall clock (waiting
/// for the peer is the point) right after a barrier lines the ranks up, kLinkRepeats
/// times in rounds over the sizes. The buffers rotate through a ring larger than the
/// caches (kLinkRingBytes), so that every exchange reads and writes cold memory, as
/// the expert dispatch does with the fresh [rows, hidden] tensors of a step (warm
/// buffers measured 75 us for 1 MiB per peer where the step's dispatches took
/// 130 us). The medians are fitted t = alpha + b / beta
/// (pairwise exchange, every peer's b at once: Hockney's alpha-beta per message).
/// Stored as the profile's all_to_all_latency and all_to_all_bandwidth, which the
/// this-machine cluster takes as its link. One process: nothing to measure, left 0.
/// Every rank runs it (collectives); rank 0's fit is the one written. Returns the
/// medians, (bytes to each peer, seconds) for each size; none with one process.
std::vector<std::pair<double, Seconds>> measure_link(HardwareProfile& p) {
  const std::unique_ptr<comm::Communicator> world = comm::make_world_communicator();
  const int n = world->size();
  if (n < 2) return {};
  const Bytes max_b = kLinkBytes.back();
  const Bytes pair_bytes = 2 * max_b * n;
  const std::size_t ring = std::size_t(std::max<Bytes>(1, (kLinkRingBytes + pair_bytes - 1) / pair_bytes));
  std::vector<std::vector<char>> sends(ring), recvs(ring);
  for (std::size_t k = 0; k < ring; ++k) {
    sends[k].assign(std::size_t(max_b * n), 1);  // touched: no page faults in the timed exchanges
    recvs[k].assign(std::size_t(max_b * n), 0);
  }
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), 0), displs(static_cast<std::size_t>(n), 0);
  std::vector<std::vector<Seconds>> t(kLinkBytes.size());
  std::size_t next = 0;
  for (int r = 0; r <= kLinkRepeats; ++r) {  // round 0 warms the transport up
    for (std::size_t i = 0; i < kLinkBytes.size(); ++i) {
      for (int q = 0; q < n; ++q) {
        counts[std::size_t(q)] = q == world->rank() ? 0 : kLinkBytes[i];
        displs[std::size_t(q)] = std::int64_t(q) * max_b;
      }
      char* send = sends[next].data();
      char* recv = recvs[next].data();
      next = (next + 1) % ring;
      world->barrier();
      const auto t0 = Clock::now();
      world->all_to_all_v(send, counts.data(), displs.data(), recv, counts.data(), displs.data(), 1);
      if (r > 0) t[i].push_back(since(t0));
    }
  }
  std::vector<std::pair<double, Seconds>> pts;
  for (std::size_t i = 0; i < kLinkBytes.size(); ++i) pts.emplace_back(double(kLinkBytes[i]), quantile(t[i], 0.5));
  const auto [alpha, per_byte] = fit_affine(pts);
  p.all_to_all_latency = alpha;
  p.all_to_all_bandwidth = 1.0 / per_byte;
  return pts;
}

// ---- cores shared by more processes than there are ------------------------------------------

/// Rounds of a mix of single-threaded work run until `until`; returns how many. A round:
/// GEMMs of 512 x 1024 x 256 (weights and activations within a core's caches),
/// 512 x 4096 x 256 (an LM head's: a 8 MiB output through the shared cache) and
/// 1024 x 256 x 1024 (an expert's down projection), and y += x over 1 Mi floats.
long work_loop(Clock::time_point until) {
  struct G {
    std::int64_t M, N, K;
    std::vector<float> a, b, c;
  };
  std::vector<G> gs;
  for (auto [M, N, K] :
       {std::tuple<std::int64_t, std::int64_t, std::int64_t>{512, 1024, 256}, {512, 4096, 256}, {1024, 256, 1024}})
    gs.push_back({M, N, K, std::vector<float>(std::size_t(M * K), 0.5f), std::vector<float>(std::size_t(N * K), 0.25f),
                  std::vector<float>(std::size_t(M * N), 0.0f)});
  std::vector<float> x(std::size_t(1) << 20, 1.0f), y(std::size_t(1) << 20, 0.0f);
  long count = 0;
  while (Clock::now() < until) {
    for (G& g : gs)
      ops::gemm<float>(false, true, g.M, g.N, g.K, 1.0f, g.a.data(), g.K, g.b.data(), g.K, 0.0f, g.c.data(), g.N);
    for (std::size_t i = 0; i < x.size(); ++i) y[i] += x[i];
    ++count;
  }
  return count;
}

/// The host's cores (not the ones this process is bound to), at least 1.
int host_cores() { return std::max(1, int(std::thread::hardware_concurrency())); }

/// For a measurement of single-threaded work: one OpenMP and one BLAS thread while
/// it lives; the thread counts and the calling thread's CPU binding (read at
/// construction; saved() says whether it could be) are restored however it ends.
class SingleThreadedScope {
 public:
  SingleThreadedScope()
      : omp_(omp_get_max_threads()),
        blas_(openblas_get_num_threads()),
        saved_(sched_getaffinity(0, sizeof(mask_), &mask_) == 0) {
    omp_set_num_threads(1);
    openblas_set_num_threads(1);
  }
  ~SingleThreadedScope() {
    if (saved_) sched_setaffinity(0, sizeof(mask_), &mask_);
    omp_set_num_threads(omp_);
    openblas_set_num_threads(blas_);
  }
  SingleThreadedScope(const SingleThreadedScope&) = delete;
  SingleThreadedScope& operator=(const SingleThreadedScope&) = delete;
  bool saved() const { return saved_; }
  const cpu_set_t& mask() const { return mask_; }

 private:
  int omp_, blas_;
  cpu_set_t mask_{};
  bool saved_;
};

}  // namespace

double measure_time_sharing(Seconds seconds) {
  const std::unique_ptr<comm::Communicator> world = comm::make_world_communicator();
  const int n = world->size();
  const int cores = host_cores();
  // Phase 1 gives the per-core rate only with a rank on every core, as mpirun binds 2
  // ranks on 2 cores; otherwise (one process, fewer or more ranks than cores, ranks on
  // several hosts) the field stays unmeasured. Every rank decides alike (hosts may
  // differ in cores): no collective is left half-entered.
  double skip = n != cores ? 1 : 0;
  if (n > 1) world->all_reduce_max(&skip, 1);
  if (skip > 0) return 1.0;
  const SingleThreadedScope scope;
  const auto span = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  work_loop(Clock::now() + span / 10);  // warm BLAS up
  world->barrier();
  double counts[3] = {double(work_loop(Clock::now() + span)), 0, 0};  // phase 1, phase 2, failures
  // Phase 2: unbound (mpirun leaves more than 2 ranks free), two threads a rank.
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c = 0; c < std::min(cores, CPU_SETSIZE); ++c) CPU_SET(c, &all);
  if (!scope.saved() || sched_setaffinity(0, sizeof(all), &all) != 0) counts[2] = 1;
  world->barrier();
  const Clock::time_point until = Clock::now() + span;
  long helper = 0;
  bool helper_failed = false;
  std::thread t([&] {
    try {
      omp_set_num_threads(1);  // this thread's own OpenMP setting (BLAS must not fan out)
      helper = work_loop(until);
    } catch (...) {
      helper_failed = true;
    }
  });
  long mine = 0;
  try {
    mine = work_loop(until);
  } catch (...) {
    counts[2] = 1;
  }
  t.join();
  if (helper_failed) counts[2] = 1;
  counts[1] = double(mine + helper);
  if (n > 1) world->all_reduce_sum(counts, 3);
  // Phase 1 ran a rank a core: the ideal of phase 2 is the same throughput.
  if (counts[2] > 0 || !(counts[0] > 0)) return 1.0;
  const double eta = counts[1] / counts[0];
  if (eta < kTimeSharingFloor) {  // another load or a CPU quota, not time slicing: keep 1
    if (world->rank() == 0)
      fmt::print(
          "warning: cores shared by twice as many threads got {:.0f}% of the ideal split, below {:.0f}%: "
          "the host is busy or capped; time_sharing_efficiency left at 1\n",
          100 * eta, 100 * kTimeSharingFloor);
    return 1.0;
  }
  return std::min(eta, 1.0);
}

NapCost measure_nap_cost(Seconds seconds) {
  const std::unique_ptr<comm::Communicator> world = comm::make_world_communicator();
  const int cores = host_cores();
  // More ranks than cores would share them: no core of one's own to measure on. Every
  // rank decides alike (hosts may differ in cores).
  double skip = world->size() > cores ? 1 : 0;
  if (world->size() > 1) world->all_reduce_max(&skip, 1);
  if (skip > 0) return {};
  const SingleThreadedScope scope;
  const bool have_mask = scope.saved();
  const cpu_set_t& bound = scope.mask();
  // This rank's core: the one it is bound to (mpirun binds a rank a core), else the
  // (rank mod n)-th of the n it may run on, so that unbound ranks of one host pick
  // different cores (where it runs now is only a snapshot: two ranks can read the same).
  int core = -1;
  if (have_mask && CPU_COUNT(&bound) > 0) {
    const int pick = CPU_COUNT(&bound) == 1 ? 0 : world->rank() % CPU_COUNT(&bound);
    for (int c = 0, seen = 0; c < CPU_SETSIZE && core < 0; ++c)
      if (CPU_ISSET(c, &bound) && seen++ == pick) core = c;
  }
  auto bind = [core] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(core, &one);
    return sched_setaffinity(0, sizeof(one), &one) == 0;  // this thread
  };
  double sums[3] = {0, 0, 0};  // cost, overshoot, failures
  if (!have_mask || core < 0 || !bind()) sums[2] = 1;
  constexpr std::int64_t M = 256, N = 384, K = 256;  // an expert's up projection in the default model
  std::vector<float> a(std::size_t(M * K), 0.5f), b(std::size_t(N * K), 0.25f), c(std::size_t(M * N), 0.0f);
  const auto work = [&](Seconds s) {
    const Clock::time_point until =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    long rounds = 0;
    for (; Clock::now() < until; ++rounds)
      ops::gemm<float>(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, c.data(), N);
    return rounds;
  };
  constexpr int kPairs = 2;
  if (sums[2] == 0) {
    work(seconds / 10);  // warm up
    for (int pair = 0; pair < kPairs; ++pair) {
      const long alone = work(seconds);
      std::atomic<bool> stop{false}, bound_ok{true};
      long naps = 0;
      Seconds napped = 0;
      std::thread napper([&] {
        if (!bind()) bound_ok = false;
        const auto t0 = Clock::now();
        while (!stop.load(std::memory_order_relaxed) && bound_ok) {
          std::this_thread::sleep_for(std::chrono::duration<double>(comm::kMinPollSleepOversubscribed));
          ++naps;
        }
        napped = since(t0);
      });
      long beside = 0;
      try {
        beside = work(seconds);
      } catch (...) {  // the napper must be joined before anything unwinds past it
        stop = true;
        napper.join();
        throw;
      }
      stop = true;
      napper.join();
      if (!bound_ok || naps == 0 || alone <= 0) {
        sums[2] = 1;
        break;
      }
      sums[0] += std::max(0.0, 1.0 - double(beside) / double(alone)) * seconds / double(naps) / kPairs;
      sums[1] += std::max(0.0, napped / double(naps) - comm::kMinPollSleepOversubscribed) / kPairs;
    }
  }
  if (world->size() > 1) world->all_reduce_sum(sums, 3);
  if (sums[2] > 0) return {};
  return {sums[0] / world->size(), sums[1] / world->size()};
}

namespace {

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "this-machine";
  return buf;
}

std::string format_seconds(Seconds s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

}  // namespace

double load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

void write_profile(const HardwareProfile& profile, const std::filesystem::path& path) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  train::write_file_atomically(path, profile.to_json().dump(2) + "\n");  // an old profile survives a failed write
}

void check_profile_out(const std::filesystem::path& out) {
  namespace fs = std::filesystem;
  check_config(!fs::is_directory(out),
               fmt::format("--out '{}' is a directory; give the profile's file name, e.g. {}/this-machine.json",
                           out.string(), out.string()));
  check_writable_dir(out.has_parent_path() ? out.parent_path() : fs::path("."), "--out", out.string());
}

double CalibrationRow::relative_error() const {
  return measured > 0 ? std::abs(predicted - measured) / measured : 0.0;
}

namespace {

/// The held-out invocations (see kHeldLinears and the rest) and the buffers they run
/// on. Each is a Job that a calibration phase times among its own jobs, so that both
/// see the same load from elsewhere on the machine, and a prediction made once the
/// profile is complete. Not movable: the jobs point into the buffers.
class HeldOut {
 public:
  struct Case {
    std::string op, shape;
    std::function<void()> run;
    std::function<Seconds(const CostModel&)> predict;
    bool warm = true;
  };
  /// The cases by calibration phase: GEMM-based ops, other kernels, memory and copies.
  std::vector<Case> gemm_cases, op_cases, memory_cases;

  HeldOut();
  HeldOut(const HeldOut&) = delete;
  HeldOut& operator=(const HeldOut&) = delete;
  ~HeldOut() { arena_.deallocate(dev_, copy_max_, MemCategory::workspace); }

  static std::vector<Job> jobs_of(const std::vector<Case>& cases) {
    std::vector<Job> jobs;
    for (const Case& c : cases) jobs.push_back({c.run, 0, c.warm});
    return jobs;
  }

 private:
  std::vector<float> x_, dy_, y_, dx_, add_y_, add_x_;
  std::vector<std::vector<std::int32_t>> offsets_;
  ColdRing ring_;
  std::unique_ptr<OpBench> bench_;
  std::unique_ptr<AttentionBench> att_;
  Arena arena_;
  Bytes copy_max_ = 0;
  void* dev_ = nullptr;
  std::vector<char> host_;
};

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

/// The calibration's phases, each timing `held`'s cases of its phase among its own
/// jobs when `held` is given (their medians land in the three job lists).
HardwareProfile calibrate_phases(int threads, Seconds budget, HeldOut* held, std::vector<Job>* gemm_jobs,
                                 std::vector<Job>* op_jobs, std::vector<Job>* memory_jobs, bool progress) {
  threads = resolve_threads(threads);
  set_threads(threads);
  const bool full = budget >= kFullGridMinBudget;
  HardwareProfile p;
  p.name = fmt::format("{} cpu ({} threads)", host_name(), threads);
  p.blas_core = ops::blas_core_name();
  p.threads = threads;
  const auto t0 = Clock::now();
  const auto note = [&](const char* what) {
    if (!progress) return;
    fmt::print("  [{:5.1f} s] {}\n", since(t0), what);
    std::fflush(stdout);
  };
  if (held) *gemm_jobs = HeldOut::jobs_of(held->gemm_cases), *op_jobs = HeldOut::jobs_of(held->op_cases),
            *memory_jobs = HeldOut::jobs_of(held->memory_cases);
  // The link first, while the ranks of an mpirun calibration start together.
  note("link between ranks ...");
  if (const auto pts = measure_link(p); progress && !pts.empty()) {  // the medians beside the fit through them
    std::string line = "    all-to-all, bytes to each peer: median (fit)";
    for (const auto& [b, t] : pts)
      line += fmt::format("; {}: {:.0f} us ({:.0f})", format_bytes(Bytes(b)), 1e6 * t,
                          1e6 * (p.all_to_all_latency + b / p.all_to_all_bandwidth));
    fmt::print("{}\n", line);
  }
  if (threads == 1) {  // what the single-threaded ranks of an oversubscribed run get of the cores
    note("cores shared by twice as many threads ...");
    p.time_sharing_efficiency = measure_time_sharing(std::min(kTimeSharingSeconds, kTimeSharingBudgetShare * budget));
    note("what a napping rank costs a computing one ...");
    const NapCost nap = measure_nap_cost(std::min(kNapCostSeconds, kTimeSharingBudgetShare * budget));
    p.nap_cost = nap.cost;
    p.nap_overshoot = nap.overshoot;
  }
  // Memory first: the op tables' stage 1 reads the bandwidth.
  note("memory bandwidth and copies ...");
  measure_memory(p, full, (1.0 - kGemmShare - kOpShare) * budget, held ? memory_jobs : nullptr);
  note("GEMMs ...");
  measure_gemms(p, full, kGemmShare * budget, held ? gemm_jobs : nullptr);
  note("op tables ...");
  measure_ops(p, full, kOpShare * budget, held ? op_jobs : nullptr);
  note("optimizer step ...");
  measure_optimizer(p, full, kOptimizerShare * budget);
  note("done");
  return p;
}

}  // namespace

HardwareProfile calibrate(int threads, Seconds budget) {
  return calibrate_phases(threads, budget, nullptr, nullptr, nullptr, nullptr, false);
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

CalibrationResult calibrate_and_validate(int threads, Seconds budget, bool progress) {
  HeldOut held;
  std::vector<Job> gemm_jobs, op_jobs, memory_jobs;
  CalibrationResult r;
  r.profile = calibrate_phases(threads, budget, &held, &gemm_jobs, &op_jobs, &memory_jobs, progress);
  const CostModel model(r.profile);
  add_rows(r.report, held.gemm_cases, gemm_jobs, model);
  add_rows(r.report, held.op_cases, op_jobs, model);
  add_rows(r.report, held.memory_cases, memory_jobs, model);
  finish_report(r.report);
  return r;
}

int run_calibrate_command(const std::string& out_path, int threads, double budget_seconds, bool report_and_write) {
  check_config(budget_seconds > 0 && budget_seconds <= 3600,
               fmt::format("--seconds must be in (0, 3600] (got {})", budget_seconds));
  check_config(threads >= 0, fmt::format("--threads must be >= 0, 0 meaning every core (got {})", threads));
  threads = resolve_threads(threads);
  // A peer under mpirun measures alongside rank 0 (so that the profile sees the
  // cores' shared memory bandwidth as training ranks do) and reports nothing.
  if (!report_and_write) {
    (void)calibrate_and_validate(threads, budget_seconds, false);
    return 0;
  }
  check_profile_out(out_path);
  fmt::print("moeflex calibrate: {} threads, budget {:.0f} s ({} grid), timed by the {} clock\n", threads,
             budget_seconds, budget_seconds >= kFullGridMinBudget ? "full" : "coarse",
             threads == 1 ? "thread's CPU" : "wall");
  // Other work on the cores makes every multi-threaded kernel wait for descheduled
  // threads: the profile then describes a busy machine. The load average is the
  // host's, so it is set against the host's cores, not the ones this rank is bound to
  // (one under `mpirun -np 2`).
  const int cores = host_cores();
  if (const double load = load_average(); load > kBusyLoadPerCore * cores)
    fmt::print(
        "warning: the machine is busy (load average {:.1f} on {} cores): timings will be noisy{}; calibrate "
        "on an idle machine for a faithful profile\n",
        load, cores, threads == 1 ? "" : " and the profile pessimistic");
  std::fflush(stdout);
  const auto t0 = Clock::now();
  const CalibrationResult result = calibrate_and_validate(threads, budget_seconds, true);
  const HardwareProfile& profile = result.profile;
  const CalibrationReport& report = result.report;
  fmt::print("measured {} GEMM shapes, {} op tables, memory {:.1f} GB/s, copies {:.1f}/{:.1f} GB/s (h2d/d2h) in {:.1f} s\n",
             profile.gemm.size(), profile.op_tables.size(), profile.memory_bandwidth / 1e9, profile.h2d_bandwidth / 1e9,
             profile.d2h_bandwidth / 1e9, since(t0));
  if (profile.all_to_all_bandwidth > 0)
    fmt::print("link between the ranks (all-to-all): latency {:.1f} us, bandwidth {:.2f} GB/s\n",
               1e6 * profile.all_to_all_latency, profile.all_to_all_bandwidth / 1e9);
  fmt::print("cores shared by twice as many threads: {:.1f}% of the ideal split\n",
             100 * profile.time_sharing_efficiency);
  if (profile.nap_cost > 0)
    fmt::print(
        "a waiting rank's naps on a shared core ({:.0f} us asked, {:.0f} us taken): each costs the rank computing "
        "there {:.1f} us\n",
        1e6 * comm::kMinPollSleepOversubscribed, 1e6 * (comm::kMinPollSleepOversubscribed + profile.nap_overshoot),
        1e6 * profile.nap_cost);
  if (profile.op_tables.count(op_names::kOptimizerStep))
    for (const OpSample& s : profile.op_tables.at(op_names::kOptimizerStep))
      fmt::print("optimizer step (zero_grads, norm, clip, AdamW) of {:.1f} M parameters: {:.2f} ms\n",
                 double(s.bytes) / 4e6, 1e3 * s.seconds);
  fmt::print("\nheld-out op invocations (cost model vs this machine; never measured by the calibration):\n");
  fmt::print("{:<24} {:<44} {:>12} {:>12} {:>8}\n", "op", "shape", "measured", "predicted", "error");
  std::map<std::string, std::pair<double, int>> by_op;  // op -> (sum of errors, count)
  for (const CalibrationRow& r : report.rows) {
    fmt::print("{:<24} {:<44} {:>12} {:>12} {:>7.1f}%\n", r.op, r.shape, format_seconds(r.measured),
               format_seconds(r.predicted), 100.0 * r.relative_error());
    auto& [sum, count] = by_op[r.op];
    sum += r.relative_error(), ++count;
  }
  fmt::print("\nmean error by op:");
  int col = 0;
  for (const auto& [op, e] : by_op)
    fmt::print("{}{:<24} {:5.1f}%", col++ % 3 == 0 ? "\n  " : "   ", op, 100.0 * e.first / e.second);
  fmt::print("\nmean absolute relative error: {:.2f}% over {} invocations\n", 100.0 * report.mean_abs_relative_error,
             report.rows.size());
  if (report.mean_spread > 0)
    fmt::print("measurement noise: the even and odd repeats of a held-out invocation differ by {:.2f}% on average\n",
               100.0 * report.mean_spread);
  else  // every held-out invocation ran once: nothing to compare
    fmt::print("measurement noise: unknown (too few repeats to compare; raise --seconds)\n");
  write_profile(profile, out_path);
  fmt::print("wrote {} ({:.1f} s in all)\n", out_path, since(t0));
  return 0;
}

namespace {

/// Refuses op_times.json's shapes[index] (of `kind`), naming the file, the entry and the field.
[[noreturn]] void bad_shape_entry(const std::filesystem::path& path, std::size_t index, const std::string& kind,
                                  const std::string& field, const std::string& rule) {
  throw DataError(fmt::format("'{}': shapes[{}]{}: '{}' {}", path.string(), index,
                              kind.empty() ? std::string() : fmt::format(" ({})", kind), field, rule));
}

const nlohmann::json& shape_member(const nlohmann::json& e, const char* key, const std::filesystem::path& path,
                                   std::size_t index, const std::string& kind) {
  auto it = e.find(key);
  if (it == e.end()) bad_shape_entry(path, index, kind, key, "is missing");
  return *it;
}

/// An entry's time field: a finite number in (0, kInSituMaxSeconds] (the profile's own bound).
Seconds shape_seconds(const nlohmann::json& e, const char* key, const std::filesystem::path& path, std::size_t index,
                      const std::string& kind, Seconds max = kInSituMaxSeconds) {
  const nlohmann::json& v = shape_member(e, key, path, index, kind);
  if (!v.is_number()) bad_shape_entry(path, index, kind, key, fmt::format("must be a number (got {})", v.dump()));
  const double x = v.get<double>();
  if (!std::isfinite(x) || !(x > 0) || x > max)
    bad_shape_entry(path, index, kind, key, fmt::format("must be in (0, {}] seconds (got {})", max, v.dump()));
  return x;
}

/// An integer field within int64 and >= `min`.
std::int64_t shape_integer(const nlohmann::json& v, std::int64_t min, const std::filesystem::path& path,
                           std::size_t index, const std::string& kind, const std::string& field) {
  if (!v.is_number_integer())
    bad_shape_entry(path, index, kind, field, fmt::format("must be an integer (got {})", v.dump()));
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
    bad_shape_entry(path, index, kind, field, fmt::format("is out of range (got {})", v.dump()));
  const std::int64_t x = v.get<std::int64_t>();
  if (x < min) bad_shape_entry(path, index, kind, field, fmt::format("must be >= {} (got {})", min, x));
  return x;
}

}  // namespace

HardwareProfile in_situ_profile(HardwareProfile base, const std::filesystem::path& run_dir,
                                std::size_t* zero_sized) {
  const std::filesystem::path path = run_dir / "op_times.json";
  std::ifstream in(path);
  if (!in)
    throw DataError(fmt::format("'{}' cannot be opened: --from-run needs a run trained with --profile-ops",
                                path.string()));
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("'{}' is not valid JSON: {}", path.string(), e.what()));
  }
  if (!doc.is_object() || !doc.contains("shapes") || !doc["shapes"].is_array())
    throw DataError(fmt::format("'{}' has no \"shapes\" list (written by an older moeflex?)", path.string()));
  // A profile's op times are fp32 ops' (the cost model's unit); a bf16 run's would
  // price every later fp32 plan with another precision's times.
  for (const char* field : {"precision", "device"})
    if (doc.contains(field) && !doc[field].is_string())
      throw DataError(fmt::format("'{}': \"{}\" must be a string (got {})", path.string(), field, doc[field].dump()));
  if (doc.value("precision", std::string("fp32")) != "fp32")
    throw DataError(fmt::format("'{}' was measured on a {} run: an in-situ profile takes the op times of an fp32 "
                                "run (train it without --bf16, with --profile-ops)",
                                path.string(), doc.value("precision", std::string())));
  // ... and of the base profile's device (files before the field are a CPU's).
  if (const std::string device = doc.value("device", std::string("cpu")); device != base.device)
    throw DataError(
        fmt::format("'{}' was measured on {} and the base profile on {}: an in-situ profile adds a "
                    "run's op times to a profile of the same device",
                    path.string(), device, base.device));
  // A base that is itself in situ keeps its entries where this run has none; the
  // grouped ratios are taken against its tables alone (not against an earlier run's
  // scales, which this run's would otherwise multiply).
  const std::vector<InSituOp> earlier_ops = std::move(base.in_situ_ops);
  const std::vector<InSituScale> earlier_scales = std::move(base.in_situ_scales);
  const std::string earlier_source = base.in_situ_source;
  base.in_situ_ops.clear();
  base.in_situ_scales.clear();
  const CostModel cost(base);  // the base's own predictions, for the grouped ratios
  const std::set<std::string> exact(std::begin(kInSituExactKinds), std::end(kInSituExactKinds));
  const std::set<std::string> scaled(std::begin(kInSituScaledKinds), std::end(kInSituScaledKinds));
  if (zero_sized) *zero_sized = 0;
  std::map<std::pair<std::string, std::vector<std::int64_t>>, std::size_t> seen;  // exact (kind, shape) -> index
  std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::pair<double, double>> ratio;  // measured, predicted
  const nlohmann::json& shapes = doc["shapes"];
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const nlohmann::json& e = shapes[i];
    if (!e.is_object()) bad_shape_entry(path, i, "", "(entry)", "must be an object {kind, shape, count, ...}");
    const nlohmann::json& k = shape_member(e, "kind", path, i, "");
    if (!k.is_string()) bad_shape_entry(path, i, "", "kind", fmt::format("must be a string (got {})", k.dump()));
    const std::string kind = k.get<std::string>();
    const bool is_exact = exact.count(kind) > 0, is_scaled = scaled.count(kind) > 0;
    if (!is_exact && !is_scaled) continue;  // a kind the cost model does not answer in situ
    const nlohmann::json& sh = shape_member(e, "shape", path, i, kind);
    if (!sh.is_array()) bad_shape_entry(path, i, kind, "shape", fmt::format("must be an array (got {})", sh.dump()));
    const std::int64_t count = shape_integer(shape_member(e, "count", path, i, kind), 1, path, i, kind, "count");
    if (is_exact) {
      const std::size_t rank = in_situ_shape_rank(kind);
      if (sh.size() != rank)
        bad_shape_entry(path, i, kind, "shape", fmt::format("must hold {} extents (got {})", rank, sh.dump()));
      std::vector<std::int64_t> shape;
      for (std::size_t d = 0; d < sh.size(); ++d)
        shape.push_back(shape_integer(sh[d], 0, path, i, kind, fmt::format("shape[{}]", d)));
      const Seconds median = shape_seconds(e, "measured_median_s", path, i, kind);
      // A zero-sized call (an expert chunk that got no rows) ran no kernel: the cost
      // model prices it at 0 without asking the profile, so it is not kept.
      if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
        if (zero_sized) ++*zero_sized;
        continue;
      }
      const auto [at, fresh] = seen.emplace(std::make_pair(kind, shape), i);
      if (!fresh)
        bad_shape_entry(path, i, kind, "shape",
                        fmt::format("{} repeats shapes[{}]'s; each (kind, shape) is listed once", sh.dump(),
                                    at->second));
      base.in_situ_ops.push_back({kind, shape, median});
    } else {
      // [rows of each group..., in, out]
      if (sh.size() < 3)
        bad_shape_entry(path, i, kind, "shape",
                        fmt::format("must be [rows of each group..., in, out] with at least one group (got {})",
                                    sh.dump()));
      std::vector<std::int64_t> rows;
      for (std::size_t d = 0; d + 2 < sh.size(); ++d)
        rows.push_back(shape_integer(sh[d], 0, path, i, kind, fmt::format("shape[{}]", d)));
      const std::int64_t in_f = shape_integer(sh[sh.size() - 2], 1, path, i, kind, "shape[-2] (in)");
      const std::int64_t out_f = shape_integer(sh.back(), 1, path, i, kind, "shape[-1] (out)");
      // The total of `count` calls: up to an hour per call, as the profile's own bound.
      const Seconds total = shape_seconds(e, "measured_total_s", path, i, kind, kInSituMaxSeconds * double(count));
      const Seconds one = kind == "grouped_linear_forward"
                              ? cost.grouped_linear_forward(rows, in_f, out_f)
                              : cost.grouped_linear_backward(rows, in_f, out_f, kind == "grouped_linear_backward_dx",
                                                             kind == "grouped_linear_backward_dw");
      auto& [m, p] = ratio[{kind, in_f, out_f}];
      m += total;
      p += double(count) * one;
    }
  }
  for (const auto& [key, mp] : ratio) {
    const auto& [kind, in_f, out_f] = key;
    if (!(mp.second > 0)) continue;  // every group empty: nothing the model prices, nothing to scale
    const double scale = mp.first / mp.second;
    if (!(scale >= kInSituMinScale && scale <= kInSituMaxScale))
      throw DataError(fmt::format("'{}': {} with weight [in {}, out {}] measured {:.6g} s where the base profile "
                                  "predicts {:.6g} s: a ratio of {:.6g}, outside [{}, {}] (wrong shapes or times in "
                                  "op_times.json, or a base profile of another machine?)",
                                  path.string(), kind, in_f, out_f, mp.first, mp.second, scale, kInSituMinScale,
                                  kInSituMaxScale));
    base.in_situ_scales.push_back({kind, in_f, out_f, scale});
  }
  for (const InSituOp& o : earlier_ops)
    if (!seen.count({o.kind, o.shape})) base.in_situ_ops.push_back(o);
  for (const InSituScale& x : earlier_scales)
    if (!ratio.count({x.kind, x.in, x.out})) base.in_situ_scales.push_back(x);
  const std::string source = std::filesystem::absolute(run_dir).lexically_normal().string();
  base.in_situ_source = earlier_source.empty() ? source : earlier_source + "; " + source;
  return base;
}

int run_in_situ_calibrate_command(const std::string& run_dir, const std::string& base_path,
                                  const std::string& out_path) {
  if (run_dir.empty()) throw ConfigError("calibrate --from-run '': give the folder of a run trained with --profile-ops");
  if (base_path.empty()) throw ConfigError("calibrate --base '': give the profile to start from");
  if (out_path.empty()) throw ConfigError("calibrate --out '': give the profile file to write");
  {  // the same file under two names (relative, absolute, through links) counts as the same
    std::error_code ec;
    const bool same = std::filesystem::exists(out_path, ec) ? std::filesystem::equivalent(out_path, base_path, ec)
                                                            : std::filesystem::weakly_canonical(out_path, ec) ==
                                                                  std::filesystem::weakly_canonical(base_path, ec);
    if (same && !ec)
      throw ConfigError(fmt::format("calibrate --out '{}' is the base profile (--base '{}'): writing it would replace "
                                    "the base profile; choose another --out",
                                    out_path, base_path));
  }
  {  // nor the run's own op times, which it reads
    std::error_code ec;
    const std::filesystem::path ops = std::filesystem::path(run_dir) / "op_times.json";
    if (std::filesystem::exists(out_path, ec) && std::filesystem::equivalent(out_path, ops, ec) && !ec)
      throw ConfigError(
          fmt::format("calibrate --out '{}' is the run's own op_times.json (--from-run '{}'): writing "
                      "it would replace what the profile is made from; choose another --out",
                      out_path, run_dir));
  }
  check_profile_out(out_path);
  std::size_t zero_sized = 0;
  const HardwareProfile profile = in_situ_profile(HardwareProfile::load(base_path), run_dir, &zero_sized);
  fmt::print("moeflex calibrate --from-run {}: base profile {}\n", run_dir, base_path);
  fmt::print("in-situ: {} ops at their exact shapes", profile.in_situ_ops.size());
  if (zero_sized > 0) fmt::print(" ({} zero-sized calls left out: they cost 0)", zero_sized);
  if (!profile.in_situ_scales.empty()) {
    fmt::print("; grouped GEMMs measured / modelled:");
    for (const InSituScale& x : profile.in_situ_scales)
      fmt::print(" {} [{}, {}] x{:.3f}", x.kind, x.in, x.out, x.scale);
  }
  fmt::print("\n");
  write_profile(profile, out_path);
  fmt::print("wrote {}\n", out_path);
  return 0;
}

}  // namespace moeflex
