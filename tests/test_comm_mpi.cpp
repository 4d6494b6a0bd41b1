// The Communicator on every rank of a job: run under `mpirun -np 2` and `-np 4`
// (CTest does both), or alone, where the same tests check the single-process
// backend. Every expected value is computed independently on each rank.
//
// Tests only EXPECT (never ASSERT) around collectives, so a failed check does not
// make a rank skip a collective the others are waiting in. Only rank 0 prints the
// usual gtest output; the others print their failures, prefixed with their rank.
// Each rank exits non-zero if a check failed on it, so mpirun does too.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "moeflex/comm/layout.h"
#include "moeflex/comm/mpi_communicator.h"

using namespace moeflex;
using namespace moeflex::comm;

namespace {

Communicator* g_world = nullptr;

Communicator& world() { return *g_world; }

// A float of rank `r` at index `i` with all mantissa bits busy, so that the
// order of a sum changes its bits: splitmix64 into [-1, 1) times a spread of
// magnitudes.
float noisy(int r, std::int64_t i) {
  std::uint64_t z = std::uint64_t(r) * 0x9E3779B97F4A7C15ull + std::uint64_t(i) * 0xBF58476D1CE4E5B9ull + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = double(z >> 11) / double(1ull << 53) * 2.0 - 1.0;
  return float(u * std::ldexp(1.0, int(z % 17) - 8));
}

// Gathers `n` values from every rank and checks that all ranks hold the same bits.
template <class T>
void expect_same_bits_on_every_rank(const std::vector<T>& v, const char* what) {
  const std::int64_t bytes = std::int64_t(v.size() * sizeof(T));
  std::vector<T> all(v.size() * std::size_t(world().size()));
  world().all_gather_bytes(v.data(), all.data(), bytes);
  for (int r = 0; r < world().size(); ++r)
    EXPECT_EQ(std::memcmp(all.data() + std::size_t(r) * v.size(), v.data(), std::size_t(bytes)), 0)
        << what << ": rank " << r << " has other bits than rank " << world().rank();
}

}  // namespace

TEST(Comm, RankAndSize) {
  EXPECT_GE(world().size(), 1);
  EXPECT_GE(world().rank(), 0);
  EXPECT_LT(world().rank(), world().size());
  EXPECT_EQ(world().world_rank(), world().rank());
  EXPECT_EQ(world().backend(), MpiSession::active() ? "mpi" : "single");
  world().barrier();
}

// The float sum is the rank-order left fold, bit for bit, on every rank, for sizes
// smaller than, equal to and larger than the number of ranks.
TEST(Comm, AllReduceSumFloatIsTheRankOrderSumOnEveryRank) {
  const int p = world().size();
  for (std::int64_t n : {std::int64_t(0), std::int64_t(1), std::int64_t(3), std::int64_t(p), std::int64_t(10007)}) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = noisy(world().rank(), i);
    world().all_reduce_sum(v.data(), n);
    int mismatches = 0, order_sensitive = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      float expect = noisy(0, i), reversed = noisy(p - 1, i);
      for (int r = 1; r < p; ++r) expect += noisy(r, i);
      for (int r = p - 2; r >= 0; --r) reversed += noisy(r, i);
      mismatches += std::memcmp(&expect, &v[std::size_t(i)], sizeof(float)) != 0;
      order_sensitive += reversed != expect;
    }
    EXPECT_EQ(mismatches, 0) << "n = " << n;
    // The inputs are such that another order would give other bits (from 3 ranks
    // on: with 2, a + b == b + a).
    if (p >= 3 && n > 1000) {
      EXPECT_GT(order_sensitive, n / 100);
    }
    expect_same_bits_on_every_rank(v, "all_reduce_sum(float)");
  }
}

TEST(Comm, AllReduceSumDoubleIntAndMax) {
  const int p = world().size(), me = world().rank();
  std::vector<double> d(5);
  for (int i = 0; i < 5; ++i) d[std::size_t(i)] = 0.1 * (me + 1) + i;
  world().all_reduce_sum(d.data(), 5);
  for (int i = 0; i < 5; ++i) {
    double expect = 0.1 * 1 + i;
    for (int r = 1; r < p; ++r) expect += 0.1 * (r + 1) + i;
    EXPECT_EQ(d[std::size_t(i)], expect) << i;
  }
  expect_same_bits_on_every_rank(d, "all_reduce_sum(double)");

  std::int64_t k[2] = {me + 1, std::int64_t(1) << 40};
  world().all_reduce_sum(k, 2);
  EXPECT_EQ(k[0], std::int64_t(p) * (p + 1) / 2);
  EXPECT_EQ(k[1], std::int64_t(p) << 40);

  double m[3] = {double(me), -double(me), me == p - 1 ? 1e300 : 0.5};
  world().all_reduce_max(m, 3);
  EXPECT_EQ(m[0], double(p - 1));
  EXPECT_EQ(m[1], 0.0);
  EXPECT_EQ(m[2], 1e300);
}

