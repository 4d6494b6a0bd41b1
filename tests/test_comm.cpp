// comm/ in one process: the single-process communicator's semantics, the layout's
// validation messages, rank coordinates and groups against hand-computed
// Megatron-Core orderings ("tp-cp-ep-dp-pp"), and the layer splits.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "moeflex/comm/layout.h"
#include "moeflex/comm/single_process.h"

using namespace moeflex;
using namespace moeflex::comm;

namespace {

// Runs `f`, expecting a ConfigError whose message contains `needle`.
template <class F>
void expect_config_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no ConfigError; expected one containing: " << needle;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

LayoutSpec spec(int world, int pp, int dp, int ep, int vpp = 1, int layers = 8, int experts = 8) {
  LayoutSpec s;
  s.world_size = world;
  s.pp = pp;
  s.dp = dp;
  s.ep = ep;
  s.vpp = vpp;
  s.num_layers = layers;
  s.num_experts = experts;
  return s;
}

}  // namespace

// ---------------------------------------------------------------- single process

TEST(SingleProcessComm, CollectivesAreIdentitiesOrCopies) {
  SingleProcessCommunicator c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.backend(), "single");
  EXPECT_EQ(c.name(), "world");

  float f[3] = {1.5f, -2.0f, 3.25f};
  c.all_reduce_sum(f, 3);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[2], 3.25f);
  double d[2] = {0.1, 7.0};
  c.all_reduce_sum(d, 2);
  c.all_reduce_max(d, 2);
  EXPECT_EQ(d[0], 0.1);
  std::int64_t k[1] = {42};
  c.all_reduce_sum(k, 1);
  EXPECT_EQ(k[0], 42);

  float rs_out[3] = {};
  c.reduce_scatter_sum(f, rs_out, 3);
  EXPECT_EQ(rs_out[1], -2.0f);

  float gathered[3] = {};
  c.all_gather(f, gathered, 3);
  EXPECT_EQ(gathered[2], 3.25f);

  std::int64_t counts_in[2] = {5, 6}, counts_out[2] = {};
  c.all_to_all(counts_in, counts_out, 2);
  EXPECT_EQ(counts_out[0], 5);
  EXPECT_EQ(counts_out[1], 6);
  std::int32_t i32_in[1] = {-9}, i32_out[1] = {};
  c.all_to_all(i32_in, i32_out, 1);
  EXPECT_EQ(i32_out[0], -9);

  double b = 3.0;
  c.broadcast(&b, sizeof b, 0);
  EXPECT_EQ(b, 3.0);
  EXPECT_THROW(c.broadcast(&b, sizeof b, 1), CommError);
  c.barrier();
  EXPECT_THROW(c.all_reduce_sum(f, -1), CommError);
}

TEST(SingleProcessComm, AllToAllVHonoursDisplacementsAndChecksCounts) {
  SingleProcessCommunicator c;
  const std::int64_t send[6] = {10, 11, 12, 13, 14, 15};
  std::int64_t recv[6] = {-1, -1, -1, -1, -1, -1};
  const std::int64_t sc[1] = {3}, sd[1] = {2}, rc[1] = {3}, rd[1] = {1};
  c.all_to_all_v(send, sc, sd, recv, rc, rd, sizeof(std::int64_t));
  EXPECT_EQ(recv[0], -1);
  EXPECT_EQ(recv[1], 12);
  EXPECT_EQ(recv[3], 14);
  EXPECT_EQ(recv[4], -1);
  const std::int64_t zero[1] = {0};
  c.all_to_all_v(send, zero, zero, recv, zero, zero, 8);  // zero counts are fine
  const std::int64_t rc_bad[1] = {2};
  EXPECT_THROW(c.all_to_all_v(send, sc, sd, recv, rc_bad, rd, 8), CommError);
}

TEST(SingleProcessComm, SendToSelfIsQueuedPerTagInOrder) {
  SingleProcessCommunicator c;
  int a = 1, b = 2, z = 3;
  c.send(&a, sizeof a, 0, 7);
  c.send(&z, sizeof z, 0, 9);
  a = 100;  // buffered: the message keeps the value at send time
  c.send(&b, sizeof b, 0, 7);
  int got = 0;
  c.recv(&got, sizeof got, 0, 9);
  EXPECT_EQ(got, 3);
  c.recv(&got, sizeof got, 0, 7);
  EXPECT_EQ(got, 1);
  c.recv(&got, sizeof got, 0, 7);
  EXPECT_EQ(got, 2);

  // Nothing left: in one process the message could never arrive.
  try {
    c.recv(&got, sizeof got, 0, 7);
    FAIL();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("tag 7"), std::string::npos) << e.what();
  }
  // Size mismatch.
  c.send(&a, sizeof a, 0, 1);
  double wide = 0;
  EXPECT_THROW(c.recv(&wide, sizeof wide, 0, 1), CommError);
  // Peers and tags are checked.
  EXPECT_THROW(c.send(&a, sizeof a, 1, 0), CommError);
  EXPECT_THROW(c.send(&a, sizeof a, 0, -1), CommError);
}

