// Parity of data and expert parallelism with a single-process run of the same
// global batch. Run under `mpirun -np 2` and `-np 4`; every
// layout that fits the world size is tried. Each rank also computes the
// single-process reference itself (it is deterministic) and compares:
//   - the global loss within 1e-6 relative,
//   - every gradient tensor (the rank's expert shard against the same slice of
//     the reference) within 1e-6 in relative norm.
// Started alone, the test runs the world-size-1 layout only.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/layout.h"
#include "moeflex/comm/mpi_communicator.h"
#include "moeflex/core/rng.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/model.h"
#include "moeflex/provision/policies.h"
#include "moeflex/train/distributed.h"
#include "moeflex/train/optimizer.h"
#include "model_fixtures.h"

using namespace moeflex;

namespace {

comm::Communicator* g_world = nullptr;




// One step's gradients for `dp` x `ep` on this world, against the reference. With
// bf16 the tokens travel between EP ranks as bf16 rows; a GEMM's fp32 sums over
// other row groupings may round an output to the neighbouring bf16, hence the
// looser tolerance (fp32 gradients of the same maths, not the same bits).
void check_layout(int dp, int ep, bool bf16 = false, bool deepseek = false) {
  const int world = g_world->size();
  ASSERT_EQ(dp, world);
  ModelConfig cfg = test::small_moe_config(3, 1, 8, false);
  cfg.bf16 = bf16;
  if (deepseek) {  // DeepSeek-V3's router: sigmoid, groups, scaling, the expert bias
    cfg = test::with_deepseek_routing(cfg, 4, 2, 0.01);
    cfg.routed_scaling_factor = 2.5;
  }
  const double tol = bf16 ? 2e-2 : 1e-6;
  comm::LayoutSpec spec;
  spec.world_size = world;
  spec.dp = dp;
  spec.ep = ep;
  spec.num_layers = int(cfg.num_hidden_layers);
  spec.num_experts = int(cfg.num_experts);
  comm::ParallelLayout layout(spec);
  comm::ParallelGroups groups = comm::make_groups(*g_world, layout);
  const int dp_rank = groups.coords.dp_rank;
  const std::int64_t B = 2, S = 8, n = B * S, M = 2;

  Arena arena;
  ModelParallel par;
  par.ep_group = groups.expert_parallel.get();
  MoEModel model(cfg, arena, par);
  model.init_weights(17);
  double loss = 0;
  std::vector<std::int32_t> ids, tg;
  for (std::int64_t mb = 0; mb < M; ++mb) {
    ids.resize(std::size_t(n));
    tg.resize(std::size_t(n));
    test::skewed_batch(global_microbatch(dp_rank, M, mb), n, cfg.vocab_size, ids.data(), tg.data());
    loss += model.forward_backward(ids.data(), tg.data(), B, S, int(mb), 1.0 / double(M * dp)).total / double(M);
  }
  reduce_gradients(param_ptrs(model.params()), groups);
  groups.data_parallel->all_reduce_sum(&loss, 1);
  loss /= dp;

  // The reference: one process, all experts, dp * M micro-batches.
  Arena ref_arena;
  MoEModel ref(cfg, ref_arena);
  ref.init_weights(17);
  double ref_loss = 0;
  for (std::int64_t mb = 0; mb < M * dp; ++mb) {
    test::skewed_batch(mb, n, cfg.vocab_size, ids.data(), tg.data());
    ref_loss += ref.forward_backward(ids.data(), tg.data(), B, S, int(mb), 1.0 / double(M * dp)).total;
  }
  ref_loss /= double(M * dp);
  EXPECT_NEAR(loss, ref_loss, (bf16 ? 1e-3 : 1e-6) * std::abs(ref_loss)) << "dp " << dp << " ep " << ep;
  const std::int64_t El = cfg.num_experts / ep, e0 = groups.coords.ep_rank * El;
  for (auto& p : model.params()) {
    Param& r = ref.param(p.name);
    const std::int64_t offset = p.expert ? e0 * (p.g.numel() / El) : 0;
    ASSERT_EQ(p.g.numel() + (p.expert ? (cfg.num_experts - El) * (p.g.numel() / El) : 0), r.g.numel());
    const double err = test::rel_norm_err(p.g.f32(), r.g.f32() + offset, p.g.numel());
    EXPECT_LT(err, tol) << p.name << " (dp " << dp << ", ep " << ep << ", rank " << g_world->rank() << ")";
    if (p.expert) {  // the shard's weights are the reference's slice
      EXPECT_EQ(0, std::memcmp(p.w.f32(), r.w.f32() + offset, std::size_t(p.w.nbytes()))) << p.name;
    }
  }
  // Clipping sees the same global norm as the reference.
  const double norm = clip_global_grad_norm(param_ptrs(model.params()), groups, 0.0);
  const double ref_norm = std::sqrt(grad_square_sum(ref.params(), false) + grad_square_sum(ref.params(), true));
  EXPECT_NEAR(norm, ref_norm, tol * ref_norm);
  // The expert bias moves by the loads of all data-parallel ranks: as the reference's.
  model.update_expert_bias(groups.data_parallel.get());
  ref.update_expert_bias(nullptr);
  int biases = 0;
  for (auto& p : model.params())
    if (p.buffer) {
      EXPECT_EQ(0, std::memcmp(p.w.f32(), ref.param(p.name).w.f32(), std::size_t(p.w.nbytes()))) << p.name;
      ++biases;
    }
  EXPECT_EQ(biases, deepseek ? 2 : 0);
}

}  // namespace

