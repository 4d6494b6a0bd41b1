// The attention block of the MoE transformer: x <- x + o_proj(attention(rope(q),
// rope(k), v)) of RMSNorm(x): H query heads and Hkv key/value heads of head_dim each
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
  Tensor q = act({n, qw}, "attn.q"), k = act({n, kvw}, "attn.k"), v = act({n, kvw}, "attn.v");
  be_.linear_forward(a.view(), P.q->working(), q.view(), n, d, qw);
  be_.linear_forward(a.view(), P.k->working(), k.view(), n, d, kvw);
  be_.linear_forward(a.view(), P.v->working(), v.view(), n, d, kvw);
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
    plan_saves(mb, l, SavePoint::attention,
               {{"attn_norm.in", &x}, {"attn_norm.out", &a}, {"attn_norm.rstd", &rstd}, {"attn.q", &q}, {"attn.k", &k},
                {"attn.v", &v}, {"attn.probs", &probs}, {"attn.out", &o}});
    save(mb, l, "attn_norm.in", std::move(x));
    save(mb, l, "attn_norm.out", std::move(a), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, false, n));
    save(mb, l, "attn_norm.rstd", std::move(rstd), rmsnorm_lineage(mb, l, "attn_norm.in", P.in_norm, true, n));
    save(mb, l, "attn.q", std::move(q), linear_lineage(mb, l, "attn_norm.out", P.q, n, d, qw, true));
    save(mb, l, "attn.k", std::move(k), linear_lineage(mb, l, "attn_norm.out", P.k, n, d, kvw, true));
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

}  // namespace moeflex