TEST(SingleProcessComm, PostedIrecvMatchesTheNextSend) {
  SingleProcessCommunicator c;
  int first = 0, second = 0;
  Request r1 = c.irecv(&first, sizeof first, 0, 4);
  Request r2 = c.irecv(&second, sizeof second, 0, 4);
  EXPECT_FALSE(r1.test());
  int v = 11;
  c.send(&v, sizeof v, 0, 4);
  v = 22;
  c.send(&v, sizeof v, 0, 4);
  EXPECT_TRUE(r1.test());
  EXPECT_TRUE(r1.done());
  r2.wait();
  EXPECT_EQ(first, 11);  // posted first, matched first
  EXPECT_EQ(second, 22);

  int never = 0;
  Request r3 = c.irecv(&never, sizeof never, 0, 5);
  EXPECT_THROW(r3.wait(), CommError);
  EXPECT_TRUE(r3.done());  // a failed wait finishes the request
}

TEST(SingleProcessComm, SplitGivesSizeOneOrNothing) {
  SingleProcessCommunicator c;
  c.set_timeout(5);
  auto sub = c.split(3, 0, "dp");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->name(), "dp");
  EXPECT_EQ(sub->timeout(), 5);
  EXPECT_EQ(c.split(-1, 0, "none"), nullptr);
}

TEST(CommTimeout, ReadsTheEnvironment) {
  unsetenv("MOEFLEX_COMM_TIMEOUT");
  EXPECT_EQ(comm_timeout_from_env(), 600.0);
  setenv("MOEFLEX_COMM_TIMEOUT", "2.5", 1);
  EXPECT_EQ(comm_timeout_from_env(), 2.5);
  setenv("MOEFLEX_COMM_TIMEOUT", "soon", 1);
  expect_config_error([] { comm_timeout_from_env(); }, "MOEFLEX_COMM_TIMEOUT='soon'");
  unsetenv("MOEFLEX_COMM_TIMEOUT");
}

// ---------------------------------------------------------------- layer splits

TEST(LayerSplit, PaddedLayersRoundsUpToPpTimesVpp) {
  EXPECT_EQ(padded_layers(61, 8, 2), 64);
  EXPECT_EQ(padded_layers(64, 8, 2), 64);
  EXPECT_EQ(padded_layers(65, 8, 2), 80);
  EXPECT_EQ(padded_layers(3, 2, 2), 4);
  EXPECT_EQ(padded_layers(1, 1, 1), 1);
  expect_config_error([] { padded_layers(0, 2, 1); }, "num_layers 0 must be >= 1");
}

