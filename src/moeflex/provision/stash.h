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
#include "moeflex/provision/copy_engine.h"

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
  /// MoE entries, known after the router: rows this rank's experts received, and the
  /// rows a perfectly balanced routing would give them (n * k: n * k / ep from each of
  /// the ep ranks, n tokens a rank). 0 elsewhere.
  std::int64_t tokens_received = 0;
  std::int64_t tokens_balanced = 0;
};

/// Decides the provision of an activation when it is saved (it sees the entry with
/// `recomputable` set; returning recompute for a non-recomputable entry saves it).
using ProvisionPolicy = std::function<Provision(const LedgerEntry&)>;

/// Rebuilds an activation from its inputs (read through ActivationStash::get).
using RecomputeFn = std::function<Tensor()>;

/// Saved activations of the micro-batches in flight.
///
/// Offload: the tensor is copied to a host buffer by the copy engine while compute
/// goes on; its device block is freed once the copy has landed (checked at every
/// stash call, on the main thread), and prefetch_layer() brings a layer's
/// activations back ahead of its backward.
class ActivationStash {
 public:
  using TensorPtr = std::shared_ptr<Tensor>;

  ActivationStash() = default;
  ~ActivationStash();
  ActivationStash(const ActivationStash&) = delete;  // the arena holds `this` (compaction source)
  ActivationStash& operator=(const ActivationStash&) = delete;
  /// Where prefetched tensors are allocated and which engine copies; without them
  /// an offload decision falls back to save. Registers the stash with `arena` as a
  /// compaction source (Arena::compact): the arena may move the device copies the
  /// stash alone holds with no copy in flight.
  void set_device(Arena* arena, CopyEngine* engine);
  /// References to its tensors that another owner holds only to read them later
  /// through the Tensor (the model's queued weight-gradient GEMMs, Qi et al.'s W):
  /// `holds(t)` counts them. A device copy referenced by nothing else stays
  /// movable in compaction (not evictable: its block would stay held).
  void set_deferred_readers(std::function<long(const Tensor*)> holds) { deferred_readers_ = std::move(holds); }

  /// Takes ownership of `t` as the activation (mb, layer, name), then applies the
  /// policy: recompute drops the tensor now (only when `lineage` is given). Throws
  /// Error if the key is present.
  void save(int microbatch, int layer, std::string_view name, std::string_view op, Tensor t,
            RecomputeFn lineage = {});
  /// Decides now, once, the provision of an activation that will be saved later
  /// under the same key (save() or save_dropped() then takes this decision without
  /// asking the policy again), from the entry save() would record with `bytes` and
  /// a lineage if `recomputable`. For producers that compute in chunks (the
  /// experts' FFN): only what is kept is allocated whole. Returns the provision
  /// save() will apply (the same fallbacks: no lineage or no copy engine = save).
  Provision reserve(int microbatch, int layer, std::string_view name, std::string_view op, Bytes bytes,
                    bool recomputable);
  /// Records a reserved activation whose decision was recompute without ever
  /// holding it whole: its ledger entry (the reserved bytes) and its lineage.
  /// Throws Error if it was not reserved as recompute.
  void save_dropped(int microbatch, int layer, std::string_view name, RecomputeFn lineage);
  /// The provision of a saved activation (offload after an eviction); throws if absent.
  Provision provision(int microbatch, int layer, std::string_view name) const;
  /// The activation, rebuilt first if it was dropped; throws Error naming the key when
  /// absent. It stays in the stash until release_layer/release_microbatch.
  TensorPtr get(int microbatch, int layer, std::string_view name);
  /// Starts copying a layer's offloaded activations back to the device (no wait).
  void prefetch_layer(int microbatch, int layer);
  /// Frees device copies of offloads whose host copy has landed.
  void poll();
  /// Waits for every offload in flight to land, then poll()s.
  void sync();
  /// Host bytes held by offloaded activations now, and their high-water mark.
  Bytes host_bytes() const { return host_bytes_; }
  Bytes host_peak_bytes() const { return host_peak_; }
  /// Drops the stash's references to one layer's activations of a micro-batch.
  void release_layer(int microbatch, int layer);
  /// Drops every activation of a micro-batch.
  void release_microbatch(int microbatch);
  void clear() {
    while (!items_.empty()) erase_item(items_.begin());
    reserved_.clear();
  }

  void set_policy(ProvisionPolicy policy) { policy_ = std::move(policy); }
  /// The routing context of the saves that follow (the MoE layer being saved), or 0, 0.
  void set_routing_context(std::int64_t received, std::int64_t balanced) {
    ctx_received_ = received;
    ctx_balanced_ = balanced;
  }

  /// Ledger records of the activations held now, in (micro-batch, layer, name) order.
  std::vector<LedgerEntry> entries() const;
  /// Every ledger record, held or not, with whether its device copy exists now
  /// (false: dropped for recompute, or offloaded and not yet prefetched).
  std::vector<std::pair<LedgerEntry, bool>> ledger() const;
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
    /// Evicted to the host by the arena to make room on fragmentation (Arena::make_room).
    Bytes evicted = 0;
  };
  const Counters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 private:
  using Key = std::tuple<int, int, std::string>;
  struct HostFree {  // returns an offload's host buffer to the engine that gave it
    HostFree() noexcept : engine(nullptr), bytes(0) {}
    HostFree(CopyEngine* e, Bytes b) noexcept : engine(e), bytes(b) {}
    CopyEngine* engine;
    Bytes bytes;
    void operator()(char* p) const { engine->host_free(p, bytes); }
  };
  struct Item {
    LedgerEntry entry;
    TensorPtr tensor;  // device copy; null while dropped (recompute) or only on the host (offload)
    RecomputeFn lineage;
    // Offload state.
    std::vector<std::int64_t> shape;
    DType dtype = DType::f32;
    std::unique_ptr<char, HostFree> host;
    CopyEngine::Ticket d2h, h2d;
    bool offloading = false;   // d2h in flight, device copy still held
    bool prefetching = false;  // h2d in flight into `tensor`
  };
  void account(const TensorPtr& t, int sign);
  void settle(Item& item);   // waits for in-flight copies of an item
  bool evict(Tensor* t);     // Arena::EvictFn: copies `t` to the host and frees it
  // Host buffer for the item's device copy, and the copy into it started
  // ("offload"/"evict" labels it for the trace).
  CopyEngine::Ticket copy_to_host(Item& item, const char* what);
  void erase_item(std::map<std::tuple<int, int, std::string>, Item, std::less<>>::iterator it);
  Arena* arena_ = nullptr;
  int relocatable_id_ = -1;  // our compaction source in arena_
  CopyEngine* engine_ = nullptr;
  std::int64_t ctx_received_ = 0, ctx_balanced_ = 0;
  Bytes host_bytes_ = 0, host_peak_ = 0;
  std::map<Key, Item, std::less<>> items_;
  std::map<Key, LedgerEntry, std::less<>> reserved_;  // reserve()d, not saved yet
  ProvisionPolicy policy_;
  std::function<long(const Tensor*)> deferred_readers_;
  Bytes bytes_ = 0;
  Bytes peak_ = 0;
  Counters counters_;
};

}  // namespace moeflex