TEST(Comm, ReduceScatterSumsEachRanksBlockInRankOrder) {
  const int p = world().size(), me = world().rank();
  const std::int64_t n = 7;
  std::vector<float> send(static_cast<std::size_t>(n * p)), recv(static_cast<std::size_t>(n));
  for (int b = 0; b < p; ++b)
    for (std::int64_t i = 0; i < n; ++i) send[std::size_t(b * n + i)] = noisy(me * 100 + b, i);
  world().reduce_scatter_sum(send.data(), recv.data(), n);
  int mismatches = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    float expect = noisy(0 * 100 + me, i);
    for (int q = 1; q < p; ++q) expect += noisy(q * 100 + me, i);
    mismatches += std::memcmp(&expect, &recv[std::size_t(i)], sizeof(float)) != 0;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Comm, AllGatherConcatenatesInRankOrder) {
  const int p = world().size(), me = world().rank();
  float mine[2] = {float(me), float(10 * me)};
  std::vector<float> all(static_cast<std::size_t>(2 * p), -1);
  world().all_gather(mine, all.data(), 2);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(all[std::size_t(2 * r)], float(r));
    EXPECT_EQ(all[std::size_t(2 * r + 1)], float(10 * r));
  }
  std::int64_t id = 1000 + me;
  std::vector<std::int64_t> ids(static_cast<std::size_t>(p));
  world().all_gather_bytes(&id, ids.data(), sizeof id);
  for (int r = 0; r < p; ++r) EXPECT_EQ(ids[std::size_t(r)], 1000 + r);
}

// Uneven, zero and gapped counts; elements of 12 bytes; counts exchanged first.
TEST(Comm, AllToAllVWithUnevenAndZeroCounts) {
  struct Elem {
    std::int32_t from, to, j;
  };
  static_assert(sizeof(Elem) == 12);
  const int p = world().size(), me = world().rank();
  auto count = [](int q, int r) -> std::int64_t { return (q + 2 * r) % 3; };  // 0, 1 or 2
  const std::size_t np = static_cast<std::size_t>(p);
  std::vector<std::int64_t> sc(np), sd(np), rc(np), rd(np);
  std::int64_t off = 0;
  for (int r = 0; r < p; ++r) {
    sc[std::size_t(r)] = count(me, r);
    sd[std::size_t(r)] = off;
    off += sc[std::size_t(r)] + 1;  // a one-element gap after each block
  }
  std::vector<Elem> send(static_cast<std::size_t>(off), Elem{-1, -1, -1});
  for (int r = 0; r < p; ++r)
    for (std::int64_t j = 0; j < sc[std::size_t(r)]; ++j)
      send[std::size_t(sd[std::size_t(r)] + j)] = Elem{me, r, std::int32_t(j)};

  world().all_to_all(sc.data(), rc.data(), 1);  // rc[q] = rank q's count for me
  std::int64_t total = 0;
  for (int q = 0; q < p; ++q) {
    EXPECT_EQ(rc[std::size_t(q)], count(q, me)) << "count from rank " << q;
    rd[std::size_t(q)] = total;
    total += rc[std::size_t(q)];
  }
  std::vector<Elem> recv(static_cast<std::size_t>(total) + 1, Elem{-7, -7, -7});
  world().all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), sizeof(Elem));
  for (int q = 0; q < p; ++q)
    for (std::int64_t j = 0; j < rc[std::size_t(q)]; ++j) {
      const Elem e = recv[std::size_t(rd[std::size_t(q)] + j)];
      EXPECT_EQ(e.from, q);
      EXPECT_EQ(e.to, me);
      EXPECT_EQ(e.j, j);
    }
  EXPECT_EQ(recv.back().from, -7);  // nothing written past the end

  // All counts zero.
  std::vector<std::int64_t> zero(static_cast<std::size_t>(p), 0);
  world().all_to_all_v(send.data(), zero.data(), zero.data(), recv.data(), zero.data(), zero.data(), 4);
}

