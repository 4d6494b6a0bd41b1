#include "moeflex/model/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/moe_dispatch.h"

namespace moeflex {

namespace {

constexpr Bytes kF32 = 4;  // f32 and i32 elements alike
Bytes rounded(std::int64_t numel) { return Arena::round_up(std::max<Bytes>(1, numel * kF32)); }

}  // namespace

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
  return r;
}

std::vector<ActivationSpec> layer_activations(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S,
                                              const MoERows& rows, bool ep) {
  const std::int64_t n = B * S, d = cfg.hidden_size, H = cfg.num_attention_heads;
  std::vector<ActivationSpec> v;
  auto add = [&](std::string name, std::string op, std::int64_t numel, bool rec, std::vector<std::string> in,
                 bool routed = false) {
    v.push_back({std::move(name), std::move(op), numel * kF32, rec, std::move(in), routed});
  };
  add("attn_norm.in", "residual", n * d, false, {});
  add("attn_norm.out", "rmsnorm", n * d, true, {"attn_norm.in"});
  add("attn_norm.rstd", "rmsnorm", n, true, {"attn_norm.in"});
  add("attn.q", "rope", n * d, true, {"attn_norm.out"});
  add("attn.k", "rope", n * d, true, {"attn_norm.out"});
  add("attn.v", "linear", n * d, true, {"attn_norm.out"});
  add("attn.probs", "attention", B * H * S * S, true, {"attn.q", "attn.k", "attn.v"});
  add("attn.out", "attention", n * d, true, {"attn.q", "attn.k", "attn.v"});
  auto mlp = [&](const std::string& prefix, std::int64_t w) {
    add(prefix + ".gate_out", "linear", n * w, true, {"ffn_norm.out"});
    add(prefix + ".up_out", "linear", n * w, true, {"ffn_norm.out"});
    add(prefix + ".act", "swiglu", n * w, true, {prefix + ".gate_out", prefix + ".up_out"});
  };
  if (!cfg.is_moe_layer(layer)) {
    mlp("dense", cfg.intermediate_size);
  } else {
    const std::int64_t E = cfg.num_experts, k = cfg.num_experts_per_tok, f = cfg.moe_intermediate_size;
    const std::int64_t R = rows.permuted, Rr = ep ? rows.received : rows.permuted;
    add("experts.in", "dispatch", Rr * d, !ep, {"ffn_norm.out", "moe.slot_of"}, true);
    add("experts.gate_out", "grouped_gemm", Rr * f, true, {"experts.in"}, true);
    add("experts.up_out", "grouped_gemm", Rr * f, true, {"experts.in"}, true);
    add("experts.act", "swiglu", Rr * f, true, {"experts.gate_out", "experts.up_out"}, true);
    add("moe.combined", "combine", R * d, !ep, {"experts.act"}, true);
    if (cfg.n_shared_experts > 0 || cfg.shared_expert_intermediate_size > 0) mlp("shared", cfg.shared_width());
    add("router.logits", "router", n * E, true, {"ffn_norm.out"});
    add("router.probs", "router", n * E, true, {"router.logits"});
    add("router.topk_idx", "router", n * k, false, {});
    add("router.topk_w", "router", n * k, true, {"router.logits"});
    add("moe.offsets", "dispatch", E + 1, false, {});
    add("moe.slot_of", "dispatch", n * k, false, {});
  }
  add("ffn_norm.in", "residual", n * d, false, {});
  add("ffn_norm.out", "rmsnorm", n * d, true, {"ffn_norm.in"});
  add("ffn_norm.rstd", "rmsnorm", n, true, {"ffn_norm.in"});
  return v;
}

std::vector<ActivationSpec> head_activations(const ModelConfig& cfg, std::int64_t B, std::int64_t S) {
  const std::int64_t n = B * S, d = cfg.hidden_size, V = cfg.vocab_size;
  return {{"final_norm.in", "residual", n * d * kF32, false, {}, false},
          {"final_norm.out", "rmsnorm", n * d * kF32, true, {"final_norm.in"}, false},
          {"final_norm.rstd", "rmsnorm", n * kF32, true, {"final_norm.in"}, false},
          {"lm_head.probs", "cross_entropy", n * V * kF32, true, {"final_norm.out"}, false}};
}

