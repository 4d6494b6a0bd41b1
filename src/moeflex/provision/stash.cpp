#include "moeflex/provision/stash.h"

#include <fmt/format.h>

#include "moeflex/core/op_context.h"

#include <cstdlib>

namespace moeflex {

const char* to_string(Provision p) {
  switch (p) {
    case Provision::save: return "save";
    case Provision::recompute: return "recompute";
    case Provision::offload: return "offload";
  }
  return "?";
}

void ActivationStash::account(const TensorPtr& t, int sign) {
  if (!t) return;
  bytes_ += sign * t->nbytes();
  peak_ = std::max(peak_, bytes_);
}

ActivationStash::~ActivationStash() {
  for (auto& [k, item] : items_) settle(item);
  if (arena_) arena_->remove_relocatable(relocatable_id_);
}

void ActivationStash::set_device(Arena* arena, CopyEngine* engine) {
  if (arena_) arena_->remove_relocatable(relocatable_id_);
  arena_ = arena;
  engine_ = engine;
  if (!arena_) return;
  // Movable: device copies only the stash references (nobody holds a pointer into
  // them) with no offload or prefetch copy reading or writing them; evictable too.
  // Also movable, not evictable: those the deferred readers reference besides.
  relocatable_id_ = arena_->add_relocatable(
      [this](std::vector<Arena::RelocatableTensor>& out) {
        for (auto& [k, item] : items_) {
          if (!item.tensor || item.offloading || item.prefetching || item.tensor->arena() != arena_) continue;
          const long refs = item.tensor.use_count();
          if (refs == 1) out.emplace_back(item.tensor.get(), true);
          else if (deferred_readers_ && refs == 1 + deferred_readers_(item.tensor.get()))
            out.emplace_back(item.tensor.get(), false);
        }
      },
      [this](Tensor* t) { return evict(t); }, [this] { sync(); });
}

bool ActivationStash::evict(Tensor* t) {
  if (!engine_) return false;
  for (auto& [key, item] : items_) {
    if (item.tensor.get() != t) continue;
    if (item.tensor.use_count() != 1 || item.offloading || item.prefetching) return false;
    if (!item.host) copy_to_host(item, "evict").wait();  // (an offload brought back keeps its host copy)
    account(item.tensor, -1);
    item.tensor.reset();
    // From now on it is an offloaded entry that has landed: prefetch_layer() and
    // get() bring it back, and the ledger says so (the planner's walk adopts it so).
    item.entry.provision = Provision::offload;
    counters_.evicted += item.entry.bytes;
    return true;
  }
  return false;
}

CopyEngine::Ticket ActivationStash::copy_to_host(Item& item, const char* what) {
  const Tensor& t = *item.tensor;
  item.shape = t.shape();
  item.dtype = t.dtype();
  item.host = std::unique_ptr<char, HostFree>(static_cast<char*>(engine_->host_alloc(item.entry.bytes)),
                                              HostFree{engine_, item.entry.bytes});
  host_bytes_ += item.entry.bytes;
  host_peak_ = std::max(host_peak_, host_bytes_);
  return engine_->copy(item.host.get(), t.raw(), item.entry.bytes,
                       fmt::format("{} L{} {} mb{}", what, item.entry.layer, item.entry.name, item.entry.microbatch),
                       /*to_host=*/true);
}

void ActivationStash::settle(Item& item) {
  item.d2h.wait();
  item.h2d.wait();
  item.offloading = item.prefetching = false;
}

void ActivationStash::erase_item(std::map<Key, Item, std::less<>>::iterator it) {
  settle(it->second);
  account(it->second.tensor, -1);
  if (it->second.host) {
    host_bytes_ -= it->second.entry.bytes;
    it->second.host.reset();
  }
  items_.erase(it);
}

void ActivationStash::poll() {
  for (auto& [k, item] : items_) {
    if (item.offloading && item.d2h.done() && item.tensor.use_count() == 1) {
      account(item.tensor, -1);
      item.tensor.reset();  // the device block goes back to the arena
      item.offloading = false;
    }
  }
}

void ActivationStash::sync() {
  for (auto& [k, item] : items_)
    if (item.offloading) item.d2h.wait();
  poll();
}

void ActivationStash::prefetch_layer(int microbatch, int layer) {
  poll();
  auto it = items_.lower_bound(Key{microbatch, layer, std::string()});
  for (; it != items_.end() && std::get<0>(it->first) == microbatch && std::get<1>(it->first) == layer; ++it) {
    Item& item = it->second;
    if (item.tensor || !item.host) continue;
    item.tensor = std::make_shared<Tensor>(*arena_, item.shape, MemCategory::activations, item.entry.name, item.dtype);
    account(item.tensor, +1);
    item.h2d = engine_->copy(item.tensor->raw(), item.host.get(), item.entry.bytes,
                             fmt::format("prefetch L{} {} mb{}", layer, item.entry.name, microbatch));
    item.prefetching = true;
  }
}

void ActivationStash::save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t,
                           RecomputeFn lineage) {
  Key key{microbatch, layer, std::string(name)};
  if (items_.count(key))
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} saved twice", name, layer, microbatch));
  Item item;
  item.entry = LedgerEntry{std::string(name), std::string(op), layer, microbatch, t.nbytes(), bool(lineage),
                           Provision::save, ctx_received_, ctx_balanced_};
  poll();
  if (auto r = reserved_.find(key); r != reserved_.end()) {  // decided at reserve()
    item.entry.provision = r->second.provision;
    reserved_.erase(r);
  } else if (policy_) {
    item.entry.provision = policy_(item.entry);
  }
  if (item.entry.provision == Provision::recompute && !lineage) item.entry.provision = Provision::save;
  if (item.entry.provision == Provision::offload && !(arena_ && engine_)) item.entry.provision = Provision::save;
  if (item.entry.provision == Provision::offload) {
    item.tensor = std::make_shared<Tensor>(std::move(t));
    item.d2h = copy_to_host(item, "offload");
    item.offloading = true;
    item.lineage = std::move(lineage);
    counters_.offloaded += item.entry.bytes;
    account(item.tensor, +1);
  } else if (item.entry.provision == Provision::recompute) {
    item.lineage = std::move(lineage);
    counters_.recomputed += item.entry.bytes;
    // t is freed here: the device no longer holds it.
  } else {
    item.tensor = std::make_shared<Tensor>(std::move(t));
    item.lineage = std::move(lineage);
    counters_.saved += item.entry.bytes;
    account(item.tensor, +1);
  }
  items_.emplace(std::move(key), std::move(item));
}

