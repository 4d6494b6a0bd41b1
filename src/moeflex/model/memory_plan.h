// The model's exact device-memory program: what one rank's forward and backward
// allocate and free in its arena, replayed symbolically (sizes only, no tensors).
//
// This is the memory half of the cost model of DESIGN.md, shared by its three
// consumers: the adaptive planner projects the rest of a step with it, the
// feasibility check computes the smallest workable budget with it, and the
// simulator (sim/) predicts each rank's peak with it. What a layer keeps (names,
// sizes, lineages, save groups) comes from the ledger (ledger.h); the order of the
// workspace allocations around the saves is still replayed here op by op
// (test_memory_plan checks the replayed peak against the arena's measured peak
// over whole steps), so a change to the model's workspace must be made here too.
//
// Every size is rounded as the arena rounds it (Arena::round_up).
#pragma once
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "moeflex/core/units.h"
#include "moeflex/model/config.h"
#include "moeflex/model/ledger.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/stash.h"

namespace moeflex {

/// The layers and ends of the model one rank's pipeline stage (chunk) holds.
struct StageSpec {
  int first_layer = 0;
  int last_layer = 0;  ///< one past the last layer
  bool embedding = true;
  bool head = true;
  int ep_size = 1;  ///< ranks of the expert-parallel group (> 1: tokens are dispatched)
  bool ep() const { return ep_size > 1; }
};

/// Decides an activation's provision from the ledger entry the stash would see
/// (name, op, layer, micro-batch, bytes, recomputable, routing context): the same
/// ProvisionPolicy the engine's stash calls. Offload is treated as freed once the
/// block's saves are done (the copy has landed).
using ProvisionFn = ProvisionPolicy;

/// One step of a rank's plan, as the memory walk replays it (train/pipeline.cpp
/// turns a StepPlan into these, mirroring its executor's buffers).
struct WalkAction {
  /// backward_input: the zero-bubble B (weight gradients deferred); weight: its W.
  enum class Kind { forward, backward, backward_input, weight, alloc_buffer, free_buffer };
  Kind kind = Kind::forward;
  int microbatch = 0;
  int stage = 0;  ///< index into the rank's StageSpec list (forward, backward)
};

struct StepPlan;

/// One rank's actions of a schedule's `plan` as the memory walk replays them,
/// mirroring the pipeline executor's buffers (train/pipeline.cpp): a received
/// activation lives until its forward, a stage's output until it is sent or
/// consumed, a gradient likewise; W actions are not modelled. walk_at[i], if
/// given, receives the index of the step of plan action i (its forward or backward).
std::vector<WalkAction> walk_actions(const StepPlan& plan, int rank, std::vector<std::size_t>* walk_at = nullptr);

/// What one rank's step does, for projections: its stages (chunks), its actions
/// in order, and the index of the action running now (kept by the executor).
struct StepProgram {
  std::vector<StageSpec> stages;
  /// Every chunk's stash on the rank (what it holds now; polled before decisions so
  /// that offloads whose copy landed are freed whichever chunk saved them).
  std::vector<ActivationStash*> stashes;
  std::vector<WalkAction> actions;
  std::size_t current = 0;
  /// Bytes each zero-bubble B left held for its W, by (micro-batch, stage's first
  /// layer), until that W runs: one figure per layer group of the W (the head's
  /// GEMMs first, then each layer's from the last, then the embedding's), in the
  /// W's order (written by the model chunks as they run).
  mutable std::map<std::pair<int, int>, std::vector<Bytes>> pending_weight_bytes;
  /// The keys of pending_weight_bytes whose reads the planner offloaded (on the host
  /// until their W brings them back).
  mutable std::set<std::pair<int, int>> offloaded_weight_reads;
};

/// Whether the adaptive planner decides an activation (else it is saved): every
/// block's entries except the shared expert's and a dense layer's FFN norm.
bool planner_decides(const ModelConfig& cfg, const LedgerEntry& entry);

/// The most memory-saving provision of an activation the planner decides:
/// recompute when it has a lineage, else offload; save when it does not decide.
Provision most_memory_saving(const ModelConfig& cfg, const LedgerEntry& entry);

/// The smallest device budget for which the adaptive planner's invariant holds
/// (DESIGN.md, "The planner's contract"): the peak of one step of `program` with
/// every activation the planner decides at its most memory-saving choice and every
/// MoE layer at its worst-case routing (MoERows::worst_case), from `persistent`
/// bytes, plus the arena's placement reserve (Arena::budget_with_reserve: 1/128
/// of the budget, at most 256 KiB). It carries no other margin: the planner's
/// fragmentation margin is a soft target (kPlannerMarginFraction), and what
/// fragmentation remains at the minimum the arena handles by compaction, stitching
/// (which the reserve leaves room for) and eviction.
Bytes minimum_budget(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const StepProgram& program,
                     Bytes persistent);

/// Rows of each layer of a stage for a micro-batch (see MemoryWalk::forward).
using RowsFn = std::function<std::vector<MoERows>(int microbatch, const StageSpec& stage)>;

/// A symbolic arena plus a symbolic activation stash, replaying the engine's
/// allocations for forwards and backwards of micro-batches on one rank.
///
/// Covers the fused backward and the zero-bubble split (B, then W).
///
/// The stash is flat: one slot per (micro-batch, layer), found through an index
/// vector, holding its entries by position in the layer kind's activation list
/// (no ordered maps, no names in the hot path). Not copyable (slots point into
/// its own blocks of entries).
class MemoryWalk {
 public:
  MemoryWalk(const MemoryWalk&) = delete;
  MemoryWalk& operator=(const MemoryWalk&) = delete;
  /// persistent: bytes in use before the step (weights, gradients, optimizer state).
  MemoryWalk(const ModelConfig& cfg, std::int64_t B, std::int64_t S, Bytes persistent);