// ---------------------------------------------------------------------------------------------
// MemoryWalk: each function below mirrors the same-named one of model.cpp, allocation
// by allocation (a Tensor's constructor is alloc, its destruction or reset is free).

MemoryWalk::MemoryWalk(const ModelConfig& cfg, std::int64_t B, std::int64_t S, Bytes persistent)
    : cfg_(cfg), B_(B), S_(S), in_use_(persistent), peak_(persistent) {}

void MemoryWalk::alloc(Bytes bytes) {
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
}

void MemoryWalk::free(Bytes bytes) { in_use_ -= bytes; }

void MemoryWalk::buffer(int count) {
  const Bytes b = rounded(B_ * S_ * cfg_.hidden_size);
  if (count > 0) {
    for (int i = 0; i < count; ++i) alloc(b);
  } else {
    free(Bytes(-count) * b);
  }
}

Bytes MemoryWalk::held(int mb) const {
  Bytes h = 0;
  for (const auto& [k, e] : stash_)
    if (std::get<0>(k) == mb && e.on_device) h += Arena::round_up(std::max<Bytes>(1, e.spec.bytes));
  return h;
}

void MemoryWalk::save(int mb, int layer, const std::vector<ActivationSpec>& specs,
                      const std::vector<std::string>& names, const ProvisionFn& provision) {
  for (const std::string& name : names) {
    auto it = std::find_if(specs.begin(), specs.end(), [&](const ActivationSpec& s) { return s.name == name; });
    if (it == specs.end()) throw Error(fmt::format("memory plan: no activation '{}' in layer {}", name, layer));
    LedgerEntry le{it->name, it->op, layer, mb, it->bytes, it->recomputable, Provision::save, 0, 0};
    if (ctx_) {  // the routing context of an MoE block's saves
      const auto& [r, ep_size] = *ctx_;
      le.tokens_received = ep_size > 1 ? r.received : r.permuted;
      le.tokens_balanced = B_ * S_ * cfg_.num_experts_per_tok / ep_size;
    }
    Entry e{*it, provision ? provision(le) : Provision::save, true};
    if (e.provision == Provision::recompute && !e.spec.recomputable) e.provision = Provision::save;
    stash_[{mb, layer, name}] = e;
  }
  // Dropped entries are freed at their save; offloads once their copy lands, taken
  // here as the end of the block's saves.
  for (const std::string& name : names) {
    Entry& e = stash_[{mb, layer, name}];
    if (e.provision != Provision::save) {
      free(Arena::round_up(std::max<Bytes>(1, e.spec.bytes)));
      e.on_device = false;
    }
  }
}

void MemoryWalk::get(int mb, int layer, const std::string& name) {
  auto it = stash_.find({mb, layer, name});
  if (it == stash_.end()) throw Error(fmt::format("memory plan: '{}' of layer {} micro-batch {} is not saved", name, layer, mb));
  if (it->second.on_device) return;
  const Bytes size = Arena::round_up(std::max<Bytes>(1, it->second.spec.bytes));
  if (it->second.provision == Provision::offload) {  // prefetched back (prefetch_layer)
    alloc(size);
    it->second.on_device = true;
    return;
  }
  // Recompute: the lineage fetches its inputs, then allocates as model.cpp's lineages do.
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  const ActivationSpec spec = it->second.spec;
  for (const std::string& in : spec.inputs) get(mb, layer, in);
  if (spec.op == "rmsnorm") {  // y [n, d] and rstd [n], one returned
    alloc(rounded(n * d));
    alloc(rounded(n));
    free(name.ends_with(".rstd") ? rounded(n * d) : rounded(n));
  } else if (spec.name == "attn.probs" || spec.name == "attn.out") {  // o and probs, one returned
    const Bytes o = rounded(n * d), p = rounded(B_ * cfg_.num_attention_heads * S_ * S_);
    alloc(o);
    alloc(p);
    free(spec.name == "attn.probs" ? o : p);
  } else if (spec.name == "router.probs" || spec.name == "router.topk_w") {  // probs, topk_w, topk_idx
    const Bytes pr = rounded(n * cfg_.num_experts), wt = rounded(n * cfg_.num_experts_per_tok);
    alloc(pr);
    alloc(wt);
    alloc(wt);
    free(wt + (spec.name == "router.probs" ? wt : pr));
  } else if (spec.name == "lm_head.probs") {  // logits [n, V], then the losses [n] for a moment
    alloc(size);
    alloc(rounded(n));
    free(rounded(n));
    it = stash_.find({mb, layer, name});
    it->second.on_device = true;
    return;
  } else {  // a linear, rope, swiglu, permute or grouped GEMM output: just itself
    alloc(size);
    it = stash_.find({mb, layer, name});
    it->second.on_device = true;
    return;
  }
  it = stash_.find({mb, layer, name});
  it->second.on_device = true;
}

