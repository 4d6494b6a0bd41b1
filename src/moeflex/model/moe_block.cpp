// The FFN block of the MoE transformer: x <- x + FFN(RMSNorm(x)), FFN a dense SwiGLU
// MLP or an MoE layer (+ shared experts). The MoE layer forward is split where compute
// meets communication (STYLE habit 7): route -> permute -> dispatch -> (the planner's
// decision) -> grouped-GEMM experts in chunks of rows -> combine -> unpermute; its
// backward runs the same stages in reverse, the experts' weight gradients through the
// weight-gradient queue (zero-bubble W). What each stage saves is the ledger's.
#include <fmt/format.h>

#include <algorithm>

#include "moeflex/core/phase_clock.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/moe_dispatch.h"

namespace moeflex {

namespace {

/// The per-expert offsets of rows [r0, r0 + rows) of a grouped GEMM's input sorted
/// by expert (offsets eoff [El + 1]), from the chunk's first row: out [El + 1].
void chunk_offsets(const std::int32_t* eoff, std::int64_t El, std::int64_t r0, std::int64_t rows, std::int32_t* out) {
  for (std::int64_t e = 0; e <= El; ++e)
    out[e] = std::int32_t(std::clamp<std::int64_t>(std::int64_t(eoff[e]) - r0, 0, rows));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward

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
  if (!cfg_.is_moe_layer(l))
    swiglu_mlp_forward(m.view(), P.s1, P.s3, P.s2, out.view(), n, l, mb, train, "dense", false);
  else
    moe_forward(l, x, m, rstd, out, n, mb, train, loss);
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

void MoEModel::moe_forward(int l, Tensor& x, Tensor& m, Tensor& rstd, Tensor& out, std::int64_t n, int mb, bool train,
                           LossParts& loss) {
  const LayerParams& P = layer(l);
  Routed r = route_forward(l, m, n, loss);
  if (expert_impl_ == ExpertImpl::sequential_reference) {
    if (dispatcher_.active()) throw Error("the sequential-experts reference path needs all experts on one rank");
    if (!be_.host_memory() || adt_ != DType::f32)
      throw Error("the sequential-experts reference path runs on the CPU in fp32 only");
    ops::moe_experts_reference(m.f32(), r.idx.i32(), r.w.f32(), r.slot_of.i32(), P.w1->w.f32(), P.w3->w.f32(),
                               P.w2->w.f32(), out.f32(), n, cfg_.hidden_size, cfg_.moe_intermediate_size,
                               cfg_.num_experts_per_tok);
  } else {
    experts_forward(l, r, x, m, rstd, out, n, mb, train);
  }
  if (P.s1) swiglu_mlp_forward(m.view(), P.s1, P.s3, P.s2, out.view(), n, l, mb, train, "shared", true);
  if (train) save_router(l, mb, r, n);
}  // (the counts go here; the router's tensors are in the stash)

void MoEModel::update_expert_bias(comm::Communicator* replicas) {
  if (!cfg_.expert_bias() || cfg_.router_bias_update_rate == 0) return;
  const std::int64_t E = cfg_.num_experts;
  std::vector<int> moe_layers;
  for (int l = par_.first_layer; l < par_.last_layer; ++l)
    if (layer(l).expert_bias) moe_layers.push_back(l);
  if (moe_layers.empty()) return;
  std::vector<double> load(moe_layers.size() * std::size_t(E), 0.0);  // [layer, expert]
  for (const RoutingStats& r : routing_) {
    const auto it = std::find(moe_layers.begin(), moe_layers.end(), r.layer);
    if (it == moe_layers.end()) continue;
    double* row = load.data() + (it - moe_layers.begin()) * E;
    for (std::int64_t e = 0; e < E; ++e) row[e] += double(r.tokens_per_expert[std::size_t(e)]);
  }
  if (replicas && replicas->size() > 1) replicas->all_reduce_sum(load.data(), std::int64_t(load.size()));
  const float rate = float(cfg_.router_bias_update_rate);
  std::vector<float> b(static_cast<std::size_t>(E));
  for (std::size_t li = 0; li < moe_layers.size(); ++li) {
    const double* row = load.data() + li * std::size_t(E);
    double mean = 0;
    for (std::int64_t e = 0; e < E; ++e) mean += row[e];
    mean /= double(E);
    Param& p = *layer(moe_layers[li]).expert_bias;
    be_.copy_to_host(b.data(), p.w.f32(), p.w.nbytes());
    for (std::int64_t e = 0; e < E; ++e)  // sign(0) = 0: a balanced expert keeps its bias
      b[std::size_t(e)] += rate * float((row[e] < mean) - (row[e] > mean));
    be_.copy_from_host(p.w.f32(), b.data(), p.w.nbytes());
  }
}

ops::RouterOptions MoEModel::router_options(int l) {
  ops::RouterOptions o;
  o.score = cfg_.scoring_func == "sigmoid" ? ops::RouterScore::sigmoid : ops::RouterScore::softmax;
  o.norm_topk_prob = cfg_.norm_topk_prob;
  o.routed_scaling_factor = cfg_.routed_scaling_factor;
  if (cfg_.group_limited()) o.n_group = cfg_.n_group, o.topk_group = cfg_.topk_group;
  o.group_score = cfg_.expert_bias() ? ops::GroupScore::top2_sum : ops::GroupScore::max;
  if (const Param* b = layer(l).expert_bias) o.bias = b->w.f32();
  return o;
}

MoEModel::Routed MoEModel::route_forward(int l, const Tensor& m, std::int64_t n, LossParts& loss) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, E = cfg_.num_experts, k = cfg_.num_experts_per_tok;
  Routed r;
  r.logits = act({n, E}, "router.logits");
  r.probs = act({n, E}, "router.probs", DType::f32);
  r.idx = act({n, k}, "router.topk_idx", DType::i32);
  r.w = act({n, k}, "router.topk_w", DType::f32);
  be_.linear_forward(m.view(), P.gate->working(), r.logits.view(), n, d, E);
  if (router_skew_)
    r.skew = ops::skew_for(*router_skew_, skew_step_, l, E, dispatcher_.active() ? dispatcher_.ep_size() : int(E));
  if (r.skew.active()) be_.skew_router_logits(r.logits.view(), n, E, k, r.skew);
  const ops::RouterOptions rule = router_options(l);
  be_.router_forward(r.logits.view(), r.probs.f32(), r.idx.i32(), r.w.f32(), n, E, k, rule);
  loss.aux += be_.aux_loss_forward(r.probs.f32(), r.idx.i32(), n, E, k, cfg_.router_aux_loss_coef, rule.score);
  if (cfg_.router_z_loss_coef > 0) loss.z += be_.z_loss_forward(r.logits.view(), n, E, cfg_.router_z_loss_coef);

  r.counts = act({E}, "moe.counts", DType::i32);
  r.offsets = act({E + 1}, "moe.offsets", DType::i32);
  r.slot_of = act({n * k}, "moe.slot_of", DType::i32);
  const std::int64_t cap = ops::expert_capacity(cfg_.capacity_factor, n, E, k);
  RoutingStats rs;
  rs.layer = l;
  // The host needs the per-expert counts (grouped GEMM sizes, dispatch) and the
  // assignments (imbalance statistics): both come back from the device here.
  r.host_offsets.resize(std::size_t(E + 1));
  r.host_counts.resize(std::size_t(E));
  rs.dropped = be_.moe_plan_dispatch(r.idx.i32(), n, E, k, cap, r.counts.i32(), r.offsets.i32(), r.slot_of.i32(),
                                     r.host_offsets.data());
  for (std::int64_t e = 0; e < E; ++e)
    r.host_counts[std::size_t(e)] = r.host_offsets[std::size_t(e + 1)] - r.host_offsets[std::size_t(e)];
  rs.tokens_per_expert = r.host_counts;
  {
    std::vector<std::int32_t> host_idx(std::size_t(n * k));
    be_.copy_to_host(host_idx.data(), r.idx.i32(), r.idx.nbytes());
    std::vector<std::int64_t> assigned(std::size_t(E), 0);
    for (std::int64_t i = 0; i < n * k; ++i) ++assigned[std::size_t(host_idx[std::size_t(i)])];
    std::int64_t mx = 0;
    for (auto a : assigned) mx = std::max(mx, a);
    rs.imbalance = double(mx) / (double(n * k) / double(E));
  }
  routing_.push_back(std::move(rs));
  r.R = r.host_offsets[std::size_t(E)];
  return r;
}

void MoEModel::experts_forward(int l, Routed& r, Tensor& x, Tensor& m, Tensor& rstd, Tensor& out, std::int64_t n,
                               int mb, bool train) {
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok;
  DispatchLayout L;
  Tensor xe = dispatch_forward(m, r, L, n);
  const std::int64_t Rr = L.rows_received;
  const std::int32_t* eoff = dispatcher_.active() ? L.local_offsets.data() : r.host_offsets.data();
  // Training decides the block's saves here, after the router and the dispatch and
  // before the experts run, so that what is not kept whole is never allocated
  // whole: the experts' FFN runs in chunks of rows (model.expert_chunk_rows) whose
  // FC1 outputs and activation are the chunk's own unless kept.
  ExpertsKept keep;  // held whole: saved or offloaded
  if (train) {
    stash_.set_routing_context(Rr, n * k);  // balanced: each of the ep ranks sends n * k / ep
    saving_rows_ = MoERows{r.R, Rr};
    // The experts' FC1 outputs, activation and combine input are computed after
    // the decision: the planner sizes them by the ledger's formulas.
    plan_saves(mb, l, SavePoint::moe,
               {{"experts.in", &xe}, {"router.logits", &r.logits}, {"router.probs", &r.probs},
                {"router.topk_idx", &r.idx}, {"router.topk_w", &r.w}, {"moe.offsets", &r.offsets},
                {"moe.slot_of", &r.slot_of}, {"ffn_norm.in", &x}, {"ffn_norm.out", &m}, {"ffn_norm.rstd", &rstd}},
               saving_rows_);
    keep.gate = reserve(mb, l, "experts.gate_out") != Provision::recompute;
    keep.up = reserve(mb, l, "experts.up_out") != Provision::recompute;
    keep.act = reserve(mb, l, "experts.act") != Provision::recompute;
  }
  const std::int64_t f = cfg_.moe_intermediate_size;
  Tensor h1 = keep.gate ? act({Rr, f}, "experts.gate_out") : Tensor();
  Tensor h3 = keep.up ? act({Rr, f}, "experts.up_out") : Tensor();
  Tensor a = keep.act ? act({Rr, f}, "experts.act") : Tensor();
  Tensor ye = act({Rr, d}, "experts.out");
  experts_ffn(l, xe, eoff, Rr, keep, h1, h3, a, ye);
  Tensor yp = combine_forward(L, ye, r.R);
  be_.unpermute_forward(yp.view(), r.slot_of.i32(), r.w.f32(), out.view(), n, k, d);
  if (train) save_experts(l, mb, n, r.R, eoff, Rr, xe, h1, h3, a, yp, std::move(L));
}

Tensor MoEModel::dispatch_forward(const Tensor& m, const Routed& r, DispatchLayout& L, std::int64_t n) {
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok;
  Tensor xp = act({r.R, d}, "moe.permuted");
  be_.permute_forward(m.view(), r.slot_of.i32(), xp.view(), n, k, d);
  L = dispatcher_.plan(r.host_counts.data());
  routing_.back().received_rows = L.rows_received;
  if (!dispatcher_.active()) return xp;
  const std::int64_t Rr = L.rows_received;
  Tensor xe = act({Rr, d}, "moe.dispatched");
  Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
  dispatcher_.dispatch(L, xp.view(), xe.view(), d, scratch.view());
  xp.reset();
  return xe;
}

void MoEModel::experts_ffn(int l, const Tensor& xe, const std::int32_t* eoff, std::int64_t Rr, ExpertsKept keep,
                           Tensor& h1, Tensor& h3, Tensor& a, Tensor& ye) {
  const PhaseScope step_phase(StepPhase::experts);  // slow-rank detection scores it per received row
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, f = cfg_.moe_intermediate_size, El = dispatcher_.local_experts();
  const std::int64_t chunk = cfg_.expert_chunk(Rr);
  std::vector<std::int32_t> loc(std::size_t(El + 1));
  for (std::int64_t r0 = 0; r0 < Rr; r0 += chunk) {
    const std::int64_t cr = std::min(chunk, Rr - r0);
    chunk_offsets(eoff, El, r0, cr, loc.data());
    Tensor t1 = keep.gate ? Tensor() : act({cr, f}, "experts.gate_out");
    Tensor t3 = keep.up ? Tensor() : act({cr, f}, "experts.up_out");
    Tensor ta = keep.act ? Tensor() : act({cr, f}, "experts.act");
    const View g = keep.gate ? h1.view() + r0 * f : t1.view();
    const View u = keep.up ? h3.view() + r0 * f : t3.view();
    const View av = keep.act ? a.view() + r0 * f : ta.view();
    const CView xc = xe.view() + r0 * d;
    be_.grouped_linear_forward(xc, P.w1->working(), g, loc.data(), El, d, f);
    be_.grouped_linear_forward(xc, P.w3->working(), u, loc.data(), El, d, f);
    be_.swiglu_forward(g, u, av, cr * f);
    be_.grouped_linear_forward(av, P.w2->working(), ye.view() + r0 * d, loc.data(), El, f, d);
  }
}

Tensor MoEModel::combine_forward(const DispatchLayout& L, Tensor& ye, std::int64_t R) {
  if (!dispatcher_.active()) return std::move(ye);
  const std::int64_t d = cfg_.hidden_size;
  Tensor yp = act({R, d}, "moe.combined");
  Tensor scratch = work({L.rows_received, d}, "moe.a2a_scratch");
  dispatcher_.combine(L, ye.view(), yp.view(), d, scratch.view());
  ye.reset();
  return yp;
}

void MoEModel::save_experts(int l, int mb, std::int64_t n, std::int64_t R, const std::int32_t* eoff, std::int64_t Rr,
                            Tensor& xe, Tensor& h1, Tensor& h3, Tensor& a, Tensor& yp, DispatchLayout L) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
  const std::int64_t El = dispatcher_.local_experts();
  // Lineage: the permutation is local without EP; with EP, dispatch and combine
  // are all-to-alls, which a backward cannot replay alone, so they have none.
  auto offs = std::make_shared<std::vector<std::int32_t>>(eoff, eoff + El + 1);
  RecomputeFn xe_fn, yp_fn;
  if (!dispatcher_.active()) {
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

void MoEModel::save_router(int l, int mb, Routed& r, std::int64_t n) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, E = cfg_.num_experts, k = cfg_.num_experts_per_tok;
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
      be_.router_forward(lg->view(), pr.f32(), ix.i32(), wt.f32(), n, E, k, router_options(l));
      return want_probs ? std::move(pr) : std::move(wt);
    };
  };
  RecomputeFn logits_fn = linear_lineage(mb, l, "ffn_norm.out", P.gate, n, d, E, false);
  if (r.skew.active())  // the injected skew is a pure function of the logits: replay it
    logits_fn = [this, inner = std::move(logits_fn), n, E, k, skew = r.skew] {
      Tensor t = inner();
      be_.skew_router_logits(t.view(), n, E, k, skew);
      return t;
    };
  save(mb, l, "router.logits", std::move(r.logits), std::move(logits_fn));
  save(mb, l, "router.probs", std::move(r.probs), route(true));
  save(mb, l, "router.topk_idx", std::move(r.idx));
  save(mb, l, "router.topk_w", std::move(r.w), route(false));
  save(mb, l, "moe.offsets", std::move(r.offsets));
  save(mb, l, "moe.slot_of", std::move(r.slot_of));
}

