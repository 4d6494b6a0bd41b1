// The weight-gradient queue (zero-bubble W, Qi et al. 2023): a backward that defers its
// weight gradients queues each GEMM with the tensors it reads; backward_weight runs
// them. While queued, those tensors may be moved or evicted to the host by the arena
// (they are read through their Tensor objects only), and come back before their GEMM.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "moeflex/core/op_context.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/model.h"

namespace moeflex {

bool MoEModel::evict_queued_read(Tensor* t) {
  auto it = wgrad_reads_.find(t);
  if (it == wgrad_reads_.end() || it->second.tensor.use_count() != it->second.holds || !t->defined()) return false;
  QueuedReads& r = it->second;
  const Bytes bytes = t->nbytes();
  CopyEngine* engine = &copy_engine_;
  r.host = std::shared_ptr<char>(static_cast<char*>(engine->host_alloc(bytes)),
                                 [engine, bytes](char* p) { engine->host_free(p, bytes); });
  copy_engine_.copy(r.host.get(), t->raw(), bytes, "evict W read", /*to_host=*/true).wait();
  r.shape = t->shape();
  r.dtype = t->dtype();
  r.category = t->category();
  t->reset();
  return true;
}

void MoEModel::bring_back(Tensor* t) {
  QueuedReads& r = wgrad_reads_.at(t);
  Tensor back(arena_, r.shape, r.category, "wgrad.bring_back", r.dtype);
  copy_engine_.copy(back.raw(), r.host.get(), back.nbytes(), "bring back W read").wait();
  *t = std::move(back);
  r.host.reset();
}

void MoEModel::count_reads(const std::vector<Shared>& reads, long sign) {
  for (const Shared& t : reads) {
    if (!t) continue;
    QueuedReads& r = wgrad_reads_[t.get()];
    if (sign > 0 && r.holds == 0) r.tensor = t;
    r.holds += sign;
    if (r.holds <= 0) wgrad_reads_.erase(t.get());
  }
}

void MoEModel::weight_grad(int mb, std::vector<Shared> reads, std::function<void()> fn) {
  if (!defer_wgrad_) {
    fn();
    return;
  }
  if (op_context().profiling)  // the W action runs it later: keep its layer for the op profiler
    fn = [fn = std::move(fn), layer = op_context().layer] {
      op_context().layer = layer;
      fn();
    };
  count_reads(reads, +1);
  wgrad_queue_[mb].push_back({std::move(reads), std::move(fn), op_context().layer});
}

bool MoEModel::plan_weight_reads(int mb) {
  if (!planner_ || !program_) return false;
  const BlockContext ctx = decision_context(mb, kHeadLayer, SavePoint::attention, MoERows{});
  return planner_->plan_weight_reads([&](bool offload) { return project_weight_reads(cfg_, ctx, offload); });
}

void MoEModel::offload_queued_reads(int mb) {
  auto it = wgrad_queue_.find(mb);
  if (it == wgrad_queue_.end()) return;
  for (const PendingWeightGrad& w : it->second)
    for (const Shared& t : w.reads) {
      if (!t || !t->defined() || t->arena() != &arena_) continue;
      const Bytes bytes = t->nbytes();
      if (!evict_queued_read(t.get()))  // the memory program offloads every group the B is past
        throw Error(fmt::format("model: a {} B tensor read by micro-batch {}'s queued weight gradients (layer {}) "
                                "is held elsewhere and cannot be offloaded",
                                bytes, mb, w.layer));
      wgrad_bytes_offloaded_ += bytes;
    }
}

void MoEModel::backward_weight(int mb) {
  if (program_) {
    program_->pending_weight_bytes.erase({mb, par_.first_layer});
    program_->offloaded_weight_reads.erase({mb, par_.first_layer});
  }
  auto it = wgrad_queue_.find(mb);
  if (it == wgrad_queue_.end()) return;
  // One layer group at a time (the memory program's W): what the group reads comes
  // back from the host first, then its GEMMs run and free what no later one reads.
  auto& queue = it->second;
  for (std::size_t g = 0; g < queue.size();) {
    std::size_t end = g;
    while (end < queue.size() && queue[end].layer == queue[g].layer) ++end;
    for (std::size_t i = g; i < end; ++i)
      for (const Shared& t : queue[i].reads)
        if (t && !t->defined()) bring_back(t.get());
    for (; g < end; ++g) {
      PendingWeightGrad& w = queue[g];
      if (!w.fn) continue;  // (ran before an error cut this W short)
      // Running: its tensors are pinned from here (one more reference than the
      // queue counts) until it has run; evicted ones come back first.
      const std::vector<Shared> running = w.reads;
      for (const Shared& t : running)
        if (!t->defined()) bring_back(t.get());
      w.fn();
      count_reads(w.reads, -1);
      w = {};
    }
  }
  wgrad_queue_.erase(it);
}

Bytes MoEModel::device_bytes(const Tensor& t) const {
  if (t.defined()) return t.arena() == &arena_ ? t.nbytes() : 0;
  auto it = wgrad_reads_.find(&t);  // evicted to the host: back on the device before its W
  if (it == wgrad_reads_.end() || !it->second.host) return 0;
  std::int64_t numel = 1;
  for (const std::int64_t x : it->second.shape) numel *= x;
  return Bytes(numel) * dtype_size(it->second.dtype);
}

std::vector<Bytes> MoEModel::weight_grad_groups(int mb) const {
  auto it = wgrad_queue_.find(mb);
  if (it == wgrad_queue_.end()) return {};
  std::unordered_set<const Tensor*> seen;
  std::vector<Bytes> groups;
  for (std::size_t i = 0; i < it->second.size(); ++i) {
    const PendingWeightGrad& w = it->second[i];
    if (i == 0 || w.layer != it->second[i - 1].layer) groups.push_back(0);
    for (const Shared& t : w.reads)
      if (t && seen.insert(t.get()).second)
        if (const Bytes b = device_bytes(*t); b > 0) groups.back() += Arena::round_up(b);
  }
  return groups;
}

Bytes MoEModel::weight_grad_bytes(int mb) const {
  Bytes held = 0;
  for (const Bytes b : weight_grad_groups(mb)) held += b;
  return held;
}

std::size_t MoEModel::pending_weight_grads(int mb) const {
  auto it = wgrad_queue_.find(mb);
  return it == wgrad_queue_.end() ? 0 : it->second.size();
}

void MoEModel::linear_bw(int mb, const Shared& dy, const Shared& x, Param* w, View dx, std::int64_t n, std::int64_t in,
                         std::int64_t out, bool accumulate_dx) {
  if (dx) be_.linear_backward(dy->view(), x->view(), w->working(), dx, nullptr, n, in, out, accumulate_dx);
  weight_grad(mb, {dy, x}, [this, dy = dy.get(), x = x.get(), w, n, in, out] {
    be_.linear_backward(dy->view(), x->view(), w->working(), nullptr, w->g.f32(), n, in, out, false);
  });
}

MoEModel::Shared MoEModel::copy_of(const Tensor& t, const char* name) {
  Tensor c(arena_, t.shape(), MemCategory::workspace, name, t.dtype());
  be_.copy(c.raw(), t.raw(), t.nbytes());
  return share(std::move(c));
}

}  // namespace moeflex
