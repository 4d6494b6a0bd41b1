#include "moeflex/provision/stash.h"

#include <fmt/format.h>

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

void ActivationStash::save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t,
                           RecomputeFn lineage) {
  Key key{microbatch, layer, std::string(name)};
  if (items_.count(key))
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} saved twice", name, layer, microbatch));
  Item item;
  item.entry = LedgerEntry{std::string(name), std::string(op), layer, microbatch, t.nbytes(), bool(lineage),
                           Provision::save};
  if (policy_ && lineage) item.entry.provision = policy_(item.entry);
  if (item.entry.provision == Provision::offload) item.entry.provision = Provision::save;  // not available yet
  if (item.entry.provision == Provision::recompute) {
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

ActivationStash::TensorPtr ActivationStash::get(int microbatch, int layer, std::string_view name) {
  auto it = items_.find(Key{microbatch, layer, std::string(name)});
  if (it == items_.end())
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} is not saved", name, layer, microbatch));
  Item& item = it->second;
  if (!item.tensor) {
    // Rebuild from the lineage; its inputs are fetched (and rebuilt) recursively.
    RecomputeFn fn = item.lineage;
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
  while (it != items_.end() && std::get<0>(it->first) == microbatch && std::get<1>(it->first) == layer) {
    account(it->second.tensor, -1);
    it = items_.erase(it);
  }
}

void ActivationStash::release_microbatch(int microbatch) {
  for (auto it = items_.begin(); it != items_.end();) {
    if (std::get<0>(it->first) == microbatch) {
      account(it->second.tensor, -1);
      it = items_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<LedgerEntry> ActivationStash::entries() const {
  std::vector<LedgerEntry> out;
  out.reserve(items_.size());
  for (auto& [k, v] : items_)
    if (v.tensor) out.push_back(v.entry);
  return out;
}

}  // namespace moeflex
