// The activation ledger (STYLE.md habit 1): for each block kind of the MoE
// transformer (attention, dense FFN, MoE FFN, head), the ordered table of the
// tensors its forward saves for its backward. Each entry declares its stash name,
// the op family that produces it, its dtype, its shape as a formula in the config
// and the token counts, its lineage (the entries a recompute rebuilds it from), its
// save group and the planner's decision point.
//
// The table is read by everything that needs to know what a layer keeps: the
// engine (model.cpp) saves by entry and checks every saved tensor's shape and dtype
// against the formula, the adaptive planner's candidates are the entries of the
// decision point, the memory walk (memory_plan.cpp) sizes and groups its saves by
// it, and the simulator (sim/) sizes what each rank keeps by it.
//
// Adding a saved tensor to a block is one entry in ledger.cpp's table (kept in the
// order the forward saves) plus the forward and backward that produce and read it:
// see docs/model.md, "The ledger".
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/tensor.h"
#include "moeflex/core/units.h"
#include "moeflex/model/config.h"

namespace moeflex {

/// The stash layer index of the final norm and the LM head (after every transformer layer).
inline constexpr int kHeadLayer = 1 << 20;

/// Rows of one MoE layer's expert path for one micro-batch on one rank.
struct MoERows {
  std::int64_t permuted = 0;  ///< R: this rank's kept assignments (rows of moe.permuted); n*k when dropless
  std::int64_t received = 0;  ///< Rr: rows this rank's local experts process (= permuted without EP)
  /// Rows of the largest expert-FFN chunk (model.expert_chunk_rows) when they are a
  /// bound rather than the engine's split of these rows; -1: derive them
  /// (largest_chunk). The split is not monotone in the rows: with chunks of at most
  /// 2,048 rows, 2,560 rows run as two chunks of 1,280 but 2,048 as one of 2,048,
  /// so the worst case bounds the chunk by min(received, expert_chunk_rows).
  std::int64_t chunk = -1;

  /// The rows the local experts process: received with EP, else permuted.
  std::int64_t expert_rows(bool ep) const { return ep ? received : permuted; }
  /// Rows of the largest chunk the experts' FFN runs in: `chunk` when set, else
  /// cfg.expert_chunk(expert_rows(ep)) (0 when there are no rows).
  std::int64_t largest_chunk(const ModelConfig& cfg, bool ep) const;
  /// Whether the rows run as one chunk (then zero-bubble schedules let the experts'
  /// weight gradients wait for W). For a bound (`chunk` set): whether some routing
  /// within it does, i.e. whenever there are rows. The rows that wait are then
  /// largest_chunk()'s.
  bool one_chunk(const ModelConfig& cfg, bool ep) const;

  /// Balanced routing of n tokens: R = n*k (capacity dropping ignored), Rr = R.
  static MoERows balanced(const ModelConfig& cfg, std::int64_t n);
  /// The most rows a rank can receive: every EP rank sends every assignment it can
  /// to this rank's experts (a token picks distinct experts, so at most
  /// min(k, local experts) of its k per sending rank), capped by the capacity
  /// factor when one is set; the chunk is the bound over every routing with at most
  /// those rows (see `chunk`).
  static MoERows worst_case(const ModelConfig& cfg, std::int64_t n, int ep_size);
};

/// Where a forward stands when the planner decides: just before the saves of an
/// attention block, of an MoE block (after its router and dispatch, before its
/// experts run), of a dense FFN block, or of the head.
enum class SavePoint { attention, moe, dense_ffn, head };

/// The sizes a shape formula reads, for one micro-batch of B sequences of S tokens
/// on one rank (n = B*S tokens).
struct LedgerDims {
  std::int64_t B = 1, S = 1, n = 1;
  std::int64_t d = 0;         ///< hidden_size
  std::int64_t H = 0;         ///< attention heads
  std::int64_t q = 0, k = 0, v = 0, o = 0;  ///< widths of q, k, v and the attention output
  std::int64_t q_lora = 0, kv_lora = 0, rope = 0;  ///< MLA: q_lora_rank, kv_lora_rank, qk_rope_head_dim
  std::int64_t qn = 0, kn = 0;  ///< QK-norm's rows for q and k (ModelConfig::qk_norm_rows)
  std::int64_t E = 0, topk = 0, f = 0;  ///< experts, experts per token, expert FFN width
  std::int64_t I = 0, fs = 0;           ///< dense FFN width, shared-expert width
  std::int64_t V = 0;                   ///< vocabulary
  std::int64_t R = 0;   ///< rows of the permuted/combined tensors (MoERows::permuted)
  std::int64_t Rr = 0;  ///< rows the local experts process (MoERows::received with EP, else R)