TEST(Parallel, DataParallel) { check_layout(g_world->size(), 1); }

TEST(Parallel, ExpertParallelAll) {
  if (g_world->size() == 1) GTEST_SKIP() << "needs mpirun";
  check_layout(g_world->size(), g_world->size());
}

TEST(Parallel, ExpertParallelAllBf16) {
  if (g_world->size() == 1) GTEST_SKIP() << "needs mpirun";
  check_layout(g_world->size(), g_world->size(), /*bf16=*/true);
}

TEST(Parallel, DeepSeekRoutingUnderExpertParallelism) {
  if (g_world->size() == 1) GTEST_SKIP() << "needs mpirun";
  check_layout(g_world->size(), g_world->size(), false, /*deepseek=*/true);
}

TEST(Parallel, ExpertParallelTwoWithinData) {
  if (g_world->size() < 4) GTEST_SKIP() << "needs 4 ranks";
  check_layout(g_world->size(), 2);
}

// The memory program under expert parallelism (dispatch and combine buffers, rows
// received from other ranks): its replayed peak equals each rank's measured arena
// peak exactly, with skewed routing, for several policies.
TEST(Parallel, MemoryPlanUnderExpertParallelism) {
  const int world = g_world->size();
  ModelConfig cfg = test::small_moe_config(2, 0, 4, true);
  if (cfg.num_experts % world != 0) GTEST_SKIP() << "experts do not divide over " << world << " ranks";
  const std::int64_t B = 2, S = 8, n = B * S, M = 2;
  // The experts' FFN whole (a chunk holds every row), or in chunks of 5 received rows.
  for (const std::int64_t chunk : {std::int64_t(0), std::int64_t(5)})
  for (const char* policy : {"none", "full", "moe-light", "threshold=1.1", "none/split", "full/split", "full/bf16"}) {
    cfg.expert_chunk_rows = chunk;
    cfg.bf16 = std::string_view(policy).ends_with("/bf16");  // the bf16 engine's program, as exactly
    const bool split = std::string_view(policy).ends_with("/split");  // zero-bubble B then W
    const std::string name = std::string(policy).substr(0, std::string(policy).find('/'));
    Arena arena;
    ModelParallel par;
    par.ep_group = world > 1 ? g_world : nullptr;
    MoEModel model(cfg, arena, par);
    model.init_weights(5);
    model.set_router_skew(2.5);
    model.stash().set_policy(make_static_policy(name));
    arena.reset_peaks();
    MemoryWalk walk(cfg, B, S, arena.in_use());
    const StageSpec stage{0, int(cfg.num_hidden_layers), true, true, world};
    std::vector<std::vector<std::int32_t>> ids(static_cast<std::size_t>(M)), tg(static_cast<std::size_t>(M));
    for (int mb = 0; mb < M; ++mb) {
      ids[std::size_t(mb)].resize(std::size_t(n));
      tg[std::size_t(mb)].resize(std::size_t(n));
      test::skewed_batch(g_world->rank() * 10 + mb, n, cfg.vocab_size, ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data());
      const std::size_t before = model.routing().size();
      model.forward_train(ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data(), B, S, mb);
      std::vector<MoERows> rows(std::size_t(cfg.num_hidden_layers));
      for (std::size_t i = before; i < model.routing().size(); ++i) {
        const auto& r = model.routing()[i];
        std::int64_t kept = 0;
        for (auto c : r.tokens_per_expert) kept += c;
        rows[std::size_t(r.layer)] = {kept, r.received_rows};
      }
      walk.forward(mb, stage, rows, make_static_policy(name));
      EXPECT_EQ(walk.in_use(), arena.in_use()) << policy << " after forward " << mb << " on rank " << g_world->rank();
    }
    model.set_defer_weight_grads(split);
    for (int mb = 0; mb < M; ++mb) {
      model.backward(ids[std::size_t(mb)].data(), tg[std::size_t(mb)].data(), B, S, mb, 0.5);
      walk.backward(mb, stage, split);
    }
    model.set_defer_weight_grads(false);
    for (int mb = 0; split && mb < M; ++mb) {
      model.backward_weight(mb);
      walk.weight(mb, stage);
    }
    EXPECT_EQ(walk.peak(), arena.peak()) << policy << " chunk " << chunk << " on rank " << g_world->rank();
    EXPECT_EQ(walk.in_use(), arena.in_use()) << policy << " at the end on rank " << g_world->rank();
  }
}