Provision ActivationStash::reserve(int microbatch, int layer, std::string_view name, std::string_view op, Bytes bytes,
                                   bool recomputable) {
  Key key{microbatch, layer, std::string(name)};
  if (items_.count(key) || reserved_.count(key))
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} reserved twice", name, layer, microbatch));
  LedgerEntry e{std::string(name), std::string(op), layer, microbatch, bytes, recomputable,
                Provision::save, ctx_received_, ctx_balanced_};
  if (policy_) e.provision = policy_(e);
  if (e.provision == Provision::recompute && !recomputable) e.provision = Provision::save;
  if (e.provision == Provision::offload && !(arena_ && engine_)) e.provision = Provision::save;
  const Provision p = e.provision;
  reserved_.emplace(std::move(key), std::move(e));
  return p;
}

void ActivationStash::save_dropped(int microbatch, int layer, std::string_view name, RecomputeFn lineage) {
  Key key{microbatch, layer, std::string(name)};
  auto r = reserved_.find(key);
  if (r == reserved_.end() || r->second.provision != Provision::recompute || !lineage)
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} was not reserved for recompute", name,
                            layer, microbatch));
  poll();
  Item item;
  item.entry = std::move(r->second);
  reserved_.erase(r);
  item.lineage = std::move(lineage);
  counters_.recomputed += item.entry.bytes;
  items_.emplace(std::move(key), std::move(item));
}

Provision ActivationStash::provision(int microbatch, int layer, std::string_view name) const {
  auto it = items_.find(Key{microbatch, layer, std::string(name)});
  if (it == items_.end())
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} is not saved", name, layer, microbatch));
  return it->second.entry.provision;
}

ActivationStash::TensorPtr ActivationStash::get(int microbatch, int layer, std::string_view name) {
  auto it = items_.find(Key{microbatch, layer, std::string(name)});
  if (it == items_.end())
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} is not saved", name, layer, microbatch));
  Item& item = it->second;
  if (item.host && !item.offloading) {
    // Offloaded: bring it back (or finish the prefetch already under way).
    if (!item.tensor) prefetch_layer(microbatch, layer);
    item.h2d.wait();
    item.prefetching = false;
    return item.tensor;
  }
  if (!item.tensor) {
    // Rebuild from the lineage; its inputs are fetched (and rebuilt) recursively.
    RecomputeFn fn = item.lineage;
    const OpScope scope(OpPhase::recompute, layer);  // labels the lineage's ops for the op profiler
    TensorPtr t = std::make_shared<Tensor>(fn());
    // The recursion may have inserted entries: look the key up again.
    auto again = items_.find(Key{microbatch, layer, std::string(name)});
    again->second.tensor = t;
    account(t, +1);
    return t;
  }
  return item.tensor;
}

void ActivationStash::release_layer(int microbatch, int layer) {
  auto it = items_.lower_bound(Key{microbatch, layer, std::string()});
  while (it != items_.end() && std::get<0>(it->first) == microbatch && std::get<1>(it->first) == layer)
    erase_item(it++);
}

void ActivationStash::release_microbatch(int microbatch) {
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    if (std::get<0>(it->first) == microbatch) it = reserved_.erase(it);
    else ++it;
  }
  for (auto it = items_.begin(); it != items_.end();) {
    if (std::get<0>(it->first) == microbatch) erase_item(it++);
    else ++it;
  }
}

std::vector<LedgerEntry> ActivationStash::entries() const {
  std::vector<LedgerEntry> out;
  out.reserve(items_.size());
  for (auto& [k, v] : items_)
    if (v.tensor) out.push_back(v.entry);
  return out;
}

std::vector<std::pair<LedgerEntry, bool>> ActivationStash::ledger() const {
  std::vector<std::pair<LedgerEntry, bool>> out;
  out.reserve(items_.size());
  for (auto& [k, v] : items_) out.emplace_back(v.entry, bool(v.tensor));
  return out;
}

}  // namespace moeflex
