// The activation ledger's table (ledger.h) and its sized readings: the activations
// a layer keeps, the extra bytes of a rebuild, the start-up report.
#include "moeflex/model/ledger.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

#include "moeflex/core/arena.h"
#include "moeflex/model/memory_walk_util.h"
#include "moeflex/ops/moe_dispatch.h"

namespace moeflex {

using walk::rounded;

LedgerShape::LedgerShape(std::initializer_list<std::int64_t> d) : rank(int(d.size())) {
  std::copy(d.begin(), d.end(), dims.begin());
}

std::int64_t LedgerShape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[std::size_t(i)];
  return n;
}

LedgerDims LedgerDims::of(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const MoERows& rows, bool ep) {
  LedgerDims x;
  x.B = B;
  x.S = S;
  x.n = B * S;
  x.d = cfg.hidden_size;
  x.H = cfg.num_attention_heads;
  x.q = cfg.q_width();
  x.k = cfg.k_width();
  x.v = cfg.v_width();
  x.o = cfg.attn_out_width();
  x.q_lora = cfg.q_lora_rank;
  x.kv_lora = cfg.kv_lora_rank;
  x.rope = cfg.qk_rope_head_dim;
  x.qn = cfg.has_qk_norm() ? cfg.qk_norm_rows(x.n, true) : 0;
  x.kn = cfg.has_qk_norm() ? cfg.qk_norm_rows(x.n, false) : 0;
  x.E = cfg.num_experts;
  x.topk = cfg.num_experts_per_tok;
  x.f = cfg.moe_intermediate_size;
  x.I = cfg.intermediate_size;
  x.fs = cfg.shared_width();
  x.V = cfg.vocab_size;
  x.R = rows.permuted;
  x.Rr = ep ? rows.received : rows.permuted;
  return x;
}

MoERows MoERows::balanced(const ModelConfig& cfg, std::int64_t n) {
  const std::int64_t R = n * cfg.num_experts_per_tok;
  return {R, R};
}

MoERows MoERows::worst_case(const ModelConfig& cfg, std::int64_t n, int ep_size) {
  const std::int64_t E = cfg.num_experts, k = cfg.num_experts_per_tok;
  const std::int64_t local = E / std::max(1, ep_size);
  std::int64_t per_sender = n * std::min(k, local);
  if (cfg.capacity_factor > 0) per_sender = std::min(per_sender, local * ops::expert_capacity(cfg.capacity_factor, n, E, k));
  MoERows r;
  r.permuted = n * k;
  if (cfg.capacity_factor > 0) r.permuted = std::min(r.permuted, E * ops::expert_capacity(cfg.capacity_factor, n, E, k));
  r.received = ep_size > 1 ? per_sender * ep_size : r.permuted;
  const std::int64_t rows = r.expert_rows(ep_size > 1);
  r.chunk = cfg.expert_chunk_rows > 0 ? std::min(rows, cfg.expert_chunk_rows) : rows;
  return r;
}

std::int64_t MoERows::largest_chunk(const ModelConfig& cfg, bool ep) const {
  const std::int64_t rows = expert_rows(ep);
  if (rows <= 0) return 0;
  return chunk >= 0 ? chunk : cfg.expert_chunk(rows);
}

bool MoERows::one_chunk(const ModelConfig& cfg, bool ep) const {
  const std::int64_t rows = expert_rows(ep);
  if (rows <= 0) return false;
  return chunk >= 0 || cfg.expert_chunk(rows) >= rows;
}

