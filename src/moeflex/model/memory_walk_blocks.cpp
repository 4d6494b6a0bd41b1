// The memory walk's replay of the blocks (MemoryWalk's forward and backward of an
// attention block, a dense or MoE FFN block and the head; the per-layer summaries
// of projection walks). What is saved, its size and its group come from the ledger
// (ledger.h); the workspace around the saves is replayed here in the engine's order
// (attention_block.cpp, moe_block.cpp, model.cpp), checked by test_memory_plan
// against the arena's measured peak.
#include <fmt/format.h>

#include <algorithm>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/memory_walk_util.h"

namespace moeflex {

using walk::rounded;

void MemoryWalk::forward(int mb, const StageSpec& st, const std::vector<MoERows>& rows, const ProvisionFn& provision) {
  alloc(rounded(B_ * S_ * cfg_.hidden_size, ab_));  // stage.input
  forward_layers(mb, st, st.first_layer, rows, provision);
}

MoERows MemoryWalk::rows_at(const StageSpec& st, int l, const std::vector<MoERows>& rows) const {
  const std::size_t i = std::size_t(l - st.first_layer);
  return i < rows.size() ? rows[i] : MoERows::balanced(cfg_, B_ * S_);
}

void MemoryWalk::forward_layers(int mb, const StageSpec& st, int from, const std::vector<MoERows>& rows,
                                const ProvisionFn& provision) {
  for (int l = from; l < st.last_layer; ++l) {
    const MoERows r = rows_at(st, l, rows);
    if (projection_ && !(mb == projection_->mb && l == projection_->layer)) {
      replay_forward(mb, l, r, st.ep_size);  // at the floor: from its summary
      continue;
    }
    const LayerSpecs& specs = specs_of(l, r, st.ep());
    attention_forward(mb, l, specs, provision);
    ffn_forward(mb, l, specs, r, st.ep_size, provision);
  }
  if (!st.head) return;  // the output stays allocated until it is sent
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size, V = cfg_.vocab_size;
  alloc(rounded(n * d, ab_));  // final_norm.out
  alloc(rounded(n, 4));        // final_norm.rstd
  alloc(rounded(n * V, ab_));  // lm_head.logits
  alloc(rounded(n, 4));        // cross_entropy.losses
  free(rounded(n, 4));
  land();  // a decision point
  save_head(mb, provision);
}

void MemoryWalk::save_head(int mb, const ProvisionFn& provision) {
  const LayerSpecs& specs = specs_of(kHeadLayer, {}, false);
  save(mb, kHeadLayer, specs, group(specs, SaveGroup::head), provision);
}

void MemoryWalk::finish_forward(int mb, const StageSpec& st, int l, SavePoint point, const std::vector<MoERows>& rows,
                                const ProvisionFn& provision) {
  land();  // the decision point: copies in flight have landed (the engine waited)
  if (point == SavePoint::head) {
    save_head(mb, provision);
    enter(kLanding, mb, l);
    return;
  }
  const MoERows r = rows_at(st, l, rows);
  const LayerSpecs& specs = specs_of(l, r, st.ep());
  if (point == SavePoint::attention) {
    save(mb, l, specs, group(specs, SaveGroup::attention), provision);
    save(mb, l, specs, group(specs, SaveGroup::mla_latents), provision);
    ffn_forward(mb, l, specs, r, st.ep_size, provision);
  } else if (point == SavePoint::dense_ffn) {
    save(mb, l, specs, group(specs, SaveGroup::dense_mlp), provision);
    save(mb, l, specs, group(specs, SaveGroup::ffn_norm), provision);
  } else {
    Slot& s = slot(mb, l);
    s.has_rows = true;
    s.rows = r;
    s.ep_size = st.ep_size;
    moe_experts(mb, l, specs, provision);
    ffn_moe_tail(mb, l, specs, provision);
  }
  enter(kLanding, mb, l);
  forward_layers(mb, st, l + 1, rows, provision);
}

void MemoryWalk::attention_forward(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  alloc(rounded(n * d, ab_));                                    // a
  alloc(rounded(n, 4));                                          // rstd
  for (const int id : group(specs, SaveGroup::mla_latents))      // MLA: the latents, before the up projections
    alloc(Arena::round_up(specs.specs[std::size_t(specs.pos[std::size_t(id)])].bytes));
  alloc(rounded(n * cfg_.q_width(), ab_));                       // q
  alloc(rounded(n * cfg_.k_width(), ab_));                       // k
  alloc(rounded(n * cfg_.v_width(), ab_));                       // v
  if (cfg_.has_qk_norm()) {                                      // QK-norm: the norms' inputs and rstds
    alloc(rounded(n * cfg_.q_width(), ab_));
    alloc(rounded(n * cfg_.k_width(), ab_));
    alloc(rounded(cfg_.qk_norm_rows(n, true), 4));
    alloc(rounded(cfg_.qk_norm_rows(n, false), 4));
  }
  alloc(rounded(n * cfg_.attn_out_width(), ab_));                // o
  alloc(rounded(B_ * cfg_.num_attention_heads * S_ * S_, ab_));  // probs
  alloc(rounded(n * d, ab_));                                    // h, the next residual
  land();  // a decision point
  save(mb, l, specs, group(specs, SaveGroup::attention), provision);
  save(mb, l, specs, group(specs, SaveGroup::mla_latents), provision);
}

void MemoryWalk::mlp_forward(int mb, int l, const LayerSpecs& specs, bool shared, std::int64_t w,
                             const ProvisionFn& provision) {
  const std::int64_t n = B_ * S_;
  for (int i = 0; i < 3; ++i) alloc(rounded(n * w, ab_));  // h1, h3, a
  if (!shared) land();                                 // a decision point
  save(mb, l, specs,
       group(specs, shared ? SaveGroup::shared_expert : SaveGroup::dense_mlp),
       provision);
}

void MemoryWalk::ffn_forward(int mb, int l, const LayerSpecs& specs, const MoERows& rows, int ep_size,
                             const ProvisionFn& provision) {
  const bool ep = ep_size > 1;
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  alloc(rounded(n * d, ab_));  // m
  alloc(rounded(n, 4));        // rstd
  alloc(rounded(n * d, ab_));  // out
  if (!cfg_.is_moe_layer(l)) {
    mlp_forward(mb, l, specs, false, cfg_.intermediate_size, provision);
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok;
    const std::int64_t R = rows.permuted, Rr = ep ? rows.received : rows.permuted;
    Slot& s = slot(mb, l);
    s.has_rows = true;
    s.rows = rows;
    s.ep_size = ep_size;
    alloc(rounded(n * E, ab_));  // logits
    alloc(rounded(n * E, 4));    // probs
    alloc(rounded(n * k, 4));    // topk_idx
    alloc(rounded(n * k, 4));    // topk_w
    alloc(rounded(E, 4));        // counts
    alloc(rounded(E + 1, 4));    // offsets
    alloc(rounded(n * k, 4));    // slot_of
    alloc(rounded(R * d, ab_));  // moe.permuted
    if (ep) {
      alloc(rounded(Rr * d, ab_));  // moe.dispatched
      alloc(rounded(Rr * d, ab_));  // all-to-all scratch
      free(rounded(Rr * d, ab_));
      free(rounded(R * d, ab_));  // moe.permuted
    }
    land();  // a decision point: after the dispatch, before the experts run
    moe_experts(mb, l, specs, provision);
    ffn_moe_tail(mb, l, specs, provision);
    return;
  }
  save(mb, l, specs, group(specs, SaveGroup::ffn_norm), provision);
}

void MemoryWalk::moe_experts(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision) {
  const Slot& s = slot(mb, l);
  has_ctx_ = true;
  ctx_rows_ = s.rows;
  ctx_ep_ = s.ep_size;
  const bool ep = s.ep_size > 1;
  const std::int64_t d = cfg_.hidden_size, f = cfg_.moe_intermediate_size;
  const std::int64_t R = s.rows.permuted, Rr = ep ? s.rows.received : s.rows.permuted;
  Bytes chunk_bytes = 0;  // the chunk's own FC1 outputs and activation
  for (const int id : specs.chunked) {
    if (decide(mb, l, specs, id, provision) != Provision::recompute)
      alloc(rounded(Rr * f, ab_));  // kept whole
    else if (Rr > 0)
      chunk_bytes += rounded(s.rows.largest_chunk(cfg_, ep) * f, ab_);
  }
  alloc(rounded(Rr * d, ab_));  // experts.out
  touch(chunk_bytes);      // the first (largest) chunk's transients
  if (ep) {
    alloc(rounded(R * d, ab_));   // moe.combined
    alloc(rounded(Rr * d, ab_));  // all-to-all scratch
    free(rounded(Rr * d, ab_));
    free(rounded(Rr * d, ab_));  // experts.out
  }
  has_ctx_ = false;
}

void MemoryWalk::ffn_moe_tail(int mb, int l, const LayerSpecs& specs, const ProvisionFn& provision) {
  const Slot& s = slot(mb, l);
  enter(kTail, mb, l);
  has_ctx_ = true;
  ctx_rows_ = s.rows;
  ctx_ep_ = s.ep_size;
  {
    // The FC1 outputs and activation not kept were never held whole (moe_experts):
    // counted here for save(), which frees a recomputed entry at once.
    const std::int64_t Rr = s.ep_size > 1 ? s.rows.received : s.rows.permuted;
    for (const int id : specs.chunked)
      if (decide(mb, l, specs, id, provision) == Provision::recompute)
        in_use_ += rounded(Rr * cfg_.moe_intermediate_size, ab_);
  }
  save(mb, l, specs, group(specs, SaveGroup::experts), provision);
  if (cfg_.n_shared_experts > 0 || cfg_.shared_expert_intermediate_size > 0)
    mlp_forward(mb, l, specs, true, cfg_.shared_width(), provision);
  save(mb, l, specs, group(specs, SaveGroup::router), provision);
  free(rounded(cfg_.num_experts, 4));  // counts
  save(mb, l, specs, group(specs, SaveGroup::ffn_norm), provision);
  has_ctx_ = false;
}

void MemoryWalk::expert_chunks(int mb, int l, std::int64_t rows, bool defer) {
  const Slot* s = find_slot(mb, l);
  auto kept = [&](int id) {
    const Entry* e = s ? find_entry(*s, id) : nullptr;
    return e && e->provision != Provision::recompute;
  };
  const bool keep1 = kept(ID("experts.gate_out")), keep3 = kept(ID("experts.up_out")), keepa = kept(ID("experts.act"));
  // A dropped combine input (no EP) comes back chunk by chunk in the backward's loop.
  const Entry* combined = s ? find_entry(*s, ID("moe.combined")) : nullptr;
  const bool combine_by_chunk = s && s->ep_size <= 1 && combined && combined->provision == Provision::recompute;
  if (!(keep1 && keep3)) get(mb, l, ID("experts.in"));
  if (keep1) get(mb, l, ID("experts.gate_out"));
  if (keep3) get(mb, l, ID("experts.up_out"));
  if (keepa) {
    get(mb, l, ID("experts.act"));
    if (defer) pin(mb, l, ID("experts.act"));  // W2's dW reads it
  }
  if (rows <= 0) return;  // no rows: no chunk
  // `rows`: the first chunk's, every later one is no larger (a bound for the worst case).
  const Bytes cf = rounded(rows * cfg_.moe_intermediate_size, ab_), cd = rounded(rows * cfg_.hidden_size, ab_);
  // ffn_backward's chunk (model.cpp): dgate, dup, dact, then the rebuilt FC1 outputs;
  // a rebuilt activation goes into dact's block; while they are held, the chunk's
  // rows of a dropped combine input, for a moment.
  alloc(3 * cf);
  const Bytes own = (keep1 ? 0 : cf) + (keep3 ? 0 : cf);
  alloc(own);
  if (combine_by_chunk) touch(cd);  // moe.combined_chunk
  free(own);
  if (defer && !keepa) keep(mb, cf);  // dact's block holds the activation W2's dW reads
  else free(cf);                      // experts.dact
  if (defer) alloc(rounded(rows * cfg_.hidden_size, ab_));  // experts.din of its own (one chunk: all the rows)
  touch(cd);                                         // experts.din_up
  if (defer) keep(mb, 2 * cf);  // dgate and dup wait for W1's and W3's dW
  else free(2 * cf);
}

void MemoryWalk::keep(int mb, Bytes bytes) {
  auto& groups = retained_[{mb, stage_id_}].groups;
  if (groups.empty() || groups.back().first != keep_layer_) groups.emplace_back(keep_layer_, 0);
  groups.back().second += bytes;
}

Bytes MemoryWalk::Retained::total() const {
  Bytes t = 0;
  for (const auto& [layer, bytes] : groups) t += bytes;
  return t;
}

void MemoryWalk::offload_groups(int mb) {
  if (!offload_this_b_) return;
  auto it = retained_.find({mb, stage_id_});
  if (it == retained_.end()) return;
  Retained& r = it->second;
  for (; r.offloaded < r.groups.size(); ++r.offloaded) free(r.groups[r.offloaded].second);
}

void MemoryWalk::pin(int mb, int layer, int id) {
  if (!split_) return;
  Slot* s = find_slot(mb, layer);
  if (Entry* e = s ? find_entry(*s, id) : nullptr) e->pinned = true;
}

Bytes MemoryWalk::retained(int mb, const StageSpec& st) const {
  auto it = retained_.find({mb, st.first_layer});
  return it == retained_.end() ? 0 : it->second.total();
}

void MemoryWalk::weight(int mb, const StageSpec& st) {
  auto it = retained_.find({mb, st.first_layer});
  if (it == retained_.end()) return;
  const Retained& r = it->second;
  for (std::size_t g = 0; g < r.groups.size(); ++g) {
    if (g < r.offloaded) alloc(r.groups[g].second);  // back before the group's GEMMs run
    free(r.groups[g].second);
  }
  retained_.erase(it);
}

void MemoryWalk::adopt_retained(int mb, int first_layer, const std::vector<Bytes>& groups, bool on_device) {
  Retained& r = retained_[{mb, first_layer}];
  for (const Bytes b : groups) r.groups.emplace_back(-2, b);  // (layers of an earlier B: never extended)
  if (!on_device) r.offloaded = r.groups.size();
}

void MemoryWalk::adopt_pending_weights(const StepProgram& program) {
  for (const auto& [key, groups] : program.pending_weight_bytes)
    adopt_retained(key.first, key.second, groups, !program.offloaded_weight_reads.count(key));
}

const MemoryWalk::LayerSummary& MemoryWalk::summary_of(int l, const MoERows& rows, int ep_size) {
  // Everything a layer's replay depends on: the sizes, its kind and rows, whether
  // an EP group dispatches, the activation element size (the floor follows from these).
  const bool moe = cfg_.is_moe_layer(l);
  const SummaryKey key = walk::config_key<9>(cfg_, {B_, S_, moe, moe ? rows.permuted : 0, moe ? rows.received : 0,
                                                    ep_size > 1, moe ? cfg_.expert_chunk_rows : 0,
                                                    moe ? rows.chunk : 0, ab_});
  // Per thread, kept for the process (a few kinds and worst-case rows in practice);
  // beyond kMemo, further summaries live as long as this walk.
  constexpr std::size_t kMemo = 256;
  thread_local std::deque<std::pair<SummaryKey, LayerSummary>> memo;
  for (const auto& [k, v] : memo)
    if (k == key) return v;
  for (const auto& [k, v] : local_summaries_)
    if (k == key) return v;
  LayerSummary sum;
  const ProvisionFn floor = [this](const LedgerEntry& e) { return most_memory_saving(cfg_, e); };
  for (const bool split : {false, true}) {
    // One exact forward from nothing, its landing, prefetch and backward body.
    MemoryWalk w(cfg_, B_, S_, 0);
    const LayerSpecs& specs = w.specs_of(l, rows, ep_size > 1);
    w.probe_ = true;
    w.attention_forward(0, l, specs, floor);
    if (!w.probe_landed_) throw Error("memory plan: a layer forward without a decision point");
    w.ffn_forward(0, l, specs, rows, ep_size, floor);
    sum.pre_peak = w.probe_pre_peak_;
    sum.pre_end = w.probe_pre_end_;
    sum.post_peak = w.peak_;
    sum.delta = w.in_use_;
    sum.landing = 0;
    for (const Key& k : w.landing_)
      if (const Entry* e = w.find_entry(*w.find_slot(k.mb, k.layer), k.id); e && e->on_device)
        sum.landing += Arena::round_up(std::max<Bytes>(1, e->bytes));
    w.land();
    const Bytes landed = w.in_use_;
    w.prefetch(0, l);
    sum.prefetch = w.in_use_ - landed;
    w.split_ = split;
    w.stage_id_ = l;
    const Bytes base = w.in_use_;
    w.peak_ = base;
    w.backward_body(0, l);
    sum.body_peak[split] = w.peak_ - base;
    sum.body_delta[split] = w.in_use_ - base;
    sum.body_retained[split] = w.retained_.empty() ? 0 : w.retained_.begin()->second.total();
  }
  auto& store = memo.size() < kMemo ? memo : local_summaries_;
  return store.emplace_back(key, sum).second;
}

void MemoryWalk::replay_forward(int mb, int l, const MoERows& rows, int ep_size) {
  const LayerSummary& sum = summary_of(l, rows, ep_size);
  touch(sum.pre_peak);
  in_use_ += sum.pre_end;
  land();  // its first decision point: what was copying lands
  touch(sum.post_peak - sum.pre_end);
  in_use_ += sum.delta - sum.pre_end;
  landing_bytes_ += sum.landing;
  Slot& s = slot(mb, l);
  s.fresh = &sum;
  s.fresh_prefetched = false;
}

void MemoryWalk::backward(int mb, const StageSpec& st, bool split) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  split_ = split;
  stage_id_ = st.first_layer;
  offload_this_b_ = split && offload_weight_reads_ && !keep_exceptions_.count({mb, st.first_layer});
  keep_layer_ = kHeadLayer;
  land();  // the engine waits for copies in flight before a backward
  enter(kPrefetched, mb, kHeadLayer);
  prefetch(mb, kHeadLayer);
  if (st.last_layer > st.first_layer) {
    enter(kPrefetched, mb, st.last_layer - 1);
    prefetch(mb, st.last_layer - 1);
  }
  alloc(rounded(n * d, ab_));  // grad.residual
  if (st.head) {
    enter(kBackward, mb, kHeadLayer);
    get(mb, kHeadLayer, ID("lm_head.probs"));
    alloc(rounded(n * d, ab_));  // lm_head.dx
    get(mb, kHeadLayer, ID("final_norm.out"));
    pin(mb, kHeadLayer, ID("lm_head.probs"));  // the LM head's dW reads both
    pin(mb, kHeadLayer, ID("final_norm.out"));
    get(mb, kHeadLayer, ID("final_norm.in"));
    get(mb, kHeadLayer, ID("final_norm.rstd"));
    free(rounded(n * d, ab_));  // lm_head.dx
  }
  release_layer(mb, kHeadLayer);
  offload_groups(mb);
  enter(kAfter, mb, kHeadLayer);
  for (int l = st.last_layer - 1; l >= st.first_layer; --l) {
    keep_layer_ = l;
    if (l > st.first_layer) {
      enter(kPrefetched, mb, l - 1);
      prefetch(mb, l - 1);
    }
    enter(kPrefetched, mb, l);  // (no-op unless watched and not yet entered)
    if (!watch_attention_) enter(kBackward, mb, l);
    Slot* s = find_slot(mb, l);
    if (s && s->fresh) {  // a summarized layer (never the watched one): its body at once
      const LayerSummary& sum = *s->fresh;
      touch(sum.body_peak[split]);
      in_use_ += sum.body_delta[split];
      if (sum.body_retained[split] > 0) keep(mb, sum.body_retained[split]);
      s->fresh = nullptr;
    } else {
      backward_body(mb, l);
    }
    offload_groups(mb);
    enter(kAfter, mb, l);
  }
  keep_layer_ = -1;
  if (split && st.embedding)
    keep(mb, rounded(n * d, ab_));  // the embedding's W scatters it
  else
    free(rounded(n * d, ab_));  // grad.residual
  offload_groups(mb);
  offload_this_b_ = false;
  split_ = false;
  for (int l = st.first_layer; l < st.last_layer; ++l)
    if (Slot* s = find_slot(mb, l)) s->has_rows = false;
}

