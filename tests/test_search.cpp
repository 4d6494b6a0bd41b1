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

// A layout whose adaptive candidate gives bit for bit its `none` candidate's result
// (the budget lets adaptive save everything) takes one row, listing both policies; the
// next slot goes to another layout.
TEST(Search, IdenticalResultsOfTwoPoliciesShareOneRow) {
  search::SearchOptions o = small_search();
  o.schedules = {"1f1b"};
  o.micro_batch_sizes = {1};
  o.tps = {1};
  o.top = 2;
  // Each policy alone: the same best layout with the same figures.
  o.policies = {"none"};
  const search::SearchResult none = search::search(o);
  o.policies = {"adaptive"};
  const search::SearchResult adaptive = search::search(o);
  ASSERT_EQ(none.top.size(), 2u);
  ASSERT_EQ(adaptive.top.size(), 2u);
  const search::Candidate& n = none.top[0];
  const search::Candidate& a = adaptive.top[0];
  ASSERT_EQ(n.parallel.str(), a.parallel.str());
  ASSERT_EQ(n.step_time, a.step_time);
  ASSERT_EQ(n.peak_bytes, a.peak_bytes);
  ASSERT_EQ(n.spike_peak_bytes, a.spike_peak_bytes);
  ASSERT_EQ(n.recompute_time, a.recompute_time);
  EXPECT_EQ(none.merged, 0);
  // Both: one row for that layout, then the second-best layout (not the same one again).
  o.policies = {"none", "adaptive"};
  const search::SearchResult both = search::search(o);
  ASSERT_EQ(both.top.size(), 2u);
  const search::Candidate& row = both.top[0];
  EXPECT_EQ(row.parallel.str(), n.parallel.str());
  EXPECT_EQ(row.policy, "none");
  EXPECT_EQ(row.equivalent_policies, (std::vector<std::string>{"none", "adaptive"}));
  EXPECT_EQ(row.policy_label(), "none=adaptive");
  EXPECT_EQ(row.step_time, n.step_time);
  EXPECT_EQ(row.peak_bytes, n.peak_bytes);
  EXPECT_NE(both.top[1].parallel.str(), row.parallel.str());
  EXPECT_EQ(both.top[1].parallel.str(), none.top[1].parallel.str());
  EXPECT_GE(both.merged, 1);
  // The JSON keeps `policy` a policy name and lists the equivalent ones.
  const auto j = both.to_json(o);
  EXPECT_EQ(j["merged"], both.merged);
  EXPECT_EQ(j["top"][0]["policy"], "none");
  EXPECT_EQ(j["top"][0]["equivalent_policies"], nlohmann::json({"none", "adaptive"}));
  EXPECT_NE(both.format(o).find("none=adaptive"), std::string::npos);
  // The last row kept is labelled as an exhaustive search labels it: its sibling, timed
  // at the same bound, is walked and joins it.
  search::SearchOptions all = o;
  all.top = 50;
  const search::SearchResult every = search::search(all);
  const search::Candidate* same = nullptr;
  for (const auto& c : every.top)
    if (c.parallel.str() == both.top[1].parallel.str() && c.schedule == both.top[1].schedule &&
        c.micro_batch_size == both.top[1].micro_batch_size)
      same = &c;
  ASSERT_NE(same, nullptr);
  EXPECT_EQ(both.top[1].equivalent_policies, same->equivalent_policies);
  EXPECT_EQ(both.top[1].policy, same->policy);
}

// Under a budget where the spike does not fit without recomputation, adaptive's result
// differs from none's (none risks an OOM, adaptive recomputes under the spike): both
// rows stay.
TEST(Search, DifferentResultsOfTwoPoliciesKeepTheirRows) {
  search::SearchOptions o = small_search();
  o.schedules = {"1f1b"};
  o.micro_batch_sizes = {1};
  o.tps = {1};
  o.policies = {"none"};
  o.top = 50;  // every layout
  // A layout with expert parallelism, where a spike raises the peak.
  search::Candidate n;
  for (const auto& c : search::search(o).top)
    if (c.parallel.ep > 1 && c.spike_peak_bytes > c.peak_bytes) {
      n = c;
      break;
    }
  ASSERT_GT(n.parallel.ep, 1);
  // A budget between none's calm and spike peaks.
  o.cluster.device_memory = (n.peak_bytes + n.spike_peak_bytes) / 2;
  o.policies = {"none", "adaptive"};
  const search::SearchResult r = search::search(o);
  const search::Candidate *none = nullptr, *adaptive = nullptr;
  for (const auto& c : r.top) {
    if (c.parallel.str() != n.parallel.str()) continue;
    EXPECT_EQ(c.equivalent_policies.size(), 1u) << c.policy_label();
    if (c.policy == "none") none = &c;
    if (c.policy == "adaptive") adaptive = &c;
  }
  ASSERT_NE(none, nullptr);
  ASSERT_NE(adaptive, nullptr);
  EXPECT_GT(none->oom_probability, 0);
  EXPECT_EQ(adaptive->oom_probability, 0);
  EXPECT_LE(adaptive->spike_peak_bytes, o.cluster.usable_memory());
  EXPECT_LT(adaptive->spike_peak_bytes, none->spike_peak_bytes);
}