void MemoryWalk::prefetch(int mb, int layer) {
  auto it = stash_.lower_bound(Key{mb, layer, std::string()});
  for (; it != stash_.end() && std::get<0>(it->first) == mb && std::get<1>(it->first) == layer; ++it)
    if (!it->second.on_device && it->second.provision == Provision::offload) {
      alloc(Arena::round_up(std::max<Bytes>(1, it->second.spec.bytes)));
      it->second.on_device = true;
    }
}

void MemoryWalk::release_layer(int mb, int layer) {
  auto it = stash_.lower_bound(Key{mb, layer, std::string()});
  while (it != stash_.end() && std::get<0>(it->first) == mb && std::get<1>(it->first) == layer) {
    if (it->second.on_device) free(Arena::round_up(std::max<Bytes>(1, it->second.spec.bytes)));
    it = stash_.erase(it);
  }
}

void MemoryWalk::forward(int mb, const StageSpec& st, const std::vector<MoERows>& rows, const ProvisionFn& provision) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size, V = cfg_.vocab_size;
  alloc(rounded(n * d));  // stage.input
  for (int l = st.first_layer; l < st.last_layer; ++l) {
    const std::size_t i = std::size_t(l - st.first_layer);
    const MoERows r = i < rows.size() ? rows[i] : MoERows::balanced(cfg_, n);
    const auto specs = layer_activations(cfg_, l, B_, S_, r, st.ep());
    attention_forward(mb, l, specs, provision);
    ffn_forward(mb, l, specs, r, st.ep_size, provision);
  }
  if (!st.head) return;  // the output stays allocated until it is sent
  alloc(rounded(n * d));  // final_norm.out
  alloc(rounded(n));      // final_norm.rstd
  alloc(rounded(n * V));  // lm_head.logits
  alloc(rounded(n));      // cross_entropy.losses
  free(rounded(n));
  save(mb, kHeadLayer, head_activations(cfg_, B_, S_),
       {"final_norm.in", "final_norm.out", "final_norm.rstd", "lm_head.probs"}, provision);
}

void MemoryWalk::attention_forward(int mb, int l, const std::vector<ActivationSpec>& specs,
                                   const ProvisionFn& provision) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  alloc(rounded(n * d));  // a
  alloc(rounded(n));      // rstd
  for (int i = 0; i < 3; ++i) alloc(rounded(n * d));  // q, k, v
  alloc(rounded(n * d));  // o
  alloc(rounded(B_ * cfg_.num_attention_heads * S_ * S_));  // probs
  alloc(rounded(n * d));  // h, the next residual
  save(mb, l, specs,
       {"attn_norm.in", "attn_norm.out", "attn_norm.rstd", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out"},
       provision);
}

void MemoryWalk::mlp_forward(int mb, int l, const std::vector<ActivationSpec>& specs, const std::string& prefix,
                             std::int64_t w, const ProvisionFn& provision) {
  const std::int64_t n = B_ * S_;
  for (int i = 0; i < 3; ++i) alloc(rounded(n * w));  // h1, h3, a
  save(mb, l, specs, {prefix + ".gate_out", prefix + ".up_out", prefix + ".act"}, provision);
}

