#include "moeflex/train/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include "moeflex/core/op_context.h"
#include "moeflex/core/phase_clock.h"

namespace moeflex {

PipelineExecutor::PipelineExecutor(const StepPlan& plan, int pp_rank, std::map<int, MoEModel*> stages,
                                   comm::Communicator* pp_group, Arena& arena, std::int64_t B, std::int64_t S,
                                   std::int64_t d)
    : plan_(plan), rank_(pp_rank), stages_(std::move(stages)), pp_(pp_group), arena_(arena), B_(B), S_(S), d_(d) {
  for (int s : plan_.stages_of(rank_))
    if (!stages_.count(s)) throw Error(fmt::format("pipeline rank {} holds stage {} but has no model for it", rank_, s));
  for (int s : plan_.stages_of(rank_)) {
    MoEModel* m = stages_.at(s);
    program_.stages.push_back(m->stage_spec());
    program_.stashes.push_back(&m->stash());
  }
  program_.actions = walk_actions(plan_, rank_, &walk_at_);
  for (auto& [s, m] : stages_) m->set_step_program(&program_);
}

void PipelineExecutor::prepare_placement(std::size_t ai, ActionKind kind) {
  // An action that allocates should find the bytes it adds in one free block: when
  // the largest one is smaller than what this action added at most so far (or on
  // its first run), compact, with the hand-offs going to the top end. A backward
  // lets the offloads in flight land first anyway (the memory program assumes so):
  // here, so that their blocks do not pin what lies above them.
  if (action_need_.size() != plan_.actions[std::size_t(rank_)].size())
    action_need_.assign(plan_.actions[std::size_t(rank_)].size(), -1);
  if (kind == ActionKind::SendActivation || kind == ActionKind::SendGrad) return;
  const Bytes need = action_need_[ai];
  if (need >= 0 && arena_.largest_free_block() >= need) return;
  arena_.defragment(/*settle=*/is_compute(kind) && kind != ActionKind::Forward);
}

Tensor PipelineExecutor::buffer(const char* name) {
  // Of the stages' activation dtype (every chunk of a run has the same).
  return Tensor(arena_, {B_ * S_, d_}, MemCategory::activations, name, stages_.begin()->second->activation_dtype());
}

LossParts PipelineExecutor::run_step(const BatchFn& batch, double grad_scale) {
  const int last = plan_.num_stages - 1;
  const Bytes bytes = B_ * S_ * d_ * dtype_size(stages_.begin()->second->activation_dtype());
  std::map<Key, Tensor> act_in, act_out, grad_out, grad_in;
  std::map<int, std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> batches;
  auto data = [&](int mb) -> std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>& {
    auto it = batches.find(mb);
    if (it == batches.end()) {
      auto& b = batches[mb];
      b.first.resize(std::size_t(B_ * S_));
      b.second.resize(std::size_t(B_ * S_));
      batch(mb, b.first.data(), b.second.data());
      return b;
    }
    return it->second;
  };
  auto take = [&](std::map<Key, Tensor>& m, Key k, const char* what) {
    auto it = m.find(k);
    if (it == m.end())
      throw Error(fmt::format("pipeline rank {}: {} of micro-batch {} stage {} is missing (schedule bug)", rank_, what,
                              k.first, k.second));
    Tensor t = std::move(it->second);
    m.erase(it);
    return t;
  };
  // Between actions the tensors handed from one action to another are read only
  // through these maps: movable (not evictable), and placed at the top end, where
  // the action that takes one pins it without splitting the free bytes below.
  struct HeldTensors {
    Arena& arena;
    int id;
    ~HeldTensors() { arena.remove_relocatable(id); }
  } held{arena_, arena_.add_relocatable([&](std::vector<Arena::RelocatableTensor>& out) {
           for (auto* m : {&act_in, &act_out, &grad_out, &grad_in})
             for (auto& [k, t] : *m)
               if (t.raw()) out.emplace_back(&t, /*can_evict=*/false, /*at_top=*/true);
         })};
  LossParts loss;
  compute_seconds_ = 0;
  using Clock = std::chrono::steady_clock;
  for (std::size_t ai = 0; ai < plan_.actions[std::size_t(rank_)].size(); ++ai) {
    const Action& a = plan_.actions[std::size_t(rank_)][ai];
    const int mb = a.microbatch, s = a.stage;
    program_.current = walk_at_[ai];
    for (ActivationStash* st : program_.stashes) st->poll();  // offloads of any chunk that landed
    const auto t0 = Clock::now();
    struct ComputeTimer {  // adds the action's time when it is a compute action; traces it
      const Action& a;
      Clock::time_point t0;
      double& acc;
      train::TraceWriter* trace;
      double trace_t0;
      Arena& arena;
      ~ComputeTimer() {
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (is_compute(a.kind)) acc += dt;
        if (trace) {
          trace->complete(is_compute(a.kind) ? "compute" : "comm", to_string(a), trace_t0, dt * 1e6,
                          {{"microbatch", a.microbatch}, {"stage", a.stage}});
          nlohmann::json mem = {{"in_use", arena.in_use()}};
          if (!arena.unlimited()) mem["budget"] = arena.budget();
          trace->counter("device memory", trace->now_us(), mem);
        }
      }
    } timer{a, t0, compute_seconds_, trace_, trace_ ? trace_->now_us() : 0.0, arena_};
    // Labels the ops of this action for the op profiler (core/op_context.h).
    OpContext& ctx = op_context();
    ctx.action = int(ai);
    ctx.microbatch = mb;
    ctx.stage = s;
    ctx.layer = OpContext::kNoLayer;
    ctx.phase = a.kind == ActionKind::Forward          ? OpPhase::forward
                : a.kind == ActionKind::BackwardWeight ? OpPhase::backward_weight
                : is_compute(a.kind)                   ? OpPhase::backward_input
                                                       : OpPhase::other;
    // The step's phase for slow-rank detection (communication calls nest in it).
    const PhaseScope step_phase(a.kind == ActionKind::Forward ? StepPhase::forward
                                : is_compute(a.kind)          ? StepPhase::backward
                                                              : StepPhase::other);
    prepare_placement(ai, a.kind);
    std::optional<Arena::FromTop> from_top;
    if (a.kind != ActionKind::Forward) from_top.emplace(arena_);
    struct NeedRecorder {  // the most bytes the action added, for prepare_placement
      Arena& arena;
      Bytes start;
      Bytes& need;
      ~NeedRecorder() { need = std::max(need, arena.window_peak() - start); }
    } need{arena_, arena_.in_use(), action_need_[ai]};
    arena_.reset_window();
    switch (a.kind) {
      case ActionKind::RecvActivation: {
        Tensor t = buffer("pipeline.recv_activation");
        pp_->recv(t.raw(), bytes, a.peer_rank, message_tag(plan_, a));
        act_in[{mb, consumer_stage(a)}] = std::move(t);
        break;
      }
      case ActionKind::Forward: {
        auto& [ids, tg] = data(mb);
        Tensor x_in;
        if (s > 0) x_in = act_in.count({mb, s}) ? take(act_in, {mb, s}, "input activation")
                                                : take(act_out, {mb, s - 1}, "local input activation");
        LossParts lp;
        Tensor out = stages_.at(s)->forward_stage(ids.data(), tg.data(), s > 0 ? x_in.view() : CView(), B_, S_, mb, &lp);
        loss.ce += lp.ce;
        loss.aux += lp.aux;
        loss.z += lp.z;
        if (s != last) act_out[{mb, s}] = std::move(out);
        break;
      }
      case ActionKind::SendActivation: {
        Tensor t = take(act_out, {mb, s}, "output activation");
        pp_->send(t.raw(), bytes, a.peer_rank, message_tag(plan_, a));
        break;
      }
      case ActionKind::RecvGrad: {
        Tensor t = buffer("pipeline.recv_grad");
        pp_->recv(t.raw(), bytes, a.peer_rank, message_tag(plan_, a));
        grad_out[{mb, consumer_stage(a)}] = std::move(t);
        break;
      }
      case ActionKind::Backward:
      case ActionKind::BackwardInput: {
        auto& [ids, tg] = data(mb);
        Tensor dy;
        if (s != last) dy = grad_out.count({mb, s}) ? take(grad_out, {mb, s}, "output gradient")
                                                    : take(grad_in, {mb, s + 1}, "local output gradient");
        Tensor dx;
        if (s > 0) dx = buffer("pipeline.input_grad");
        MoEModel& m = *stages_.at(s);
        m.set_defer_weight_grads(a.kind == ActionKind::BackwardInput);
        m.backward_stage(ids.data(), tg.data(), s != last ? dy.view() : CView(), s > 0 ? dx.view() : View(), B_, S_, mb,
                         grad_scale);
        m.set_defer_weight_grads(false);
        if (s > 0) grad_in[{mb, s}] = std::move(dx);
        break;
      }
      case ActionKind::BackwardWeight:
        stages_.at(s)->backward_weight(mb);
        break;
      case ActionKind::SendGrad: {
        Tensor t = take(grad_in, {mb, s}, "input gradient");
        pp_->send(t.raw(), bytes, a.peer_rank, message_tag(plan_, a));
        break;
      }
    }
  }
  op_context() = OpContext{.profiling = op_context().profiling};
  if (!act_in.empty() || !act_out.empty() || !grad_out.empty() || !grad_in.empty())
    throw Error(fmt::format("pipeline rank {}: the step ended with undelivered tensors (schedule bug)", rank_));
  pp_->flush_sends();
  loss.total = loss.ce + loss.aux + loss.z;
  return loss;
}

LossParts PipelineExecutor::forward_eval(const std::int32_t* ids, const std::int32_t* targets) {
  const int last = plan_.num_stages - 1;
  const Bytes bytes = B_ * S_ * d_ * dtype_size(stages_.begin()->second->activation_dtype());
  LossParts loss;
  Tensor carry;  // output of the previous stage when it is local
  for (int s = 0; s <= last; ++s) {
    if (plan_.rank_of(s) != rank_) continue;
    Tensor x_in;
    if (s > 0) {
      if (plan_.rank_of(s - 1) == rank_) {
        x_in = std::move(carry);
      } else {
        x_in = buffer("pipeline.eval_recv");
        pp_->recv(x_in.raw(), bytes, plan_.rank_of(s - 1), 1 << 20);
      }
    }
    LossParts lp;
    Tensor out = stages_.at(s)->forward_stage(ids, targets, s > 0 ? x_in.view() : CView(), B_, S_, 0, &lp, false);
    loss.ce += lp.ce;
    loss.aux += lp.aux;
    loss.z += lp.z;
    if (s < last) {
      if (plan_.rank_of(s + 1) == rank_) carry = std::move(out);
      else pp_->send(out.raw(), bytes, plan_.rank_of(s + 1), 1 << 20);
    }
  }
  pp_->flush_sends();
  loss.total = loss.ce + loss.aux + loss.z;
  return loss;
}

void PipelineExecutor::clear_routing() {
  for (auto& [s, m] : stages_) m->clear_routing();
}

std::vector<RoutingStats> PipelineExecutor::routing() const {
  std::vector<RoutingStats> out;
  for (auto& [s, m] : stages_)
    for (auto& r : m->routing()) out.push_back(r);
  return out;
}

}  // namespace moeflex
