// Forward and backward of the MoE transformer (docs/model.md). Every tensor a
// backward needs is saved by name into the ActivationStash; everything else is
// workspace freed as soon as it is used, so the arena's peak is what the ledger says.
#include "moeflex/model/model.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/model/memory_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moeflex/core/op_context.h"
#include "moeflex/core/rng.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/moe_dispatch.h"

namespace moeflex {

namespace {

std::uint64_t name_stream(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// The per-expert offsets of rows [r0, r0 + rows) of a grouped GEMM's input sorted
/// by expert (offsets eoff [El + 1]), from the chunk's first row: out [El + 1].
void chunk_offsets(const std::int32_t* eoff, std::int64_t El, std::int64_t r0, std::int64_t rows, std::int32_t* out) {
  for (std::int64_t e = 0; e <= El; ++e)
    out[e] = std::int32_t(std::clamp<std::int64_t>(std::int64_t(eoff[e]) - r0, 0, rows));
}

}  // namespace

MoEModel::MoEModel(const ModelConfig& cfg, Arena& arena, const ModelParallel& par)
    : cfg_(cfg), arena_(arena), be_(ops::backend_of(arena)), par_(par), dispatcher_(par.ep_group, cfg.num_experts) {
  cfg_.validate();
  if (!cfg_.engine_attention())
    throw ConfigError(
        fmt::format("model: the training engine runs multi-head attention with head_dim = hidden_size / "
                    "num_attention_heads = {}; head_dim {}, num_key_value_heads {} and kv_lora_rank {} (wider "
                    "heads, GQA, MLA) are priced by the simulator only",
                    cfg_.hidden_size / cfg_.num_attention_heads, cfg_.head_dim(), cfg_.kv_heads(), cfg_.kv_lora_rank));
  if (cfg_.group_limited())
    throw ConfigError(
        fmt::format("model: group-limited routing (n_group {}, topk_group {}) is priced by the "
                    "simulator only; the training engine's router picks from all experts (set "
                    "both to 1)",
                    cfg_.n_group, cfg_.topk_group));
  adt_ = cfg_.bf16 ? DType::bf16 : DType::f32;
  if (!be_.host_memory()) {
    if (dispatcher_.active())
      throw ConfigError(fmt::format("expert parallelism (ep {}) on the {} backend needs the NCCL token dispatcher, "
                                    "which is not implemented yet: use --ep 1 on a GPU, or --device cpu",
                                    dispatcher_.ep_size(), to_string(be_.kind())));
    copy_engine_.set_device(&be_);  // offloads and prefetches on the device's copy streams
  }
  stash_.set_device(&arena_, &copy_engine_);
  // Zero-bubble: what queued W work reads stays held until W, across other
  // micro-batches' F and B. Pinned, those blocks would split the free bytes for
  // good (a budget of exactly the memory program's peak would then fail on
  // fragmentation); but W reads them through their Tensor objects only, so they are
  // movable while queued. The stash offers those it also holds (use count = 1 +
  // the queue's); this source the queue's own (copies of the output gradient, the
  // input gradients of the GEMMs, stash tensors the backward has released).
  stash_.set_deferred_readers([this](const Tensor* t) -> long {
    auto it = wgrad_reads_.find(t);
    return it == wgrad_reads_.end() ? 0 : it->second.holds;
  });
  relocatable_id_ = arena_.add_relocatable(
      [this](std::vector<Arena::RelocatableTensor>& out) {
        for (auto& [t, r] : wgrad_reads_)
          if (r.tensor.use_count() == r.holds && t->arena() == &arena_) out.emplace_back(const_cast<Tensor*>(t));
      },
      [this](Tensor* t) { return evict_queued_read(t); });
  if (par_.last_layer < 0) par_.last_layer = int(cfg.num_hidden_layers);
  if (par_.first_layer < 0 || par_.first_layer > par_.last_layer || par_.last_layer > cfg.num_hidden_layers)
    throw ConfigError(fmt::format("model stage holds layers [{}, {}) of {}", par_.first_layer, par_.last_layer,
                                  cfg.num_hidden_layers));
  const std::int64_t d = cfg.hidden_size, V = cfg.vocab_size, f = cfg.moe_intermediate_size;
  const std::int64_t El = dispatcher_.local_experts(), e0 = dispatcher_.first_expert();
  const std::int64_t fs = cfg.shared_width(), I = cfg.intermediate_size;
  // Reserve first: Param* pointers into params_ must stay valid.
  params_.reserve(static_cast<std::size_t>(4 + (par_.last_layer - par_.first_layer) * 13));
  auto add = [&](std::string name, std::vector<std::int64_t> shape, bool no_decay = false) -> Param* {
    Tensor w(arena, shape, MemCategory::weights, name);
    Tensor wc = adt_ == DType::f32 ? Tensor() : Tensor(arena, shape, MemCategory::weights, name + ".working", adt_);
    Tensor g(arena, shape, MemCategory::grads, name);
    g.zero();
    Param& p = params_.emplace_back();
    p.name = std::move(name);
    p.w = std::move(w);
    p.g = std::move(g);
    p.no_decay = no_decay;
    p.wc = std::move(wc);
    return &p;
  };
  auto add_expert = [&](std::string name, std::vector<std::int64_t> shape) -> Param* {
    Param* p = add(std::move(name), shape);
    p->expert = true;
    p->init_offset = e0 * shape[1] * shape[2];
    return p;
  };
  if (par_.embedding) embed_ = add("model.embed_tokens.weight", {V, d});
  for (std::int64_t l = par_.first_layer; l < par_.last_layer; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerParams lp{};
    lp.in_norm = add(p + "input_layernorm.weight", {d}, true);
    lp.q = add(p + "self_attn.q_proj.weight", {d, d});
    lp.k = add(p + "self_attn.k_proj.weight", {d, d});
    lp.v = add(p + "self_attn.v_proj.weight", {d, d});
    lp.o = add(p + "self_attn.o_proj.weight", {d, d});
    lp.post_norm = add(p + "post_attention_layernorm.weight", {d}, true);
    if (cfg.is_moe_layer(l)) {
      lp.gate = add(p + "mlp.gate.weight", {cfg.num_experts, d});
      lp.w1 = add_expert(p + "mlp.experts.gate_proj.weight", {El, f, d});
      lp.w3 = add_expert(p + "mlp.experts.up_proj.weight", {El, f, d});
      lp.w2 = add_expert(p + "mlp.experts.down_proj.weight", {El, d, f});
      if (fs > 0) {
        lp.s1 = add(p + "mlp.shared_experts.gate_proj.weight", {fs, d});
        lp.s3 = add(p + "mlp.shared_experts.up_proj.weight", {fs, d});
        lp.s2 = add(p + "mlp.shared_experts.down_proj.weight", {d, fs});
      }
    } else {
      lp.s1 = add(p + "mlp.gate_proj.weight", {I, d});
      lp.s3 = add(p + "mlp.up_proj.weight", {I, d});
      lp.s2 = add(p + "mlp.down_proj.weight", {d, I});
    }
    layers_.push_back(lp);
  }
  if (par_.head) {
    final_norm_ = add("model.norm.weight", {d}, true);
    // A tied head on a stage without the embedding keeps its own copy of the
    // embedding matrix (same name, same init); the trainer sums the two copies'
    // gradients across the first and last stage.
    if (!cfg.tie_word_embeddings) {
      lm_head_ = add("lm_head.weight", {V, d});
    } else if (embed_) {
      lm_head_ = embed_;
    } else {
      lm_head_ = add("model.embed_tokens.weight", {V, d});
      lm_head_->tied_copy = true;
    }
  }
}

Param& MoEModel::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  throw Error(fmt::format("model has no parameter '{}'", name));
}

void MoEModel::init_weights(std::uint64_t seed) {
  const double out_scale = 1.0 / std::sqrt(2.0 * double(cfg_.num_hidden_layers));
  std::vector<float> staging;  // device weights are written on the host, then copied
  for (auto& p : params_) {
    const std::int64_t n = p.w.numel();
    float* w = p.w.f32();
    if (!be_.host_memory()) {
      staging.resize(std::size_t(n));
      w = staging.data();
    }
    auto upload = [&] {
      if (!be_.host_memory()) be_.copy_from_host(p.w.f32(), w, p.w.nbytes());
    };
    if (p.no_decay) {
      for (std::int64_t i = 0; i < n; ++i) w[i] = 1.0f;
      upload();
      continue;
    }
    double std = cfg_.initializer_range;
    if (p.name.find("o_proj") != std::string::npos || p.name.find("down_proj") != std::string::npos)
      std *= out_scale;
    const std::uint64_t stream = name_stream(p.name);
    const std::uint64_t off = std::uint64_t(p.init_offset);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(std * normal01(seed, stream, off + std::uint64_t(i)));
    upload();
  }
  sync_working_weights();
}

void MoEModel::sync_working_weights() {
  for (auto& p : params_)
    if (p.wc.defined()) be_.cast(p.w.view(), p.wc.view(), p.w.numel());
}

void MoEModel::zero_grads() {
  for (auto& p : params_) p.g.zero();
}

MoEModel::~MoEModel() {
  arena_.remove_relocatable(relocatable_id_);
  wgrad_queue_.clear();
  wgrad_reads_.clear();  // (host copies go back to copy_engine_, destroyed after this)
}

bool MoEModel::evict_queued_read(Tensor* t) {
  auto it = wgrad_reads_.find(t);
  if (it == wgrad_reads_.end() || it->second.tensor.use_count() != it->second.holds || !t->defined()) return false;
  QueuedReads& r = it->second;
  const Bytes bytes = t->nbytes();
  CopyEngine* engine = &copy_engine_;
  r.host = std::shared_ptr<char>(static_cast<char*>(engine->host_alloc(bytes)),
                                 [engine, bytes](char* p) { engine->host_free(p, bytes); });
  copy_engine_.copy(r.host.get(), t->raw(), bytes, "evict W read", /*to_host=*/true).wait();
  r.shape = t->shape();
  r.dtype = t->dtype();
  r.category = t->category();
  t->reset();
  wgrad_bytes_evicted_ += bytes;
  return true;
}

void MoEModel::bring_back(Tensor* t) {
  QueuedReads& r = wgrad_reads_.at(t);
  Tensor back(arena_, r.shape, r.category, "wgrad.bring_back", r.dtype);
  copy_engine_.copy(back.raw(), r.host.get(), back.nbytes(), "bring back W read").wait();
  *t = std::move(back);
  r.host.reset();
}

void MoEModel::count_reads(const std::vector<Shared>& reads, long sign) {
  for (const Shared& t : reads) {
    if (!t) continue;
    QueuedReads& r = wgrad_reads_[t.get()];
    if (sign > 0 && r.holds == 0) r.tensor = t;
    r.holds += sign;
    if (r.holds <= 0) wgrad_reads_.erase(t.get());
  }
}

void MoEModel::weight_grad(int mb, std::vector<Shared> reads, std::function<void()> fn) {
  if (!defer_wgrad_) {
    fn();
    return;
  }
  if (op_context().profiling)  // the W action runs it later: keep its layer for the op profiler
    fn = [fn = std::move(fn), layer = op_context().layer] {
      op_context().layer = layer;
      fn();
    };
  count_reads(reads, +1);
  wgrad_queue_[mb].push_back({std::move(reads), std::move(fn)});
}

void MoEModel::backward_weight(int mb) {
  if (program_) program_->pending_weight_bytes.erase({mb, par_.first_layer});
  auto it = wgrad_queue_.find(mb);
  if (it == wgrad_queue_.end()) return;
  for (PendingWeightGrad& w : it->second) {
    if (!w.fn) continue;  // (ran before an error cut this W short)
    // Running: its tensors are pinned from here (one more reference than the queue
    // counts) until it has run; evicted ones come back first.
    const std::vector<Shared> running = w.reads;
    for (const Shared& t : running)
      if (!t->defined()) bring_back(t.get());
    w.fn();
    count_reads(w.reads, -1);
    w = {};
  }
  wgrad_queue_.erase(it);
}

std::size_t MoEModel::pending_weight_grads(int mb) const {
  auto it = wgrad_queue_.find(mb);
  return it == wgrad_queue_.end() ? 0 : it->second.size();
}

void MoEModel::linear_bw(int mb, const Shared& dy, const Shared& x, Param* w, View dx, std::int64_t n, std::int64_t in,
                         std::int64_t out, bool accumulate_dx) {
  if (dx) be_.linear_backward(dy->view(), x->view(), w->working(), dx, nullptr, n, in, out, accumulate_dx);
  weight_grad(mb, {dy, x}, [this, dy = dy.get(), x = x.get(), w, n, in, out] {
    be_.linear_backward(dy->view(), x->view(), w->working(), nullptr, w->g.f32(), n, in, out, false);
  });
}

MoEModel::Shared MoEModel::copy_of(const Tensor& t, const char* name) {
  Tensor c(arena_, t.shape(), MemCategory::workspace, name, t.dtype());
  be_.copy(c.raw(), t.raw(), t.nbytes());
  return share(std::move(c));
}

RecomputeFn MoEModel::rmsnorm_lineage(int mb, int l, const char* input, const Param* w, bool want_rstd,
                                      std::int64_t n) {
  const std::int64_t d = cfg_.hidden_size;
  const float eps = float(cfg_.rms_norm_eps);
  return [this, mb, l, input, w, want_rstd, n, d, eps] {
    auto x = stash_.get(mb, l, input);
    // The one returned first: the other, freed at once, then leaves no hole under it
    // (a hole under a block its backward holds could not be compacted away).
    Tensor y, r;
    if (want_rstd) r = act({n}, "rmsnorm.rstd", DType::f32);
    y = act({n, d}, "rmsnorm.out");
    if (!want_rstd) r = act({n}, "rmsnorm.rstd", DType::f32);
    be_.rmsnorm_forward(x->view(), w->working(), y.view(), r.f32(), n, d, eps);
    return want_rstd ? std::move(r) : std::move(y);
  };
}

RecomputeFn MoEModel::linear_lineage(int mb, int l, std::string input, const Param* w, std::int64_t n,
                                     std::int64_t in, std::int64_t out, bool rope) {
  return [this, mb, l, input = std::move(input), w, n, in, out, rope] {
    auto x = stash_.get(mb, l, input);
    Tensor y = act({n, out}, "linear.out");
    be_.linear_forward(x->view(), w->working(), y.view(), n, in, out);
    if (rope)
      be_.rope_forward(y.view(), n / rope_seq_, rope_seq_, cfg_.num_attention_heads, cfg_.head_dim(), cfg_.rope_theta);
    return y;
  };
}

RecomputeFn MoEModel::swiglu_lineage(int mb, int l, std::string gate, std::string up) {
  return [this, mb, l, gate = std::move(gate), up = std::move(up)] {
    auto g = stash_.get(mb, l, gate), u = stash_.get(mb, l, up);
    Tensor a(arena_, g->shape(), MemCategory::activations, "swiglu.out", g->dtype());
    be_.swiglu_forward(g->view(), u->view(), a.view(), a.numel());
    return a;
  };
}

void MoEModel::plan_saves(int mb, int l, SavePoint point, std::initializer_list<Held> held, const MoERows& rows) {
  if (!planner_) return;
  BlockContext ctx;
  ctx.microbatch = mb;
  ctx.layer = l;
  ctx.point = point;
  ctx.B = batch_;
  ctx.S = rope_seq_;
  ctx.rows = rows;
  ctx.stage = stage_spec();
  ctx.program = program_;
  // Offloads still copying land here: the memory program frees them at decisions.
  const std::vector<ActivationStash*> stashes = rank_stashes();
  for (ActivationStash* st : stashes) st->sync();
  ctx.in_use = arena_.in_use();
  for (ActivationStash* st : stashes) {  // what the rank holds now, from every chunk's stash
    auto part = st->ledger();
    ctx.ledger.insert(ctx.ledger.end(), part.begin(), part.end());
  }
  // Exposed seconds of not keeping each candidate, from the calibrated cost model:
  // its recompute time, or the part of its offload and prefetch copies that the
  // rest of the forward and the backward of the layer above cannot hide.
  LayerCost lc;
  if (cost_model_) {
    LayerWork work{ctx.B, ctx.S, point == SavePoint::moe ? rows : MoERows::balanced(cfg_, ctx.B * ctx.S), ctx.stage.ep_size};
    lc = l == kHeadLayer ? head_cost(*cost_model_, cfg_, work) : layer_cost(*cost_model_, cfg_, l, work);
  }
  std::vector<SaveCandidate> v;
  const bool ep = dispatcher_.active(), moe_layer = l != kHeadLayer && cfg_.is_moe_layer(l);
  const LedgerDims dims = LedgerDims::of(cfg_, batch_, rope_seq_, rows, ep);
  LedgerDims chunk_dims = dims;  // one chunk of the experts' rows (model.expert_chunk_rows)
  chunk_dims.Rr = cfg_.expert_chunk(dims.Rr);
  std::size_t found = 0;
  // The candidates: the ledger's entries of this decision point, in ledger order.
  for (const SavedTensor* e : layer_entries(cfg_, l)) {
    if (e->point != point || !e->planner_decides(moe_layer)) continue;
    const Tensor* t = nullptr;
    for (const Held& h : held)
      if (std::string_view(h.name) == e->name) t = h.t;
    found += t != nullptr;
    if (t && !t->defined()) continue;
    const std::string name = e->name;
    const Bytes bytes = t ? t->nbytes() : e->bytes(cfg_, dims);
    const bool recomputable = e->recomputable(ep);
    // In an MoE block the router and FFN-norm entries are saved after the shared expert ran.
    const bool first = point != SavePoint::moe || e->group == SaveGroup::experts;
    const Bytes chunk = e->chunked && dims.Rr > 0 ? Arena::round_up(e->bytes(cfg_, chunk_dims)) : 0;
    Seconds drop = 0;
    if (cost_model_) {
      drop = recomputable ? lc.recompute_seconds(name)
                          : overlapped(cost_model_->copy_d2h(bytes), lc.forward) +
                                overlapped(cost_model_->copy_h2d(bytes), lc.backward());
      drop = std::max(drop, 1e-9);  // never free: an even trade goes to the bytes that cost nothing
    }
    v.push_back({name, e->recompute_op, bytes, recomputable, drop, rebuild_extra_bytes(cfg_, ctx.B, ctx.S, name), first,
                 chunk});
    ctx.candidates.push_back(name);
  }
  if (found != held.size())
    throw Error(fmt::format("model: a tensor held at layer {}'s decision point is not a ledger candidate there", l));
  planner_->plan_block(mb, l, v, [&](const BlockChoice* choice) { return project_block(cfg_, ctx, choice); },
                       block_cache_key(ctx));
}

LedgerDims MoEModel::ledger_dims() const {
  return LedgerDims::of(cfg_, batch_, rope_seq_, saving_rows_, dispatcher_.active());
}

void MoEModel::save(int mb, int l, std::string_view name, Tensor t, RecomputeFn lineage) {
  const SavedTensor* e = ledger_entry(name);
  if (!e) throw Error(fmt::format("model: '{}' of layer {} is saved but has no ledger entry (model/ledger.cpp)", name, l));
  const std::vector<std::int64_t> want = e->shape(ledger_dims()).vec();
  const DType dt = e->engine_dtype(adt_);
  if (t.shape() != want || t.dtype() != dt)
    throw Error(fmt::format("model: '{}' of layer {} is saved as [{}] {}, but the ledger says {} = [{}] {}", name, l,
                            fmt::join(t.shape(), ", "), to_string(t.dtype()), e->formula, fmt::join(want, ", "),
                            to_string(dt)));
  stash_.save(mb, l, name, e->op, std::move(t), std::move(lineage));
}

Provision MoEModel::reserve(int mb, int l, std::string_view name) {
  const SavedTensor* e = ledger_entry(name);
  if (!e || !e->chunked) throw Error(fmt::format("model: '{}' is not a chunked ledger entry", name));
  return stash_.reserve(mb, l, name, e->op, e->bytes(cfg_, ledger_dims()), e->recomputable(dispatcher_.active()));
}

Tensor MoEModel::act(std::vector<std::int64_t> shape, const char* name, DType dt) {
  return Tensor(arena_, std::move(shape), MemCategory::activations, name, dt);
}

Tensor MoEModel::work(std::vector<std::int64_t> shape, const char* name, DType dt) {
  return Tensor(arena_, std::move(shape), MemCategory::workspace, name, dt);
}

LossParts MoEModel::forward_eval(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B,
                                 std::int64_t S, float* last_logits) {
  return forward(ids, targets, B, S, /*mb=*/0, /*train=*/false, last_logits);
}

LossParts MoEModel::forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B,
                                     std::int64_t S, int microbatch, double grad_scale) {
  LossParts loss = forward_train(ids, targets, B, S, microbatch);
  backward(ids, targets, B, S, microbatch, grad_scale);
  return loss;
}

