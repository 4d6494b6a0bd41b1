#include "moeflex/train/replica.h"

#include <fmt/format.h>

#include "moeflex/schedule/generators.h"
#include "moeflex/schedule/validate.h"
#include "moeflex/train/distributed.h"

namespace moeflex {

Replica::Replica(const ModelConfig& cfg, const std::string& schedule, const comm::ParallelLayout& layout,
                 comm::ParallelGroups& groups, Arena& arena, std::int64_t M, std::int64_t B, std::int64_t S)
    : cfg_(cfg), layout_(layout), groups_(groups), arena_(arena), M_(M) {
  const int p = layout.pp();
  if (schedule == "dualpipev") {
    if (layout.vpp() != 2)
      throw ConfigError(fmt::format("schedule dualpipev puts two stages on each of the {} pipeline ranks: set "
                                    "--vpp 2 (got vpp {})", p, layout.vpp()));
    plan_ = make_schedule(schedule, p, int(M));
  } else {
    plan_ = make_schedule(schedule, p, int(M), layout.vpp());
  }
  validate(plan_);
  if (plan_.num_stages != layout.num_stages())
    throw ConfigError(fmt::format("schedule {} has {} stages but the layout has pp {} x vpp {} = {}", schedule,
                                  plan_.num_stages, p, layout.vpp(), layout.num_stages()));
  const int pp_rank = groups.coords.pp_rank;
  std::map<int, MoEModel*> stage_models;
  for (int s : plan_.stages_of(pp_rank)) {
    ModelParallel par;
    par.ep_group = groups.expert_parallel.get();
    par.first_layer = layout.stage_first_layer(s);
    par.last_layer = par.first_layer + layout.stage_layers()[std::size_t(s)];
    par.last_layer = std::min(par.last_layer, layout.num_layers());  // padding layers are empty
    par.first_layer = std::min(par.first_layer, par.last_layer);
    par.embedding = s == 0;
    par.head = s == plan_.num_stages - 1;
    chunks_.push_back(std::make_unique<MoEModel>(cfg, arena, par));
    stage_models[s] = chunks_.back().get();
  }
  executor_ = std::make_unique<PipelineExecutor>(plan_, pp_rank, stage_models, groups.pipeline.get(), arena, B, S,
                                                 cfg.hidden_size);
}

void Replica::set_trace(train::TraceWriter* trace) {
  trace_ = trace;
  executor_->set_trace(trace);
  for (auto& c : chunks_) {
    if (!trace) {
      c->copy_engine().set_observer({});
      continue;
    }
    c->copy_engine().set_observer([trace](const CopyEngine::CopyRecord& r) {
      try {  // on the copy thread: a tracing problem must not end the process
        const double start = trace->to_us(r.start);
        trace->complete("copy", r.label.empty() ? std::string_view("copy") : std::string_view(r.label), start,
                        trace->to_us(r.end) - start, {{"bytes", r.bytes}});
      } catch (const std::exception&) {
      }
    });
  }
}

void Replica::init_weights(std::uint64_t seed) {
  for (auto& c : chunks_) c->init_weights(seed);
}

void Replica::zero_grads() {
  for (auto& c : chunks_) c->zero_grads();
}

std::vector<Param*> Replica::params() {
  std::vector<Param*> out;
  for (auto& c : chunks_)
    for (auto& p : c->params()) out.push_back(&p);
  return out;
}

std::vector<MoEModel*> Replica::chunks() {
  std::vector<MoEModel*> out;
  for (auto& c : chunks_) out.push_back(c.get());
  return out;
}

LossParts Replica::global_loss(LossParts local, double divide_by) {
  double parts[3] = {local.ce / divide_by, local.aux / divide_by, local.z / divide_by};
  if (groups_.pipeline && groups_.pipeline->size() > 1) groups_.pipeline->all_reduce_sum(parts, 3);
  const int dp = layout_.dp();
  if (dp > 1) {
    groups_.data_parallel->all_reduce_sum(parts, 3);
    for (double& v : parts) v /= dp;
  }
  return LossParts{parts[0] + parts[1] + parts[2], parts[0], parts[1], parts[2]};
}

LossParts Replica::forward_backward(const BatchFn& batch) {
  const LossParts local = executor_->run_step(batch, 1.0 / double(M_ * layout_.dp()));
  const double t0 = trace_ ? trace_->now_us() : 0.0;
  reduce_gradients(params(), groups_);
  if (cfg_.tie_word_embeddings && plan_.num_stages > 1)
    sync_tied_embedding(params(), groups_, cfg_.vocab_size * cfg_.hidden_size, arena_);
  const LossParts loss = global_loss(local, double(M_));
  if (trace_) trace_->complete("comm", "dp all-reduce", t0, trace_->now_us() - t0);
  return loss;
}

double Replica::clip_grad_norm(double max_norm) { return clip_global_grad_norm(params(), groups_, max_norm); }

void Replica::update_expert_bias() {
  for (auto& c : chunks_) c->update_expert_bias(groups_.data_parallel.get());
}

LossParts Replica::evaluate(const std::int32_t* ids, const std::int32_t* targets) {
  // Every data-parallel replica evaluates the same batch: no division by dp.
  const LossParts local = executor_->forward_eval(ids, targets);
  double parts[3] = {local.ce, local.aux, local.z};
  if (groups_.pipeline && groups_.pipeline->size() > 1) groups_.pipeline->all_reduce_sum(parts, 3);
  return LossParts{parts[0] + parts[1] + parts[2], parts[0], parts[1], parts[2]};
}

}  // namespace moeflex