// threshold=R compares a rank's received rows with a balanced routing's, n * k (each
// of the ep ranks sends it n * k / ep): no rank can receive more than ep times that,
// so threshold=ep never recomputes, however skewed the routing; and at threshold=0.5
// the busiest rank, at or above the mean, always does. (Against n * k / ep, calm
// micro-batches looked ep times spiky: threshold recomputed like moe-full.)
TEST(Parallel, ThresholdComparesReceivedRowsWithABalancedRoutingsUnderEp) {
  const int world = g_world->size();
  const ModelConfig cfg = test::small_moe_config(2, 0, 4, true);
  if (world < 2 || cfg.num_experts % world != 0) GTEST_SKIP() << "needs 2 or 4 EP ranks";
  const std::int64_t B = 2, S = 8, n = B * S;
  for (const double r : {double(world), 0.5}) {
    Arena arena;
    ModelParallel par;
    par.ep_group = g_world;
    MoEModel model(cfg, arena, par);
    model.init_weights(5);
    model.set_router_skew(2.5);
    model.stash().set_policy(make_static_policy(fmt::format("threshold={}", r)));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
    for (int mb = 0; mb < 2; ++mb) {
      test::skewed_batch(g_world->rank() * 10 + mb, n, cfg.vocab_size, ids.data(), tg.data());
      model.forward_train(ids.data(), tg.data(), B, S, mb);
    }
    double recomputed = double(model.stash().counters().recomputed);
    g_world->all_reduce_sum(&recomputed, 1);
    if (r >= world)
      EXPECT_EQ(recomputed, 0) << "threshold=" << r;
    else
      EXPECT_GT(recomputed, 0) << "threshold=" << r;
  }
}

int main(int argc, char** argv) { return test::run_mpi_tests(argc, argv, g_world); }