LossParts MoEModel::forward_train(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B,
                                  std::int64_t S, int microbatch) {
  return forward(ids, targets, B, S, microbatch, /*train=*/true, nullptr);
}

void MoEModel::backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                        int mb, double grad_scale) {
  if (!par_.embedding || !par_.head) throw Error("backward() needs the whole model; use backward_stage()");
  backward_stage(ids, targets, nullptr, nullptr, B, S, mb, grad_scale);
}

LossParts MoEModel::forward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                            int mb, bool train, float* last_logits) {
  if (!par_.embedding || !par_.head) throw Error("forward() needs the whole model; use forward_stage()");
  LossParts loss;
  forward_impl(ids, targets, nullptr, B, S, mb, train, loss, last_logits);
  return loss;
}

Tensor MoEModel::forward_stage(const std::int32_t* ids, const std::int32_t* targets, CView x_in, std::int64_t B,
                               std::int64_t S, int mb, LossParts* loss, bool train) {
  LossParts local;
  Tensor out = forward_impl(ids, targets, x_in, B, S, mb, train, local, nullptr);
  if (loss) *loss = local;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Whole stage

Tensor MoEModel::forward_impl(const std::int32_t* ids, const std::int32_t* targets, CView x_in, std::int64_t B,
                              std::int64_t S, int mb, bool train, LossParts& loss, float* last_logits) {
  if (train && expert_impl_ != ExpertImpl::grouped_gemm)
    throw Error("the sequential-experts reference path is forward-only (use it with forward_eval)");
  if (S > cfg_.max_position_embeddings)
    throw ConfigError(fmt::format("sequence length {} exceeds model.max_position_embeddings = {}", S,
                                  cfg_.max_position_embeddings));
  const std::int64_t n = B * S, d = cfg_.hidden_size, V = cfg_.vocab_size;
  if (train) {  // the micro-batch's shape, for the ledger's formulas and the lineages' RoPE
    batch_ = B;
    rope_seq_ = S;
  }

  Tensor x = act({n, d}, "stage.input");
  op_context().layer = kOpLayerEmbedding;  // the layer under way, for the op profiler
  if (par_.embedding) {
    for (std::int64_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= V) throw DataError(fmt::format("token id {} out of range [0, {}) at position {}", ids[i], V, i));
    be_.embedding_forward(ids, embed_->working(), x.view(), n, d);
  } else {
    if (x_in.dtype != adt_)
      throw Error(fmt::format("stage input is {} but the model runs in {}", to_string(x_in.dtype), to_string(adt_)));
    be_.copy(x.raw(), x_in.data, x.nbytes());
  }
  for (int l = par_.first_layer; l < par_.last_layer; ++l) {
    op_context().layer = l;
    attention_forward(l, x, B, S, mb, train);
    ffn_forward(l, x, n, mb, train, loss);
  }
  if (!par_.head) {
    loss.total = loss.aux + loss.z;
    return x;
  }
  op_context().layer = kHeadLayer;
  Tensor hn = act({n, d}, "final_norm.out");
  Tensor rstd = act({n}, "final_norm.rstd", DType::f32);
  be_.rmsnorm_forward(x.view(), final_norm_->working(), hn.view(), rstd.f32(), n, d, float(cfg_.rms_norm_eps));
  Tensor logits = act({n, V}, "lm_head.logits");
  be_.linear_forward(hn.view(), lm_head_->working(), logits.view(), n, d, V);
  if (last_logits) {
    // Each sequence's last row, widened to fp32 on the host (bf16 -> f32 is exact).
    std::vector<bf16> row(adt_ == DType::bf16 ? std::size_t(V) : 0);
    for (std::int64_t b = 0; b < B; ++b) {
      const CView src = logits.view() + ((b + 1) * S - 1) * V;
      if (adt_ == DType::f32) {
        be_.copy_to_host(last_logits + b * V, src.data, Bytes(sizeof(float)) * V);
      } else {
        be_.copy_to_host(row.data(), src.data, Bytes(sizeof(bf16)) * V);
        for (std::int64_t v = 0; v < V; ++v) last_logits[b * V + v] = to_float(row[std::size_t(v)]);
      }
    }
  }
  if (!targets) {
    if (train) throw Error("training needs targets");
    return Tensor();
  }
  for (std::int64_t i = 0; i < n; ++i)
    if (targets[i] < 0 || targets[i] >= V) throw DataError(fmt::format("target id {} out of range [0, {}) at position {}", targets[i], V, i));
  {
    Tensor losses = work({n}, "cross_entropy.losses", DType::f32);
    loss.ce = be_.cross_entropy_forward(logits.view(), targets, logits.view(), losses.f32(), n, V);
  }
  loss.total = loss.ce + loss.aux + loss.z;
  if (train) {
    plan_saves(mb, kHeadLayer, SavePoint::head,
               {{"final_norm.in", &x}, {"final_norm.out", &hn}, {"final_norm.rstd", &rstd}, {"lm_head.probs", &logits}});
    save(mb, kHeadLayer, "final_norm.in", std::move(x));
    save(mb, kHeadLayer, "final_norm.out", std::move(hn),
                rmsnorm_lineage(mb, kHeadLayer, "final_norm.in", final_norm_, false, n));
    save(mb, kHeadLayer, "final_norm.rstd", std::move(rstd),
                rmsnorm_lineage(mb, kHeadLayer, "final_norm.in", final_norm_, true, n));
    save(mb, kHeadLayer, "lm_head.probs", std::move(logits), [this, mb, targets, n, d, V] {
      auto hn = stash_.get(mb, kHeadLayer, "final_norm.out");
      Tensor probs = act({n, V}, "lm_head.logits");
      be_.linear_forward(hn->view(), lm_head_->working(), probs.view(), n, d, V);
      Tensor losses = work({n}, "cross_entropy.losses", DType::f32);
      be_.cross_entropy_forward(probs.view(), targets, probs.view(), losses.f32(), n, V);
      return probs;
    });
  }
  return Tensor();
}

void MoEModel::backward_stage(const std::int32_t* ids, const std::int32_t* targets, CView dy, View dx_in,
                              std::int64_t B, std::int64_t S, int mb, double grad_scale) {
  const std::int64_t n = B * S, d = cfg_.hidden_size, V = cfg_.vocab_size;
  if (defer_wgrad_ && program_) {
    // What this B will leave held for its W, for the planner's projections until
    // then: the memory program's own split backward over this micro-batch's ledger.
    const StageSpec st = stage_spec();
    MemoryWalk w(cfg_, B, S, 0);
    for (const auto& [e, on] : stash_.ledger())
      if (e.microbatch == mb) w.adopt(e, on, st.ep_size);
    w.backward(mb, st, true);
    program_->pending_weight_bytes[{mb, st.first_layer}] = w.retained(mb, st);
  }
  // Offloads still copying land first (the memory program assumes so), then the
  // offloaded activations come back one layer ahead of their backward.
  for (ActivationStash* st : rank_stashes()) st->sync();
  stash_.prefetch_layer(mb, kHeadLayer);
  if (par_.last_layer > par_.first_layer) stash_.prefetch_layer(mb, par_.last_layer - 1);
  Tensor dx = work({n, d}, "grad.residual");
  op_context().layer = kHeadLayer;
  if (par_.head) {
    Shared probs = stash_.get(mb, kHeadLayer, "lm_head.probs");
    be_.cross_entropy_backward(probs->view(), targets, probs->view(), n, V, float(grad_scale / double(n)));
    Tensor dhn = work({n, d}, "lm_head.dx");
    linear_bw(mb, probs, stash_.get(mb, kHeadLayer, "final_norm.out"), lm_head_, dhn.view(), n, d, V, false);
    Shared x = stash_.get(mb, kHeadLayer, "final_norm.in"), rstd = stash_.get(mb, kHeadLayer, "final_norm.rstd");
    be_.rmsnorm_backward(dhn.view(), x->view(), final_norm_->working(), rstd->f32(), dx.view(), final_norm_->g.f32(), n,
                         d);
  } else {
    if (dy.dtype != adt_)
      throw Error(
          fmt::format("stage output gradient is {} but the model runs in {}", to_string(dy.dtype), to_string(adt_)));
    be_.copy(dx.raw(), dy.data, dx.nbytes());
  }
  stash_.release_layer(mb, kHeadLayer);
  for (int l = par_.last_layer - 1; l >= par_.first_layer; --l) {
    if (l > par_.first_layer) stash_.prefetch_layer(mb, l - 1);
    op_context().layer = l;
    ffn_backward(l, dx, n, mb, grad_scale);
    attention_backward(l, dx, B, S, mb);
    stash_.release_layer(mb, l);
  }
  op_context().layer = kOpLayerEmbedding;
  if (par_.embedding) {
    // Part of W when the backward is split: with tied embeddings, the LM head's dW
    // (queued first) and this scatter then add up in the same order either way.
    Shared g = share(std::move(dx));
    weight_grad(mb, {g},
                [g = g.get(), ids, n, d, this] { be_.embedding_backward(ids, g->view(), embed_->g.f32(), n, d); });
  } else {
    if (dx_in.dtype != adt_)
      throw Error(
          fmt::format("stage input gradient is {} but the model runs in {}", to_string(dx_in.dtype), to_string(adt_)));
    be_.copy(dx_in.data, dx.raw(), dx.nbytes());
  }
  stash_.release_microbatch(mb);
}

// ---------------------------------------------------------------------------------------------
// Attention block: x <- x + o_proj(attention(rope(q), rope(k), v)) of RMSNorm(x)

void MoEModel::attention_forward(int l, Tensor& x, std::int64_t B, std::int64_t S, int mb, bool train) {
  const LayerParams& P = layer(l);
  const std::int64_t n = B * S, d = cfg_.hidden_size, H = cfg_.num_attention_heads, hd = cfg_.head_dim();
  Tensor a = act({n, d}, "attn_norm.out"), rstd = act({n}, "attn_norm.rstd", DType::f32);
  be_.rmsnorm_forward(x.view(), P.in_norm->working(), a.view(), rstd.f32(), n, d, float(cfg_.rms_norm_eps));
  Tensor q = act({n, d}, "attn.q"), k = act({n, d}, "attn.k"), v = act({n, d}, "attn.v");
  be_.linear_forward(a.view(), P.q->working(), q.view(), n, d, d);
  be_.linear_forward(a.view(), P.k->working(), k.view(), n, d, d);
  be_.linear_forward(a.view(), P.v->working(), v.view(), n, d, d);
  be_.rope_forward(q.view(), B, S, H, hd, cfg_.rope_theta);
  be_.rope_forward(k.view(), B, S, H, hd, cfg_.rope_theta);
  Tensor o = act({n, d}, "attn.out"), probs = act({B, H, S, S}, "attn.probs");
  be_.attention_forward(q.view(), k.view(), v.view(), o.view(), probs.view(), B, S, H, hd);
  Tensor h = act({n, d}, "attn.residual");
  be_.linear_forward(o.view(), P.o->working(), h.view(), n, d, d);
  be_.add_inplace(h.view(), x.view(), n * d);
  if (train) {
    rope_seq_ = S;
    batch_ = B;
    plan_saves(mb, l, SavePoint::attention,
               {{"attn_norm.in", &x}, {"attn_norm.out", &a}, {"attn_norm.rstd", &rstd}, {"attn.q", &q}, {"attn.k", &k},
                {"attn.v", &v}, {"attn.probs", &probs}, {"attn.out", &o}});
    save(mb, l, "attn_norm.in", std::move(x));
    save(mb, l, "attn_norm.out", std::move(a), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, false, n));
    save(mb, l, "attn_norm.rstd", std::move(rstd), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, true, n));
    save(mb, l, "attn.q", std::move(q), linear_lineage(mb, l, "attn_norm.out", P.q, n, d, d, true));
    save(mb, l, "attn.k", std::move(k), linear_lineage(mb, l, "attn_norm.out", P.k, n, d, d, true));
    save(mb, l, "attn.v", std::move(v), linear_lineage(mb, l, "attn_norm.out", P.v, n, d, d, false));
    auto core = [this, mb, l, B, S, H, hd, n, d](bool want_probs) -> RecomputeFn {
      return [this, mb, l, B, S, H, hd, n, d, want_probs] {
        auto q = stash_.get(mb, l, "attn.q"), k = stash_.get(mb, l, "attn.k"), v = stash_.get(mb, l, "attn.v");
        Tensor o, probs;  // the one returned first (see route() below)
        if (!want_probs) o = act({n, d}, "attn.out");
        probs = act({B, H, S, S}, "attn.probs");
        if (want_probs) o = act({n, d}, "attn.out");
        be_.attention_forward(q->view(), k->view(), v->view(), o.view(), probs.view(), B, S, H, hd);
        return want_probs ? std::move(probs) : std::move(o);
      };
    };
    save(mb, l, "attn.probs", std::move(probs), core(true));
    save(mb, l, "attn.out", std::move(o), core(false));
  }
  x = std::move(h);
}