  /// The forward of micro-batch `mb` through `stage` (MoEModel::forward_stage):
  /// rows[i] for the stage's i-th layer (ignored for dense layers; may be empty for
  /// a stage without MoE layers). Its kept activations stay until backward(mb, stage).
  /// A stage that is not the last leaves its output [B*S, d] allocated (the
  /// pipeline's send buffer): free it with buffer(-1) when it is sent.
  void forward(int mb, const StageSpec& stage, const std::vector<MoERows>& rows, const ProvisionFn& provision);
  /// The backward of `mb` through `stage` (MoEModel::backward_stage): rebuilds
  /// recomputed entries as the engine fetches them, allocates the gradients, and
  /// releases the micro-batch's activations of the stage. The pipeline's gradient
  /// buffers (dy received, dx to send) are the caller's, via buffer(). With
  /// `split` (zero-bubble B), what the deferred weight gradients read stays
  /// allocated (output gradients, copies of the residual gradient, the activations
  /// they multiply) until weight(mb, stage).
  void backward(int mb, const StageSpec& stage, bool split = false);
  /// The zero-bubble W of `mb` through `stage`, one layer group at a time (the
  /// order of MoEModel::backward_weight): brings the group's reads back if they
  /// were offloaded, then frees them.
  void weight(int mb, const StageSpec& stage);
  /// From now on (on): every zero-bubble B offloads what it keeps for its W, each
  /// layer's group once that layer's backward is done (MoEModel::backward_stage),
  /// the planner's most memory-saving choice for those reads.
  void set_offload_weight_reads(bool on) { offload_weight_reads_ = on; }
  /// The B of `mb` through the stage starting at `first_layer` keeps its W reads on
  /// the device, whatever set_offload_weight_reads says (a planner's choice).
  void keep_weight_reads(int mb, int first_layer) { keep_exceptions_.insert({mb, first_layer}); }
  /// Bytes the B of `mb` through `stage` keeps for its W (0 once W ran).
  Bytes retained(int mb, const StageSpec& stage) const;
  /// Takes over what a real zero-bubble B left held for the W of `mb` through the
  /// stage starting at `first_layer`, by layer group (StepProgram::
  /// pending_weight_bytes): in the walk's starting use when on_device, else on
  /// the host until the W.
  void adopt_retained(int mb, int first_layer, const std::vector<Bytes>& groups, bool on_device = true);
  /// adopt_retained for everything `program` has pending, with its residency.
  void adopt_pending_weights(const StepProgram& program);
  /// Allocates (+1) or frees (-1) `count` pipeline buffers of [B*S, d] floats.
  void buffer(int count);