TEST(Comm, AllToAllExchangesInt32Counts) {
  const int p = world().size(), me = world().rank();
  std::vector<std::int32_t> send(static_cast<std::size_t>(2 * p)), recv(static_cast<std::size_t>(2 * p));
  for (int r = 0; r < p; ++r) {
    send[std::size_t(2 * r)] = 100 * me + r;
    send[std::size_t(2 * r + 1)] = -(100 * me + r);
  }
  world().all_to_all(send.data(), recv.data(), 2);
  for (int q = 0; q < p; ++q) {
    EXPECT_EQ(recv[std::size_t(2 * q)], 100 * q + me);
    EXPECT_EQ(recv[std::size_t(2 * q + 1)], -(100 * q + me));
  }
}

TEST(Comm, BroadcastFromEveryRoot) {
  const int p = world().size(), me = world().rank();
  for (int root = 0; root < p; ++root) {
    std::vector<double> v(3, me == root ? 3.5 * root + 1 : -1.0);
    world().broadcast(v.data(), std::int64_t(v.size() * sizeof(double)), root);
    for (double x : v) EXPECT_EQ(x, 3.5 * root + 1);
  }
}

// Every rank sends to its right neighbour, then receives from its left one: with
// blocking sends of messages beyond the eager limit this deadlocks.
TEST(Comm, SendRecvRingDoesNotDeadlock) {
  const int p = world().size(), me = world().rank();
  const int right = (me + 1) % p, left = (me + p - 1) % p;
  const std::size_t n = 1 << 18;  // 1 MiB of floats
  std::vector<float> out(n), in(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = float(me * 7 + int(i % 1000));
  world().send(out.data(), std::int64_t(n * sizeof(float)), right, 3);
  std::fill(out.begin(), out.end(), -1.0f);  // buffered: reusing the buffer is fine
  world().recv(in.data(), std::int64_t(n * sizeof(float)), left, 3);
  int bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += in[i] != float(left * 7 + int(i % 1000));
  EXPECT_EQ(bad, 0);
  world().flush_sends();
}

// Tags are matched independently; irecv posted before the send.
TEST(Comm, TagsAndIrecv) {
  const int p = world().size(), me = world().rank();
  const int right = (me + 1) % p, left = (me + p - 1) % p;
  int got1 = 0, got2 = 0, got3 = 0;
  Request early = world().irecv(&got3, sizeof got3, left, 12);
  int a = 100 + me, b = 200 + me, c = 300 + me;
  world().send(&a, sizeof a, right, 10);
  world().send(&b, sizeof b, right, 11);
  world().send(&c, sizeof c, right, 12);
  world().recv(&got2, sizeof got2, left, 11);  // out of send order, by tag
  world().recv(&got1, sizeof got1, left, 10);
  early.wait();
  EXPECT_EQ(got1, 100 + left);
  EXPECT_EQ(got2, 200 + left);
  EXPECT_EQ(got3, 300 + left);
  world().barrier();
}

TEST(Comm, WrongSizedReceiveThrows) {
  const int p = world().size(), me = world().rank();
  const int right = (me + 1) % p, left = (me + p - 1) % p;
  double wide = 1.0;
  world().send(&wide, sizeof wide, right, 20);
  world().send(&wide, sizeof wide, right, 21);
  float narrow = 0;
  try {
    world().recv(&narrow, sizeof narrow, left, 20);  // 8 bytes arrive for 4
    ADD_FAILURE() << "no CommError";
  } catch (const CommError& e) {
    if (MpiSession::active()) {  // MPI's own text, e.g. MPI_ERR_TRUNCATE: message truncated
      EXPECT_NE(std::string(e.what()).find("TRUNCATE"), std::string::npos) << e.what();
    }
  }
  double wider[2];
  try {
    world().recv(wider, sizeof wider, left, 21);  // 8 bytes arrive for 16
    ADD_FAILURE() << "no CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("expected 16 bytes but the message has 8"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(world().send(&wide, sizeof wide, p, 0), CommError);
  EXPECT_THROW(world().recv(&wide, sizeof wide, -1, 0), CommError);
  world().flush_sends();
  world().barrier();
}

TEST(Comm, SplitOrdersByKeyAndReduces) {
  const int p = world().size(), me = world().rank();
  // Two groups by parity, ranks in reverse order of world rank.
  auto sub = world().split(me % 2, -me, "parity");
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int r = me % 2; r < p; r += 2) members.push_back(r);
  std::reverse(members.begin(), members.end());
  EXPECT_EQ(sub->size(), int(members.size()));
  EXPECT_EQ(sub->name(), "parity");
  for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(sub->world_rank_of(i), members[std::size_t(i)]);
  EXPECT_EQ(sub->world_rank(), me);
  float x = float(me);
  sub->all_reduce_sum(&x, 1);
  EXPECT_EQ(x, float(std::accumulate(members.begin(), members.end(), 0)));

  // Negative color: this rank joins nothing (here: the last rank).
  auto some = world().split(me == p - 1 ? -1 : 0, me, "some");
  EXPECT_EQ(some == nullptr, me == p - 1);
  if (some) {
    EXPECT_EQ(some->size(), p - 1);
  }
}

// The groups of make_groups have the layout's members, in order, and talk to
// exactly them (a sum of world ranks over each group).
TEST(Comm, GroupsFromTheLayout) {
  const int p = world().size(), me = world().rank();
  std::vector<LayoutSpec> specs;
  auto add = [&](int pp, int dp, int ep) {
    LayoutSpec s;
    s.world_size = p;
    s.pp = pp;
    s.dp = dp;
    s.ep = ep;
    s.num_layers = 4;
    s.num_experts = 4;
    specs.push_back(s);
  };
  if (p == 1) add(1, 1, 1);
  if (p == 2) {
    add(2, 1, 1);
    add(1, 2, 1);
    add(1, 2, 2);
  }
  if (p == 4) {
    add(2, 2, 2);
    add(2, 2, 1);
    add(1, 4, 2);
    add(1, 4, 4);
    add(4, 1, 1);
  }
  for (const LayoutSpec& s : specs) {
    ParallelLayout l(s);
    ParallelGroups g = make_groups(world(), l);
    EXPECT_EQ(g.coords, l.coords(me));
    const std::pair<Communicator*, std::vector<int>> kinds[4] = {
        {g.pipeline.get(), l.pipeline_group(me)},
        {g.data_parallel.get(), l.data_parallel_group(me)},
        {g.expert_parallel.get(), l.expert_parallel_group(me)},
        {g.expert_data_parallel.get(), l.expert_data_parallel_group(me)}};
    for (const auto& [c, members] : kinds) {
      EXPECT_EQ(c->size(), int(members.size())) << l.describe() << " group " << c->name();
      for (int i = 0; i < c->size() && i < int(members.size()); ++i)
        EXPECT_EQ(c->world_rank_of(i), members[std::size_t(i)]) << l.describe() << " group " << c->name();
      std::int64_t sum = me;
      c->all_reduce_sum(&sum, 1);
      EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), std::int64_t(0)))
          << l.describe() << " group " << c->name();
    }
  }
}