void MemoryWalk::ffn_forward(int mb, int l, const std::vector<ActivationSpec>& specs, const MoERows& rows,
                             int ep_size, const ProvisionFn& provision) {
  const bool ep = ep_size > 1;
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  alloc(rounded(n * d));  // m
  alloc(rounded(n));      // rstd
  alloc(rounded(n * d));  // out
  if (!cfg_.is_moe_layer(l)) {
    mlp_forward(mb, l, specs, "dense", cfg_.intermediate_size, provision);
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
    const std::int64_t R = rows.permuted, Rr = ep ? rows.received : rows.permuted;
    rows_[{mb, l}] = {rows, ep_size};
    ctx_ = &rows_[{mb, l}];
    alloc(rounded(n * E));  // logits
    alloc(rounded(n * E));  // probs
    alloc(rounded(n * k));  // topk_idx
    alloc(rounded(n * k));  // topk_w
    alloc(rounded(E));      // counts
    alloc(rounded(E + 1));  // offsets
    alloc(rounded(n * k));  // slot_of
    alloc(rounded(R * d));  // moe.permuted
    if (ep) {
      alloc(rounded(Rr * d));  // moe.dispatched
      alloc(rounded(Rr * d));  // all-to-all scratch
      free(rounded(Rr * d));
      free(rounded(R * d));  // moe.permuted
    }
    for (int i = 0; i < 3; ++i) alloc(rounded(Rr * f));  // h1, h3, a
    alloc(rounded(Rr * d));                              // experts.out
    if (ep) {
      alloc(rounded(R * d));   // moe.combined
      alloc(rounded(Rr * d));  // all-to-all scratch
      free(rounded(Rr * d));
      free(rounded(Rr * d));  // experts.out
    }
    save(mb, l, specs, {"experts.in", "experts.gate_out", "experts.up_out", "experts.act", "moe.combined"}, provision);
    if (cfg_.n_shared_experts > 0 || cfg_.shared_expert_intermediate_size > 0)
      mlp_forward(mb, l, specs, "shared", cfg_.shared_width(), provision);
    save(mb, l, specs,
         {"router.logits", "router.probs", "router.topk_idx", "router.topk_w", "moe.offsets", "moe.slot_of"},
         provision);
    free(rounded(E));  // counts
  }
  save(mb, l, specs, {"ffn_norm.in", "ffn_norm.out", "ffn_norm.rstd"}, provision);
  ctx_ = nullptr;
}

void MemoryWalk::backward(int mb, const StageSpec& st) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  prefetch(mb, kHeadLayer);
  if (st.last_layer > st.first_layer) prefetch(mb, st.last_layer - 1);
  alloc(rounded(n * d));  // grad.residual
  if (st.head) {
    get(mb, kHeadLayer, "lm_head.probs");
    alloc(rounded(n * d));  // lm_head.dx
    get(mb, kHeadLayer, "final_norm.out");
    get(mb, kHeadLayer, "final_norm.in");
    get(mb, kHeadLayer, "final_norm.rstd");
    free(rounded(n * d));  // lm_head.dx
  }
  release_layer(mb, kHeadLayer);
  for (int l = st.last_layer - 1; l >= st.first_layer; --l) {
    if (l > st.first_layer) prefetch(mb, l - 1);
    ffn_backward(mb, l);
    attention_backward(mb, l);
    release_layer(mb, l);
  }
  free(rounded(n * d));  // grad.residual
  for (auto it = rows_.begin(); it != rows_.end();)
    it = it->first.first == mb && it->first.second >= st.first_layer && it->first.second < st.last_layer
             ? rows_.erase(it)
             : std::next(it);
}