  /// Continues a forward that stopped at `point` of layer `layer` (kHeadLayer for
  /// the head) with the block's tensors allocated and not yet saved: the block's
  /// saves under `provision`, the rest of the block, the later layers and the head.
  /// rows as for forward() (rows of `layer` itself are the real ones).
  void finish_forward(int mb, const StageSpec& stage, int layer, SavePoint point, const std::vector<MoERows>& rows,
                      const ProvisionFn& provision);
  /// Replays actions[from..] (see WalkAction) on `stages`.
  void run(const std::vector<WalkAction>& actions, std::size_t from, const std::vector<StageSpec>& stages,
           const RowsFn& rows, const ProvisionFn& provision);
  /// Takes over an activation the real stash holds (its bytes already counted in
  /// the persistent/in-use figure the walk started from when on_device). The
  /// lineage is looked up by name; `ep_size` as in StageSpec.
  void adopt(const LedgerEntry& entry, bool on_device, int ep_size);

  /// Phases of the walk around one layer's activations of one micro-batch (see
  /// watch()): the block still finishing its forward, held until the backward,
  /// prefetched (offloads back one layer ahead), its backward, after its release.
  enum Phase { kCompute, kTail, kLanding, kHeld, kPrefetched, kBackward, kBackwardRest, kAfter, kPhases };
  /// From now on, also records the peak of each Phase for the block at `point` of
  /// layer `layer` (or kHeadLayer) of micro-batch `mb`; the walk starts in kTail
  /// (an MoE block in kCompute: its experts run after the decision, until its saves),
  /// moves to kLanding when the block's saves are done (its offloads still copying)
  /// and to kHeld at the next decision point (where they have landed). kBackward is the block's own
  /// backward (an attention block's starts after its layer's FFN backward),
  /// kBackwardRest the rest of its layer's backward until the layer is released.
  void watch(int mb, int layer, SavePoint point);
  /// The peak in_use of `phase` since watch() (0 if the walk never entered it).
  Bytes phase_peak(Phase phase) const { return phase_peak_[phase]; }

  Bytes in_use() const { return in_use_; }
  Bytes peak() const { return peak_; }
  void reset_peak() { peak_ = in_use_; }
  /// Bytes of `mb`'s activations on the device now (all stages; not for a
  /// projection walk, whose later layers are summaries).
  Bytes held(int mb) const;

  /// The planner's projection policy (project_block), in the walk's own terms.
  struct Projection {
    int mb = -1, layer = -1;  ///< the block under decision (layer or kHeadLayer)
    /// By activation id: whether the block decides it, and its provision then.
    std::vector<char> candidate;
    std::vector<Provision> block;
  };
  /// From now on, decides every save by `projection` instead of the ProvisionFn
  /// arguments (which are then ignored): the block's candidates take its
  /// provisions, every other activation its most memory-saving choice
  /// (most_memory_saving). Every later layer forward other than the block's own
  /// (and its backward) is then replayed from a summary of one exact replay of
  /// such a layer (the same kind and rows), memoized per thread: the same bytes and
  /// peaks as the exact walk, in O(1) per layer. `projection` must outlive the walk.
  void set_projection(const Projection* projection) { projection_ = projection; }