// ---------------------------------------------------------------------------------------------
// Backward

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
    moe_backward(l, dx, dy, m, dm, n, mb, grad_scale);
  }
  m.reset();
  dy.reset();
  Shared h = stash_.get(mb, l, "ffn_norm.in"), rstd = stash_.get(mb, l, "ffn_norm.rstd");
  Tensor dtmp = work({n, d}, "ffn_norm.dx");
  be_.rmsnorm_backward(dm.view(), h->view(), P.post_norm->working(), rstd->f32(), dtmp.view(), P.post_norm->g.f32(), n,
                       d);
  be_.add_inplace(dx.view(), dtmp.view(), n * d);
}

void MoEModel::moe_backward(int l, Tensor& dx, const Shared& dy, const Shared& m, Tensor& dm, std::int64_t n, int mb,
                            double grad_scale) {
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, E = cfg_.num_experts, k = cfg_.num_experts_per_tok;
  Shared offsets = stash_.get(mb, l, "moe.offsets"), slot_of = stash_.get(mb, l, "moe.slot_of");
  Shared idx = stash_.get(mb, l, "router.topk_idx"), w = stash_.get(mb, l, "router.topk_w");
  (void)offsets;  // kept in the stash for the memory program; its values are the layout's (host) offsets
  auto lit = dispatch_layouts_.find({mb, l});
  if (lit == dispatch_layouts_.end()) throw Error(fmt::format("no dispatch layout for layer {} micro-batch {}", l, mb));
  const DispatchLayout L = std::move(lit->second);
  dispatch_layouts_.erase(lit);
  Tensor dw = work({n, k}, "router.dtopk_w", DType::f32);
  // Without EP, a combine input (moe.combined, the experts' outputs) that was not
  // kept is never rebuilt whole: the chunk loop has each chunk's activation anyway
  // (kept, or rebuilt for its own backward), runs the chunk's down projection once
  // more and takes its slots' top-k gradients from it (combine_topk_grad), so the
  // experts' FC1 and activation are not rebuilt twice.
  const bool combine_by_chunk =
      !dispatcher_.active() && stash_.provision(mb, l, "moe.combined") == Provision::recompute;
  experts_backward(l, mb, dx, L, *slot_of, *w, dw, dm, n, combine_by_chunk);
  if (P.s1) swiglu_mlp_backward(dy, m, P.s1, P.s3, P.s2, dm.view(), n, l, mb, "shared");
  Shared probs = stash_.get(mb, l, "router.probs"), logits = stash_.get(mb, l, "router.logits");
  Tensor dprobs = work({n, E}, "router.dprobs", DType::f32);
  dprobs.zero();
  const ops::RouterOptions rule = router_options(l);
  be_.aux_loss_backward(idx->i32(), probs->f32(), dprobs.f32(), n, E, k, cfg_.router_aux_loss_coef * grad_scale,
                        rule.score);
  Tensor dlogits = work({n, E}, "router.dlogits");
  be_.router_backward(dw.f32(), dprobs.f32(), probs->f32(), idx->i32(), dlogits.view(), n, E, k, rule);
  if (cfg_.router_z_loss_coef > 0)
    be_.z_loss_backward(logits->view(), dlogits.view(), n, E, cfg_.router_z_loss_coef * grad_scale);
  linear_bw(mb, share(std::move(dlogits)), m, P.gate, dm.view(), n, d, E, true);
}

