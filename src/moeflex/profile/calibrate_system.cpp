// What the calibration measures of the machine around the kernels: the link between
// the ranks under mpirun (all-to-all latency and bandwidth), cores shared by more
// threads than there are (time_sharing_efficiency), what a napping rank costs the
// rank computing on its core (nap_cost), and the host's name, cores and load.
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/wait_policy.h"
#include "moeflex/ops/blas.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/profile/calibrate_internal.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace moeflex {
namespace calibration {

// ---- the link between ranks ---------------------------------------------------------------

namespace {

/// Bytes to every peer of the all-to-all samples of measure_link.
const std::vector<Bytes> kLinkBytes = {4 * kKiB, 64 * kKiB, 256 * kKiB, 1 * kMiB, 4 * kMiB};
constexpr int kLinkRepeats = 15;  ///< timed exchanges per size; the median counts
/// The ring of exchange buffers measure_link rotates through: larger than the last-level
/// cache of a current CPU, so that each exchange starts cold.
constexpr Bytes kLinkRingBytes = 256 * kMiB;

}  // namespace

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

/// The host's cores (not the ones this process is bound to), at least 1.
int host_cores() { return std::max(1, int(std::thread::hardware_concurrency())); }

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "this-machine";
  return buf;
}

namespace {

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
}  // namespace calibration

using namespace calibration;  // the budget's constants, work_loop, SingleThreadedScope

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

double load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

}  // namespace moeflex