  /// The dims of `cfg` for a micro-batch [B, S] with an MoE layer's rows; `ep`:
  /// an expert-parallel group of more than one rank dispatches (Rr = rows.received).
  static LedgerDims of(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const MoERows& rows, bool ep);
};

/// A saved tensor's shape: up to four dimensions.
struct LedgerShape {
  std::array<std::int64_t, 4> dims{};
  int rank = 0;
  LedgerShape(std::initializer_list<std::int64_t> d);
  std::int64_t numel() const;
  std::vector<std::int64_t> vec() const { return {dims.begin(), dims.begin() + rank}; }
};

/// The dtype a saved tensor is declared with: the engine's activation dtype (fp32,
/// or bf16 in the bf16 engine), or always fp32 / int32.
enum class SavedDType : std::uint8_t { activation, f32, i32 };

/// The block kind an entry belongs to; `ffn` entries (the FFN norm) belong to both
/// FFN kinds.
enum class BlockKind : std::uint8_t { attention, ffn, dense_ffn, moe_ffn, head };

/// The groups in which a forward saves its entries, in this order within a layer:
/// the attention block, MLA's latents, a dense MLP, an MoE layer's experts, its
/// shared expert, its router and dispatch, the FFN norm; the head on its own.
enum class SaveGroup : std::uint8_t { attention, mla_latents, dense_mlp, experts, shared_expert, router, ffn_norm, head };
inline constexpr int kSaveGroups = 8;

/// What a recompute of the entry allocates beside it (its lineage's other outputs,
/// freed when it returns): nothing, an RMSNorm's other output, the attention
/// core's other output, the router's other outputs, the head's losses; or never
/// rebuilt whole (an MoE combine input, rebuilt chunk by chunk in the backward).
enum class Rebuild : std::uint8_t {
  plain, norm_out, norm_rstd, attn_probs, attn_out, router_probs, router_topk_w, lm_head, expert_out,
  qk_norm  ///< QK-norm's roped output: beside it, its rstd for a moment
};

/// Whether the entry has a lineage: never, always, or only without expert
/// parallelism (an all-to-all's output cannot be rebuilt by one rank alone).
enum class Lineage : std::uint8_t { none, always, without_ep };

/// Whether the adaptive planner decides the entry: always, never (it is saved), or
/// in MoE layers only (the FFN norm of a dense layer is saved).
enum class Decided : std::uint8_t { always, never, moe_layers };

/// One saved tensor of the ledger.
struct SavedTensor {
  const char* name;          ///< stash key, e.g. "attn.probs"
  const char* op;            ///< producing op family, as the stash records it
  const char* recompute_op;  ///< what its lineage runs (the planner's ranking without a cost model)
  SavedDType dtype;
  LedgerShape (*shape)(const LedgerDims&);  ///< shape formula
  const char* formula;       ///< the formula as text, e.g. "[n, d]"
  std::array<const char*, 3> inputs;        ///< lineage inputs (the same layer's entries), null-padded
  Lineage lineage;
  bool routed;               ///< its size depends on the routing (MoERows)
  bool chunked;              ///< when recomputed, never held whole: one chunk of rows at a time
  BlockKind block;
  SaveGroup group;
  SavePoint point;           ///< the planner's decision point for it
  Decided decided;
  Rebuild rebuild;
  bool (*present)(const ModelConfig&);  ///< whether the config has it (null: always)