void MemoryWalk::backward_body(int mb, int l) {
  ffn_backward(mb, l);
  enter(watch_attention_ ? kBackward : kBackwardRest, mb, l);
  attention_backward(mb, l);
  release_layer(mb, l);
}

void MemoryWalk::mlp_backward(int mb, int l, bool shared, std::int64_t w) {
  const std::int64_t n = B_ * S_;
  const std::vector<int>& ids =
      shared ? IDS("shared.act", "shared.gate_out", "shared.up_out") : IDS("dense.act", "dense.gate_out", "dense.up_out");
  alloc(rounded(n * w, ab_));  // da
  get(mb, l, ids[0]);
  pin(mb, l, ids[0]);  // W: down projection
  get(mb, l, ids[1]);
  get(mb, l, ids[2]);
  alloc(rounded(n * w, ab_));  // dh1
  alloc(rounded(n * w, ab_));  // dh3
  free(rounded(n * w, ab_));   // da
  if (split_) {  // dh1 and dh3 wait for the W of the up and gate projections, with the norm's output
    keep(mb, 2 * rounded(n * w, ab_));
    pin(mb, l, ID("ffn_norm.out"));
  } else {
    free(2 * rounded(n * w, ab_));
  }
}

void MemoryWalk::ffn_backward(int mb, int l) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  get(mb, l, ID("ffn_norm.out"));
  alloc(rounded(n * d, ab_));  // dm
  const bool shared = cfg_.n_shared_experts > 0 || cfg_.shared_expert_intermediate_size > 0;
  const bool dy_read_by_w = !cfg_.is_moe_layer(l) || shared;  // the down projections' dW read dy
  if (split_) alloc(rounded(n * d, ab_));                     // ffn.dy, a copy of the residual gradient
  if (!cfg_.is_moe_layer(l)) {
    mlp_backward(mb, l, false, cfg_.intermediate_size);
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok;
    const Slot* s = find_slot(mb, l);
    if (!s || !s->has_rows)
      throw Error(fmt::format("memory plan: no forward of MoE layer {} of micro-batch {} to go back through", l, mb));
    const MoERows rows = s->rows;
    const int ep_size = s->ep_size;
    const bool ep = ep_size > 1;
    const std::int64_t R = rows.permuted, Rr = ep ? rows.received : rows.permuted;
    for (const int id : IDS("moe.offsets", "moe.slot_of", "router.topk_idx", "router.topk_w")) get(mb, l, id);
    alloc(rounded(n * k, 4));             // router.dtopk_w
    if (ep) alloc(rounded(Rr * d, ab_));  // experts.dout (before moe.dcombined, which it outlives)
    alloc(rounded(R * d, ab_));           // moe.dcombined
    const Entry* combined = find_entry(*s, ID("moe.combined"));
    if (ep || !combined || combined->provision != Provision::recompute)  // else chunk by chunk (expert_chunks)
      get(mb, l, ID("moe.combined"));
    if (ep) {
      alloc(rounded(Rr * d, ab_));  // all-to-all scratch
      free(rounded(Rr * d, ab_));
      free(rounded(R * d, ab_));  // moe.dcombined
    }
    // The expert weight gradients wait for W only when the rows make one chunk (model.cpp).
    // (For the worst case's bound: whenever some routing within it makes one chunk.)
    const bool defer = split_ && rows.one_chunk(cfg_, ep);  // (no rows: no chunk, no dW)
    const std::int64_t chunk = rows.largest_chunk(cfg_, ep);
    get(mb, l, ID("experts.in"));
    if (defer) pin(mb, l, ID("experts.in"));  // W1's and W3's dW read it
    expert_chunks(mb, l, chunk, defer);  // (experts.din: written over experts.dout, or see there)
    if (defer) keep(mb, rounded(chunk * d, ab_));  // experts.dout waits for W2's dW
    if (ep) {
      alloc(rounded(R * d, ab_));   // moe.dpermuted
      alloc(rounded(Rr * d, ab_));  // all-to-all scratch
      free(rounded(Rr * d, ab_));
      free(rounded(R * d, ab_));
    }
    free(rounded(Rr * d, ab_));  // experts.din (experts.dout, or moe.dcombined without EP, when not deferred)
    if (shared) mlp_backward(mb, l, true, cfg_.shared_width());
    get(mb, l, ID("router.probs"));
    get(mb, l, ID("router.logits"));
    alloc(rounded(n * E, 4));    // dprobs
    alloc(rounded(n * E, ab_));  // dlogits
    if (split_) {           // waits for the router GEMM's dW, with the norm's output
      keep(mb, rounded(n * E, ab_));
      pin(mb, l, ID("ffn_norm.out"));
    } else {
      free(rounded(n * E, ab_));  // dlogits, after the router GEMM's backward
    }
    free(rounded(n * E, 4));  // dprobs
    free(rounded(n * k, 4));  // router.dtopk_w
  }
  if (split_) {  // ffn.dy: held by the down projections' W, else gone here
    if (dy_read_by_w)
      keep(mb, rounded(n * d, ab_));
    else
      free(rounded(n * d, ab_));
  }
  get(mb, l, ID("ffn_norm.in"));
  get(mb, l, ID("ffn_norm.rstd"));
  alloc(rounded(n * d, ab_));     // dtmp
  free(2 * rounded(n * d, ab_));  // dtmp, dm
}

