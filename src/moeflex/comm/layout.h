// The parallel layout: which rank holds which pipeline stage, data-parallel replica
// and expert shard, the process groups that follow, and the split of layers into
// (virtual) pipeline stages.
//
// Rank order is Megatron-Core's default "tp-cp-ep-dp-pp" (parallel_state.py,
// RankGenerator with generate_masked_orthogonal_rank_groups): tp varies fastest,
// pp slowest. cp is 1 here. Dense layers see world = tp x dp x pp; expert layers
// see the same ranks as tp x ep x expert_dp x pp (Megatron's expert
// RankGenerator, dp there being expert_data_parallel_size = world / (tp ep pp)),
// i.e. expert parallelism is carved out of data parallelism, dp = ep x expert_dp:
//
//   rank = tp_rank + tp * (dp_rank + dp * pp_rank),   tp_rank = 0 while tp = 1
//   dp_rank = ep_rank + ep * expert_dp_rank
//
// Example, world 8 = pp 2 x dp 4, ep 2: ranks 0..3 hold stage 0, ranks 4..7 stage 1;
// data-parallel groups {0,1,2,3} {4,5,6,7}; pipeline groups {0,4} {1,5} {2,6} {3,7};
// expert-parallel groups (consecutive ep ranks) {0,1} {2,3} {4,5} {6,7};
// expert-data-parallel groups (same pp, same ep_rank) {0,2} {1,3} {4,6} {5,7}.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moeflex/comm/communicator.h"

namespace moeflex::comm {

/// What a layout is built from; validated by ParallelLayout's constructor.
struct LayoutSpec {
  int world_size = 1;             ///< ranks in the job
  int tp = 1;                     ///< tensor parallelism: reserved, must be 1
  int pp = 1;                     ///< pipeline-parallel size (ranks per pipeline)
  int dp = 1;                     ///< data-parallel size (model replicas of the dense layers)
  int ep = 1;                     ///< expert-parallel size, carved out of dp (dp = ep x expert_dp)
  int vpp = 1;                    ///< virtual stages (model chunks) per pipeline rank
  int num_layers = 1;             ///< transformer layers of the model
  int num_experts = 0;            ///< routed experts per MoE layer; 0 for a dense model
  bool pad_layers = false;        ///< pad with empty layers up to a multiple of pp x vpp
  std::vector<int> stage_layers;  ///< optional uneven split: pp x vpp sizes, in virtual-stage order
};

/// A rank's coordinates. In virtual-stage terms (interleaved schedules), rank with
/// pp_rank p holds virtual stages p, p + pp, ..., p + (vpp - 1) pp (Megatron's
/// interleaving); schedules with another placement (DualPipeV) map stages
/// themselves.
struct RankCoords {
  int tp_rank = 0;
  int pp_rank = 0;
  int dp_rank = 0;         ///< in [0, dp)
  int ep_rank = 0;         ///< dp_rank % ep: which expert shard
  int expert_dp_rank = 0;  ///< dp_rank / ep: which replica of that shard
  bool operator==(const RankCoords&) const = default;
};

/// The smallest multiple of pp x vpp that is >= num_layers (61 -> 64 for pp 8 x
/// vpp 2). Throws ConfigError for non-positive arguments.
int padded_layers(int num_layers, int pp, int vpp);

/// Layers of each of the pp x vpp virtual stages, in virtual-stage order:
/// - `uneven` given: it must have pp x vpp entries, each >= 1, summing to
///   num_layers; it is returned as is;
/// - else, `pad`: padded_layers() layers split evenly (the padding layers, which
///   are empty, come last);
/// - else num_layers must be a multiple of pp x vpp, split evenly.
/// Errors (ConfigError) name the numbers and the way out.
std::vector<int> stage_layers(int num_layers, int pp, int vpp, const std::vector<int>& uneven = {},
                              bool pad = false);

/// A validated layout. Construction throws ConfigError naming the numbers when
/// world != tp x pp x dp, ep does not divide dp, num_experts is not divisible by
/// ep, tp != 1, or the layers do not fit pp x vpp stages.
class ParallelLayout {
 public:
  explicit ParallelLayout(const LayoutSpec& spec);

  int world_size() const { return spec_.world_size; }
  int tp() const { return spec_.tp; }
  int pp() const { return spec_.pp; }
  int dp() const { return spec_.dp; }
  int ep() const { return spec_.ep; }
  int expert_dp() const { return spec_.dp / spec_.ep; }
  int vpp() const { return spec_.vpp; }
  int num_stages() const { return spec_.pp * spec_.vpp; }
  const LayoutSpec& spec() const { return spec_; }

  /// Real layers of the model.
  int num_layers() const { return spec_.num_layers; }
  /// Layers including empty padding layers (== num_layers() without padding).
  int total_layers() const { return total_layers_; }
  /// True for the empty padding layers, the indices >= num_layers().
  bool is_padding_layer(int layer) const { return layer >= spec_.num_layers; }
  /// Layers of each virtual stage (pp x vpp entries, padding included).
  const std::vector<int>& stage_layers() const { return stage_layers_; }
  /// Index of the first layer of virtual stage `stage`.
  int stage_first_layer(int stage) const;
  /// Experts held by each rank of an expert-parallel group (num_experts / ep).
  int experts_per_rank() const { return spec_.num_experts / spec_.ep; }

  /// Coordinates of world rank `rank`.
  RankCoords coords(int rank) const;
  /// World rank with these coordinates (tp_rank 0).
  int rank_of(int pp_rank, int dp_rank) const;

  /// World ranks of `rank`'s groups, position i holding the group's rank i:
  /// - pipeline: same dp coordinates, pp_rank 0..pp-1;
  std::vector<int> pipeline_group(int rank) const;
  /// - data parallel: same pp_rank, dp_rank 0..dp-1 (dense-gradient all-reduce);
  std::vector<int> data_parallel_group(int rank) const;
  /// - expert parallel: same pp_rank and expert_dp_rank, ep_rank 0..ep-1 (ep
  ///   consecutive ranks; the all-to-all of dispatch and combine);
  std::vector<int> expert_parallel_group(int rank) const;
  /// - expert data parallel: same pp_rank and ep_rank, expert_dp_rank
  ///   0..expert_dp-1 (expert-gradient all-reduce).
  std::vector<int> expert_data_parallel_group(int rank) const;

  /// "pp 2 x dp 2 (ep 2 x expert_dp 1), vpp 1, tp 1 = 4 ranks; 8 layers in 2 stages [4, 4]".
  std::string describe() const;

 private:
  void check_rank(int rank) const;

  LayoutSpec spec_;
  int total_layers_ = 0;
  std::vector<int> stage_layers_;
};

/// This rank's communicators for a layout (every one a split of `world`, in the
/// group orders above), and its coordinates.
struct ParallelGroups {
  RankCoords coords;
  std::unique_ptr<Communicator> pipeline;
  std::unique_ptr<Communicator> data_parallel;
  std::unique_ptr<Communicator> expert_parallel;
  std::unique_ptr<Communicator> expert_data_parallel;
};

/// Collective over `world`: splits it into the layout's groups (names "pp", "dp",
/// "ep", "expert_dp"). Throws ConfigError if world.size() != layout.world_size(),
/// CommError if a group's membership differs from the layout (a bug).
ParallelGroups make_groups(Communicator& world, const ParallelLayout& layout);

}  // namespace moeflex::comm