TEST(LayerSplit, EvenUnevenAndPadded) {
  EXPECT_EQ(stage_layers(8, 2, 2), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(stage_layers(61, 8, 2, {}, true), std::vector<int>(16, 4));
  EXPECT_EQ(stage_layers(7, 2, 1, {3, 4}), (std::vector<int>{3, 4}));
  expect_config_error([] { stage_layers(61, 8, 2); },
                      "num_layers 61 is not divisible by pp 8 x vpp 2 = 16 virtual stages");
  expect_config_error([] { stage_layers(61, 8, 2); }, "padding to 64 layers");
  expect_config_error([] { stage_layers(3, 2, 2); }, "num_layers 3 does not fit pp 2 x vpp 2 = 4 virtual stages");
  expect_config_error([] { stage_layers(7, 2, 1, {3, 3}); }, "adds up to 6 layers, not num_layers 7");
  expect_config_error([] { stage_layers(7, 2, 1, {7}); }, "has 1 entries but pp 2 x vpp 1 = 2");
  expect_config_error([] { stage_layers(7, 2, 1, {7, 0}); }, "virtual stage 1 0 layers");
}

TEST(LayerSplit, LayoutKnowsPaddingLayersAndStageStarts) {
  LayoutSpec s = spec(2, 2, 1, 1, 2, 3, 0);
  expect_config_error([&] { ParallelLayout l(s); }, "num_layers 3 does not fit pp 2 x vpp 2");
  s.pad_layers = true;
  ParallelLayout l(s);
  EXPECT_EQ(l.num_layers(), 3);
  EXPECT_EQ(l.total_layers(), 4);
  EXPECT_EQ(l.stage_layers(), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_FALSE(l.is_padding_layer(2));
  EXPECT_TRUE(l.is_padding_layer(3));
  EXPECT_EQ(l.stage_first_layer(3), 3);

  LayoutSpec u = spec(2, 2, 1, 1, 1, 7, 0);
  u.stage_layers = {2, 5};
  ParallelLayout lu(u);
  EXPECT_EQ(lu.stage_first_layer(1), 2);
  EXPECT_EQ(lu.total_layers(), 7);
}

// ---------------------------------------------------------------- validation

TEST(ParallelLayout, RefusesMisSizedLayoutsNamingTheNumbers) {
  expect_config_error([] { ParallelLayout l(spec(6, 2, 4, 1)); }, "world size 6 is not tp 1 x pp 2 x dp 4 = 8");
  expect_config_error([] { ParallelLayout l(spec(4, 1, 4, 3, 1, 8, 6)); }, "ep 3 does not divide dp 4");
  expect_config_error([] { ParallelLayout l(spec(4, 1, 4, 4, 1, 8, 6)); }, "num_experts 6 is not divisible by ep 4");
  expect_config_error([] { ParallelLayout l(spec(2, 1, 2, 2, 1, 8, 0)); }, "ep 2 needs an MoE model");
  expect_config_error([] { ParallelLayout l(spec(4, 4, 1, 1, 1, 6)); },
                      "num_layers 6 is not divisible by pp 4 x vpp 1 = 4");
  expect_config_error([] { ParallelLayout l(spec(4, 2, 2, 0)); }, "ep 0 must be >= 1");
  LayoutSpec tp = spec(4, 1, 2, 1);
  tp.tp = 2;
  expect_config_error([&] { ParallelLayout l(tp); }, "tp 2 is not supported yet");
  LayoutSpec both = spec(2, 2, 1, 1, 1, 3);
  both.pad_layers = true;
  both.stage_layers = {1, 2};
  expect_config_error([&] { ParallelLayout l(both); }, "not both");
}

// ---------------------------------------------------------------- rank order

// Hand-computed with Megatron-Core's order tp-cp-ep-dp-pp (tp = cp = 1):
// rank = dp_rank + dp * pp_rank, dp_rank = ep_rank + ep * expert_dp_rank.
TEST(ParallelLayout, World8Pp2Dp4Ep2) {
  ParallelLayout l(spec(8, 2, 4, 2));
  EXPECT_EQ(l.expert_dp(), 2);
  EXPECT_EQ(l.experts_per_rank(), 4);
  const RankCoords c5 = l.coords(5);
  EXPECT_EQ(c5.pp_rank, 1);
  EXPECT_EQ(c5.dp_rank, 1);
  EXPECT_EQ(c5.ep_rank, 1);
  EXPECT_EQ(c5.expert_dp_rank, 0);
  const RankCoords c2 = l.coords(2);
  EXPECT_EQ(c2, (RankCoords{0, 0, 2, 0, 1}));
  EXPECT_EQ(l.rank_of(1, 3), 7);

  const std::vector<std::vector<int>> pp = {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}};
  const std::vector<std::vector<int>> dp = {{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3},
                                            {4, 5, 6, 7}, {4, 5, 6, 7}, {4, 5, 6, 7}, {4, 5, 6, 7}};
  const std::vector<std::vector<int>> ep = {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}};
  const std::vector<std::vector<int>> edp = {{0, 2}, {1, 3}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {4, 6}, {5, 7}};
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(l.pipeline_group(r), pp[std::size_t(r)]) << "rank " << r;
    EXPECT_EQ(l.data_parallel_group(r), dp[std::size_t(r)]) << "rank " << r;
    EXPECT_EQ(l.expert_parallel_group(r), ep[std::size_t(r)]) << "rank " << r;
    EXPECT_EQ(l.expert_data_parallel_group(r), edp[std::size_t(r)]) << "rank " << r;
  }
}

TEST(ParallelLayout, World4Pp2Dp2Ep2) {
  ParallelLayout l(spec(4, 2, 2, 2));
  EXPECT_EQ(l.coords(3), (RankCoords{0, 1, 1, 1, 0}));
  EXPECT_EQ(l.pipeline_group(1), (std::vector<int>{1, 3}));
  EXPECT_EQ(l.data_parallel_group(2), (std::vector<int>{2, 3}));
  EXPECT_EQ(l.expert_parallel_group(2), (std::vector<int>{2, 3}));
  EXPECT_EQ(l.expert_data_parallel_group(2), (std::vector<int>{2}));
}