void MoEModel::experts_backward(int l, int mb, Tensor& dx, const DispatchLayout& L, const Tensor& slot_of,
                                const Tensor& w, Tensor& dw, Tensor& dm, std::int64_t n, bool combine_by_chunk) {
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok;
  const std::int64_t Rr = L.rows_received, R = L.rows_sent;  // (without EP: the dispatch's own offsets and rows)
  // The backward of combine is dispatch, and the backward of dispatch is combine.
  Shared dyes = combine_backward(L, dx, slot_of, w, dw, n, combine_by_chunk, mb, l);
  Tensor dxe_own;
  View dxe;
  expert_chunks_backward(l, mb, dx, L, dyes, slot_of, dw, n, combine_by_chunk, dxe_own, dxe);
  if (!dxe) {  // (defensive: with deferred expert gradients there are rows, and the first chunk allocated it)
    dxe_own = work({Rr, d}, "experts.din");
    dxe = dxe_own.view();
  }
  if (dispatcher_.active()) {
    Tensor dxp = work({R, d}, "moe.dpermuted");
    Tensor scratch = work({Rr, d}, "moe.a2a_scratch");
    dispatcher_.combine(L, dxe, dxp.view(), d, scratch.view());
    be_.permute_backward(dxp.view(), slot_of.i32(), dm.view(), n, k, d);
  } else {
    be_.permute_backward(dxe, slot_of.i32(), dm.view(), n, k, d);
  }
}