 private:
  /// A layer kind's activations (layer_activations or head_activations) with
  /// lookups: the position of each activation id, the planner's floor and the
  /// rebuild by position. Memoized per thread (specs_of).
  struct LayerSpecs {
    std::vector<ActivationSpec> specs;
    std::vector<std::int8_t> pos;  ///< by activation id: index into specs, -1 if absent
    std::vector<Provision> floor;  ///< by position: most_memory_saving
    std::vector<Rebuild> rebuild;  ///< by position (the ledger entry's)
    /// The ids of each SaveGroup's entries, in ledger order.
    std::array<std::vector<int>, kSaveGroups> group;
    /// The ids of the entries chunked when recomputed (the experts' FC1 outputs and activation).
    std::vector<int> chunked;
  };
  /// Most activations one layer keeps (an MoE layer with a shared expert keeps 25, 27
  /// with MLA's latents).
  static constexpr int kMaxLayerActivations = 32;
  /// One saved activation of the symbolic stash.
  struct Entry {
    Bytes bytes = 0;  ///< LedgerEntry::bytes (not rounded)
    Provision provision = Provision::save;
    bool present = false;
    bool on_device = false;
    bool pinned = false;  ///< read by a deferred weight gradient (zero-bubble B)
  };
  /// What a layer forward at the floor with given rows does to the walk (a
  /// projection walk's later layers, see set_projection), from one exact replay
  /// that starts with nothing allocated and nothing copying. Bytes relative to the
  /// layer's start (forward) or the start of its backward body (after its prefetch).
  struct LayerSummary {
    Bytes pre_peak = 0;   ///< forward: highest use before its first decision point (land())
    Bytes pre_end = 0;    ///< forward: use added at that point
    Bytes post_peak = 0;  ///< forward: highest use after it, less what landed there
    Bytes delta = 0;      ///< forward: use added by its end, less what landed
    Bytes landing = 0;    ///< forward: its offloads still copying at its end (freed at the next land())
    Bytes prefetch = 0;   ///< bytes prefetch() brings back for its backward
    /// Backward body (ffn_backward to release_layer), [fused, zero-bubble B]:
    /// highest use, use added (<= 0), and bytes left held for the W.
    Bytes body_peak[2] = {}, body_delta[2] = {}, body_retained[2] = {};
  };
  /// The activations micro-batch `mb` holds for one layer: exact entries (by
  /// position in specs), or a fresh summary (a projection walk's later layers).
  struct Slot {
    int mb = 0, layer = 0;
    const LayerSpecs* specs = nullptr;
    Entry* entries = nullptr;  ///< kMaxLayerActivations of them, or null (none saved)
    const LayerSummary* fresh = nullptr;
    bool fresh_prefetched = false;
    bool has_rows = false;  ///< an MoE layer's forward ran: rows and EP size for its backward
    int ep_size = 1;
    MoERows rows;
  };
  /// An activation: micro-batch, layer, activation id.
  struct Key {
    int mb, layer, id;
  };
  void alloc(Bytes bytes);
  void free(Bytes bytes);
  /// Records `bytes` in use for a moment (the peaks), as alloc then free would.
  void touch(Bytes bytes);
  /// The slot of (mb, layer) (kHeadLayer for the head), created empty if absent.
  Slot& slot(int mb, int layer);
  /// The slot of (mb, layer), or null.
  Slot* find_slot(int mb, int layer) const;
  /// The entry of activation `id` in slot `s`, or null if not saved.
  Entry* find_entry(const Slot& s, int id) const;
  /// Brings (mb, layer, id) onto the device as the stash's get() does.
  void get(int mb, int layer, int id);
  /// Saves the entries `ids` (in that order) from `specs` under the provision.
  void save(int mb, int layer, const LayerSpecs& specs, const std::vector<int>& ids, const ProvisionFn& provision);
  /// The provision save() gives activation `id` of (mb, layer) (the block's
  /// projection, the floor, or `provision` seeing its ledger entry).
  Provision decide(int mb, int layer, const LayerSpecs& specs, int id, const ProvisionFn& provision);
  /// An MoE layer's experts after its decision (model.cpp: the chunked FFN, the
  /// combine), with the FC1 outputs and activation allocated whole only when kept.
  void moe_experts(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision);
  /// ffn_backward's expert loop of (mb, l): fetches what is kept, then replays its
  /// first (largest) chunk, of `rows` rows (MoERows::largest_chunk; 0: none): the
  /// gradients, the rebuilt FC1 outputs and activation, and a dropped combine
  /// input's rows; `defer`: the expert weight gradients wait for W (zero-bubble B,
  /// the rows in one chunk).
  void expert_chunks(int mb, int l, std::int64_t rows, bool defer);
  void prefetch(int mb, int layer);
  void release_layer(int mb, int layer);
  void keep(int mb, Bytes bytes);  // held until weight(mb) of the current stage
  void pin(int mb, int layer, int id);  // read by a deferred weight gradient
  bool split_ = false;
  int stage_id_ = 0;                                      // first layer of the stage under backward
  /// What a B keeps for its W: bytes by layer group in the W's order; the first
  /// `offloaded` groups are on the host.
  struct Retained {
    std::vector<std::pair<int, Bytes>> groups;  // (layer, bytes)
    std::size_t offloaded = 0;
    Bytes total() const;
  };
  std::map<std::pair<int, int>, Retained> retained_;  // (mb, stage) -> what it holds for W
  int keep_layer_ = 0;                                // the layer whose group keep() adds to
  bool offload_weight_reads_ = false;
  bool offload_this_b_ = false;                    // the B under way offloads its groups as it goes
  std::set<std::pair<int, int>> keep_exceptions_;  // Bs that keep their reads (keep_weight_reads)
  void offload_groups(int mb);                     // the B under way's groups so far, to the host
  MoERows rows_at(const StageSpec& st, int l, const std::vector<MoERows>& rows) const;
  /// layer_activations (or head_activations for kHeadLayer), memoized by layer kind and rows.
  const LayerSpecs& specs_of(int layer, const MoERows& rows, bool ep);
  using SpecKey = std::tuple<int, std::int64_t, std::int64_t, bool>;
  std::vector<std::pair<SpecKey, const LayerSpecs*>> specs_;  // this walk's, from the per-thread memo
  std::vector<std::unique_ptr<LayerSpecs>> own_specs_;         // beyond the memo
  void forward_layers(int mb, const StageSpec& st, int from, const std::vector<MoERows>& rows,
                      const ProvisionFn& provision);
  void save_head(int mb, const ProvisionFn& provision);
  void ffn_moe_tail(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision);
  void attention_forward(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision);
  void ffn_forward(int mb, int l, const LayerSpecs& specs, const MoERows& rows, int ep_size,
                   const ProvisionFn& provision);
  void mlp_forward(int mb, int l, const LayerSpecs& specs, bool shared, std::int64_t width,
                   const ProvisionFn& provision);
  /// The ids of `g`'s entries in `specs`, in ledger order.
  static const std::vector<int>& group(const LayerSpecs& specs, SaveGroup g) { return specs.group[std::size_t(g)]; }
  std::vector<int> mla_latents_;  // MLA's latent entries (ModelConfig::mla; empty otherwise), by id
  /// The part of a layer's backward after its prefetch: FFN, attention, release.
  void backward_body(int mb, int l);
  void attention_backward(int mb, int l);
  void ffn_backward(int mb, int l);
  void mlp_backward(int mb, int l, bool shared, std::int64_t width);
  /// The summary of layer `l`'s forward at the floor with `rows` (memoized per thread).
  const LayerSummary& summary_of(int l, const MoERows& rows, int ep_size);
  /// A projection walk's forward of layer `l` of `mb`, from its summary.
  void replay_forward(int mb, int l, const MoERows& rows, int ep_size);

