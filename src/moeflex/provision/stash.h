// The activation stash: every tensor a forward pass saves for its backward, keyed
// by (micro-batch, layer, name), with the ledger record that says what it is.
//
// This is the single place where saved activations live (STYLE habit 1), so the
// provisioning policies of the adaptive planner (save / recompute / offload) are
// applied here and nowhere in the model's maths.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "moeflex/core/tensor.h"

namespace moeflex {

/// One saved activation as the ledger records it.
struct LedgerEntry {
  std::string name;       ///< e.g. "attn.probs"
  std::string op;         ///< the operator that produced it, e.g. "attention"
  int layer = -1;         ///< transformer layer (-1: embedding / head)
  int microbatch = 0;     ///< micro-batch index within the step
  Bytes bytes = 0;        ///< exact bytes (numel * dtype size)
};

/// Saved activations of the micro-batches in flight.
class ActivationStash {
 public:
  /// Takes ownership of `t` as the activation (mb, layer, name). Throws Error if present.
  void save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t);
  /// The saved tensor; throws Error naming the key when absent.
  Tensor& get(int microbatch, int layer, std::string_view name);
  /// Removes the activation and returns it (the caller frees it when done).
  Tensor take(int microbatch, int layer, std::string_view name);
  /// Frees every activation of a micro-batch (e.g. after its backward).
  void release_microbatch(int microbatch);
  /// Frees everything.
  void clear() { items_.clear(); }

  /// Ledger records of the activations held now, in (micro-batch, layer, name) order.
  std::vector<LedgerEntry> entries() const;
  /// Bytes held now.
  Bytes bytes() const { return bytes_; }
  /// High-water mark of bytes() since the last reset_peak().
  Bytes peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = bytes_; }

 private:
  using Key = std::tuple<int, int, std::string>;
  struct Item {
    LedgerEntry entry;
    Tensor tensor;
  };
  std::map<Key, Item, std::less<>> items_;
  Bytes bytes_ = 0;
  Bytes peak_ = 0;
};

}  // namespace moeflex