MoEModel::Shared MoEModel::combine_backward(const DispatchLayout& L, Tensor& dx, const Tensor& slot_of, const Tensor& w,
                                            Tensor& dw, std::int64_t n, bool combine_by_chunk, int mb, int l) {
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok;
  // With EP, experts.dout outlives moe.dcombined: allocated first (workspace grows
  // down from the top), so that freeing moe.dcombined leaves no hole in the stack.
  Tensor dye;
  if (dispatcher_.active()) dye = work({L.rows_received, d}, "experts.dout");
  {
    Tensor dyp = work({L.rows_sent, d}, "moe.dcombined");
    if (combine_by_chunk) {
      dw.zero();  // the dropped assignments' (the kept ones come chunk by chunk)
      be_.unpermute_backward(dx.view(), CView(), slot_of.i32(), w.f32(), dyp.view(), nullptr, n, k, d);
    } else {
      Shared yp = stash_.get(mb, l, "moe.combined");
      be_.unpermute_backward(dx.view(), yp->view(), slot_of.i32(), w.f32(), dyp.view(), dw.f32(), n, k, d);
    }
    if (dispatcher_.active()) {
      Tensor scratch = work({L.rows_received, d}, "moe.a2a_scratch");
      dispatcher_.dispatch(L, dyp.view(), dye.view(), d, scratch.view());
    } else {
      dye = std::move(dyp);
    }
  }
  return share(std::move(dye));
}