  /// Whether it has a lineage in a chunk dispatched over `ep` (> 1: all-to-alls).
  bool recomputable(bool ep) const { return lineage == Lineage::always || (lineage == Lineage::without_ep && !ep); }
  /// Whether the planner decides it in a layer of this kind (moe: an MoE layer).
  bool planner_decides(bool moe_layer) const {
    return decided == Decided::always || (decided == Decided::moe_layers && moe_layer);
  }
  /// Bytes per element under `cfg` (the activation dtype's, or 4).
  Bytes element_bytes(const ModelConfig& cfg) const {
    return dtype == SavedDType::activation ? Bytes(cfg.activation_bytes()) : 4;
  }
  /// The engine dtype of the tensor, in an engine of activation dtype `act`.
  DType engine_dtype(DType act) const {
    return dtype == SavedDType::activation ? act : dtype == SavedDType::f32 ? DType::f32 : DType::i32;
  }
  /// Exact bytes (numel * element bytes, unrounded) at `dims`.
  Bytes bytes(const ModelConfig& cfg, const LedgerDims& dims) const {
    return Bytes(shape(dims).numel()) * element_bytes(cfg);
  }
};

/// The whole table, in the order a layer's forward saves (attention block, then
/// the FFN block's entries), then the head's entries.
const std::vector<SavedTensor>& ledger_table();

/// The entry named `name` (any block), or null: the first of its variants, which share
/// name, dtype, op and shape (the rebuild and inputs may differ by config).
const SavedTensor* ledger_entry(std::string_view name);

/// The entries a layer of `cfg` keeps, in table order: the attention block's, then
/// the dense or MoE FFN block's (layer = kHeadLayer: the head's).
std::vector<const SavedTensor*> layer_entries(const ModelConfig& cfg, int layer);

/// One activation a layer's forward keeps for its backward, with its exact size:
/// a ledger entry sized for one micro-batch.
struct ActivationSpec {
  std::string name;                 ///< stash key, e.g. "attn.probs"
  std::string op;                   ///< producer family, as the stash records it
  Bytes bytes = 0;                  ///< numel * dtype size (LedgerEntry::bytes)
  bool recomputable = false;        ///< has a lineage (the stash can drop and rebuild it)
  std::vector<std::string> inputs;  ///< the same layer's entries its lineage reads
  bool routed = false;              ///< its size depends on the routing (MoERows)
  int id = -1;                      ///< activation_id(name)
  std::vector<int> input_ids;       ///< activation_id of each input
  const SavedTensor* entry = nullptr;  ///< its ledger entry
};

/// The activations layer `layer`'s forward keeps (attention block then FFN block),
/// for a micro-batch of B sequences of S tokens: the ledger's entries sized. `rows`
/// matters for MoE layers only; `ep` is whether an expert-parallel group of more
/// than one rank dispatches (then the all-to-all outputs have no lineage).
std::vector<ActivationSpec> layer_activations(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S,
                                              const MoERows& rows, bool ep);

/// The activations of the final norm and LM head (stash layer kHeadLayer).
std::vector<ActivationSpec> head_activations(const ModelConfig& cfg, std::int64_t B, std::int64_t S);

/// A small dense integer for an activation name (interned once per process), for
/// fast keys; thread-safe.
int activation_id(std::string_view name);

/// Bytes the recompute of activation `name` allocates beyond the activation itself
/// for a moment (its lineage's other outputs, freed when it returns; the entry's
/// Rebuild), for a micro-batch [B, S]. 0 for a name the ledger does not have.
Bytes rebuild_extra_bytes(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const std::string& name);

/// What one micro-batch's saved activations add up to at balanced routing, block
/// kind by block kind (bytes and tensor count; with `entries`, every entry with its
/// op, formula and bytes): the start-up report of a run, several lines without a
/// final newline. `ep`: the chunk dispatches over an expert-parallel group.
std::string ledger_report(const ModelConfig& cfg, std::int64_t B, std::int64_t S, bool ep, bool entries = false);

}  // namespace moeflex
