// Parity of pipeline parallelism (every schedule) and of its combinations with
// data and expert parallelism, against a single-process run of the same global
// batch. Run under `mpirun -np 2` and `-np 4`: each case whose
// world size matches runs. Every rank computes the single-process reference
// itself and compares the global loss and each gradient tensor it holds:
//   - pipeline-only layouts: the cross-entropy loss is bit-identical;
//   - all layouts: total loss within 1e-6 relative, gradients within 1e-6 in
//     relative norm (expert shards against the reference's slice).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/layout.h"
#include "moeflex/comm/mpi_communicator.h"
#include "moeflex/core/rng.h"
#include "moeflex/train/distributed.h"
#include "moeflex/train/replica.h"
#include "model_fixtures.h"

using namespace moeflex;

namespace {

comm::Communicator* g_world = nullptr;




struct Case {
  int world, pp, dp, ep, vpp;
  const char* schedule;
  bool tied;
  int M;  // micro-batches per rank
  int layers = 4;
  bool pad = false;
  std::vector<int> split = {};
  bool bf16 = false;  // the bf16 engine: stage boundaries carry bf16 activations and gradients
};

void run_case(const Case& c) {
  ModelConfig cfg = test::small_moe_config(4, 1, 4, c.tied);
  cfg.num_hidden_layers = c.layers;
  cfg.bf16 = c.bf16;
  // Pipeline stages alone compute the reference's ops on the same inputs; data and
  // expert parallelism regroup rows and sums, which in bf16 may round an output to
  // the neighbouring bf16 value.
  const double tol = c.bf16 && (c.dp > 1 || c.ep > 1) ? 2e-2 : 1e-6;
  comm::LayoutSpec spec;
  spec.world_size = c.world;
  spec.pp = c.pp;
  spec.dp = c.dp;
  spec.ep = c.ep;
  spec.vpp = c.vpp;
  spec.num_layers = int(cfg.num_hidden_layers);
  spec.num_experts = int(cfg.num_experts);
  spec.pad_layers = c.pad;
  spec.stage_layers = c.split;
  comm::ParallelLayout layout(spec);
  comm::ParallelGroups groups = comm::make_groups(*g_world, layout);
  const std::int64_t B = 2, S = 8, n = B * S;
  Arena arena;
  Replica replica(cfg, c.schedule, layout, groups, arena, c.M, B, S);
  replica.init_weights(21);
  const int dp_rank = groups.coords.dp_rank;
  const LossParts loss = replica.forward_backward([&](int mb, std::int32_t* ids, std::int32_t* tg) {
    test::skewed_batch(global_microbatch(dp_rank, c.M, mb), n, cfg.vocab_size, ids, tg);
  });
  const double norm = replica.clip_grad_norm(0.0);

  Arena ref_arena;
  MoEModel ref(cfg, ref_arena);
  ref.init_weights(21);
  double ref_ce = 0, ref_total = 0;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
  const std::int64_t Mg = c.M * c.dp;
  for (std::int64_t mb = 0; mb < Mg; ++mb) {
    test::skewed_batch(mb, n, cfg.vocab_size, ids.data(), tg.data());
    const LossParts lp = ref.forward_backward(ids.data(), tg.data(), B, S, int(mb), 1.0 / double(Mg));
    ref_ce += lp.ce;
    ref_total += lp.total;
  }
  ref_ce /= double(Mg);
  ref_total /= double(Mg);
  const std::string where = fmt::format("{} pp{} dp{} ep{} vpp{}{}{} rank {}", c.schedule, c.pp, c.dp, c.ep, c.vpp,
                                        c.tied ? " tied" : "", c.bf16 ? " bf16" : "", g_world->rank());
  if (c.dp == 1) {
    EXPECT_EQ(loss.ce, ref_ce) << where << ": pipeline-only loss must be bit-identical";
  }
  EXPECT_NEAR(loss.total, ref_total, (tol > 1e-6 ? 1e-3 : 1e-6) * std::abs(ref_total)) << where;
  const std::int64_t El = cfg.num_experts / c.ep, e0 = groups.coords.ep_rank * El;
  int compared = 0;
  for (Param* p : replica.params()) {
    Param& r = ref.param(p->name);
    const std::int64_t offset = p->expert ? e0 * (p->g.numel() / El) : 0;
    EXPECT_LT(test::rel_norm_err(p->g.f32(), r.g.f32() + offset, p->g.numel()), tol) << p->name << " " << where;
    ++compared;
  }
  EXPECT_GT(compared, 0) << where;
  double ref_sq = 0;
  for (auto& p : ref.params())
    for (std::int64_t i = 0; i < p.g.numel(); ++i) ref_sq += double(p.g.f32()[i]) * p.g.f32()[i];
  EXPECT_NEAR(norm, std::sqrt(ref_sq), tol * std::sqrt(ref_sq)) << where;
}

const Case kCases[] = {
    // world 2
    {2, 2, 1, 1, 1, "gpipe", false, 3},
    {2, 2, 1, 1, 1, "1f1b", false, 3},
    {2, 2, 1, 1, 1, "1f1b", true, 4},
    {2, 2, 1, 1, 1, "zb-h1", false, 3},
    {2, 2, 1, 1, 2, "interleaved", false, 4},
    {2, 2, 1, 1, 2, "dualpipev", false, 4},
    {2, 2, 1, 1, 2, "dualpipev", true, 5},
    {2, 2, 1, 1, 1, "1f1b", false, 3, 3, true},            // 3 layers padded to 4
    {2, 2, 1, 1, 1, "1f1b", true, 3, 5, false, {1, 4}},    // uneven split
    {2, 2, 1, 1, 2, "interleaved", false, 2, 7, true},     // 7 layers padded to 8
    {2, 2, 1, 1, 1, "1f1b", true, 3, 4, false, {}, true},  // bf16
    {2, 2, 1, 1, 2, "1f1b-overlap", false, 4},             // Megatron-Core's combined 1F1B: F&B pairs
    {2, 2, 1, 1, 1, "1f1b-overlap", true, 4},
    {2, 1, 2, 2, 1, "1f1b-overlap", false, 3},  // no pipeline: F0, (F1 B0), (F2 B1), B2 under EP
    // world 4
    {4, 4, 1, 1, 1, "1f1b", false, 4},
    {4, 4, 1, 1, 1, "zb-h1", true, 5},
    {4, 2, 2, 1, 1, "1f1b", false, 2},
    {4, 2, 2, 2, 1, "1f1b", false, 2},
    {4, 2, 2, 2, 1, "zb-h1", true, 3},
    {4, 2, 2, 2, 2, "dualpipev", false, 4},
    {4, 2, 2, 2, 1, "zb-h1", false, 3, 4, false, {}, true},  // bf16
    {4, 2, 2, 1, 2, "interleaved", true, 2},
    {4, 2, 2, 2, 2, "1f1b-overlap", true, 4},
};

}  // namespace

TEST(PipelineParity, AllSchedulesAndLayouts) {
  int ran = 0;
  for (const Case& c : kCases) {
    if (c.world != g_world->size()) continue;
    run_case(c);
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no case for world size " << g_world->size() << "; run under mpirun -np 2 or 4";
}

int main(int argc, char** argv) { return test::run_mpi_tests(argc, argv, g_world); }