  ModelConfig cfg_;
  std::int64_t B_, S_;
  Bytes ab_ = 4;  // bytes of an activation element (cfg_.activation_bytes())
  Bytes in_use_ = 0, peak_ = 0;
  std::vector<int> slot_index_;  // by mb * (layers + 1) + layer (the head last): index into slots_, -1
  std::deque<Slot> slots_;       // never erased (a slot's address is stable)
  mutable Slot* last_slot_ = nullptr;  // find_slot's last answer
  std::deque<std::array<Entry, kMaxLayerActivations>> entry_blocks_;
  bool has_ctx_ = false;  // the routing context of the saves under way (an MoE block's)
  MoERows ctx_rows_;
  int ctx_ep_ = 1;
  const Projection* projection_ = nullptr;
  int watch_mb_ = -1, watch_layer_ = -1;
  bool watch_attention_ = false;
  Phase phase_ = kTail;
  Bytes phase_peak_[kPhases] = {};
  void enter(Phase phase, int mb, int layer);
  std::vector<Key> landing_;  // offloads whose copy is in flight
  Bytes landing_bytes_ = 0;   // the same for summarized layers
  // A summary replay (summary_of): notes the highest use before the first land().
  bool probe_ = false, probe_landed_ = false;
  Bytes probe_pre_peak_ = 0, probe_pre_end_ = 0;
  /// What a LayerSummary depends on (see summary_of).
  using SummaryKey = std::array<std::int64_t, 25>;  // walk::config_key (16) and 9 more
  std::deque<std::pair<SummaryKey, LayerSummary>> local_summaries_;  // beyond the per-thread memo
  void land();
};

/// What the planner's projection of one block depends on (DESIGN.md, "The
/// planner's contract": the layer's operators with exact bytes, the arena's use,
/// the rank's remaining actions).
struct BlockContext {
  int microbatch = 0;
  int layer = 0;             ///< or kHeadLayer
  SavePoint point = SavePoint::attention;
  std::int64_t B = 1, S = 1;
  StageSpec stage;           ///< the chunk the block belongs to
  MoERows rows;              ///< the MoE block's real rows (point moe)
  Bytes in_use = 0;          ///< arena bytes in use at the decision
  /// Every activation the rank holds (all chunks), with whether it is on the device.
  std::vector<std::pair<LedgerEntry, bool>> ledger;
  /// The rank's step and the action under way; null: the micro-batch's own
  /// backward follows its forward directly.
  const StepProgram* program = nullptr;
  std::vector<std::string> candidates;  ///< the block's activations the planner decides
};

/// The block's projection: one walk of the rest of the rank's step from the
/// decision, with the block kept whole (choice null) or taking `choice`, every
/// later block the planner decides at its most memory-saving choice, and every
/// routing not yet known at its worst case (MoERows::worst_case).
BlockProjection project_block(const ModelConfig& cfg, const BlockContext& ctx, const BlockChoice* choice);

/// The projection of a zero-bubble B's W-read decision (AdaptivePlanner::
/// plan_weight_reads) at the start of the B of ctx.microbatch through ctx.stage:
/// the exact peak of the rest of the rank's step (ctx.program, from the current
/// action, the B itself) with what its W reads kept on the device until the W, or
/// offloaded layer by layer as the B goes, every later decision at its most
/// memory-saving choice and every routing at its worst case. ctx.program must be set.
Bytes project_weight_reads(const ModelConfig& cfg, const BlockContext& ctx, bool offload);

/// The planner's cache key for the block: its layer, save point, place in the
/// step and rows, and a digest of the ledger (name, size, provision, residency of
/// every activation held); the planner adds the bytes in use.
std::vector<std::int64_t> block_cache_key(const BlockContext& ctx);

}  // namespace moeflex
