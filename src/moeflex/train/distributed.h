// Data, expert and pipeline parallelism around the model: which micro-batches a
// rank runs, how gradients are reduced across replicas, and the global norm.
//
// Gradient scaling: each rank runs M micro-batches with grad_scale 1/(M*dp), so a
// SUM over replicas gives the gradient of the global mean loss. Dense (non-expert)
// parameters are replicated over the data-parallel group; routed-expert shards are
// replicated over the expert-data-parallel group (Megatron-Core's layout; the
// tokens of the other EP ranks already reached them through the all-to-all).
#pragma once
#include <cstdint>
#include <vector>

#include "moeflex/comm/layout.h"
#include "moeflex/model/model.h"

namespace moeflex {

/// Global micro-batch index of a rank's local micro-batch `mb` (data order of a
/// single-process run with dp * M micro-batches).
inline std::int64_t global_microbatch(int dp_rank, std::int64_t M, std::int64_t mb) { return dp_rank * M + mb; }

/// Pointers to every parameter of `params`.
std::vector<Param*> param_ptrs(std::vector<Param>& params);

/// Sums gradients over the replicas that hold the same parameters. groups may have
/// null members (single process): then nothing is communicated.
void reduce_gradients(const std::vector<Param*>& params, comm::ParallelGroups& groups);

/// Tied embeddings over pipeline stages: the first stage's embedding and the last
/// stage's copy get the sum of both gradients (every pipeline rank takes part;
/// those without a copy add zeros). numel: vocab_size * hidden_size.
void sync_tied_embedding(const std::vector<Param*>& params, comm::ParallelGroups& groups, std::int64_t numel,
                         Arena& arena);

/// Global L2 norm of the model's gradient across the layout (after reduce_gradients):
/// dense parts counted once, expert shards summed over the EP group, stages over PP,
/// tied copies left out. Sums are in double, in a fixed order. Clips to max_norm when
/// > 0; returns the norm before clipping.
double clip_global_grad_norm(const std::vector<Param*>& params, comm::ParallelGroups& groups, double max_norm);

}  // namespace moeflex