void MemoryWalk::attention_backward(int mb, int l) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  const Bytes probs = rounded(B_ * cfg_.num_attention_heads * S_ * S_, ab_);
  const Bytes dq = rounded(n * cfg_.q_width(), ab_),
              dkv = rounded(n * cfg_.k_width(), ab_) + rounded(n * cfg_.v_width(), ab_);
  const Bytes dout = rounded(n * cfg_.attn_out_width(), ab_);
  alloc(dq);     // dq
  alloc(dkv);    // dk, dv
  alloc(dout);   // dout (o_proj's dx)
  if (split_) {  // attn.o_proj.dy, a copy of the residual gradient kept for o_proj's dW
    alloc(rounded(n * d, ab_));
    keep(mb, rounded(n * d, ab_));
  }
  get(mb, l, ID("attn.out"));
  pin(mb, l, ID("attn.out"));
  for (const int id : IDS("attn.q", "attn.k", "attn.v", "attn.probs")) get(mb, l, id);
  alloc(probs);  // dprobs
  free(probs);
  free(dout);
  if (cfg_.has_qk_norm()) {  // QK-norm's backward: d of each norm's input, then its dy freed
    for (const int id : IDS("attn.q_norm.in", "attn.q_norm.rstd")) get(mb, l, id);
    alloc(rounded(n * cfg_.q_width(), ab_));
    free(rounded(n * cfg_.q_width(), ab_));
    for (const int id : IDS("attn.k_norm.in", "attn.k_norm.rstd")) get(mb, l, id);
    alloc(rounded(n * cfg_.k_width(), ab_));
    free(rounded(n * cfg_.k_width(), ab_));
  }
  // MLA: the up projections' backward reads the latents and writes their gradients,
  // which the norms and the down projections' backward then consume.
  Bytes dlatent = 0;  // d of q's latent [n, q_lora_rank] and of kv's [n, kv_lora_rank + qk_rope_head_dim]
  for (const int id : mla_latents_) {
    get(mb, l, id);
    pin(mb, l, id);  // under a split, the up projections' deferred dW reads them
  }
  if (cfg_.mla())
    dlatent = (cfg_.q_lora_rank > 0 ? rounded(n * cfg_.q_lora_rank, ab_) : 0) +
              rounded(n * (cfg_.kv_lora_rank + cfg_.qk_rope_head_dim), ab_);
  alloc(dlatent);
  get(mb, l, ID("attn_norm.out"));
  alloc(rounded(n * d, ab_));  // da
  if (split_) {  // dq, dk, dv wait for the W of q, k, v, with the norm's output
    keep(mb, dq + dkv);
    pin(mb, l, ID("attn_norm.out"));
  } else {
    free(dq + dkv);  // dq, dk, dv after their GEMMs
  }
  if (split_) {  // the down projections' deferred dW reads them, with the norm's output
    keep(mb, dlatent);
  } else {
    free(dlatent);
  }
  get(mb, l, ID("attn_norm.in"));
  get(mb, l, ID("attn_norm.rstd"));
  alloc(rounded(n * d, ab_));     // dtmp
  free(2 * rounded(n * d, ab_));  // dtmp, da
}

}  // namespace moeflex
