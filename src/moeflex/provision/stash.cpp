#include "moeflex/provision/stash.h"

#include <fmt/format.h>

namespace moeflex {

void ActivationStash::save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t) {
  Key key{microbatch, layer, std::string(name)};
  if (items_.count(key))
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} saved twice", name, layer, microbatch));
  LedgerEntry e{std::string(name), std::string(op), layer, microbatch, t.nbytes()};
  bytes_ += e.bytes;
  peak_ = std::max(peak_, bytes_);
  items_.emplace(std::move(key), Item{std::move(e), std::move(t)});
}

Tensor& ActivationStash::get(int microbatch, int layer, std::string_view name) {
  auto it = items_.find(Key{microbatch, layer, std::string(name)});
  if (it == items_.end())
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} is not saved", name, layer, microbatch));
  return it->second.tensor;
}

Tensor ActivationStash::take(int microbatch, int layer, std::string_view name) {
  auto it = items_.find(Key{microbatch, layer, std::string(name)});
  if (it == items_.end())
    throw Error(fmt::format("activation stash: '{}' of layer {} micro-batch {} is not saved", name, layer, microbatch));
  Tensor t = std::move(it->second.tensor);
  bytes_ -= it->second.entry.bytes;
  items_.erase(it);
  return t;
}

void ActivationStash::release_microbatch(int microbatch) {
  for (auto it = items_.begin(); it != items_.end();) {
    if (std::get<0>(it->first) == microbatch) {
      bytes_ -= it->second.entry.bytes;
      it = items_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<LedgerEntry> ActivationStash::entries() const {
  std::vector<LedgerEntry> out;
  out.reserve(items_.size());
  for (auto& [k, v] : items_) out.push_back(v.entry);
  return out;
}

}  // namespace moeflex
