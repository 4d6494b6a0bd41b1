#include "moeflex/comm/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <numeric>

namespace moeflex::comm {

namespace {
void check_positive(int v, const char* what) {
  check_config(v >= 1, fmt::format("{} {} must be >= 1", what, v));
}
}  // namespace

int padded_layers(int num_layers, int pp, int vpp) {
  check_positive(num_layers, "num_layers");
  check_positive(pp, "pp");
  check_positive(vpp, "vpp");
  const int stages = pp * vpp;
  return (num_layers + stages - 1) / stages * stages;
}

std::vector<int> stage_layers(int num_layers, int pp, int vpp, const std::vector<int>& uneven, bool pad) {
  check_positive(num_layers, "num_layers");
  check_positive(pp, "pp");
  check_positive(vpp, "vpp");
  const int stages = pp * vpp;
  if (!uneven.empty()) {
    check_config(int(uneven.size()) == stages,
                 fmt::format("the uneven stage split has {} entries but pp {} x vpp {} = {} virtual stages need "
                             "one each",
                             uneven.size(), pp, vpp, stages));
    for (std::size_t s = 0; s < uneven.size(); ++s)
      check_config(uneven[s] >= 1, fmt::format("the uneven stage split gives virtual stage {} {} layers; every "
                                               "stage needs at least 1",
                                               s, uneven[s]));
    const int sum = std::accumulate(uneven.begin(), uneven.end(), 0);
    check_config(sum == num_layers, fmt::format("the uneven stage split {} adds up to {} layers, not num_layers {}",
                                                fmt::join(uneven, ", "), sum, num_layers));
    return uneven;
  }
  const int total = pad ? padded_layers(num_layers, pp, vpp) : num_layers;
  check_config(total >= stages,
               fmt::format("num_layers {} does not fit pp {} x vpp {} = {} virtual stages: each stage needs at "
                           "least one layer (or enable empty-layer padding to {} layers)",
                           num_layers, pp, vpp, stages, padded_layers(num_layers, pp, vpp)));
  check_config(total % stages == 0,
               fmt::format("num_layers {} is not divisible by pp {} x vpp {} = {} virtual stages: give an uneven "
                           "split ({} stage sizes adding up to {}) or enable empty-layer padding to {} layers",
                           num_layers, pp, vpp, stages, stages, num_layers, padded_layers(num_layers, pp, vpp)));
  return std::vector<int>(static_cast<std::size_t>(stages), total / stages);
}

ParallelLayout::ParallelLayout(const LayoutSpec& spec) : spec_(spec) {
  const LayoutSpec& s = spec_;
  check_positive(s.world_size, "world size");
  check_positive(s.tp, "tp");
  check_positive(s.pp, "pp");
  check_positive(s.dp, "dp");
  check_positive(s.ep, "ep");
  check_positive(s.vpp, "vpp");
  check_config(s.num_experts >= 0, fmt::format("num_experts {} must be >= 0", s.num_experts));
  check_config(s.tp == 1, fmt::format("tp {} is not supported yet: tensor parallelism is reserved, use tp 1", s.tp));
  check_config(s.world_size == s.tp * s.pp * s.dp,
               fmt::format("world size {} is not tp {} x pp {} x dp {} = {}", s.world_size, s.tp, s.pp, s.dp,
                           s.tp * s.pp * s.dp));
  check_config(s.dp % s.ep == 0,
               fmt::format("ep {} does not divide dp {}: expert parallelism is carved out of data parallelism "
                           "(dp = ep x expert_dp)",
                           s.ep, s.dp));
  if (s.ep > 1)
    check_config(s.num_experts > 0, fmt::format("ep {} needs an MoE model, but num_experts is 0", s.ep));
  check_config(s.num_experts % s.ep == 0,
               fmt::format("num_experts {} is not divisible by ep {}", s.num_experts, s.ep));
  check_config(s.stage_layers.empty() || !s.pad_layers,
               "give either an uneven stage split or empty-layer padding, not both");
  stage_layers_ = comm::stage_layers(s.num_layers, s.pp, s.vpp, s.stage_layers, s.pad_layers);
  total_layers_ = std::accumulate(stage_layers_.begin(), stage_layers_.end(), 0);
}

int ParallelLayout::stage_first_layer(int stage) const {
  check_config(stage >= 0 && stage < num_stages(),
               fmt::format("virtual stage {} is not in [0, {})", stage, num_stages()));
  return std::accumulate(stage_layers_.begin(), stage_layers_.begin() + stage, 0);
}

void ParallelLayout::check_rank(int rank) const {
  check_config(rank >= 0 && rank < spec_.world_size,
               fmt::format("rank {} is not in [0, {}) for layout {}", rank, spec_.world_size, describe()));
}

RankCoords ParallelLayout::coords(int rank) const {
  check_rank(rank);
  RankCoords c;
  c.tp_rank = rank % spec_.tp;
  const int rest = rank / spec_.tp;
  c.dp_rank = rest % spec_.dp;
  c.pp_rank = rest / spec_.dp;
  c.ep_rank = c.dp_rank % spec_.ep;
  c.expert_dp_rank = c.dp_rank / spec_.ep;
  return c;
}

int ParallelLayout::rank_of(int pp_rank, int dp_rank) const {
  check_config(pp_rank >= 0 && pp_rank < spec_.pp && dp_rank >= 0 && dp_rank < spec_.dp,
               fmt::format("coordinates pp_rank {} dp_rank {} are outside pp {} x dp {}", pp_rank, dp_rank,
                           spec_.pp, spec_.dp));
  return spec_.tp * (dp_rank + spec_.dp * pp_rank);
}

std::vector<int> ParallelLayout::pipeline_group(int rank) const {
  const RankCoords c = coords(rank);
  std::vector<int> g;
  for (int p = 0; p < spec_.pp; ++p) g.push_back(c.tp_rank + rank_of(p, c.dp_rank));
  return g;
}

std::vector<int> ParallelLayout::data_parallel_group(int rank) const {
  const RankCoords c = coords(rank);
  std::vector<int> g;
  for (int d = 0; d < spec_.dp; ++d) g.push_back(c.tp_rank + rank_of(c.pp_rank, d));
  return g;
}

std::vector<int> ParallelLayout::expert_parallel_group(int rank) const {
  const RankCoords c = coords(rank);
  std::vector<int> g;
  for (int e = 0; e < spec_.ep; ++e) g.push_back(c.tp_rank + rank_of(c.pp_rank, e + spec_.ep * c.expert_dp_rank));
  return g;
}

std::vector<int> ParallelLayout::expert_data_parallel_group(int rank) const {
  const RankCoords c = coords(rank);
  std::vector<int> g;
  for (int x = 0; x < expert_dp(); ++x) g.push_back(c.tp_rank + rank_of(c.pp_rank, c.ep_rank + spec_.ep * x));
  return g;
}

std::string ParallelLayout::describe() const {
  return fmt::format("tp {} x pp {} x dp {} (ep {} x expert_dp {}) = {} ranks, vpp {}; {} layers{} in {} stages [{}]",
                     spec_.tp, spec_.pp, spec_.dp, spec_.ep, expert_dp(), spec_.world_size, spec_.vpp,
                     spec_.num_layers,
                     total_layers_ != spec_.num_layers ? fmt::format(" (padded to {})", total_layers_) : "",
                     num_stages(), fmt::join(stage_layers_, ", "));
}

namespace {
std::unique_ptr<Communicator> split_checked(Communicator& world, int color, int key, const std::string& name,
                                            const std::vector<int>& expected) {
  std::unique_ptr<Communicator> g = world.split(color, key, name);
  bool ok = g != nullptr && g->size() == int(expected.size());
  for (int r = 0; ok && r < g->size(); ++r) ok = g->world_rank_of(r) == world.world_rank_of(expected[std::size_t(r)]);
  if (!ok)
    throw CommError(fmt::format("group '{}' of rank {} does not have the layout's members [{}]", name, world.rank(),
                                fmt::join(expected, ", ")));
  return g;
}
}  // namespace

ParallelGroups make_groups(Communicator& world, const ParallelLayout& layout) {
  check_config(world.size() == layout.world_size(),
               fmt::format("the job has {} ranks but the layout {} needs {}", world.size(), layout.describe(),
                           layout.world_size()));
  const int me = world.rank();
  ParallelGroups g;
  const RankCoords c = layout.coords(me);
  g.coords = c;
  // Colors number the groups, keys order the ranks inside them; every rank makes
  // the four splits in the same order.
  g.pipeline = split_checked(world, c.tp_rank + layout.tp() * c.dp_rank, c.pp_rank, "pp", layout.pipeline_group(me));
  g.data_parallel =
      split_checked(world, c.tp_rank + layout.tp() * c.pp_rank, c.dp_rank, "dp", layout.data_parallel_group(me));
  g.expert_parallel =
      split_checked(world, c.tp_rank + layout.tp() * (c.expert_dp_rank + layout.expert_dp() * c.pp_rank), c.ep_rank,
                    "ep", layout.expert_parallel_group(me));
  g.expert_data_parallel =
      split_checked(world, c.tp_rank + layout.tp() * (c.ep_rank + layout.ep() * c.pp_rank), c.expert_dp_rank,
                    "expert_dp", layout.expert_data_parallel_group(me));
  return g;
}

}  // namespace moeflex::comm