// Failure paths, each run as its own mpirun by CTest (they end the job on purpose):
// MOEFLEX_TEST_FAILURE=watchdog: rank 0 waits for a message rank 1 never sends;
// the watchdog must end the job naming the operation and the peer.
// MOEFLEX_TEST_FAILURE=crash: rank 1 is killed while rank 0 waits in a barrier;
// the job must end (mpirun reports the dead rank) rather than hang.
TEST(CommFailure, EndsTheJobInsteadOfHanging) {
  const char* mode = std::getenv("MOEFLEX_TEST_FAILURE");
  if (mode == nullptr || world().size() < 2) GTEST_SKIP() << "set MOEFLEX_TEST_FAILURE and run under mpirun";
  const int me = world().rank();
  if (std::string(mode) == "watchdog") {
    world().set_timeout(1.0);
    if (me == 0) {
      int never = 0;
      world().recv(&never, sizeof never, 1, 99);
    }
  } else if (std::string(mode) == "crash") {
    if (me == 1) std::raise(SIGKILL);
    world().barrier();
  }
  std::this_thread::sleep_for(std::chrono::seconds(30));  // the job must be ended before this
  ADD_FAILURE() << "the job was not ended";
}

namespace {

// Prints only failed checks, with the rank: the listener of ranks other than 0.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<MpiSession> session;
  if (MpiSession::launched_by_mpi()) session = std::make_unique<MpiSession>(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<Communicator> w = make_world_communicator();
  g_world = w.get();
  if (w->rank() != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(w->rank()));
  }
  const int rc = RUN_ALL_TESTS();
  std::int64_t failed_ranks = rc != 0;
  w->all_reduce_sum(&failed_ranks, 1);
  if (w->rank() == 0 && failed_ranks > 0)
    std::fprintf(stderr, "test_comm_mpi: checks failed on %lld of %d ranks\n", (long long)failed_ranks, w->size());
  w.reset();
  return rc;
}