namespace {

using D = const LedgerDims&;
using enum SavedDType;
using enum BlockKind;
constexpr Decided dec = Decided::always, nodec = Decided::never, moe_only = Decided::moe_layers;

bool has_mla(const ModelConfig& c) { return c.mla(); }
bool no_mla(const ModelConfig& c) { return !c.mla(); }
bool plain_qk(const ModelConfig& c) { return !c.mla() && !c.has_qk_norm(); }
bool normed_qk(const ModelConfig& c) { return !c.mla() && c.has_qk_norm(); }
bool has_q_latent(const ModelConfig& c) { return c.mla() && c.q_lora_rank > 0; }
bool mla_q_from_norm(const ModelConfig& c) { return c.mla() && c.q_lora_rank <= 0; }
bool has_shared(const ModelConfig& c) { return c.n_shared_experts > 0 || c.shared_expert_intermediate_size > 0; }

/// A row of the table (the fields of SavedTensor in a readable order).
SavedTensor row(const char* name, const char* op, SavedDType dt, LedgerShape (*shape)(D), const char* formula,
                std::array<const char*, 3> inputs, Lineage lin, BlockKind block, SaveGroup group, SavePoint point,
                Decided decided, Rebuild rebuild = Rebuild::plain, bool (*present)(const ModelConfig&) = nullptr,
                const char* recompute_op = nullptr, bool routed = false, bool chunked = false) {
  return SavedTensor{name,    op,      recompute_op ? recompute_op : op, dt, shape, formula, inputs, lin, routed,
                     chunked, block,   group, point, decided, rebuild, present};
}

std::vector<SavedTensor> make_table() {
  constexpr auto A = SavePoint::attention, M = SavePoint::moe, F = SavePoint::dense_ffn, Hd = SavePoint::head;
  const char* const na = "attn_norm.in";
  const char* const no = "attn_norm.out";
  const char* const fo = "ffn_norm.out";
  return {
      // Attention block: x <- x + o_proj(attention(rope(q), rope(k), v)) of RMSNorm(x);
      // under QK-norm q and k are RMSNorm(q_proj(.)), RMSNorm(k_proj(.)) before RoPE.
      row("attn_norm.in", "residual", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]", {}, Lineage::none,
          attention, SaveGroup::attention, A, dec),
      row("attn_norm.out", "rmsnorm", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]", {na}, Lineage::always,
          attention, SaveGroup::attention, A, dec, Rebuild::norm_out),
      row("attn_norm.rstd", "rmsnorm", f32, [](D x) { return LedgerShape{x.n}; }, "[n]", {na}, Lineage::always, attention,
          SaveGroup::attention, A, dec, Rebuild::norm_rstd),
      // MLA's latents (simulator only for now): q's [n, q_lora_rank] twice (the
      // up projection's normed input and its norm's input), kv's [n, kv_lora_rank]
      // twice and the shared rope key [n, qk_rope_head_dim].
      row("attn.q_latent", "linear", activation, [](D x) { return LedgerShape{x.n, 2 * x.q_lora}; }, "[n, 2 q_lora_rank]",
          {no}, Lineage::always, attention, SaveGroup::mla_latents, A, dec, Rebuild::plain, has_q_latent),
      row("attn.kv_latent", "linear", activation, [](D x) { return LedgerShape{x.n, 2 * x.kv_lora + x.rope}; },
          "[n, 2 kv_lora_rank + qk_rope_head_dim]", {no}, Lineage::always, attention, SaveGroup::mla_latents, A, dec,
          Rebuild::plain, has_mla),
      // QK-norm (Qwen3-MoE, OLMoE): the norms' inputs (the projections) and their rstd.
      row("attn.q_norm.in", "linear", activation, [](D x) { return LedgerShape{x.n, x.q}; }, "[n, q_width]", {no},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, normed_qk),
      row("attn.q_norm.rstd", "rmsnorm", f32, [](D x) { return LedgerShape{x.qn}; }, "[n H] or [n]", {},
          Lineage::none, attention, SaveGroup::attention, A, dec, Rebuild::plain, normed_qk),
      row("attn.k_norm.in", "linear", activation, [](D x) { return LedgerShape{x.n, x.k}; }, "[n, k_width]", {no},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, normed_qk),
      row("attn.k_norm.rstd", "rmsnorm", f32, [](D x) { return LedgerShape{x.kn}; }, "[n Hkv] or [n]", {},
          Lineage::none, attention, SaveGroup::attention, A, dec, Rebuild::plain, normed_qk),
      row("attn.q", "rope", activation, [](D x) { return LedgerShape{x.n, x.q}; }, "[n, q_width]", {no}, Lineage::always,
          attention, SaveGroup::attention, A, dec, Rebuild::plain, plain_qk),
      row("attn.q", "rope", activation, [](D x) { return LedgerShape{x.n, x.q}; }, "[n, q_width]", {"attn.q_norm.in"},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::qk_norm, normed_qk),
      row("attn.q", "rope", activation, [](D x) { return LedgerShape{x.n, x.q}; }, "[n, q_width]", {"attn.q_latent"},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, has_q_latent),
      row("attn.q", "rope", activation, [](D x) { return LedgerShape{x.n, x.q}; }, "[n, q_width]", {no}, Lineage::always,
          attention, SaveGroup::attention, A, dec, Rebuild::plain, mla_q_from_norm),
      row("attn.k", "rope", activation, [](D x) { return LedgerShape{x.n, x.k}; }, "[n, k_width]", {no}, Lineage::always,
          attention, SaveGroup::attention, A, dec, Rebuild::plain, plain_qk),
      row("attn.k", "rope", activation, [](D x) { return LedgerShape{x.n, x.k}; }, "[n, k_width]", {"attn.k_norm.in"},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::qk_norm, normed_qk),
      row("attn.k", "rope", activation, [](D x) { return LedgerShape{x.n, x.k}; }, "[n, k_width]", {"attn.kv_latent"},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, has_mla),
      row("attn.v", "linear", activation, [](D x) { return LedgerShape{x.n, x.v}; }, "[n, v_width]", {no},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, no_mla),
      row("attn.v", "linear", activation, [](D x) { return LedgerShape{x.n, x.v}; }, "[n, v_width]", {"attn.kv_latent"},
          Lineage::always, attention, SaveGroup::attention, A, dec, Rebuild::plain, has_mla),
      row("attn.probs", "attention", activation, [](D x) { return LedgerShape{x.B, x.H, x.S, x.S}; }, "[B, H, S, S]",
          {"attn.q", "attn.k", "attn.v"}, Lineage::always, attention, SaveGroup::attention, A, dec,
          Rebuild::attn_probs),
      row("attn.out", "attention", activation, [](D x) { return LedgerShape{x.n, x.o}; }, "[n, attn_out_width]",
          {"attn.q", "attn.k", "attn.v"}, Lineage::always, attention, SaveGroup::attention, A, dec,
          Rebuild::attn_out),
      // Dense FFN block: SwiGLU MLP of width intermediate_size.
      row("dense.gate_out", "linear", activation, [](D x) { return LedgerShape{x.n, x.I}; }, "[n, I]", {fo},
          Lineage::always, dense_ffn, SaveGroup::dense_mlp, F, dec),
      row("dense.up_out", "linear", activation, [](D x) { return LedgerShape{x.n, x.I}; }, "[n, I]", {fo},
          Lineage::always, dense_ffn, SaveGroup::dense_mlp, F, dec),
      row("dense.act", "swiglu", activation, [](D x) { return LedgerShape{x.n, x.I}; }, "[n, I]",
          {"dense.gate_out", "dense.up_out"}, Lineage::always, dense_ffn, SaveGroup::dense_mlp, F, dec),
      // MoE FFN block: route -> permute -> dispatch -> grouped-GEMM experts -> combine.
      row("experts.in", "dispatch", activation, [](D x) { return LedgerShape{x.Rr, x.d}; }, "[Rr, d]",
          {fo, "moe.slot_of"}, Lineage::without_ep, moe_ffn, SaveGroup::experts, M, dec, Rebuild::plain, nullptr, "permute", true),
      row("experts.gate_out", "grouped_gemm", activation, [](D x) { return LedgerShape{x.Rr, x.f}; }, "[Rr, f]",
          {"experts.in"}, Lineage::always, moe_ffn, SaveGroup::experts, M, dec, Rebuild::plain, nullptr, nullptr, true, true),
      row("experts.up_out", "grouped_gemm", activation, [](D x) { return LedgerShape{x.Rr, x.f}; }, "[Rr, f]",
          {"experts.in"}, Lineage::always, moe_ffn, SaveGroup::experts, M, dec, Rebuild::plain, nullptr, nullptr, true, true),
      row("experts.act", "swiglu", activation, [](D x) { return LedgerShape{x.Rr, x.f}; }, "[Rr, f]",
          {"experts.gate_out", "experts.up_out"}, Lineage::always, moe_ffn, SaveGroup::experts, M, dec, Rebuild::plain,
          nullptr, nullptr, true, true),
      row("moe.combined", "combine", activation, [](D x) { return LedgerShape{x.R, x.d}; }, "[R, d]", {"experts.act"},
          Lineage::without_ep, moe_ffn, SaveGroup::experts, M, dec, Rebuild::expert_out, nullptr, "grouped_gemm", true),
      row("shared.gate_out", "linear", activation, [](D x) { return LedgerShape{x.n, x.fs}; }, "[n, fs]", {fo},
          Lineage::always, moe_ffn, SaveGroup::shared_expert, M, nodec, Rebuild::plain, has_shared),
      row("shared.up_out", "linear", activation, [](D x) { return LedgerShape{x.n, x.fs}; }, "[n, fs]", {fo},
          Lineage::always, moe_ffn, SaveGroup::shared_expert, M, nodec, Rebuild::plain, has_shared),
      row("shared.act", "swiglu", activation, [](D x) { return LedgerShape{x.n, x.fs}; }, "[n, fs]",
          {"shared.gate_out", "shared.up_out"}, Lineage::always, moe_ffn, SaveGroup::shared_expert, M, nodec, Rebuild::plain,
          has_shared),
      row("router.logits", "router", activation, [](D x) { return LedgerShape{x.n, x.E}; }, "[n, E]", {fo},
          Lineage::always, moe_ffn, SaveGroup::router, M, dec, Rebuild::plain, nullptr, "linear"),
      row("router.probs", "router", f32, [](D x) { return LedgerShape{x.n, x.E}; }, "[n, E]", {"router.logits"},
          Lineage::always, moe_ffn, SaveGroup::router, M, dec, Rebuild::router_probs),
      row("router.topk_idx", "router", i32, [](D x) { return LedgerShape{x.n, x.topk}; }, "[n, k]", {}, Lineage::none, moe_ffn,
          SaveGroup::router, M, dec),
      row("router.topk_w", "router", f32, [](D x) { return LedgerShape{x.n, x.topk}; }, "[n, k]", {"router.logits"},
          Lineage::always, moe_ffn, SaveGroup::router, M, dec, Rebuild::router_topk_w),
      row("moe.offsets", "dispatch", i32, [](D x) { return LedgerShape{x.E + 1}; }, "[E + 1]", {}, Lineage::none, moe_ffn,
          SaveGroup::router, M, dec),
      row("moe.slot_of", "dispatch", i32, [](D x) { return LedgerShape{x.n * x.topk}; }, "[n k]", {}, Lineage::none, moe_ffn,
          SaveGroup::router, M, dec),
      // The FFN norm of either FFN kind (saved after the block's residual add).
      row("ffn_norm.in", "residual", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]", {}, Lineage::none, ffn,
          SaveGroup::ffn_norm, M, moe_only),
      row("ffn_norm.out", "rmsnorm", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]", {"ffn_norm.in"},
          Lineage::always, ffn, SaveGroup::ffn_norm, M, moe_only, Rebuild::norm_out),
      row("ffn_norm.rstd", "rmsnorm", f32, [](D x) { return LedgerShape{x.n}; }, "[n]", {"ffn_norm.in"},
          Lineage::always, ffn, SaveGroup::ffn_norm, M, moe_only, Rebuild::norm_rstd),
      // Head: final RMSNorm, LM head and cross-entropy (the logits become the probabilities).
      row("final_norm.in", "residual", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]", {}, Lineage::none,
          BlockKind::head, SaveGroup::head, Hd, dec),
      row("final_norm.out", "rmsnorm", activation, [](D x) { return LedgerShape{x.n, x.d}; }, "[n, d]",
          {"final_norm.in"}, Lineage::always, BlockKind::head, SaveGroup::head, Hd, dec, Rebuild::norm_out),
      row("final_norm.rstd", "rmsnorm", f32, [](D x) { return LedgerShape{x.n}; }, "[n]", {"final_norm.in"},
          Lineage::always, BlockKind::head, SaveGroup::head, Hd, dec, Rebuild::norm_rstd),
      row("lm_head.probs", "cross_entropy", activation, [](D x) { return LedgerShape{x.n, x.V}; }, "[n, V]",
          {"final_norm.out"}, Lineage::always, BlockKind::head, SaveGroup::head, Hd, dec, Rebuild::lm_head),
  };
}