void MoEModel::expert_chunks_backward(int l, int mb, Tensor& dx, const DispatchLayout& L, const Shared& dyes,
                                      const Tensor& slot_of, Tensor& dw, std::int64_t n, bool combine_by_chunk,
                                      Tensor& dxe_own, View& dxe) {
  const PhaseScope step_phase(StepPhase::experts);
  const LayerParams& P = layer(l);
  const std::int64_t d = cfg_.hidden_size, k = cfg_.num_experts_per_tok, f = cfg_.moe_intermediate_size;
  const std::int64_t El = dispatcher_.local_experts(), Rr = L.rows_received;
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
  Shared xe = stash_.get(mb, l, "experts.in");
  // The chunks' input gradients overwrite the rows of dye each chunk has used up
  // (dye and dxe are both [Rr, d]), unless W2's dW waits for dye: then their own,
  // allocated once the chunk's gradients are (the rows make one chunk then).
  dxe = defer_experts ? View() : dyes->view();
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
    be_.grouped_linear_backward(dyc, keepa ? aw->view() + r0 * f : dac->view(), P.w2->working(), dac->view(), nullptr,
                                loc.data(), El, f, d);  // (dx only: the activation is not read)
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
      be_.grouped_linear_forward(keepa ? CView(aw->view() + r0 * f) : CView(dac->view()), P.w2->working(), yc.view(),
                                 loc.data(), El, f, d);
      be_.combine_topk_grad(dx.view(), yc.view(), slot_of.i32(), dw.f32(), n, k, d, r0, cr);
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
}

}  // namespace moeflex
