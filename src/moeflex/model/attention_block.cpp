// The attention block of the MoE transformer: x <- x + o_proj(attention(rope(q),
// rope(k), v)) of RMSNorm(x), with q and k RMS-normed before RoPE under QK-norm
// (ModelConfig::qk_norm): H query heads and Hkv key/value heads of head_dim each
// (grouped-query attention when Hkv < H; q and o are H x head_dim wide, k and v
// Hkv x head_dim); forward saves the ledger's attention entries, backward reads them.
#include "moeflex/model/model.h"

namespace moeflex {

void MoEModel::attention_forward(int l, Tensor& x, std::int64_t B, std::int64_t S, int mb, bool train) {
  const LayerParams& P = layer(l);
  const std::int64_t n = B * S, d = cfg_.hidden_size, H = cfg_.num_attention_heads, Hkv = cfg_.kv_heads(),
                     hd = cfg_.head_dim(), qw = cfg_.q_width(), kvw = cfg_.kv_width();
  Tensor a = act({n, d}, "attn_norm.out"), rstd = act({n}, "attn_norm.rstd", DType::f32);
  be_.rmsnorm_forward(x.view(), P.in_norm->working(), a.view(), rstd.f32(), n, d, float(cfg_.rms_norm_eps));
  // With QK-norm the projections write the norms' inputs, and q and k are the norms'
  // outputs (roped in place, as without it).
  const bool qkn = cfg_.has_qk_norm();
  Tensor q_in = qkn ? act({n, qw}, "attn.q_norm.in") : Tensor(), k_in = qkn ? act({n, kvw}, "attn.k_norm.in") : Tensor();
  Tensor q = qkn ? Tensor() : act({n, qw}, "attn.q"), k = qkn ? Tensor() : act({n, kvw}, "attn.k");
  Tensor v = act({n, kvw}, "attn.v");
  be_.linear_forward(a.view(), P.q->working(), (qkn ? q_in : q).view(), n, d, qw);
  be_.linear_forward(a.view(), P.k->working(), (qkn ? k_in : k).view(), n, d, kvw);
  be_.linear_forward(a.view(), P.v->working(), v.view(), n, d, kvw);
  Tensor q_rstd, k_rstd;
  if (qkn) {
    q = act({n, qw}, "attn.q");
    q_rstd = act({cfg_.qk_norm_rows(n, true)}, "attn.q_norm.rstd", DType::f32);
    be_.rmsnorm_forward(q_in.view(), P.q_norm->working(), q.view(), q_rstd.f32(), cfg_.qk_norm_rows(n, true),
                        cfg_.qk_norm_width(true), float(cfg_.rms_norm_eps));
    k = act({n, kvw}, "attn.k");
    k_rstd = act({cfg_.qk_norm_rows(n, false)}, "attn.k_norm.rstd", DType::f32);
    be_.rmsnorm_forward(k_in.view(), P.k_norm->working(), k.view(), k_rstd.f32(), cfg_.qk_norm_rows(n, false),
                        cfg_.qk_norm_width(false), float(cfg_.rms_norm_eps));
  }
  be_.rope_forward(q.view(), B, S, H, hd, cfg_.rope_theta);
  be_.rope_forward(k.view(), B, S, Hkv, hd, cfg_.rope_theta);
  Tensor o = act({n, qw}, "attn.out"), probs = act({B, H, S, S}, "attn.probs");
  be_.attention_forward(q.view(), k.view(), v.view(), o.view(), probs.view(), B, S, H, Hkv, hd);
  Tensor h = act({n, d}, "attn.residual");
  be_.linear_forward(o.view(), P.o->working(), h.view(), n, qw, d);
  be_.add_inplace(h.view(), x.view(), n * d);
  if (train) {
    rope_seq_ = S;
    batch_ = B;
    if (qkn)
      plan_saves(mb, l, SavePoint::attention,
                 {{"attn_norm.in", &x}, {"attn_norm.out", &a}, {"attn_norm.rstd", &rstd}, {"attn.q_norm.in", &q_in},
                  {"attn.q_norm.rstd", &q_rstd}, {"attn.k_norm.in", &k_in}, {"attn.k_norm.rstd", &k_rstd},
                  {"attn.q", &q}, {"attn.k", &k}, {"attn.v", &v}, {"attn.probs", &probs}, {"attn.out", &o}});
    else
      plan_saves(mb, l, SavePoint::attention,
                 {{"attn_norm.in", &x}, {"attn_norm.out", &a}, {"attn_norm.rstd", &rstd}, {"attn.q", &q},
                  {"attn.k", &k}, {"attn.v", &v}, {"attn.probs", &probs}, {"attn.out", &o}});
    save(mb, l, "attn_norm.in", std::move(x));
    save(mb, l, "attn_norm.out", std::move(a), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, false, n));
    save(mb, l, "attn_norm.rstd", std::move(rstd), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, true, n));
    if (qkn) {
      save(mb, l, "attn.q_norm.in", std::move(q_in), linear_lineage(mb, l, "attn_norm.out", P.q, n, d, qw, false));
      save(mb, l, "attn.q_norm.rstd", std::move(q_rstd));
      save(mb, l, "attn.k_norm.in", std::move(k_in), linear_lineage(mb, l, "attn_norm.out", P.k, n, d, kvw, false));
      save(mb, l, "attn.k_norm.rstd", std::move(k_rstd));
      save(mb, l, "attn.q", std::move(q), qk_norm_lineage(mb, l, true));
      save(mb, l, "attn.k", std::move(k), qk_norm_lineage(mb, l, false));
    } else {
      save(mb, l, "attn.q", std::move(q), linear_lineage(mb, l, "attn_norm.out", P.q, n, d, qw, true));
      save(mb, l, "attn.k", std::move(k), linear_lineage(mb, l, "attn_norm.out", P.k, n, d, kvw, true));
    }
    save(mb, l, "attn.v", std::move(v), linear_lineage(mb, l, "attn_norm.out", P.v, n, d, kvw, false));
    auto core = [this, mb, l, B, S, H, Hkv, hd, n, qw](bool want_probs) -> RecomputeFn {
      return [this, mb, l, B, S, H, Hkv, hd, n, qw, want_probs] {
        auto q = stash_.get(mb, l, "attn.q"), k = stash_.get(mb, l, "attn.k"), v = stash_.get(mb, l, "attn.v");
        Tensor o, probs;  // the one returned first (see route() below)
        if (!want_probs) o = act({n, qw}, "attn.out");
        probs = act({B, H, S, S}, "attn.probs");
        if (want_probs) o = act({n, qw}, "attn.out");
        be_.attention_forward(q->view(), k->view(), v->view(), o.view(), probs.view(), B, S, H, Hkv, hd);
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
  const std::int64_t n = B * S, d = cfg_.hidden_size, H = cfg_.num_attention_heads, Hkv = cfg_.kv_heads(),
                     hd = cfg_.head_dim(), qw = cfg_.q_width(), kvw = cfg_.kv_width();
  Tensor dq = work({n, qw}, "attn.dq"), dk = work({n, kvw}, "attn.dk"), dv = work({n, kvw}, "attn.dv");
  {
    // dx keeps changing (the residual stream), so a deferred o_proj dW gets a copy.
    Tensor dout = work({n, qw}, "attn.dout");
    Shared o = stash_.get(mb, l, "attn.out");  // o_proj's input; the flash backward reads it too
    linear_bw(mb, defer_wgrad_ ? copy_of(dx, "attn.o_proj.dy") : borrow(dx), o, P.o, dout.view(), n, qw, d, false);
    Shared q = stash_.get(mb, l, "attn.q"), k = stash_.get(mb, l, "attn.k"), v = stash_.get(mb, l, "attn.v");
    Shared probs = stash_.get(mb, l, "attn.probs");
    Tensor dprobs = work({B, H, S, S}, "attn.dprobs");
    be_.attention_backward(dout.view(), q->view(), k->view(), v->view(), o->view(), probs->view(), dq.view(), dk.view(),
                           dv.view(), dprobs.view(), B, S, H, Hkv, hd);
  }
  be_.rope_backward(dq.view(), B, S, H, hd, cfg_.rope_theta);
  be_.rope_backward(dk.view(), B, S, Hkv, hd, cfg_.rope_theta);
  if (cfg_.has_qk_norm()) {
    dq = qk_norm_backward(mb, l, true, std::move(dq));
    dk = qk_norm_backward(mb, l, false, std::move(dk));
  }
  Shared a = stash_.get(mb, l, "attn_norm.out");
  Tensor da = work({n, d}, "attn_norm.dout");
  linear_bw(mb, share(std::move(dq)), a, P.q, da.view(), n, d, qw, false);
  linear_bw(mb, share(std::move(dk)), a, P.k, da.view(), n, d, kvw, true);
  linear_bw(mb, share(std::move(dv)), a, P.v, da.view(), n, d, kvw, true);
  a.reset();
  Shared x = stash_.get(mb, l, "attn_norm.in"), rstd = stash_.get(mb, l, "attn_norm.rstd");
  Tensor dtmp = work({n, d}, "attn_norm.dx");
  be_.rmsnorm_backward(da.view(), x->view(), P.in_norm->working(), rstd->f32(), dtmp.view(), P.in_norm->g.f32(), n, d);
  be_.add_inplace(dx.view(), dtmp.view(), n * d);
}

RecomputeFn MoEModel::qk_norm_lineage(int mb, int l, bool is_q) {
  const LayerParams& P = layer(l);
  const Param* w = is_q ? P.q_norm : P.k_norm;
  const std::int64_t n = batch_ * rope_seq_, rows = cfg_.qk_norm_rows(n, is_q), width = cfg_.qk_norm_width(is_q);
  const std::int64_t heads = is_q ? cfg_.num_attention_heads : cfg_.kv_heads();
  return [this, mb, l, is_q, w, n, rows, width, heads] {
    auto x = stash_.get(mb, l, is_q ? "attn.q_norm.in" : "attn.k_norm.in");
    Tensor y = act({n, heads * cfg_.head_dim()}, is_q ? "attn.q" : "attn.k");
    {
      Tensor rstd = act({rows}, "rmsnorm.rstd", DType::f32);  // on top of y, freed at once
      be_.rmsnorm_forward(x->view(), w->working(), y.view(), rstd.f32(), rows, width, float(cfg_.rms_norm_eps));
    }
    be_.rope_forward(y.view(), n / rope_seq_, rope_seq_, heads, cfg_.head_dim(), cfg_.rope_theta);
    return y;
  };
}

Tensor MoEModel::qk_norm_backward(int mb, int l, bool is_q, Tensor dy) {
  Param* w = is_q ? layer(l).q_norm : layer(l).k_norm;
  const std::int64_t n = dy.shape()[0], rows = cfg_.qk_norm_rows(n, is_q), width = cfg_.qk_norm_width(is_q);
  Shared x = stash_.get(mb, l, is_q ? "attn.q_norm.in" : "attn.k_norm.in");
  Shared rstd = stash_.get(mb, l, is_q ? "attn.q_norm.rstd" : "attn.k_norm.rstd");
  Tensor dx = work(dy.shape(), is_q ? "attn.dq_norm" : "attn.dk_norm");
  be_.rmsnorm_backward(dy.view(), x->view(), w->working(), rstd->f32(), dx.view(), w->g.f32(), rows, width);
  return dx;  // dy is freed on return, after dx is taken
}

}  // namespace moeflex