bool in_layer(const SavedTensor& e, const ModelConfig& cfg, int layer) {
  if (e.present && !e.present(cfg)) return false;
  if (layer == kHeadLayer) return e.block == BlockKind::head;
  switch (e.block) {
    case BlockKind::attention:
    case BlockKind::ffn: return true;
    case BlockKind::dense_ffn: return !cfg.is_moe_layer(layer);
    case BlockKind::moe_ffn: return cfg.is_moe_layer(layer);
    case BlockKind::head: return false;
  }
  return false;
}

std::vector<ActivationSpec> sized(const ModelConfig& cfg, int layer, const LedgerDims& dims, bool ep) {
  std::vector<ActivationSpec> v;
  for (const SavedTensor* e : layer_entries(cfg, layer)) {
    ActivationSpec a;
    a.name = e->name;
    a.op = e->op;
    a.bytes = e->bytes(cfg, dims);
    a.recomputable = e->recomputable(ep);
    for (const char* in : e->inputs)
      if (in) a.inputs.emplace_back(in);
    a.routed = e->routed;
    a.id = activation_id(a.name);
    for (const auto& x : a.inputs) a.input_ids.push_back(activation_id(x));
    a.entry = e;
    v.push_back(std::move(a));
  }
  return v;
}

}  // namespace

