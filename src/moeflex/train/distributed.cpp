#include "moeflex/train/distributed.h"

#include <cmath>

#include "moeflex/train/optimizer.h"

namespace moeflex {

void reduce_gradients(std::vector<Param>& params, comm::ParallelGroups& groups) {
  for (auto& p : params) {
    comm::Communicator* g = p.expert ? groups.expert_data_parallel.get() : groups.data_parallel.get();
    if (g && g->size() > 1) g->all_reduce_sum(p.g.f32(), p.g.numel());
  }
}

double clip_global_grad_norm(std::vector<Param>& params, comm::ParallelGroups& groups, double max_norm) {
  double sq[2] = {grad_square_sum(params, /*expert=*/false), grad_square_sum(params, /*expert=*/true)};
  // Expert shards differ across the EP group; dense parts are identical there.
  if (groups.expert_parallel && groups.expert_parallel->size() > 1) groups.expert_parallel->all_reduce_sum(&sq[1], 1);
  double total = sq[0] + sq[1];
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce_sum(&total, 1);
  const double norm = std::sqrt(total);
  if (max_norm > 0 && norm > max_norm) scale_grads(params, float(max_norm / (norm + 1e-6)));
  return norm;
}

}  // namespace moeflex
