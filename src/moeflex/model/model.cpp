// The MoE transformer (docs/model.md): its parameters, a pipeline stage's forward and
// backward over its layers and head, and the save point every block's forward goes
// through (the planner's decision, the ledger's check, the stash). The blocks are in
// attention_block.cpp and moe_block.cpp, the weight-gradient queue in
// weight_grad_queue.cpp. Every tensor a backward needs is saved by its ledger name;
// everything else is workspace freed as soon as it is used.
#include "moeflex/model/model.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/parameters.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moeflex/core/op_context.h"
#include "moeflex/core/rng.h"

namespace moeflex {

namespace {

std::uint64_t name_stream(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

MoEModel::MoEModel(const ModelConfig& cfg, Arena& arena, const ModelParallel& par)
    : cfg_(cfg), arena_(arena), be_(ops::backend_of(arena)), par_(par), dispatcher_(par.ep_group, cfg.num_experts) {
  cfg_.validate();
  if (!cfg_.engine_attention())
    throw ConfigError(
        fmt::format("model: kv_lora_rank {} asks for multi-head latent attention, which the simulator prices "
                    "but the training engine does not run yet (it runs multi-head and grouped-query "
                    "attention: set kv_lora_rank = 0)",
                    cfg_.kv_lora_rank));
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
      [this](Tensor* t) {
        const Bytes bytes = t->nbytes();
        if (!evict_queued_read(t)) return false;
        wgrad_bytes_evicted_ += bytes;
        return true;
      });
  if (par_.last_layer < 0) par_.last_layer = int(cfg.num_hidden_layers);
  if (par_.first_layer < 0 || par_.first_layer > par_.last_layer || par_.last_layer > cfg.num_hidden_layers)
    throw ConfigError(fmt::format("model stage holds layers [{}, {}) of {}", par_.first_layer, par_.last_layer,
                                  cfg.num_hidden_layers));
  const std::int64_t El = dispatcher_.local_experts(), e0 = dispatcher_.first_expert();
  // Reserve first: Param* pointers into params_ must stay valid.
  std::size_t count = 4;
  for (int l = par_.first_layer; l < par_.last_layer; ++l) count += layer_parameters(cfg, l, El).size();
  params_.reserve(count);
  auto add = [&](std::string name, std::vector<std::int64_t> shape, bool no_decay = false,
                 bool buffer = false) -> Param* {
    Tensor w(arena, shape, MemCategory::weights, name);
    Tensor wc = adt_ == DType::f32 || buffer ? Tensor()
                                             : Tensor(arena, shape, MemCategory::weights, name + ".working", adt_);
    Tensor g(arena, shape, MemCategory::grads, name);
    g.zero();
    Param& p = params_.emplace_back();
    p.name = std::move(name);
    p.w = std::move(w);
    p.g = std::move(g);
    p.no_decay = no_decay;
    p.buffer = buffer;
    p.wc = std::move(wc);
    return &p;
  };
  auto add_expert = [&](std::string name, std::vector<std::int64_t> shape) -> Param* {
    Param* p = add(std::move(name), shape);
    p->expert = true;
    p->init_offset = e0 * shape[1] * shape[2];
    return p;
  };
  if (par_.embedding) embed_ = add(embedding_parameter(cfg).name, embedding_parameter(cfg).shape);
  for (std::int64_t l = par_.first_layer; l < par_.last_layer; ++l) {
    // The layer's tensors from the one parameter list the simulator counts too.
    const std::size_t first = params_.size();
    for (const ParamSpec& spec : layer_parameters(cfg, int(l), El))
      spec.expert ? add_expert(spec.name, spec.shape) : add(spec.name, spec.shape, spec.no_decay, spec.buffer);
    const std::string p = fmt::format("model.layers.{}.", l);
    auto get = [&](const char* suffix) -> Param* {
      for (std::size_t i = first; i < params_.size(); ++i)
        if (params_[i].name == p + suffix) return &params_[i];
      return nullptr;
    };
    LayerParams lp{};
    lp.in_norm = get("input_layernorm.weight");
    lp.q = get("self_attn.q_proj.weight");
    lp.k = get("self_attn.k_proj.weight");
    lp.v = get("self_attn.v_proj.weight");
    lp.o = get("self_attn.o_proj.weight");
    lp.q_norm = get("self_attn.q_norm.weight");
    lp.k_norm = get("self_attn.k_norm.weight");
    lp.post_norm = get("post_attention_layernorm.weight");
    lp.gate = get("mlp.gate.weight");
    lp.expert_bias = get("mlp.gate.e_score_correction_bias");
    lp.w1 = get("mlp.experts.gate_proj.weight");
    lp.w3 = get("mlp.experts.up_proj.weight");
    lp.w2 = get("mlp.experts.down_proj.weight");
    const bool moe = cfg.is_moe_layer(l);
    lp.s1 = get(moe ? "mlp.shared_experts.gate_proj.weight" : "mlp.gate_proj.weight");
    lp.s3 = get(moe ? "mlp.shared_experts.up_proj.weight" : "mlp.up_proj.weight");
    lp.s2 = get(moe ? "mlp.shared_experts.down_proj.weight" : "mlp.down_proj.weight");
    layers_.push_back(lp);
  }
  if (par_.head) {
    final_norm_ = add(final_norm_parameter(cfg).name, final_norm_parameter(cfg).shape, true);
    // A tied head on a stage without the embedding keeps its own copy of the
    // embedding matrix (same name, same init); the trainer sums the two copies'
    // gradients across the first and last stage.
    if (!cfg.tie_word_embeddings) {
      lm_head_ = add(lm_head_parameter(cfg).name, lm_head_parameter(cfg).shape);
    } else if (embed_) {
      lm_head_ = embed_;
    } else {
      lm_head_ = add(embedding_parameter(cfg).name, embedding_parameter(cfg).shape);
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
    if (p.no_decay) {  // norm weights start at 1, buffers (the expert bias) at 0
      for (std::int64_t i = 0; i < n; ++i) w[i] = p.buffer ? 0.0f : 1.0f;
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
      be_.rope_forward(y.view(), n / rope_seq_, rope_seq_, out / cfg_.head_dim(), cfg_.head_dim(), cfg_.rope_theta);
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

BlockContext MoEModel::decision_context(int mb, int l, SavePoint point, const MoERows& rows) {
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
  return ctx;
}

void MoEModel::plan_saves(int mb, int l, SavePoint point, std::initializer_list<Held> held, const MoERows& rows) {
  if (!planner_) return;
  BlockContext ctx = decision_context(mb, l, point, rows);
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
  chunk_dims.Rr = rows.largest_chunk(cfg_, ep);
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
  // The micro-batch's shape, for the ledger's formulas and the lineages' RoPE (a stage
  // that holds only the head decides its saves with it too).
  if (train) {
    batch_ = B;
    rope_seq_ = S;
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
  offload_w_reads_ = defer_wgrad_ && plan_weight_reads(mb);
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
  if (offload_w_reads_) offload_queued_reads(mb);
  for (int l = par_.last_layer - 1; l >= par_.first_layer; --l) {
    if (l > par_.first_layer) stash_.prefetch_layer(mb, l - 1);
    op_context().layer = l;
    ffn_backward(l, dx, n, mb, grad_scale);
    attention_backward(l, dx, B, S, mb);
    stash_.release_layer(mb, l);
    if (offload_w_reads_) offload_queued_reads(mb);
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
  dx.reset();  // (the memory program frees the residual gradient here)
  if (offload_w_reads_) offload_queued_reads(mb);
  stash_.release_microbatch(mb);
  // What this B leaves held for its W, for the planner's projections until then:
  // what the queue holds, measured (evicted reads counted: they come back for W).
  if (defer_wgrad_ && program_) {
    program_->pending_weight_bytes[{mb, par_.first_layer}] = weight_grad_groups(mb);
    if (offload_w_reads_) program_->offloaded_weight_reads.insert({mb, par_.first_layer});
  }
  offload_w_reads_ = false;
}

}  // namespace moeflex