const std::vector<SavedTensor>& ledger_table() {
  static const std::vector<SavedTensor> table = make_table();
  return table;
}

const SavedTensor* ledger_entry(std::string_view name) {
  static const auto by_name = [] {
    std::map<std::string, const SavedTensor*, std::less<>> m;
    for (const SavedTensor& e : ledger_table()) m.emplace(e.name, &e);  // variants share name, dtype and op
    return m;
  }();
  auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : it->second;
}

std::vector<const SavedTensor*> layer_entries(const ModelConfig& cfg, int layer) {
  std::vector<const SavedTensor*> v;
  for (const SavedTensor& e : ledger_table())
    if (in_layer(e, cfg, layer)) v.push_back(&e);
  return v;
}

std::vector<ActivationSpec> layer_activations(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S,
                                              const MoERows& rows, bool ep) {
  return sized(cfg, layer, LedgerDims::of(cfg, B, S, rows, ep), ep);
}

std::vector<ActivationSpec> head_activations(const ModelConfig& cfg, std::int64_t B, std::int64_t S) {
  return sized(cfg, kHeadLayer, LedgerDims::of(cfg, B, S, {}, false), false);
}

Bytes rebuild_extra_bytes(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const std::string& name) {
  const SavedTensor* e = nullptr;  // the variant `cfg` has (variants may rebuild differently)
  for (const SavedTensor& t : ledger_table())
    if (t.name == name && (!t.present || t.present(cfg))) e = e ? e : &t;
  if (!e) return 0;
  const std::int64_t n = B * S;
  const Bytes ab = cfg.activation_bytes();
  switch (e->rebuild) {
    case Rebuild::norm_rstd: return rounded(n * cfg.hidden_size, ab);  // the normed output beside the rstd
    case Rebuild::norm_out: return rounded(n, 4);                      // the rstd beside the output
    case Rebuild::attn_probs: return rounded(n * cfg.attn_out_width(), ab);
    case Rebuild::attn_out: return rounded(B * cfg.num_attention_heads * S * S, ab);
    case Rebuild::router_probs: return 2 * rounded(n * cfg.num_experts_per_tok, 4);
    case Rebuild::router_topk_w: return rounded(n * cfg.num_experts, 4) + rounded(n * cfg.num_experts_per_tok, 4);
    case Rebuild::lm_head: return rounded(n, 4);
    case Rebuild::qk_norm: return rounded(cfg.qk_norm_rows(n, name == "attn.q"), 4);
    case Rebuild::plain:
    case Rebuild::expert_out: return 0;
  }
  return 0;
}

