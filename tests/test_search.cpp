// The auto search: every layout it returns validates, invalid and oversized ones
// are dropped and counted, the ranking is by effective TGS, and a clearly better
// layout (no pipeline bubble) comes first.
#include <gtest/gtest.h>

#include "model_fixtures.h"
#include "moeflex/comm/layout.h"
#include "moeflex/search/search.h"

using namespace moeflex;
using namespace moeflex::sim;

namespace {

ClusterSpec small_cluster() {
  ClusterSpec c;
  c.name = "test";
  c.gpus_per_node = 4;
  c.device_memory = 1 * kGiB;
  c.intra_node = {1e-6, 100e9};
  c.inter_node = {5e-6, 10e9};
  c.peak_flops = 1e12;
  c.profile.name = "flat";
  c.profile.gemm = {{64, 64, 64, 1e12}};
  c.profile.memory_bandwidth = 1e11;
  c.profile.launch_overhead = 1e-6;
  c.profile.h2d_bandwidth = c.profile.d2h_bandwidth = 1e10;
  return c;
}

search::SearchOptions small_search() {
  search::SearchOptions o;
  o.model = test::small_moe_config(4, 0, 8, true);
  o.cluster = small_cluster();
  o.gpus = 4;
  o.top = 50;
  o.seq_len = 16;
  o.global_batch = 16;
  return o;
}

}  // namespace

TEST(Search, ReturnsOnlyValidLayoutsRankedByEffectiveTgs) {
  const search::SearchOptions o = small_search();
  const search::SearchResult r = search::search(o);
  ASSERT_FALSE(r.top.empty());
  EXPECT_GT(r.invalid, 0);  // e.g. tp 8 > 4 GPUs per node, interleaved with m % pp != 0
  EXPECT_EQ(r.enumerated, r.invalid + r.no_fit + r.timed);
  for (std::size_t i = 0; i < r.top.size(); ++i) {
    const auto& c = r.top[i];
    EXPECT_EQ(c.parallel.world(), 4);
    // The expert layers' view of a stage: tp x dp ranks as ep x expert_dp (folding).
    comm::LayoutSpec ls;
    ls.world_size = c.parallel.pp * c.parallel.tp * c.parallel.dp;
    ls.pp = c.parallel.pp;
    ls.dp = c.parallel.tp * c.parallel.dp;
    ls.ep = c.parallel.ep;
    ls.vpp = c.schedule == "dualpipev" ? 2 : c.parallel.vpp;
    ls.num_layers = 4;
    ls.num_experts = 8;
    ls.pad_layers = true;
    EXPECT_NO_THROW(comm::ParallelLayout{ls}) << c.parallel.str();
    EXPECT_LE(c.peak_bytes, o.cluster.usable_memory());
    if (i > 0) {
      EXPECT_GE(r.top[i - 1].effective_tgs, c.effective_tgs);
    }
  }
}

TEST(Search, ClearlyBetterLayoutComesFirst) {
  // 4 GPUs, 2 micro-batches per pipeline at pp 4 would idle most of the time:
  // pure data parallelism has no bubble and wins.
  search::SearchOptions o = small_search();
  o.policies = {"none"};
  o.schedules = {"gpipe", "1f1b"};
  o.micro_batch_sizes = {1};
  o.tps = {1};
  const search::SearchResult r = search::search(o);
  ASSERT_FALSE(r.top.empty());
  EXPECT_EQ(r.top[0].parallel.pp, 1);
  EXPECT_EQ(r.top[0].bubble, 0);
  const auto& last = r.top.back();
  EXPECT_GT(last.parallel.pp, 1);
  EXPECT_LT(last.tgs, r.top[0].tgs);
}

TEST(Search, LayoutsThatDoNotFitAreDropped) {
  search::SearchOptions o = small_search();
  o.cluster.device_memory = 64 * kKiB;  // less than the weights of any split
  EXPECT_THROW(search::search(o), ConfigError);
  // A memory objective puts the smallest peak first.
  o = small_search();
  o.objective = "memory";
  const search::SearchResult r = search::search(o);
  for (std::size_t i = 1; i < r.top.size(); ++i) EXPECT_LE(r.top[i - 1].peak_bytes, r.top[i].peak_bytes);
}

// The timing pass runs on several threads sharing one layer-cost cache; the result
// must not depend on how many (same layouts, same order, the same figures bit for bit).
TEST(Search, ThreadsDoNotChangeTheResult) {
  search::SearchOptions o = small_search();
  o.threads = 1;
  const search::SearchResult one = search::search(o);
  o.threads = 3;
  const search::SearchResult three = search::search(o);
  ASSERT_EQ(one.top.size(), three.top.size());
  EXPECT_EQ(one.timed, three.timed);
  EXPECT_EQ(one.walked, three.walked);
  for (std::size_t i = 0; i < one.top.size(); ++i) {
    EXPECT_EQ(one.top[i].parallel.str(), three.top[i].parallel.str()) << i;
    EXPECT_EQ(one.top[i].schedule, three.top[i].schedule) << i;
    EXPECT_EQ(one.top[i].policy, three.top[i].policy) << i;
    EXPECT_EQ(one.top[i].step_time, three.top[i].step_time) << i;
    EXPECT_EQ(one.top[i].peak_bytes, three.top[i].peak_bytes) << i;
  }
}

TEST(Search, ACpuEngineClusterGetsOnlyLayoutsTheEngineRuns) {
  // The GPU-like cluster folds EP over tp x dp somewhere in its results (ep > dp);
  // a cluster of CPU-engine processes (per-tensor gradient reduction, this-machine)
  // gets tp 1 only: the engine has no tensor parallelism.
  search::SearchOptions o = small_search();
  o.policies = {"none"};
  o.schedules = {"1f1b"};
  o.micro_batch_sizes = {1};
  o.top = 1000;
  const search::SearchResult gpu = search::search(o);
  bool folded = false;
  for (const auto& c : gpu.top) folded = folded || (c.parallel.tp > 1 && c.parallel.ep > c.parallel.dp);
  EXPECT_TRUE(folded);
  o.cluster.per_tensor_gradient_reduce = true;
  const search::SearchResult cpu = search::search(o);
  ASSERT_FALSE(cpu.top.empty());
  for (const auto& c : cpu.top) EXPECT_EQ(c.parallel.tp, 1) << c.parallel.str();
  EXPECT_LT(cpu.enumerated, gpu.enumerated);
}
