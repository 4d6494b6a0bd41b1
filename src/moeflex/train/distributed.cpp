#include "moeflex/train/distributed.h"

#include <cmath>
#include <cstring>

#include "moeflex/train/optimizer.h"

namespace moeflex {

std::vector<Param*> param_ptrs(std::vector<Param>& params) {
  std::vector<Param*> out;
  for (auto& p : params) out.push_back(&p);
  return out;
}

void reduce_gradients(const std::vector<Param*>& params, comm::ParallelGroups& groups) {
  for (Param* p : params) {
    comm::Communicator* g = p->expert ? groups.expert_data_parallel.get() : groups.data_parallel.get();
    if (g && g->size() > 1) g->all_reduce_sum(p->g.f32(), p->g.numel());
  }
}

void sync_tied_embedding(const std::vector<Param*>& params, comm::ParallelGroups& groups, std::int64_t numel,
                         Arena& arena) {
  std::vector<Param*> copies;
  for (Param* p : params)
    if (p->name == "model.embed_tokens.weight") copies.push_back(p);
  Tensor sum(arena, {numel}, MemCategory::workspace, "tied_embedding.grad_sum");
  sum.zero();
  float* s = sum.f32();
  for (Param* p : copies) {
    const float* g = p->g.f32();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < numel; ++i) s[i] += g[i];
  }
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce_sum(s, numel);
  for (Param* p : copies) std::memcpy(p->g.f32(), s, sizeof(float) * std::size_t(numel));
}

double clip_global_grad_norm(const std::vector<Param*>& params, comm::ParallelGroups& groups, double max_norm) {
  double sq[2] = {0, 0};
  for (Param* p : params)
    if (!p->tied_copy) sq[p->expert ? 1 : 0] += grad_square_sum(*p);
  // Expert shards differ across the EP group; dense parts are identical there.
  if (groups.expert_parallel && groups.expert_parallel->size() > 1) groups.expert_parallel->all_reduce_sum(&sq[1], 1);
  double total = sq[0] + sq[1];
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce_sum(&total, 1);
  const double norm = std::sqrt(total);
  if (max_norm > 0 && norm > max_norm) {
    const float scale = float(max_norm / (norm + 1e-6));
    for (Param* p : params) scale_grads(*p, scale);
  }
  return norm;
}

}  // namespace moeflex