void MoEModel::attention_backward(int l, Tensor& dx, std::int64_t B, std::int64_t S, int mb) {
  const LayerParams& P = layer(l);
  const std::int64_t n = B * S, d = cfg_.hidden_size, H = cfg_.num_attention_heads, hd = cfg_.head_dim();
  Tensor dq = work({n, d}, "attn.dq"), dk = work({n, d}, "attn.dk"), dv = work({n, d}, "attn.dv");
  {
    // dx keeps changing (the residual stream), so a deferred o_proj dW gets a copy.
    Tensor dout = work({n, d}, "attn.dout");
    Shared o = stash_.get(mb, l, "attn.out");  // o_proj's input; the flash backward reads it too
    linear_bw(mb, defer_wgrad_ ? copy_of(dx, "attn.o_proj.dy") : borrow(dx), o, P.o, dout.view(), n, d, d, false);
    Shared q = stash_.get(mb, l, "attn.q"), k = stash_.get(mb, l, "attn.k"), v = stash_.get(mb, l, "attn.v");
    Shared probs = stash_.get(mb, l, "attn.probs");
    Tensor dprobs = work({B, H, S, S}, "attn.dprobs");
    be_.attention_backward(dout.view(), q->view(), k->view(), v->view(), o->view(), probs->view(), dq.view(), dk.view(),
                           dv.view(), dprobs.view(), B, S, H, hd);
  }
  be_.rope_backward(dq.view(), B, S, H, hd, cfg_.rope_theta);
  be_.rope_backward(dk.view(), B, S, H, hd, cfg_.rope_theta);
  Shared a = stash_.get(mb, l, "attn_norm.out");
  Tensor da = work({n, d}, "attn_norm.dout");
  linear_bw(mb, share(std::move(dq)), a, P.q, da.view(), n, d, d, false);
  linear_bw(mb, share(std::move(dk)), a, P.k, da.view(), n, d, d, true);
  linear_bw(mb, share(std::move(dv)), a, P.v, da.view(), n, d, d, true);
  a.reset();
  Shared x = stash_.get(mb, l, "attn_norm.in"), rstd = stash_.get(mb, l, "attn_norm.rstd");
  Tensor dtmp = work({n, d}, "attn_norm.dx");
  be_.rmsnorm_backward(da.view(), x->view(), P.in_norm->working(), rstd->f32(), dtmp.view(), P.in_norm->g.f32(), n, d);
  be_.add_inplace(dx.view(), dtmp.view(), n * d);
}

