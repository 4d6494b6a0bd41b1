// The activation stash: every tensor a forward pass saves for its backward, keyed
// by (micro-batch, layer, name), with the ledger record that says what it is and
// its lineage (how to rebuild it from other stash entries).
//
// This is the single place where provisioning policies act (STYLE habit 2): when a
// tensor is saved, the policy decides whether it stays on the device (save) or is
// dropped and rebuilt in backward from its lineage (recompute). The model's maths
// never changes with the policy, so every policy gives the same gradients.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "moeflex/core/tensor.h"

namespace moeflex {

/// What happens to a saved activation between its forward and its backward.
enum class Provision : int { save, recompute, offload };
const char* to_string(Provision p);

/// One saved activation as the ledger records it.
struct LedgerEntry {
  std::string name;       ///< e.g. "attn.probs"
  std::string op;         ///< the operator that produced it, e.g. "attention"
  int layer = -1;         ///< transformer layer (the head uses a large index)
  int microbatch = 0;     ///< micro-batch index within the step
  Bytes bytes = 0;        ///< exact bytes (numel * dtype size)
  bool recomputable = false;  ///< has a lineage (a function rebuilding it from other entries)
  Provision provision = Provision::save;
};

/// Decides the provision of an activation when it is saved (it sees the entry with
/// `recomputable` set; returning recompute for a non-recomputable entry saves it).
using ProvisionPolicy = std::function<Provision(const LedgerEntry&)>;

/// Rebuilds an activation from its inputs (read through ActivationStash::get).
using RecomputeFn = std::function<Tensor()>;

/// Saved activations of the micro-batches in flight.
class ActivationStash {
 public:
  using TensorPtr = std::shared_ptr<Tensor>;

  /// Takes ownership of `t` as the activation (mb, layer, name), then applies the
  /// policy: recompute drops the tensor now (only when `lineage` is given). Throws
  /// Error if the key is present.
  void save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t,
            RecomputeFn lineage = {});
  /// The activation, rebuilt first if it was dropped; throws Error naming the key when
  /// absent. It stays in the stash until release_layer/release_microbatch.
  TensorPtr get(int microbatch, int layer, std::string_view name);
  /// Drops the stash's references to one layer's activations of a micro-batch.
  void release_layer(int microbatch, int layer);
  /// Drops every activation of a micro-batch.
  void release_microbatch(int microbatch);
  void clear() { items_.clear(); }

  void set_policy(ProvisionPolicy policy) { policy_ = std::move(policy); }

  /// Ledger records of the activations held now, in (micro-batch, layer, name) order.
  std::vector<LedgerEntry> entries() const;
  /// Bytes held on the device now (recomputed-and-dropped entries count 0).
  Bytes bytes() const { return bytes_; }
  /// High-water mark of bytes() since the last reset_peak().
  Bytes peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = bytes_; }

  /// Cumulative bytes, since reset_counters(), by the provision decided at save.
  struct Counters {
    Bytes saved = 0;
    Bytes recomputed = 0;
    Bytes offloaded = 0;
  };
  const Counters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 private:
  using Key = std::tuple<int, int, std::string>;
  struct Item {
    LedgerEntry entry;
    TensorPtr tensor;  // null while dropped for recompute
    RecomputeFn lineage;
  };
  void account(const TensorPtr& t, int sign);
  std::map<Key, Item, std::less<>> items_;
  ProvisionPolicy policy_;
  Bytes bytes_ = 0;
  Bytes peak_ = 0;
  Counters counters_;
};

}  // namespace moeflex
