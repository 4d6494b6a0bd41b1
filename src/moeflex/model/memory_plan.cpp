// The memory program's core (memory_plan.h): the symbolic arena and stash of a
// MemoryWalk (slots, saves under a provision, rebuilds, prefetches, releases, landing
// offloads), the replay of a rank's actions, the smallest workable budget, and the
// planner's projection of a block. The blocks' own replays are in memory_walk_blocks.cpp.
#include "moeflex/model/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/memory_walk_util.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/schedule/plan.h"

namespace moeflex {

using walk::rounded;

namespace {

/// activation_id without the registry's lock or a full hash, for names this thread
/// has seen (a ledger's few names, over and over): an open-addressed table keyed by
/// the name's length and its first and last 8 bytes, each hit checked in full.
int cached_activation_id(const std::string& name) {
  struct Seen {
    std::string name;
    int id = -1;
  };
  constexpr std::size_t kSize = 256, kMaxFill = 192;
  thread_local std::array<Seen, kSize> table;
  thread_local std::size_t fill = 0;
  const std::size_t n = name.size();
  std::uint64_t head = 0, tail = 0;
  std::memcpy(&head, name.data(), std::min<std::size_t>(n, 8));
  if (n > 8) std::memcpy(&tail, name.data() + n - 8, 8);
  std::uint64_t h = (head * 0x9E3779B97F4A7C15ull) ^ (tail * 0xC2B2AE3D27D4EB4Full) ^ n;
  h ^= h >> 29;
  for (std::size_t i = (h * 0x9E3779B97F4A7C15ull) >> 56;; i = (i + 1) % kSize) {
    Seen& s = table[i];
    if (s.id < 0) {
      const int id = activation_id(name);
      if (fill < kMaxFill) {  // (beyond that, a name not seen yet takes the registry's path)
        s.name = name;
        s.id = id;
        ++fill;
      }
      return id;
    }
    if (s.name == name) return s.id;
  }
}

}  // namespace

bool planner_decides(const ModelConfig& cfg, const LedgerEntry& e) {
  const SavedTensor* entry = ledger_entry(e.name);
  return !entry || entry->planner_decides(e.layer != kHeadLayer && cfg.is_moe_layer(e.layer));
}

Provision most_memory_saving(const ModelConfig& cfg, const LedgerEntry& e) {
  if (!planner_decides(cfg, e)) return Provision::save;
  return e.recomputable ? Provision::recompute : Provision::offload;
}

Bytes minimum_budget(const ModelConfig& cfg, std::int64_t B, std::int64_t S, const StepProgram& program,
                     Bytes persistent) {
  MemoryWalk w(cfg, B, S, persistent);
  const RowsFn worst = [&](int, const StageSpec& st) {
    return std::vector<MoERows>(std::size_t(std::max(0, st.last_layer - st.first_layer)),
                                MoERows::worst_case(cfg, B * S, st.ep_size));
  };
  w.set_offload_weight_reads(true);
  w.run(program.actions, 0, program.stages, worst, [&](const LedgerEntry& e) { return most_memory_saving(cfg, e); });
  return Arena::budget_with_reserve(w.peak());
}

// ---------------------------------------------------------------------------------------------
// MemoryWalk's symbolic arena and stash (a Tensor's constructor is alloc, its
// destruction or reset is free); the blocks' replays are in memory_walk_blocks.cpp.

MemoryWalk::MemoryWalk(const ModelConfig& cfg, std::int64_t B, std::int64_t S, Bytes persistent)
    : cfg_(cfg), B_(B), S_(S), ab_(cfg.activation_bytes()), in_use_(persistent), peak_(persistent) {
  if (cfg_.mla())  // (most walks are of models without: a projection builds many)
    for (const SavedTensor* e : layer_entries(cfg_, 0))
      if (e->group == SaveGroup::mla_latents) mla_latents_.push_back(activation_id(e->name));
}

const MemoryWalk::LayerSpecs& MemoryWalk::specs_of(int layer, const MoERows& rows, bool ep) {
  // Layers of one kind with the same rows list the same activations: build once
  // per thread (a few kinds and rows in practice; beyond kMemo, once per walk).
  const int kind = layer == kHeadLayer ? 2 : cfg_.is_moe_layer(layer) ? 1 : 0;
  const SpecKey key{kind, kind == 1 ? rows.permuted : 0, kind == 1 ? rows.received : 0, ep};
  for (const auto& [k, v] : specs_)
    if (k == key) return *v;
  const auto full = walk::config_key<7>(
      cfg_, {B_, S_, kind, std::get<1>(key), std::get<2>(key), ep, ab_});
  constexpr std::size_t kMemo = 256;
  thread_local std::deque<std::pair<std::array<std::int64_t, walk::kConfigKeyFields + 7>, std::unique_ptr<LayerSpecs>>>
      memo;
  for (const auto& [k, v] : memo)
    if (k == full) {
      specs_.emplace_back(key, v.get());
      return *v;
    }
  auto ls = std::make_unique<LayerSpecs>();
  ls->specs = kind == 2 ? head_activations(cfg_, B_, S_) : layer_activations(cfg_, layer, B_, S_, rows, ep);
  if (ls->specs.size() > std::size_t(kMaxLayerActivations))
    throw Error(fmt::format("memory plan: layer {} keeps {} activations, more than {}", layer, ls->specs.size(),
                            kMaxLayerActivations));
  int ids = 0;
  for (const ActivationSpec& a : ls->specs) ids = std::max(ids, a.id + 1);
  ls->pos.assign(std::size_t(ids), -1);
  for (std::size_t i = 0; i < ls->specs.size(); ++i) {
    const ActivationSpec& a = ls->specs[i];
    ls->pos[std::size_t(a.id)] = std::int8_t(i);
    ls->floor.push_back(most_memory_saving(cfg_, LedgerEntry{a.name, a.op, layer, 0, a.bytes, a.recomputable}));
    ls->rebuild.push_back(a.entry->rebuild);
    ls->group[std::size_t(a.entry->group)].push_back(a.id);
    if (a.entry->chunked) ls->chunked.push_back(a.id);
  }
  const LayerSpecs* out = ls.get();
  if (memo.size() < kMemo) memo.emplace_back(full, std::move(ls));
  else own_specs_.push_back(std::move(ls));
  specs_.emplace_back(key, out);
  return *out;
}

MemoryWalk::Slot& MemoryWalk::slot(int mb, int layer) {
  const std::size_t per = std::size_t(cfg_.num_hidden_layers) + 1;
  const std::size_t i = std::size_t(mb) * per + (layer == kHeadLayer ? per - 1 : std::size_t(layer));
  if (mb < 0 || layer < 0 || (layer != kHeadLayer && std::size_t(layer) >= per - 1))
    throw Error(fmt::format("memory plan: no layer {} of micro-batch {}", layer, mb));
  if (i >= slot_index_.size()) slot_index_.resize((std::size_t(mb) + 1) * per, -1);
  if (slot_index_[i] < 0) {
    slot_index_[i] = int(slots_.size());
    Slot& s = slots_.emplace_back();
    s.mb = mb;
    s.layer = layer;
  }
  return slots_[std::size_t(slot_index_[i])];
}

MemoryWalk::Slot* MemoryWalk::find_slot(int mb, int layer) const {
  if (last_slot_ && last_slot_->mb == mb && last_slot_->layer == layer) return last_slot_;  // a layer's run of lookups
  const std::size_t per = std::size_t(cfg_.num_hidden_layers) + 1;
  const std::size_t i = std::size_t(mb) * per + (layer == kHeadLayer ? per - 1 : std::size_t(layer));
  if (mb < 0 || layer < 0 || i >= slot_index_.size() || slot_index_[i] < 0) return nullptr;
  return last_slot_ = const_cast<Slot*>(&slots_[std::size_t(slot_index_[i])]);
}

MemoryWalk::Entry* MemoryWalk::find_entry(const Slot& s, int id) const {
  if (!s.entries || std::size_t(id) >= s.specs->pos.size()) return nullptr;
  const int pos = s.specs->pos[std::size_t(id)];
  return pos >= 0 && s.entries[pos].present ? &s.entries[pos] : nullptr;
}

void MemoryWalk::alloc(Bytes bytes) {
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  phase_peak_[phase_] = std::max(phase_peak_[phase_], in_use_);
}

void MemoryWalk::touch(Bytes bytes) {
  peak_ = std::max(peak_, in_use_ + bytes);
  phase_peak_[phase_] = std::max(phase_peak_[phase_], in_use_ + bytes);
}

void MemoryWalk::watch(int mb, int layer, SavePoint point) {
  watch_mb_ = mb;
  watch_layer_ = layer;
  watch_attention_ = point == SavePoint::attention;
  phase_ = point == SavePoint::moe ? kCompute : kTail;
  for (auto& p : phase_peak_) p = 0;
  phase_peak_[phase_] = in_use_;
}

void MemoryWalk::enter(Phase phase, int mb, int layer) {
  if (mb != watch_mb_ || layer != watch_layer_ || phase <= phase_) return;
  phase_ = phase;
  phase_peak_[phase_] = std::max(phase_peak_[phase_], in_use_);
}

void MemoryWalk::free(Bytes bytes) { in_use_ -= bytes; }

void MemoryWalk::buffer(int count) {
  const Bytes b = rounded(B_ * S_ * cfg_.hidden_size, ab_);
  if (count > 0) {
    for (int i = 0; i < count; ++i) alloc(b);
  } else {
    free(Bytes(-count) * b);
  }
}

Bytes MemoryWalk::held(int mb) const {
  Bytes h = 0;
  for (const Slot& s : slots_)
    if (s.mb == mb && s.entries)
      for (int i = 0; i < kMaxLayerActivations; ++i)
        if (s.entries[i].present && s.entries[i].on_device) h += Arena::round_up(std::max<Bytes>(1, s.entries[i].bytes));
  return h;
}

Provision MemoryWalk::decide(int mb, int layer, const LayerSpecs& specs, int id, const ProvisionFn& provision) {
  thread_local LedgerEntry le;  // reused: its strings keep their capacity
  const int pos = std::size_t(id) < specs.pos.size() ? specs.pos[std::size_t(id)] : -1;
  if (pos < 0) throw Error(fmt::format("memory plan: no activation #{} in layer {}", id, layer));
  const ActivationSpec& spec = specs.specs[std::size_t(pos)];
  Provision p = Provision::save;
  if (projection_) {
    const bool block = mb == projection_->mb && layer == projection_->layer;
    p = block && std::size_t(id) < projection_->candidate.size() && projection_->candidate[std::size_t(id)]
            ? projection_->block[std::size_t(id)]
            : specs.floor[std::size_t(pos)];
  } else if (provision) {
    le.name.assign(spec.name);
    le.op.assign(spec.op);
    le.layer = layer;
    le.microbatch = mb;
    le.bytes = spec.bytes;
    le.recomputable = spec.recomputable;
    le.provision = Provision::save;
    le.tokens_received = le.tokens_balanced = 0;
    if (has_ctx_) {  // the routing context of an MoE block's saves
      le.tokens_received = ctx_ep_ > 1 ? ctx_rows_.received : ctx_rows_.permuted;
      le.tokens_balanced = B_ * S_ * cfg_.num_experts_per_tok;  // each of ep ranks sends n * k / ep
    }
    p = provision(le);
  }
  if (p == Provision::recompute && !spec.recomputable) p = Provision::save;
  return p;
}

void MemoryWalk::save(int mb, int layer, const LayerSpecs& specs, const std::vector<int>& ids,
                      const ProvisionFn& provision) {
  Slot& s = slot(mb, layer);
  if (!s.specs) s.specs = &specs;
  if (!s.entries) s.entries = entry_blocks_.emplace_back().data();
  for (const int id : ids) {
    const Provision p = decide(mb, layer, specs, id, provision);
    const int pos = specs.pos[std::size_t(id)];
    // (The slot's spec list may be another of the same kind, e.g. the adopted
    // layer's: the same names at the same positions.)
    s.entries[pos] = Entry{specs.specs[std::size_t(pos)].bytes, p, true, true, false};
  }
  // Recomputed entries are freed at their save. An offloaded one keeps its device
  // block while the copy runs, at the latest until the next decision point, where
  // the engine waits for copies in flight (MoEModel::plan_saves): see land().
  for (const int id : ids) {
    Entry& e = s.entries[specs.pos[std::size_t(id)]];
    if (e.provision == Provision::recompute) {
      free(Arena::round_up(std::max<Bytes>(1, e.bytes)));
      e.on_device = false;
    } else if (e.provision == Provision::offload) {
      landing_.push_back({mb, layer, id});
    }
  }
}

void MemoryWalk::get(int mb, int layer, int id) {
  Slot* s = find_slot(mb, layer);
  Entry* e = s ? find_entry(*s, id) : nullptr;
  if (!e) throw Error(fmt::format("memory plan: activation #{} of layer {} micro-batch {} is not saved", id, layer, mb));
  if (e->on_device) return;
  const Bytes size = Arena::round_up(std::max<Bytes>(1, e->bytes));
  if (e->provision == Provision::offload) {  // prefetched back (prefetch_layer)
    alloc(size);
    e->on_device = true;
    return;
  }
  // Recompute: the lineage fetches its inputs, then allocates as model.cpp's lineages do.
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  const std::size_t pos = std::size_t(s->specs->pos[std::size_t(id)]);
  if (s->specs->rebuild[pos] == Rebuild::expert_out)  // (model.cpp: its lineage refuses too)
    throw Error(fmt::format("memory plan: moe.combined of layer {} is rebuilt chunk by chunk by the backward's "
                            "expert loop (expert_chunks), never whole",
                            layer));
  for (const int in : s->specs->specs[pos].input_ids) get(mb, layer, in);
  switch (s->specs->rebuild[pos]) {
    case Rebuild::norm_out:  // y [n, d] and rstd [n], one returned
    case Rebuild::norm_rstd:
      alloc(rounded(n * d, ab_));
      alloc(rounded(n, 4));
      free(s->specs->rebuild[pos] == Rebuild::norm_rstd ? rounded(n * d, ab_) : rounded(n, 4));
      break;
    case Rebuild::attn_probs:  // o and probs, one returned
    case Rebuild::attn_out: {
      const Bytes o = rounded(n * cfg_.attn_out_width(), ab_),
                  p = rounded(B_ * cfg_.num_attention_heads * S_ * S_, ab_);
      alloc(o);
      alloc(p);
      free(s->specs->rebuild[pos] == Rebuild::attn_probs ? o : p);
      break;
    }
    case Rebuild::router_probs:  // probs, topk_w, topk_idx
    case Rebuild::router_topk_w: {
      const Bytes pr = rounded(n * cfg_.num_experts, 4), wt = rounded(n * cfg_.num_experts_per_tok, 4);
      alloc(pr);
      alloc(wt);
      alloc(wt);
      free(wt + (s->specs->rebuild[pos] == Rebuild::router_probs ? wt : pr));
      break;
    }
    case Rebuild::lm_head:  // logits [n, V], then the losses [n] for a moment
      alloc(size);
      alloc(rounded(n, 4));
      free(rounded(n, 4));
      break;
    case Rebuild::qk_norm: {  // QK-norm's roped output, its rstd on top for a moment
      const Bytes r = rounded(cfg_.qk_norm_rows(n, s->specs->specs[pos].name == "attn.q"), 4);
      alloc(size);
      alloc(r);
      free(r);
      break;
    }
    case Rebuild::plain:  // a linear, rope, swiglu, permute or grouped GEMM output: just itself
    case Rebuild::expert_out:
      alloc(size);
      break;
  }
  e->on_device = true;
}

void MemoryWalk::prefetch(int mb, int layer) {
  Slot* s = find_slot(mb, layer);
  if (!s) return;
  if (s->fresh) {  // a summarized layer: its offloads, once
    if (!s->fresh_prefetched && s->fresh->prefetch > 0) alloc(s->fresh->prefetch);
    s->fresh_prefetched = true;
    return;
  }
  if (!s->entries) return;
  for (int i = 0; i < kMaxLayerActivations; ++i) {
    Entry& e = s->entries[i];
    if (e.present && !e.on_device && e.provision == Provision::offload) {
      alloc(Arena::round_up(std::max<Bytes>(1, e.bytes)));
      e.on_device = true;
    }
  }
}

void MemoryWalk::release_layer(int mb, int layer) {
  Slot* s = find_slot(mb, layer);
  if (!s || !s->entries) return;
  for (int i = 0; i < kMaxLayerActivations; ++i) {
    Entry& e = s->entries[i];
    if (!e.present) continue;
    if (e.on_device) {
      const Bytes b = Arena::round_up(std::max<Bytes>(1, e.bytes));
      if (e.pinned) keep(mb, b);  // a deferred weight gradient still reads it
      else free(b);
    }
    e = Entry{};
  }
}

void MemoryWalk::adopt(const LedgerEntry& e, bool on_device, int ep_size) {
  const LayerSpecs& specs = specs_of(e.layer, MoERows::balanced(cfg_, B_ * S_), ep_size > 1);
  const int id = cached_activation_id(e.name);
  if (std::size_t(id) >= specs.pos.size() || specs.pos[std::size_t(id)] < 0)
    throw Error(fmt::format("memory plan: cannot adopt unknown activation '{}'", e.name));
  Slot& s = slot(e.microbatch, e.layer);
  if (!s.specs) s.specs = &specs;
  if (!s.entries) s.entries = entry_blocks_.emplace_back().data();
  s.entries[specs.pos[std::size_t(id)]] = Entry{e.bytes, e.provision, true, on_device, false};
  // An offload whose copy is still in flight: its device block goes once the copy
  // lands, taken (as for the walk's own offloads) as the end of the block under way.
  if (on_device && e.provision == Provision::offload) landing_.push_back({e.microbatch, e.layer, id});
  // The backward needs the layer's rows: read them off the routed entries' sizes.
  s.has_rows = true;
  s.ep_size = ep_size;
  if (id == ID("experts.gate_out")) s.rows.received = e.bytes / (ab_ * cfg_.moe_intermediate_size);
  if (id == ID("moe.combined")) s.rows.permuted = e.bytes / (ab_ * cfg_.hidden_size);
  if (ep_size <= 1 && id == ID("experts.gate_out")) s.rows.permuted = s.rows.received;
}

void MemoryWalk::land() {
  if (phase_ == kLanding) enter(kHeld, watch_mb_, watch_layer_);  // the watched block's offloads go now
  if (probe_ && !probe_landed_) {  // summary_of: the highest use before the first decision point
    probe_landed_ = true;
    probe_pre_peak_ = peak_;
    probe_pre_end_ = in_use_;
    peak_ = in_use_;
  }
  for (const Key& k : landing_) {
    Slot* s = find_slot(k.mb, k.layer);
    Entry* e = s ? find_entry(*s, k.id) : nullptr;
    if (e && e->on_device) {
      free(Arena::round_up(std::max<Bytes>(1, e->bytes)));
      e->on_device = false;
    }
  }
  landing_.clear();
  free(landing_bytes_);
  landing_bytes_ = 0;
}

void MemoryWalk::run(const std::vector<WalkAction>& actions, std::size_t from, const std::vector<StageSpec>& stages,
                     const RowsFn& rows, const ProvisionFn& provision) {
  for (std::size_t i = from; i < actions.size(); ++i) {
    const WalkAction& a = actions[i];
    switch (a.kind) {
      case WalkAction::Kind::forward: {
        const StageSpec& st = stages.at(std::size_t(a.stage));
        forward(a.microbatch, st, rows(a.microbatch, st), provision);
        break;
      }
      case WalkAction::Kind::backward: backward(a.microbatch, stages.at(std::size_t(a.stage))); break;
      case WalkAction::Kind::backward_input: backward(a.microbatch, stages.at(std::size_t(a.stage)), true); break;
      case WalkAction::Kind::weight: weight(a.microbatch, stages.at(std::size_t(a.stage))); break;
      case WalkAction::Kind::alloc_buffer: buffer(1); break;
      case WalkAction::Kind::free_buffer: buffer(-1); break;
    }
  }
}

std::vector<WalkAction> walk_actions(const StepPlan& plan, int rank, std::vector<std::size_t>* walk_at) {
  using K = WalkAction::Kind;
  const int last = plan.num_stages - 1;
  std::vector<WalkAction> w;
  for (const Action& a : plan.actions[std::size_t(rank)]) {
    const int chunk = is_compute(a.kind) ? plan.chunk_of(a.stage) : 0;
    std::size_t at = w.size();
    switch (a.kind) {
      case ActionKind::RecvActivation:
      case ActionKind::RecvGrad: w.push_back({K::alloc_buffer, a.microbatch, 0}); break;
      case ActionKind::SendActivation:
      case ActionKind::SendGrad: w.push_back({K::free_buffer, a.microbatch, 0}); break;
      case ActionKind::Forward:
        w.push_back({K::forward, a.microbatch, chunk});
        if (a.stage > 0) w.push_back({K::free_buffer, a.microbatch, 0});  // its input
        break;
      case ActionKind::Backward:
      case ActionKind::BackwardInput:
        if (a.stage > 0) w.push_back({K::alloc_buffer, a.microbatch, 0});  // dx
        at = w.size();
        w.push_back({a.kind == ActionKind::Backward ? K::backward : K::backward_input, a.microbatch, chunk});
        if (a.stage != last) w.push_back({K::free_buffer, a.microbatch, 0});  // dy
        break;
      case ActionKind::BackwardWeight: w.push_back({K::weight, a.microbatch, chunk}); break;
    }
    if (walk_at) walk_at->push_back(at);
  }
  return w;
}

BlockProjection project_block(const ModelConfig& cfg, const BlockContext& ctx, const BlockChoice* choice) {
  const StageSpec& stage = ctx.stage;
  const int mb = ctx.microbatch, l = ctx.layer;
  const MoERows worst = MoERows::worst_case(cfg, ctx.B * ctx.S, stage.ep_size);
  MemoryWalk w(cfg, ctx.B, ctx.S, ctx.in_use);
  for (const auto& [e, on] : ctx.ledger) w.adopt(e, on, stage.ep_size);
  if (ctx.program)
    w.adopt_pending_weights(*ctx.program);
  w.set_offload_weight_reads(true);  // the later Bs' W reads at their floor, as the planner may take it
  std::vector<MoERows> own(std::size_t(std::max(0, stage.last_layer - stage.first_layer)), worst);
  if (ctx.point == SavePoint::moe) own.at(std::size_t(l - stage.first_layer)) = ctx.rows;
  const RowsFn future = [&](int, const StageSpec& st) {
    return std::vector<MoERows>(std::size_t(std::max(0, st.last_layer - st.first_layer)),
                                MoERows::worst_case(cfg, ctx.B * ctx.S, st.ep_size));
  };
  // The block's candidates take `choice` (kept whole without one: the planner's
  // closed form drops from that), everything else its most memory-saving choice.
  MemoryWalk::Projection policy;
  policy.mb = mb;
  policy.layer = l;
  for (const std::string& name : ctx.candidates) {
    const std::size_t id = std::size_t(cached_activation_id(name));
    if (id >= policy.candidate.size()) {
      policy.candidate.resize(id + 1, 0);
      policy.block.resize(id + 1, Provision::save);
    }
    policy.candidate[id] = 1;
    if (choice)
      if (auto it = choice->find(name); it != choice->end()) policy.block[id] = it->second;
  }
  w.set_projection(&policy);
  w.watch(mb, l, ctx.point);
  w.finish_forward(mb, stage, l, ctx.point, own, nullptr);
  if (ctx.program) w.run(ctx.program->actions, ctx.program->current + 1, ctx.program->stages, future, nullptr);
  else w.backward(mb, stage);
  using P = MemoryWalk;  // (by name: every phase, each into its own field)
  return {.tail = w.phase_peak(P::kTail),
          .landing = w.phase_peak(P::kLanding),
          .held = w.phase_peak(P::kHeld),
          .prefetched = w.phase_peak(P::kPrefetched),
          .backward = w.phase_peak(P::kBackward),
          .backward_rest = w.phase_peak(P::kBackwardRest),
          .after = w.phase_peak(P::kAfter),
          .compute = w.phase_peak(P::kCompute)};
}

Bytes project_weight_reads(const ModelConfig& cfg, const BlockContext& ctx, bool offload) {
  MemoryWalk w(cfg, ctx.B, ctx.S, ctx.in_use);
  for (const auto& [e, on] : ctx.ledger) w.adopt(e, on, ctx.stage.ep_size);
  w.adopt_pending_weights(*ctx.program);
  if (!offload) w.keep_weight_reads(ctx.microbatch, ctx.stage.first_layer);
  w.set_offload_weight_reads(true);
  MemoryWalk::Projection floor;  // no block: every later save at its floor, later layers summarized
  w.set_projection(&floor);
  const RowsFn worst = [&](int, const StageSpec& st) {
    return std::vector<MoERows>(std::size_t(std::max(0, st.last_layer - st.first_layer)),
                                MoERows::worst_case(cfg, ctx.B * ctx.S, st.ep_size));
  };
  w.run(ctx.program->actions, ctx.program->current, ctx.program->stages, worst, nullptr);  // from the B itself
  return w.peak();
}

std::vector<std::int64_t> block_cache_key(const BlockContext& ctx) {
  std::uint64_t digest = 1469598103934665603ull;  // FNV-1a over the ledger's state
  auto mix = [&](std::uint64_t x) { digest = (digest ^ x) * 1099511628211ull; };
  for (const auto& [e, on] : ctx.ledger) {
    mix(std::uint64_t(e.microbatch) << 32 ^ std::uint64_t(e.layer));
    mix(std::uint64_t(cached_activation_id(e.name)));  // (ids are stable within the process)
    mix(std::uint64_t(e.bytes) << 3 ^ std::uint64_t(e.provision) << 1 ^ std::uint64_t(on));
  }
  if (ctx.program)
    for (const auto& [key, groups] : ctx.program->pending_weight_bytes) {
      mix(std::uint64_t(key.first) << 32 ^ std::uint64_t(key.second));
      mix(std::uint64_t(ctx.program->offloaded_weight_reads.count(key)));
      for (const Bytes b : groups) mix(std::uint64_t(b));
    }
  return {ctx.layer, int(ctx.point), ctx.program ? std::int64_t(ctx.program->current) : -1, ctx.rows.permuted,
          ctx.rows.received, std::int64_t(digest)};
}

}  // namespace moeflex