// ---------------------------------------------------------------------------------------------
// FFN block: x <- x + FFN(RMSNorm(x)), FFN = dense SwiGLU or MoE (+ shared experts)

void MoEModel::swiglu_mlp_forward(CView m, Param* w1, Param* w3, Param* w2, View y, std::int64_t n, int l, int mb,
                                  bool train, const char* prefix, bool accumulate) {
  const std::int64_t d = cfg_.hidden_size, w = w1->w.dim(0);
  Tensor h1 = act({n, w}, "mlp.gate_out"), h3 = act({n, w}, "mlp.up_out"), a = act({n, w}, "mlp.act");
  be_.linear_forward(m, w1->working(), h1.view(), n, d, w);
  be_.linear_forward(m, w3->working(), h3.view(), n, d, w);
  be_.swiglu_forward(h1.view(), h3.view(), a.view(), n * w);
  be_.gemm(false, true, n, d, w, 1.0f, a.view(), w, w2->working(), w, accumulate ? 1.0f : 0.0f, y, d);
  if (train && std::string_view(prefix) == "dense")
    plan_saves(mb, l, SavePoint::dense_ffn, {{"dense.gate_out", &h1}, {"dense.up_out", &h3}, {"dense.act", &a}});
  if (train) {
    const std::string g = fmt::format("{}.gate_out", prefix), u = fmt::format("{}.up_out", prefix);
    save(mb, l, g, std::move(h1), linear_lineage(mb, l, "ffn_norm.out", w1, n, d, w, false));
    save(mb, l, u, std::move(h3), linear_lineage(mb, l, "ffn_norm.out", w3, n, d, w, false));
    save(mb, l, fmt::format("{}.act", prefix), std::move(a), swiglu_lineage(mb, l, g, u));
  }
}