void MemoryWalk::mlp_backward(int mb, int l, const std::string& prefix, std::int64_t w) {
  const std::int64_t n = B_ * S_;
  alloc(rounded(n * w));  // da
  get(mb, l, prefix + ".act");
  get(mb, l, prefix + ".gate_out");
  get(mb, l, prefix + ".up_out");
  alloc(rounded(n * w));  // dh1
  alloc(rounded(n * w));  // dh3
  free(3 * rounded(n * w));
}

void MemoryWalk::ffn_backward(int mb, int l) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  get(mb, l, "ffn_norm.out");
  alloc(rounded(n * d));  // dm
  if (!cfg_.is_moe_layer(l)) {
    mlp_backward(mb, l, "dense", cfg_.intermediate_size);
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
    const auto [rows, ep_size] = rows_.at({mb, l});
    const bool ep = ep_size > 1;
    const std::int64_t R = rows.permuted, Rr = ep ? rows.received : rows.permuted;
    for (const char* name : {"moe.offsets", "moe.slot_of", "router.topk_idx", "router.topk_w"}) get(mb, l, name);
    alloc(rounded(n * k));  // router.dtopk_w
    alloc(rounded(R * d));  // moe.dcombined
    get(mb, l, "moe.combined");
    if (ep) {
      alloc(rounded(Rr * d));  // experts.dout
      alloc(rounded(Rr * d));  // all-to-all scratch
      free(rounded(Rr * d));
      free(rounded(R * d));  // moe.dcombined
    }
    alloc(rounded(Rr * f));  // experts.dact
    get(mb, l, "experts.act");
    free(rounded(Rr * d));   // experts.dout (or moe.dcombined without EP)
    alloc(rounded(Rr * f));  // dh1
    alloc(rounded(Rr * f));  // dh3
    get(mb, l, "experts.gate_out");
    get(mb, l, "experts.up_out");
    free(rounded(Rr * f));  // experts.dact
    get(mb, l, "experts.in");
    alloc(rounded(Rr * d));  // experts.din
    free(rounded(Rr * f));   // dh1
    alloc(rounded(Rr * d));  // experts.din_up
    free(rounded(Rr * d));
    free(rounded(Rr * f));  // dh3
    if (ep) {
      alloc(rounded(R * d));   // moe.dpermuted
      alloc(rounded(Rr * d));  // all-to-all scratch
      free(rounded(Rr * d));
      free(rounded(R * d));
    }
    free(rounded(Rr * d));  // experts.din
    if (cfg_.n_shared_experts > 0 || cfg_.shared_expert_intermediate_size > 0)
      mlp_backward(mb, l, "shared", cfg_.shared_width());
    get(mb, l, "router.probs");
    get(mb, l, "router.logits");
    alloc(rounded(n * E));  // dprobs
    alloc(rounded(n * E));  // dlogits
    free(rounded(n * E));   // dlogits, after the router GEMM's backward
    free(rounded(n * E));   // dprobs
    free(rounded(n * k));   // router.dtopk_w
  }
  get(mb, l, "ffn_norm.in");
  get(mb, l, "ffn_norm.rstd");
  alloc(rounded(n * d));  // dtmp
  free(2 * rounded(n * d));  // dtmp, dm
}

void MemoryWalk::attention_backward(int mb, int l) {
  const std::int64_t n = B_ * S_, d = cfg_.hidden_size;
  const Bytes probs = rounded(B_ * cfg_.num_attention_heads * S_ * S_);
  for (int i = 0; i < 3; ++i) alloc(rounded(n * d));  // dq, dk, dv
  alloc(rounded(n * d));                              // dout
  get(mb, l, "attn.out");
  for (const char* name : {"attn.q", "attn.k", "attn.v", "attn.probs"}) get(mb, l, name);
  alloc(probs);  // dprobs
  free(probs);
  free(rounded(n * d));  // dout
  get(mb, l, "attn_norm.out");
  alloc(rounded(n * d));  // da
  free(3 * rounded(n * d));  // dq, dk, dv after their GEMMs
  get(mb, l, "attn_norm.in");
  get(mb, l, "attn_norm.rstd");
  alloc(rounded(n * d));  // dtmp
  free(2 * rounded(n * d));  // dtmp, da
}

}  // namespace moeflex
