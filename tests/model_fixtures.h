// Shared fixtures of the model-level tests: a small MoE config with every feature
// switched on, reproducible token batches, relative errors in norm, and the main()
// of the tests that run under mpirun.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/mpi_communicator.h"
#include "moeflex/core/rng.h"
#include "moeflex/model/config.h"

namespace moeflex::test {

/// vocab 64, hidden 32, 4 heads, `experts` experts top-2 of width 16, one shared
/// expert, aux and z losses; `layers` layers of which the first `dense` are dense.
inline ModelConfig small_moe_config(std::int64_t layers, std::int64_t dense, std::int64_t experts, bool tied) {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.num_hidden_layers = layers;
  c.first_k_dense_replace = dense;
  c.intermediate_size = 48;
  c.num_attention_heads = 4;
  c.max_position_embeddings = 16;
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.n_shared_experts = 1;
  c.router_aux_loss_coef = 0.01;
  c.router_z_loss_coef = 0.001;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.1;
  return c;
}

/// `c` with DeepSeek-V3's router: sigmoid scores, noaux_tc's expert bias moved by
/// `bias_rate` a step, top-k from `topk_group` of `n_group` groups.
inline ModelConfig with_deepseek_routing(ModelConfig c, std::int64_t n_group, std::int64_t topk_group,
                                         double bias_rate) {
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.router_bias_update_rate = bias_rate;
  return c;
}

/// small_moe_config(layers, 1, 4, tied) with MLA attention (DeepSeek-V2/V3):
/// kv_lora_rank 8, q_lora_rank as given (0: none), q/k heads of 8 + 4 (rope), v heads of 8.
inline ModelConfig small_mla_moe_config(std::int64_t layers, std::int64_t q_lora_rank) {
  ModelConfig c = small_moe_config(layers, 1, 4, true);
  c.kv_lora_rank = 8;
  c.q_lora_rank = q_lora_rank;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 8;
  return c;
}

/// Token ids of a micro-batch, skewed towards low ids (uneven routing on purpose),
/// and uniform targets; a pure function of (global micro-batch, position).
inline void skewed_batch(std::int64_t global_mb, std::int64_t n, std::int64_t V, std::int32_t* ids,
                         std::int32_t* tg) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double u = uniform01(99, std::uint64_t(global_mb), std::uint64_t(i));
    ids[i] = std::int32_t(u * u * double(V));
    tg[i] = std::int32_t(uniform01(98, std::uint64_t(global_mb), std::uint64_t(i)) * double(V));
  }
}

/// ||a - b|| / ||b|| (in double).
template <typename A, typename B>
double rel_norm_err(const A* a, const B* b, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

/// main() of a test run under mpirun (or alone, on one rank): only rank 0 prints,
/// every rank's exit code reflects its own failures.
inline int run_mpi_tests(int argc, char** argv, comm::Communicator*& world_out) {
  comm::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  auto world = comm::make_world_communicator();
  world_out = world.get();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  world.reset();
  return rc;
}

}  // namespace moeflex::test