void MoEModel::swiglu_mlp_backward(const Shared& dy, const Shared& m, Param* w1, Param* w3, Param* w2, View dm,
                                   std::int64_t n, int l, int mb, const char* prefix) {
  const std::int64_t d = cfg_.hidden_size, w = w1->w.dim(0);
  Tensor da = work({n, w}, "mlp.dact");
  linear_bw(mb, dy, stash_.get(mb, l, fmt::format("{}.act", prefix)), w2, da.view(), n, w, d, false);
  Shared h1 = stash_.get(mb, l, fmt::format("{}.gate_out", prefix));
  Shared h3 = stash_.get(mb, l, fmt::format("{}.up_out", prefix));
  Tensor dh1 = work({n, w}, "mlp.dgate"), dh3 = work({n, w}, "mlp.dup");
  be_.swiglu_backward(da.view(), h1->view(), h3->view(), dh1.view(), dh3.view(), n * w);
  h1.reset();
  h3.reset();
  da.reset();
  linear_bw(mb, share(std::move(dh1)), m, w1, dm, n, d, w, true);
  linear_bw(mb, share(std::move(dh3)), m, w3, dm, n, d, w, true);
}

void MoEModel::ffn_forward(int l, Tensor& x, std::int64_t n, int mb, bool train, LossParts& loss) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size;
  Tensor m = act({n, d}, "ffn_norm.out"), rstd = act({n}, "ffn_norm.rstd", DType::f32);
  be_.rmsnorm_forward(x.view(), P.post_norm->working(), m.view(), rstd.f32(), n, d, float(cfg_.rms_norm_eps));
  Tensor out = act({n, d}, "ffn.residual");
  if (!cfg_.is_moe_layer(l)) {
    swiglu_mlp_forward(m.view(), P.s1, P.s3, P.s2, out.view(), n, l, mb, train, "dense", false);
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
    Tensor logits = act({n, E}, "router.logits"), probs = act({n, E}, "router.probs", DType::f32);
    Tensor idx = act({n, k}, "router.topk_idx", DType::i32), w = act({n, k}, "router.topk_w", DType::f32);
    be_.linear_forward(m.view(), P.gate->working(), logits.view(), n, d, E);
    const double skew = router_skew_;
    const int skew_groups = dispatcher_.active() ? dispatcher_.ep_size() : int(E);
    if (skew > 1) be_.skew_router_logits(logits.view(), n, E, k, skew_groups, skew);
    be_.router_forward(logits.view(), probs.f32(), idx.i32(), w.f32(), n, E, k, cfg_.norm_topk_prob);
    loss.aux += be_.aux_loss_forward(probs.f32(), idx.i32(), n, E, k, cfg_.router_aux_loss_coef);
    if (cfg_.router_z_loss_coef > 0) loss.z += be_.z_loss_forward(logits.view(), n, E, cfg_.router_z_loss_coef);

    Tensor counts = act({E}, "moe.counts", DType::i32), offsets = act({E + 1}, "moe.offsets", DType::i32);
    Tensor slot_of = act({n * k}, "moe.slot_of", DType::i32);
    const std::int64_t cap = ops::expert_capacity(cfg_.capacity_factor, n, E, k);
    RoutingStats rs;
    rs.layer = l;
    // The host needs the per-expert counts (grouped GEMM sizes, dispatch) and the
    // assignments (imbalance statistics): both come back from the device here.
    std::vector<std::int32_t> host_offsets(static_cast<std::size_t>(E + 1)), host_counts(static_cast<std::size_t>(E));
    rs.dropped = be_.moe_plan_dispatch(idx.i32(), n, E, k, cap, counts.i32(), offsets.i32(), slot_of.i32(),
                                       host_offsets.data());
    for (std::int64_t e = 0; e < E; ++e) host_counts[std::size_t(e)] = host_offsets[std::size_t(e + 1)] - host_offsets[std::size_t(e)];
    rs.tokens_per_expert = host_counts;
    {
      std::vector<std::int32_t> host_idx(std::size_t(n * k));
      be_.copy_to_host(host_idx.data(), idx.i32(), idx.nbytes());
      std::vector<std::int64_t> assigned(std::size_t(E), 0);
      for (std::int64_t i = 0; i < n * k; ++i) ++assigned[std::size_t(host_idx[std::size_t(i)])];
      std::int64_t mx = 0;
      for (auto a : assigned) mx = std::max(mx, a);
      rs.imbalance = double(mx) / (double(n * k) / double(E));
    }
    routing_.push_back(std::move(rs));
    const std::int64_t R = host_offsets[std::size_t(E)];

    if (expert_impl_ == ExpertImpl::sequential_reference) {
      if (dispatcher_.active()) throw Error("the sequential-experts reference path needs all experts on one rank");
      if (!be_.host_memory() || adt_ != DType::f32)
        throw Error("the sequential-experts reference path runs on the CPU in fp32 only");
      ops::moe_experts_reference(m.f32(), idx.i32(), w.f32(), slot_of.i32(), P.w1->w.f32(), P.w3->w.f32(),
                                 P.w2->w.f32(), out.f32(), n, d, f, k);
    } else {
      // route -> permute -> dispatch -> grouped-GEMM experts -> combine -> unpermute
      Tensor xp = act({R, d}, "moe.permuted");
      be_.permute_forward(m.view(), slot_of.i32(), xp.view(), n, k, d);
      DispatchLayout L = dispatcher_.plan(host_counts.data());
      routing_.back().received_rows = L.rows_received;
      const std::int64_t El = dispatcher_.local_experts(), Rr = L.rows_received;
      const std::int32_t* eoff = dispatcher_.active() ? L.local_offsets.data() : host_offsets.data();
      Tensor xe;
      if (dispatcher_.active()) {
        xe = act({Rr, d}, "moe.dispatched");
        Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
        dispatcher_.dispatch(L, xp.view(), xe.view(), d, scratch.view());
        xp.reset();
      } else {
        xe = std::move(xp);
      }
      // Training decides the block's saves here, after the router and the dispatch and
      // before the experts run, so that what is not kept whole is never allocated
      // whole: the experts' FFN runs in chunks of rows (model.expert_chunk_rows) whose
      // FC1 outputs and activation are the chunk's own unless kept.
      const bool ep = dispatcher_.active();
      const std::int64_t chunk = cfg_.expert_chunk(Rr);
      bool keep1 = false, keep3 = false, keepa = false;  // held whole: saved or offloaded
      if (train) {
        stash_.set_routing_context(Rr, n * k);  // balanced: each of the ep ranks sends n * k / ep
        saving_rows_ = MoERows{R, Rr};
        // The experts' FC1 outputs, activation and combine input are computed after
        // the decision: the planner sizes them by the ledger's formulas.
        plan_saves(mb, l, SavePoint::moe,
                   {{"experts.in", &xe}, {"router.logits", &logits}, {"router.probs", &probs}, {"router.topk_idx", &idx},
                    {"router.topk_w", &w}, {"moe.offsets", &offsets}, {"moe.slot_of", &slot_of}, {"ffn_norm.in", &x},
                    {"ffn_norm.out", &m}, {"ffn_norm.rstd", &rstd}},
                   saving_rows_);
        keep1 = reserve(mb, l, "experts.gate_out") != Provision::recompute;
        keep3 = reserve(mb, l, "experts.up_out") != Provision::recompute;
        keepa = reserve(mb, l, "experts.act") != Provision::recompute;
      }
      Tensor h1 = keep1 ? act({Rr, f}, "experts.gate_out") : Tensor();
      Tensor h3 = keep3 ? act({Rr, f}, "experts.up_out") : Tensor();
      Tensor a = keepa ? act({Rr, f}, "experts.act") : Tensor();
      Tensor ye = act({Rr, d}, "experts.out");
      {
        std::vector<std::int32_t> loc(std::size_t(El + 1));
        for (std::int64_t r0 = 0; r0 < Rr; r0 += chunk) {
          const std::int64_t cr = std::min(chunk, Rr - r0);
          chunk_offsets(eoff, El, r0, cr, loc.data());
          Tensor t1 = keep1 ? Tensor() : act({cr, f}, "experts.gate_out");
          Tensor t3 = keep3 ? Tensor() : act({cr, f}, "experts.up_out");
          Tensor ta = keepa ? Tensor() : act({cr, f}, "experts.act");
          const View g = keep1 ? h1.view() + r0 * f : t1.view();
          const View u = keep3 ? h3.view() + r0 * f : t3.view();
          const View av = keepa ? a.view() + r0 * f : ta.view();
          const CView xc = xe.view() + r0 * d;
          be_.grouped_linear_forward(xc, P.w1->working(), g, loc.data(), El, d, f);
          be_.grouped_linear_forward(xc, P.w3->working(), u, loc.data(), El, d, f);
          be_.swiglu_forward(g, u, av, cr * f);
          be_.grouped_linear_forward(av, P.w2->working(), ye.view() + r0 * d, loc.data(), El, f, d);
        }
      }
      Tensor yp;
      if (dispatcher_.active()) {
        yp = act({R, d}, "moe.combined");
        Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
        dispatcher_.combine(L, ye.view(), yp.view(), d, scratch.view());
        ye.reset();
      } else {
        yp = std::move(ye);
      }
      be_.unpermute_forward(yp.view(), slot_of.i32(), w.f32(), out.view(), n, k, d);
      if (train) {
        // Lineage: the permutation is local without EP; with EP, dispatch and combine
        // are all-to-alls, which a backward cannot replay alone, so they have none.
        auto offs = std::make_shared<std::vector<std::int32_t>>(eoff, eoff + El + 1);
        RecomputeFn xe_fn, yp_fn;
        if (!ep) {
          xe_fn = [this, mb, l, n, k, d, R] {
            auto m = stash_.get(mb, l, "ffn_norm.out"), slot = stash_.get(mb, l, "moe.slot_of");
            Tensor t = act({R, d}, "moe.permuted");
            be_.permute_forward(m->view(), slot->i32(), t.view(), n, k, d);
            return t;
          };
          // Recomputable, but never rebuilt whole: ffn_backward's expert loop takes its
          // rows chunk by chunk (combine_by_chunk) from the activation it has anyway.
          yp_fn = [l]() -> Tensor {
            throw Error(fmt::format("moe.combined of layer {} is rebuilt chunk by chunk by the backward's expert "
                                    "loop, never whole",
                                    l));
          };
        }
        auto grouped = [this, mb, l, offs, El, Rr, d, f](const Param* W) -> RecomputeFn {
          return [this, mb, l, offs, El, Rr, d, f, W] {
            auto x = stash_.get(mb, l, "experts.in");
            Tensor t = act({Rr, f}, "experts.fc1");
            be_.grouped_linear_forward(x->view(), W->working(), t.view(), offs->data(), El, d, f);
            return t;
          };
        };
        // What was not kept whole is recorded with its lineage alone (the backward's
        // expert loop rebuilds it chunk by chunk).
        auto save_fc = [&](const char* name, Tensor& t, RecomputeFn fn) {
          if (t.defined()) save(mb, l, name, std::move(t), std::move(fn));
          else stash_.save_dropped(mb, l, name, std::move(fn));
        };
        save(mb, l, "experts.in", std::move(xe), xe_fn);
        save_fc("experts.gate_out", h1, grouped(P.w1));
        save_fc("experts.up_out", h3, grouped(P.w3));
        save_fc("experts.act", a, swiglu_lineage(mb, l, "experts.gate_out", "experts.up_out"));
        save(mb, l, "moe.combined", std::move(yp), yp_fn);
        dispatch_layouts_[{mb, l}] = std::move(L);
      }
    }
    if (P.s1) swiglu_mlp_forward(m.view(), P.s1, P.s3, P.s2, out.view(), n, l, mb, train, "shared", true);
    if (train) {
      auto route = [this, mb, l, n, E, k](bool want_probs) -> RecomputeFn {
        return [this, mb, l, n, E, k, want_probs] {
          auto lg = stash_.get(mb, l, "router.logits");
          // The one returned first: the other is freed at once and, allocated above it,
          // leaves no hole under the returned block (which its backward then holds).
          Tensor pr, wt;
          if (want_probs) pr = act({n, E}, "router.probs", DType::f32);
          wt = act({n, k}, "router.topk_w", DType::f32);
          if (!want_probs) pr = act({n, E}, "router.probs", DType::f32);
          Tensor ix = work({n, k}, "router.topk_idx", DType::i32);
          be_.router_forward(lg->view(), pr.f32(), ix.i32(), wt.f32(), n, E, k, cfg_.norm_topk_prob);
          return want_probs ? std::move(pr) : std::move(wt);
        };
      };
      RecomputeFn logits_fn = linear_lineage(mb, l, "ffn_norm.out", P.gate, n, d, E, false);
      if (skew > 1)  // the injected skew is a pure function of the logits: replay it
        logits_fn = [this, inner = std::move(logits_fn), n, E, k, skew_groups, skew] {
          Tensor t = inner();
          be_.skew_router_logits(t.view(), n, E, k, skew_groups, skew);
          return t;
        };
      save(mb, l, "router.logits", std::move(logits), std::move(logits_fn));
      save(mb, l, "router.probs", std::move(probs), route(true));
      save(mb, l, "router.topk_idx", std::move(idx));
      save(mb, l, "router.topk_w", std::move(w), route(false));
      save(mb, l, "moe.offsets", std::move(offsets));
      save(mb, l, "moe.slot_of", std::move(slot_of));
    }
  }
  be_.add_inplace(out.view(), x.view(), n * d);
  if (train) {
    if (!cfg_.is_moe_layer(l)) stash_.set_routing_context(0, 0);
    save(mb, l, "ffn_norm.in", std::move(x));
    save(mb, l, "ffn_norm.out", std::move(m), rmsnorm_lineage(mb, l, "ffn_norm.in", P.post_norm, false, n));
    save(mb, l, "ffn_norm.rstd", std::move(rstd), rmsnorm_lineage(mb, l, "ffn_norm.in", P.post_norm, true, n));
    stash_.set_routing_context(0, 0);
  }
  x = std::move(out);
}

