// The calibration's timing harness: the clock a job is timed by (a thread's CPU
// clock with one thread, the wall clock with several), the cache eviction before
// each timed run, the interleaved rounds that spend a phase's budget on its jobs
// (run_jobs), the second look at dips (run_series), and the thread counts.
#include <omp.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "moeflex/profile/calibrate_internal.h"
#include "moeflex/profile/op_profiler.h"

extern "C" void openblas_set_num_threads(int);

namespace moeflex::calibration {
namespace {

/// Which clock times a job. With one thread every kernel runs on the calling thread,
/// and that thread's CPU time (CLOCK_THREAD_CPUTIME_ID) is what the kernel took
/// without the slices the scheduler gave other processes meanwhile: on a shared
/// machine a call of a few ms is descheduled at least once in most repeats, which
/// doubles its wall time but not its CPU time. On an idle machine the two agree.
/// With several threads a kernel's time is that of its slowest thread, which only
/// the wall clock sees.
bool g_thread_cpu_clock = false;

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

}  // namespace

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

int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_num_procs(); }

void set_threads(int threads) {
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  g_thread_cpu_clock = threads == 1;
}

}  // namespace moeflex::calibration