int activation_id(std::string_view name) {
  // Names are few (a layer's activations); ids are dense and stable for the process.
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view v) const { return std::hash<std::string_view>{}(v); }
  };
  using Ids = std::unordered_map<std::string, int, Hash, std::equal_to<>>;
  // A per-thread copy in front of the shared table: ids never change once given, so
  // threads (the search's timing pass) look names up without taking the lock.
  thread_local Ids local;
  if (auto hit = local.find(name); hit != local.end()) return hit->second;
  static std::mutex mu;
  static Ids ids;
  std::lock_guard<std::mutex> lock(mu);
  auto it = ids.find(name);
  if (it == ids.end()) it = ids.emplace(std::string(name), int(ids.size())).first;
  local.emplace(it->first, it->second);
  return it->second;
}

std::string ledger_report(const ModelConfig& cfg, std::int64_t B, std::int64_t S, bool ep, bool entries) {
  const std::int64_t n = B * S;
  const LedgerDims dims = LedgerDims::of(cfg, B, S, MoERows::balanced(cfg, n), ep);
  struct Block {
    const char* title;
    int layer;
    BlockKind kinds[2];
  };
  int dense = -1, moe = -1;  // the first layer of each FFN kind
  for (int l = int(cfg.num_hidden_layers) - 1; l >= 0; --l) (cfg.is_moe_layer(l) ? moe : dense) = l;
  const Block blocks[] = {{"attention block", 0, {BlockKind::attention, BlockKind::attention}},
                          {"dense FFN block", dense, {BlockKind::dense_ffn, BlockKind::ffn}},
                          {"MoE FFN block", moe, {BlockKind::moe_ffn, BlockKind::ffn}},
                          {"head", kHeadLayer, {BlockKind::head, BlockKind::head}}};
  std::string out = fmt::format("ledger: one micro-batch [B {}, S {}] saves, at balanced routing (R = Rr = n k = {}):", B,
                                S, dims.R);
  for (const Block& b : blocks) {
    if (b.layer < 0 || cfg.num_hidden_layers == 0) continue;
    Bytes total = 0;
    int count = 0;
    std::string rows;
    for (const SavedTensor* e : layer_entries(cfg, b.layer)) {
      if (e->block != b.kinds[0] && e->block != b.kinds[1]) continue;
      const Bytes bytes = e->bytes(cfg, dims);
      total += bytes;
      ++count;
      if (entries) rows += fmt::format("\n    {:<18} {:<13} {:<40} {:>12} B", e->name, e->op, e->formula, bytes);
    }
    out += fmt::format("\n  {} ({} B, {} tensors, {:.2f} MiB){}", b.title, total, count, double(total) / (1 << 20), rows);
  }
  return out;
}

}  // namespace moeflex