TEST(ParallelLayout, World4Dp4Ep2AndPp4) {
  ParallelLayout l(spec(4, 1, 4, 2));
  EXPECT_EQ(l.coords(3), (RankCoords{0, 0, 3, 1, 1}));
  EXPECT_EQ(l.pipeline_group(3), (std::vector<int>{3}));
  EXPECT_EQ(l.expert_parallel_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(l.expert_data_parallel_group(3), (std::vector<int>{1, 3}));
  EXPECT_EQ(l.expert_data_parallel_group(0), (std::vector<int>{0, 2}));

  ParallelLayout p(spec(4, 4, 1, 1));
  EXPECT_EQ(p.coords(2), (RankCoords{0, 2, 0, 0, 0}));
  EXPECT_EQ(p.pipeline_group(2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p.data_parallel_group(2), (std::vector<int>{2}));
}

TEST(ParallelLayout, World16Pp2Dp8Ep4) {
  ParallelLayout l(spec(16, 2, 8, 4, 1, 8, 16));
  EXPECT_EQ(l.coords(13), (RankCoords{0, 1, 5, 1, 1}));
  EXPECT_EQ(l.pipeline_group(13), (std::vector<int>{5, 13}));
  EXPECT_EQ(l.data_parallel_group(13), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(l.expert_parallel_group(13), (std::vector<int>{12, 13, 14, 15}));
  EXPECT_EQ(l.expert_data_parallel_group(13), (std::vector<int>{9, 13}));
}

// Every group kind partitions the world, and the members of a group agree on
// every coordinate except the one the group spans, which runs 0, 1, ... in order.
TEST(ParallelLayout, GroupsPartitionTheWorldForManyLayouts) {
  for (int pp : {1, 2, 3, 4})
    for (int dp : {1, 2, 4, 6, 8})
      for (int ep : {1, 2, 3, 4}) {
        if (dp % ep != 0) continue;
        ParallelLayout l(spec(pp * dp, pp, dp, ep, 1, 12, 12));
        std::map<std::vector<int>, int> seen[4];
        for (int r = 0; r < l.world_size(); ++r) {
          const RankCoords c = l.coords(r);
          EXPECT_EQ(l.rank_of(c.pp_rank, c.dp_rank), r);
          const std::vector<int> groups[4] = {l.pipeline_group(r), l.data_parallel_group(r),
                                              l.expert_parallel_group(r), l.expert_data_parallel_group(r)};
          const int sizes[4] = {pp, dp, ep, dp / ep};
          for (int k = 0; k < 4; ++k) {
            ASSERT_EQ(int(groups[k].size()), sizes[k]);
            ++seen[k][groups[k]];
            for (int i = 0; i < sizes[k]; ++i) {
              const RankCoords m = l.coords(groups[k][std::size_t(i)]);
              const int spanned[4] = {m.pp_rank, m.dp_rank, m.ep_rank, m.expert_dp_rank};
              EXPECT_EQ(spanned[k], i);
              if (k != 0) { EXPECT_EQ(m.pp_rank, c.pp_rank); }
              if (k == 0) { EXPECT_EQ(m.dp_rank, c.dp_rank); }
              if (k == 2) { EXPECT_EQ(m.expert_dp_rank, c.expert_dp_rank); }
              if (k == 3) { EXPECT_EQ(m.ep_rank, c.ep_rank); }
            }
          }
        }
        const int sizes[4] = {pp, dp, ep, dp / ep};
        for (int k = 0; k < 4; ++k) {
          EXPECT_EQ(int(seen[k].size()) * sizes[k], l.world_size()) << "group kind " << k;
          for (const auto& [members, count] : seen[k]) EXPECT_EQ(count, sizes[k]);
        }
      }
}

TEST(ParallelLayout, MakeGroupsOnOneProcess) {
  SingleProcessCommunicator world;
  ParallelLayout l(spec(1, 1, 1, 1, 1, 4, 4));
  ParallelGroups g = make_groups(world, l);
  EXPECT_EQ(g.pipeline->size(), 1);
  EXPECT_EQ(g.data_parallel->name(), "dp");
  EXPECT_EQ(g.expert_parallel->name(), "ep");
  EXPECT_EQ(g.expert_data_parallel->name(), "expert_dp");
  expect_config_error([&] { make_groups(world, ParallelLayout(spec(2, 2, 1, 1))); }, "the job has 1 ranks");
}

TEST(ParallelLayout, DescribeNamesEverySize) {
  LayoutSpec s = spec(16, 8, 2, 2, 2, 61, 8);
  s.pad_layers = true;
  ParallelLayout l(s);
  EXPECT_EQ(l.describe(),
            "tp 1 x pp 8 x dp 2 (ep 2 x expert_dp 1) = 16 ranks, vpp 2; 61 layers (padded to 64) in 16 stages "
            "[4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]");
}