void MoEModel::ffn_backward(int l, Tensor& dx, std::int64_t n, int mb, double grad_scale) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size;
  Shared m = stash_.get(mb, l, "ffn_norm.out");
  Tensor dm = work({n, d}, "ffn_norm.dout");
  // dx (the residual stream's gradient) changes after this block, so deferred
  // weight gradients that read it get a copy.
  Shared dy = defer_wgrad_ ? copy_of(dx, "ffn.dy") : borrow(dx);
  if (!cfg_.is_moe_layer(l)) {
    dm.zero();
    swiglu_mlp_backward(dy, m, P.s1, P.s3, P.s2, dm.view(), n, l, mb, "dense");
  } else {
    const std::int64_t E = cfg_.num_experts, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
    Shared offsets = stash_.get(mb, l, "moe.offsets"), slot_of = stash_.get(mb, l, "moe.slot_of");
    Shared idx = stash_.get(mb, l, "router.topk_idx"), w = stash_.get(mb, l, "router.topk_w");
    (void)offsets;  // kept in the stash for the memory program; its values are the layout's (host) offsets
    auto lit = dispatch_layouts_.find({mb, l});
    if (lit == dispatch_layouts_.end()) throw Error(fmt::format("no dispatch layout for layer {} micro-batch {}", l, mb));
    const DispatchLayout L = std::move(lit->second);
    dispatch_layouts_.erase(lit);
    const std::int64_t El = dispatcher_.local_experts(), Rr = L.rows_received;
    // Without EP the layout's offsets are the dispatch offsets (plan() sums the same counts).
    const std::int64_t R = L.rows_sent;
    Tensor dw = work({n, k}, "router.dtopk_w", DType::f32);
    // Without EP, a combine input (moe.combined, the experts' outputs) that was not
    // kept is never rebuilt whole: the chunk loop below has each chunk's activation
    // anyway (kept, or rebuilt for its own backward), runs the chunk's down
    // projection once more and takes its slots' top-k gradients from it
    // (combine_topk_grad), so the experts' FC1 and activation are not rebuilt twice.
    const bool combine_by_chunk =
        !dispatcher_.active() && stash_.provision(mb, l, "moe.combined") == Provision::recompute;
    {
      // The backward of combine is dispatch, and the backward of dispatch is combine.
      // With EP, experts.dout outlives moe.dcombined: allocated first (workspace grows
      // down from the top), so that freeing moe.dcombined leaves no hole in the stack.
      Tensor dye;
      if (dispatcher_.active()) dye = work({Rr, d}, "experts.dout");
      {
        Tensor dyp = work({R, d}, "moe.dcombined");
        if (combine_by_chunk) {
          dw.zero();  // the dropped assignments' (the kept ones come chunk by chunk)
          be_.unpermute_backward(dx.view(), CView(), slot_of->i32(), w->f32(), dyp.view(), nullptr, n, k, d);
        } else {
          Shared yp = stash_.get(mb, l, "moe.combined");
          be_.unpermute_backward(dx.view(), yp->view(), slot_of->i32(), w->f32(), dyp.view(), dw.f32(), n, k, d);
        }
        if (dispatcher_.active()) {
          Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
          dispatcher_.dispatch(L, dyp.view(), dye.view(), d, scratch.view());
        } else {
          dye = std::move(dyp);
        }
      }
      // Chunk by chunk (model.expert_chunk_rows), over the chunk's activation and FC1
      // outputs (views of what was kept, else rebuilt for the chunk): the down
      // projection's and SwiGLU's backward, then FC1's into the chunk's rows of dxe.
      // The expert weight gradients accumulate chunk after chunk; they wait for W
      // (zero-bubble) only when the rows make one chunk: waiting would hold every
      // chunk's gradients ([Rr, f] in all) and undo the chunks' bound.
      const bool defer_experts = defer_wgrad_ && Rr > 0 && cfg_.expert_chunk(Rr) >= Rr;  // (no rows: nothing to wait)
      auto grouped_dw = [&](Shared dyy, std::int64_t dy_row, Shared xx, std::int64_t x_row, Param* W, std::int64_t in,
                            std::int64_t out, const std::int32_t* loc) {
        auto run = [this, dyy = dyy.get(), dy_row, xx = xx.get(), x_row, W, El, in, out,
                    offs = std::vector<std::int32_t>(loc, loc + El + 1)] {
          be_.grouped_linear_backward(dyy->view() + dy_row * out, xx->view() + x_row * in, W->working(), nullptr,
                                      W->g.f32(), offs.data(), El, in, out);
        };
        if (defer_experts)
          weight_grad(mb, {std::move(dyy), std::move(xx)}, std::move(run));
        else
          run();
      };
      Shared dyes = share(std::move(dye));
      Shared xe = stash_.get(mb, l, "experts.in");
      // The chunks' input gradients overwrite the rows of dye each chunk has used up
      // (dye and dxe are both [Rr, d]), unless W2's dW waits for dye: then their own,
      // allocated once the chunk's gradients are (the rows make one chunk then).
      Tensor dxe_own;
      View dxe = defer_experts ? View() : dyes->view();
      // Per chunk, the gradients' blocks come before the rebuilt FC1 outputs, which go
      // first (a stack, so that the chunk leaves no holes between held blocks); a
      // rebuilt activation is only read by W2's dW and is rebuilt into dact's block
      // once SwiGLU's backward has used dact up.
      const bool keep1 = stash_.provision(mb, l, "experts.gate_out") != Provision::recompute;
      const bool keep3 = stash_.provision(mb, l, "experts.up_out") != Provision::recompute;
      const bool keepa = stash_.provision(mb, l, "experts.act") != Provision::recompute;
      Shared h1w = keep1 ? stash_.get(mb, l, "experts.gate_out") : Shared();
      Shared h3w = keep3 ? stash_.get(mb, l, "experts.up_out") : Shared();
      Shared aw = keepa ? stash_.get(mb, l, "experts.act") : Shared();
      const std::int64_t chunk = cfg_.expert_chunk(Rr);
      std::vector<std::int32_t> loc(std::size_t(El + 1));
      for (std::int64_t r0 = 0; r0 < Rr; r0 += chunk) {
        const std::int64_t cr = std::min(chunk, Rr - r0);
        chunk_offsets(L.local_offsets.data(), El, r0, cr, loc.data());
        const CView dyc = dyes->view() + r0 * d;
        const CView xc = xe->view() + r0 * d;
        // dgate and dup outlive dact: allocated first, so that dact's block, freed
        // first, is the lowest of the workspace stack (no hole above the later ones).
        Shared dh1 = share(work({cr, f}, "experts.dgate")), dh3 = share(work({cr, f}, "experts.dup"));
        Shared dac = share(work({cr, f}, "experts.dact"));
        be_.grouped_linear_backward(dyc, keepa ? aw->view() + r0 * f : dac->view(), P.w2->working(), dac->view(),
                                    nullptr, loc.data(), El, f, d);  // (dx only: the activation is not read)
        Tensor t1 = keep1 ? Tensor() : act({cr, f}, "experts.gate_out");
        Tensor t3 = keep3 ? Tensor() : act({cr, f}, "experts.up_out");
        if (!keep1) be_.grouped_linear_forward(xc, P.w1->working(), t1.view(), loc.data(), El, d, f);
        if (!keep3) be_.grouped_linear_forward(xc, P.w3->working(), t3.view(), loc.data(), El, d, f);
        const CView g = keep1 ? CView(h1w->view() + r0 * f) : CView(t1.view());
        const CView u = keep3 ? CView(h3w->view() + r0 * f) : CView(t3.view());
        be_.swiglu_backward(dac->view(), g, u, dh1->view(), dh3->view(), cr * f);
        if (!keepa) be_.swiglu_forward(g, u, dac->view(), cr * f);  // the activation, in dact's block
        if (combine_by_chunk) {  // the chunk's rows of moe.combined, for their top-k gradients
          Tensor yc = work({cr, d}, "moe.combined_chunk");
          be_.grouped_linear_forward(keepa ? CView(aw->view() + r0 * f) : CView(dac->view()), P.w2->working(),
                                     yc.view(), loc.data(), El, f, d);
          be_.combine_topk_grad(dx.view(), yc.view(), slot_of->i32(), dw.f32(), n, k, d, r0, cr);
        }
        if (keepa)
          grouped_dw(dyes, r0, aw, r0, P.w2, f, d, loc.data());
        else
          grouped_dw(dyes, r0, dac, 0, P.w2, f, d, loc.data());
        t3.reset();
        t1.reset();
        dac.reset();  // (W2's dW may still hold the activation in it)
        if (!dxe) {
          dxe_own = work({Rr, d}, "experts.din");
          dxe = dxe_own.view();
        }
        const View dxc = dxe + r0 * d;
        be_.grouped_linear_backward(dh1->view(), xc, P.w1->working(), dxc, nullptr, loc.data(), El, d, f);
        grouped_dw(dh1, 0, xe, r0, P.w1, d, f, loc.data());
        Tensor dx3 = work({cr, d}, "experts.din_up");
        be_.grouped_linear_backward(dh3->view(), xc, P.w3->working(), dx3.view(), nullptr, loc.data(), El, d, f);
        grouped_dw(dh3, 0, xe, r0, P.w3, d, f, loc.data());
        be_.add_inplace(dxc, dx3.view(), cr * d);
      }
      h1w.reset();
      h3w.reset();
      aw.reset();
      xe.reset();
      if (!dxe) {  // (defensive: with defer_experts there are rows, and the first chunk allocated it)
        dxe_own = work({Rr, d}, "experts.din");
        dxe = dxe_own.view();
      }
      if (dispatcher_.active()) {
        Tensor dxp = work({R, d}, "moe.dpermuted");
        Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
        dispatcher_.combine(L, dxe, dxp.view(), d, scratch.view());
        be_.permute_backward(dxp.view(), slot_of->i32(), dm.view(), n, k, d);
      } else {
        be_.permute_backward(dxe, slot_of->i32(), dm.view(), n, k, d);
      }
    }
    if (P.s1) swiglu_mlp_backward(dy, m, P.s1, P.s3, P.s2, dm.view(), n, l, mb, "shared");
    Shared probs = stash_.get(mb, l, "router.probs"), logits = stash_.get(mb, l, "router.logits");
    Tensor dprobs = work({n, E}, "router.dprobs", DType::f32);
    dprobs.zero();
    be_.aux_loss_backward(idx->i32(), dprobs.f32(), n, E, k, cfg_.router_aux_loss_coef * grad_scale);
    Tensor dlogits = work({n, E}, "router.dlogits");
    be_.router_backward(dw.f32(), dprobs.f32(), probs->f32(), idx->i32(), dlogits.view(), n, E, k, cfg_.norm_topk_prob);
    if (cfg_.router_z_loss_coef > 0)
      be_.z_loss_backward(logits->view(), dlogits.view(), n, E, cfg_.router_z_loss_coef * grad_scale);
    linear_bw(mb, share(std::move(dlogits)), m, P.gate, dm.view(), n, d, E, true);
  }
  m.reset();
  dy.reset();
  Shared h = stash_.get(mb, l, "ffn_norm.in"), rstd = stash_.get(mb, l, "ffn_norm.rstd");
  Tensor dtmp = work({n, d}, "ffn_norm.dx");
  be_.rmsnorm_backward(dm.view(), h->view(), P.post_norm->working(), rstd->f32(), dtmp.view(), P.post_norm->g.f32(), n,
                       d);
  be_.add_inplace(dx.view(), dtmp.view(), n * d);
}

}  // namespace moeflex
