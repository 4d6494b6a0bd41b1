// Layer times from the cost model, op for op as model.cpp runs them (see layer_cost.h).
#include "moeflex/model/layer_cost.h"

#include <algorithm>
#include <tuple>

namespace moeflex {

namespace {

/// A plain copy of n elements (copy_of, the all-to-all's local scratch, memcpy of a stage input).
Seconds copy(const CostModel& c, std::int64_t n) { return c.elementwise(Bytes(2) * n * kActivationBytes); }
/// Zero-filling n elements (Tensor::zero).
Seconds zero(const CostModel& c, std::int64_t n) { return c.elementwise(Bytes(n) * kActivationBytes); }

enum class Phase { forward, backward_input, backward_weight };

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::forward: return "forward";
    case Phase::backward_input: return "backward_input";
    case Phase::backward_weight: return "backward_weight";
  }
  return "";
}

/// Adds op times to a LayerCost: to the time of the phase they run in (`into`, which
/// for the experts' weight gradients of a chunked split backward is B) and, with a
/// breakdown, to its ops under the phase the profiler labels them with (`label`).
struct Acc {
  LayerCost& lc;
  bool on;
  Seconds& total(Phase p) {
    return p == Phase::forward ? lc.forward : p == Phase::backward_input ? lc.backward_input : lc.backward_weight;
  }
  void add(Phase p, const char* kind, Seconds t, double count = 1) { add(p, p, kind, t, count); }
  void add(Phase into, Phase label, const char* kind, Seconds t, double count) {
    total(into) += t;
    if (!on) return;
    OpTally& x = lc.ops[{phase_name(label), kind}];
    x.count += count;
    x.seconds += t;
  }
  /// A recompute entry: its lineage's ops (kind, seconds, calls).
  void rebuild(const std::string& name, std::initializer_list<std::tuple<const char*, Seconds, double>> parts) {
    Seconds t = 0;
    OpBreakdown b;
    for (const auto& [kind, s, n] : parts) {
      t += s;
      if (on) b[{"recompute", kind}] = OpTally{n, s};
    }
    lc.recompute.emplace_back(name, t);
    if (on) lc.recompute_ops.push_back(std::move(b));
  }
};

/// A SwiGLU MLP of width w on n tokens (dense layers, shared experts), as
/// swiglu_mlp_forward/backward run it, adding into `lc` and its recompute table.
void swiglu_mlp(const CostModel& c, std::int64_t n, std::int64_t d, std::int64_t w, const std::string& prefix,
                Acc& a) {
  a.add(Phase::forward, "linear_forward", 2 * c.linear_forward(n, d, w), 2);
  a.add(Phase::forward, "swiglu_forward", c.swiglu_forward(n * w));
  a.add(Phase::forward, "gemm_nt", c.linear_forward(n, w, d));  // the down projection accumulates: a gemm call
  // backward: down (dx), swiglu, gate and up (dx); W: the three dW GEMMs.
  a.add(Phase::backward_input, "linear_backward_dx", c.linear_backward(n, w, d, true, false));
  a.add(Phase::backward_input, "swiglu_backward", c.swiglu_backward(n * w));
  a.add(Phase::backward_input, "linear_backward_dx", 2 * c.linear_backward(n, d, w, true, false), 2);
  a.add(Phase::backward_weight, "linear_backward_dw", c.linear_backward(n, w, d, false, true));
  a.add(Phase::backward_weight, "linear_backward_dw", 2 * c.linear_backward(n, d, w, false, true), 2);
  a.rebuild(prefix + ".gate_out", {{"linear_forward", c.linear_forward(n, d, w), 1}});
  a.rebuild(prefix + ".up_out", {{"linear_forward", c.linear_forward(n, d, w), 1}});
  a.rebuild(prefix + ".act", {{"swiglu_forward", c.swiglu_forward(n * w), 1}});
}

/// The chunks of an expert FFN over rows grouped as `groups` (model.cpp's chunk loop,
/// model.expert_chunk_rows): each distinct chunk's group sizes and rows, with how many
/// chunks have them (chunks of even groups repeat, so a long list prices in a few).
struct ExpertChunkShape {
  std::vector<std::int64_t> groups;
  std::int64_t rows = 0;
  std::int64_t count = 0;
};
std::vector<ExpertChunkShape> expert_chunk_shapes(const ModelConfig& cfg, const std::vector<std::int64_t>& groups) {
  std::int64_t total = 0;
  for (auto g : groups) total += g;
  std::vector<ExpertChunkShape> out;
  if (total <= 0) return out;
  const std::int64_t chunk = cfg.expert_chunk(total);
  std::vector<std::int64_t> offsets(groups.size() + 1, 0);
  for (std::size_t e = 0; e < groups.size(); ++e) offsets[e + 1] = offsets[e] + groups[e];
  std::vector<std::int64_t> cg(groups.size());
  for (std::int64_t r0 = 0; r0 < total; r0 += chunk) {
    const std::int64_t rows = std::min(chunk, total - r0);
    for (std::size_t e = 0; e < groups.size(); ++e)
      cg[e] = std::clamp(offsets[e + 1] - r0, std::int64_t(0), rows) - std::clamp(offsets[e] - r0, std::int64_t(0), rows);
    bool found = false;
    for (auto& s : out)
      if (s.rows == rows && s.groups == cg) {
        ++s.count;
        found = true;
        break;
      }
    if (!found) out.push_back({cg, rows, 1});
  }
  return out;
}

}  // namespace

void add_breakdown(OpBreakdown& into, const OpBreakdown& b, double times) {
  for (const auto& [key, t] : b) {
    OpTally& x = into[key];
    x.count += times * t.count;
    x.seconds += times * t.seconds;
  }
}

Seconds LayerCost::recompute_seconds(const std::string& name) const {
  for (const auto& [n, s] : recompute)
    if (n == name) return s;
  return 0;
}

Seconds LayerCost::recompute_total(const std::function<bool(const std::string&)>& recomputed, OpBreakdown* ops) const {
  // What the backward's expert loop rebuilds inline (labelled backward_input): the
  // chunk tensors, and the combine's input chunk by chunk.
  auto in_loop = [](const std::string& n) {
    return n == "experts.gate_out" || n == "experts.up_out" || n == "experts.act" || n == "moe.combined";
  };
  Seconds t = 0;
  for (std::size_t i = 0; i < recompute.size(); ++i) {
    const auto& [n, s] = recompute[i];
    if (!recomputed(n)) continue;
    t += s;
    if (!ops || i >= recompute_ops.size()) continue;
    for (const auto& [key, x] : recompute_ops[i]) {
      OpTally& y = (*ops)[{in_loop(n) ? "backward_input" : "recompute", key.second}];
      y.count += x.count;
      y.seconds += x.seconds;
    }
  }
  return t;
}

std::vector<std::int64_t> even_groups(std::int64_t rows, std::int64_t experts) {
  std::vector<std::int64_t> g(std::size_t(std::max<std::int64_t>(experts, 1)), 0);
  if (experts <= 0 || rows <= 0) return g;
  const std::int64_t base = rows / experts, extra = rows % experts;
  for (std::int64_t e = 0; e < experts; ++e) g[std::size_t(e)] = base + (e < extra ? 1 : 0);
  return g;
}

namespace {

/// One layer's attention on this rank, as the ops price it: the projections into q,
/// k and v (their GEMMs' forward, dx and dW, and how many), the RMSNorms between
/// them and RoPE (MLA's latent norms, or QK-norm), RoPE on q and k, the core (H heads of core_hd) and o_proj
/// (out_width -> d).
struct AttentionOps {
  Seconds in_f = 0, in_dx = 0, in_dw = 0;
  double in_calls = 0;
  Seconds norms_f = 0, norms_b = 0;
  double norm_calls = 0;
  Seconds rope_f = 0, rope_b = 0;
  std::int64_t H = 0, core_hd = 0, out_width = 0;
};

/// Multi-head (or grouped-query) attention as model.cpp runs it: q, k, v one GEMM
/// each, H heads of hd for q and o, KVh for k and v, QK-norm when the config has it.
/// Adds the q, k, v rebuilds (and the norms' inputs').
AttentionOps multi_head_attention(const CostModel& c, const ModelConfig& cfg, std::int64_t B, std::int64_t S,
                                  std::int64_t H, std::int64_t KVh, Acc& a) {
  const std::int64_t n = B * S, d = cfg.hidden_size, hd = cfg.head_dim(), dh = H * hd, dkv = KVh * hd;
  AttentionOps o;
  // QK-norm: an RMSNorm over q and one over k, between the projections and RoPE; per
  // head (n H rows of head_dim) or over the rank's whole width (n rows).
  // (Rows and width per rank: ModelConfig::qk_norm_rows/_width with this rank's heads.)
  const bool per_head = cfg.qk_norm == "head";
  const std::int64_t q_rows = per_head ? n * H : n, k_rows = per_head ? n * KVh : n;
  const std::int64_t q_cols = per_head ? hd : dh, k_cols = per_head ? hd : dkv;
  Seconds qn_f = 0, kn_f = 0;
  if (cfg.has_qk_norm()) {
    qn_f = c.rmsnorm_forward(q_rows, q_cols);
    kn_f = c.rmsnorm_forward(k_rows, k_cols);
    o.norms_f = qn_f + kn_f;
    o.norms_b = c.rmsnorm_backward(q_rows, q_cols) + c.rmsnorm_backward(k_rows, k_cols);
    o.norm_calls = 2;
  }
  o.in_f = c.linear_forward(n, d, dh) + 2 * c.linear_forward(n, d, dkv);
  o.in_dx = c.linear_backward(n, d, dh, true, false) + 2 * c.linear_backward(n, d, dkv, true, false);
  o.in_dw = c.linear_backward(n, d, dh, false, true) + 2 * c.linear_backward(n, d, dkv, false, true);
  o.in_calls = 3;
  o.rope_f = c.rope_forward(B, S, H, hd) + c.rope_forward(B, S, KVh, hd);
  o.rope_b = c.rope_backward(B, S, H, hd) + c.rope_backward(B, S, KVh, hd);
  o.H = H, o.core_hd = hd, o.out_width = dh;
  if (cfg.has_qk_norm()) {  // q and k from the norms' saved inputs, which are the projections
    a.rebuild("attn.q_norm.in", {{"linear_forward", c.linear_forward(n, d, dh), 1}});
    a.rebuild("attn.k_norm.in", {{"linear_forward", c.linear_forward(n, d, dkv), 1}});
    a.rebuild("attn.q", {{"rmsnorm_forward", qn_f, 1}, {"rope_forward", c.rope_forward(B, S, H, hd), 1}});
    a.rebuild("attn.k", {{"rmsnorm_forward", kn_f, 1}, {"rope_forward", c.rope_forward(B, S, KVh, hd), 1}});
  } else {
    a.rebuild("attn.q",
              {{"linear_forward", c.linear_forward(n, d, dh), 1}, {"rope_forward", c.rope_forward(B, S, H, hd), 1}});
    a.rebuild("attn.k",
              {{"linear_forward", c.linear_forward(n, d, dkv), 1}, {"rope_forward", c.rope_forward(B, S, KVh, hd), 1}});
  }
  a.rebuild("attn.v", {{"linear_forward", c.linear_forward(n, d, dkv), 1}});
  return o;
}

/// Multi-head latent attention's projections (ModelConfig::mla; the simulator's only:
/// the engine runs multi-head and grouped-query attention). H heads on this rank; the down projections
/// (d -> q_lora_rank, d -> kv_lora_rank + qk_rope_head_dim) are whole on every
/// tensor-parallel rank, the up projections and o split by heads, as Megatron-Core's
/// MLA. The core is priced as attention with (qk + v) / 2-wide heads: q k^T over
/// qk_head_dim and p v over v_head_dim, the same FLOPs. Adds the q, k, v rebuilds.
AttentionOps latent_attention(const CostModel& c, const ModelConfig& cfg, std::int64_t B, std::int64_t S,
                              std::int64_t H, Acc& a) {
  const std::int64_t n = B * S, d = cfg.hidden_size, ql = cfg.q_lora_rank, kl = cfg.kv_lora_rank;
  const std::int64_t rp = cfg.qk_rope_head_dim, qk = cfg.qk_head_dim(), vd = cfg.v_head_dim;
  const std::int64_t dq = H * qk, dkv = H * (cfg.qk_nope_head_dim + vd);
  const int qn = ql > 0 ? 2 : 1;  // q's GEMMs: down and up, or one
  auto q_gemms = [&](bool dx, bool dw) {
    return ql > 0 ? c.linear_backward(n, d, ql, dx, dw) + c.linear_backward(n, ql, dq, dx, dw)
                  : c.linear_backward(n, d, dq, dx, dw);
  };
  auto kv_gemms = [&](bool dx, bool dw) {
    return c.linear_backward(n, d, kl + rp, dx, dw) + c.linear_backward(n, kl, dkv, dx, dw);
  };
  const Seconds q_fwd = ql > 0 ? c.linear_forward(n, d, ql) + c.linear_forward(n, ql, dq) : c.linear_forward(n, d, dq);
  const Seconds kv_fwd = c.linear_forward(n, d, kl + rp) + c.linear_forward(n, kl, dkv);
  const Seconds q_norm = ql > 0 ? c.rmsnorm_forward(n, ql) : 0;
  AttentionOps o;
  o.in_f = q_fwd + kv_fwd;
  o.in_dx = q_gemms(true, false) + kv_gemms(true, false);
  o.in_dw = q_gemms(false, true) + kv_gemms(false, true);
  o.in_calls = qn + 2;
  o.norms_f = q_norm + c.rmsnorm_forward(n, kl);
  o.norms_b = (ql > 0 ? c.rmsnorm_backward(n, ql) : 0) + c.rmsnorm_backward(n, kl);
  o.norm_calls = qn;
  o.rope_f = c.rope_forward(B, S, H, rp) + c.rope_forward(B, S, 1, rp);  // q's rope part, the shared k_rope
  o.rope_b = c.rope_backward(B, S, H, rp) + c.rope_backward(B, S, 1, rp);
  o.H = H, o.core_hd = (qk + vd) / 2, o.out_width = H * vd;
  // The latents (memory_plan: saved, or rebuilt from the attention's input) and the
  // heads from them: a rebuilt q costs its up projection and rope, its latent the down
  // projection and norm.
  if (ql > 0) {
    a.rebuild("attn.q_latent", {{"linear_forward", c.linear_forward(n, d, ql), 1}, {"rmsnorm_forward", q_norm, 1}});
    a.rebuild("attn.q",
              {{"linear_forward", c.linear_forward(n, ql, dq), 1}, {"rope_forward", c.rope_forward(B, S, H, rp), 1}});
  } else {
    a.rebuild("attn.q", {{"linear_forward", q_fwd, 1}, {"rope_forward", c.rope_forward(B, S, H, rp), 1}});
  }
  a.rebuild("attn.kv_latent",
            {{"linear_forward", c.linear_forward(n, d, kl + rp), 1}, {"rmsnorm_forward", c.rmsnorm_forward(n, kl), 1}});
  // kv's up projection makes k's nope part and v: each rebuild its share of the GEMM.
  a.rebuild("attn.k", {{"linear_forward", c.linear_forward(n, kl, H * cfg.qk_nope_head_dim), 1},
                       {"rope_forward", c.rope_forward(B, S, 1, rp), 1}});
  a.rebuild("attn.v", {{"linear_forward", c.linear_forward(n, kl, H * vd), 1}});
  return o;
}

/// The attention block's ops after its input norm (model.cpp attention_forward /
/// attention_backward), whichever attention `o` describes, and the core's rebuilds.
/// `ns`: this rank's tokens of the residual stream (sequence-parallel shard).
void price_attention(const CostModel& c, const AttentionOps& o, std::int64_t B, std::int64_t S, std::int64_t ns,
                     std::int64_t d, bool split, Acc& a) {
  constexpr Phase F = Phase::forward, B_ = Phase::backward_input, W = Phase::backward_weight;
  const std::int64_t n = B * S;
  a.add(F, "linear_forward", o.in_f, o.in_calls);
  if (o.norm_calls > 0) a.add(F, "rmsnorm_forward", o.norms_f, o.norm_calls);
  a.add(F, "rope_forward", o.rope_f, 2);
  a.add(F, "attention_forward", c.attention_forward(B, S, o.H, o.core_hd));
  a.add(F, "linear_forward", c.linear_forward(n, o.out_width, d));
  a.add(F, "add_inplace", c.add_inplace(ns * d));
  if (split) a.add(B_, "copy", copy(c, ns * d));  // o_proj's dy for its deferred dW
  a.add(B_, "linear_backward_dx", c.linear_backward(n, o.out_width, d, true, false));
  a.add(B_, "attention_backward", c.attention_backward(B, S, o.H, o.core_hd));
  a.add(B_, "rope_backward", o.rope_b, 2);
  a.add(B_, "linear_backward_dx", o.in_dx, o.in_calls);
  if (o.norm_calls > 0) a.add(B_, "rmsnorm_backward", o.norms_b, o.norm_calls);
  a.add(W, "linear_backward_dw", c.linear_backward(n, o.out_width, d, false, true));
  a.add(W, "linear_backward_dw", o.in_dw, o.in_calls);
  a.rebuild("attn.probs", {{"attention_forward", c.attention_forward(B, S, o.H, o.core_hd), 1}});
  a.rebuild("attn.out", {{"attention_forward", c.attention_forward(B, S, o.H, o.core_hd), 1}});
}

}  // namespace

LayerCost layer_cost(const CostModel& c, const ModelConfig& cfg, int layer, const LayerWork& wk) {
  LayerCost lc;
  Acc a{lc, wk.breakdown};
  constexpr Phase F = Phase::forward, B_ = Phase::backward_input, W = Phase::backward_weight;
  const int tp = std::max(wk.tp, 1);
  const std::int64_t B = wk.B, S = wk.S, n = B * S, d = cfg.hidden_size;
  const std::int64_t ns = n / tp;  // tokens of this rank's sequence-parallel shard
  // q and the attention output are H heads wide, k and v KVh (GQA; KVh = H for
  // multi-head attention); with tp, each rank holds its share of the heads.
  const std::int64_t H = cfg.num_attention_heads / tp;
  const std::int64_t KVh = cfg.kv_heads_per_rank(tp);
  const bool split = wk.split_backward;

  // ---- attention block (model.cpp attention_forward / attention_backward)
  a.add(F, "rmsnorm_forward", c.rmsnorm_forward(ns, d));
  const AttentionOps attn =
      cfg.mla() ? latent_attention(c, cfg, B, S, H, a) : multi_head_attention(c, cfg, B, S, H, KVh, a);
  price_attention(c, attn, B, S, ns, d, wk.split_backward, a);
  a.add(B_, "rmsnorm_backward", c.rmsnorm_backward(ns, d));
  a.add(B_, "add_inplace", c.add_inplace(ns * d));
  a.rebuild("attn_norm.out", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});
  a.rebuild("attn_norm.rstd", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});

  // ---- FFN block (ffn_forward / ffn_backward)
  a.add(F, "rmsnorm_forward", c.rmsnorm_forward(ns, d));
  a.add(F, "add_inplace", c.add_inplace(ns * d));
  if (split) a.add(B_, "copy", copy(c, ns * d));  // the FFN's dy for its deferred dW
  a.add(B_, "rmsnorm_backward", c.rmsnorm_backward(ns, d));
  a.add(B_, "add_inplace", c.add_inplace(ns * d));
  a.rebuild("ffn_norm.out", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});
  a.rebuild("ffn_norm.rstd", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});
  if (!cfg.is_moe_layer(layer)) {
    a.add(B_, "zero", zero(c, ns * d));  // dm.zero()
    swiglu_mlp(c, n, d, cfg.intermediate_size / tp, "dense", a);
  } else {
    const std::int64_t E = cfg.num_experts, k = cfg.num_experts_per_tok, f = cfg.moe_intermediate_size;
    const std::int64_t R = wk.rows.permuted, Rr = wk.rows.received;
    const bool ep = wk.ep > 1;
    const std::int64_t El = E / std::max(wk.ep, 1);
    const std::vector<std::int64_t> groups = even_groups(Rr, El);
    // router: gate GEMM, softmax/top-k, aux loss (reads probs [n, E] and top-k [n, k]),
    // z loss, the dispatch plan (top-k read, slots written) and the top-k indices
    // read back to the host for the imbalance statistics (a copy on the CPU engine)
    a.add(F, "linear_forward", c.linear_forward(ns, d, E));
    a.add(F, "router_forward", c.router_forward(ns, E, k));
    a.add(F, "aux_loss_forward", c.aux_loss_forward(ns, E, k));
    if (cfg.router_z_loss_coef > 0) a.add(F, "z_loss_forward", c.z_loss_forward(ns, E));
    a.add(F, "moe_plan_dispatch", c.elementwise(Bytes(2) * ns * k * kActivationBytes));
    a.add(F, "copy_d2h", c.elementwise(Bytes(2) * ns * k * kActivationBytes));
    a.add(F, "permute_forward", c.permute_forward(ns, k, d));
    if (ep) a.add(F, "a2a_local_copy", 2 * copy(c, Rr * d), 2);  // dispatch and combine through the local scratch
    // The experts' FFN runs chunk by chunk (model.expert_chunk_rows): each chunk's
    // GEMMs priced at the chunk's group sizes. Their weight gradients are part of B
    // when a split backward runs over more than one chunk (model.cpp computes them at once).
    Seconds fc1 = 0, act = 0, fc2 = 0, fc2_dx = 0, act_b = 0, fc1_dx = 0, add_b = 0, fc1_dw = 0, fc2_dw = 0, topk_b = 0;
    std::int64_t chunks = 0;
    for (const ExpertChunkShape& ch : expert_chunk_shapes(cfg, groups)) {
      const double m = double(ch.count);
      chunks += ch.count;
      fc1 += m * c.grouped_linear_forward(ch.groups, d, f);
      act += m * c.swiglu_forward(ch.rows * f);
      fc2 += m * c.grouped_linear_forward(ch.groups, f, d);
      fc2_dx += m * c.grouped_linear_backward(ch.groups, f, d, true, false);
      act_b += m * c.swiglu_backward(ch.rows * f);
      fc1_dx += m * c.grouped_linear_backward(ch.groups, d, f, true, false);
      add_b += m * c.add_inplace(ch.rows * d);
      fc2_dw += m * c.grouped_linear_backward(ch.groups, f, d, false, true);
      fc1_dw += m * c.grouped_linear_backward(ch.groups, d, f, false, true);
      topk_b += m * c.combine_topk_grad(ns, k, d, ch.rows);
    }
    const double nc = double(chunks);
    a.add(F, "grouped_linear_forward", 2 * fc1 + fc2, 3 * nc);
    a.add(F, "swiglu_forward", act, nc);
    a.add(F, "unpermute_forward", c.unpermute_forward(ns, k, d));
    // backward: unpermute, dispatch, down (dx), swiglu, gate/up (dx) + add, combine, permute
    a.add(B_, "unpermute_backward", c.unpermute_backward(ns, k, d));
    if (ep) a.add(B_, "a2a_local_copy", 2 * copy(c, Rr * d), 2);
    a.add(B_, "grouped_linear_backward_dx", fc2_dx + 2 * fc1_dx, 3 * nc);
    a.add(B_, "swiglu_backward", act_b, nc);
    a.add(B_, "add_inplace", add_b, nc);
    a.add(split && chunks > 1 ? B_ : W, W, "grouped_linear_backward_dw", fc2_dw + 2 * fc1_dw, 3 * nc);
    a.add(B_, "permute_backward", c.permute_backward(ns, k, d));
    // router backward: dprobs zero, aux loss, softmax/top-k backward, z loss, gate GEMM dx (dW in W)
    a.add(B_, "zero", zero(c, ns * E));
    a.add(B_, "aux_loss_backward", c.aux_loss_backward(ns, E, k));
    a.add(B_, "router_backward", c.router_backward(ns, E, k));
    if (cfg.router_z_loss_coef > 0) a.add(B_, "z_loss_backward", c.z_loss_backward(ns, E));
    a.add(B_, "linear_backward_dx", c.linear_backward(ns, d, E, true, false));
    a.add(W, "linear_backward_dw", c.linear_backward(ns, d, E, false, true));
    if (cfg.shared_width() > 0) swiglu_mlp(c, ns, d, cfg.shared_width() / tp, "shared", a);
    a.rebuild("router.logits", {{"linear_forward", c.linear_forward(ns, d, E), 1}});
    a.rebuild("router.probs", {{"router_forward", c.router_forward(ns, E, k), 1}});
    a.rebuild("router.topk_w", {{"router_forward", c.router_forward(ns, E, k), 1}});
    if (!ep) {
      a.rebuild("experts.in", {{"permute_forward", c.permute_forward(ns, k, d), 1}});
      // Chunk by chunk in the backward's expert loop (model.cpp): the top-k gradient
      // zeroed, each chunk's down projection again and its slots' dot products.
      a.rebuild("moe.combined", {{"zero", zero(c, ns * k), 1},
                                 {"grouped_linear_forward", fc2, nc},
                                 {"combine_topk_grad", topk_b, nc}});
    }
    a.rebuild("experts.gate_out", {{"grouped_linear_forward", fc1, nc}});
    a.rebuild("experts.up_out", {{"grouped_linear_forward", fc1, nc}});
    a.rebuild("experts.act", {{"swiglu_forward", act, nc}});
    if (ep) {
      // Balanced routing keeps 1/ep of a rank's rows local; the rest crosses the network.
      const double off = double(wk.ep - 1) / double(wk.ep);
      lc.a2a_send_bytes = Bytes(double(R) * off) * d * wk.element_bytes;
      lc.a2a_recv_bytes = Bytes(double(Rr) * off) * d * wk.element_bytes;
    }
  }
  if (tp > 1) lc.tp_collective_bytes = n * d * wk.element_bytes;
  return lc;
}

LayerCost head_cost(const CostModel& c, const ModelConfig& cfg, const LayerWork& wk) {
  LayerCost lc;
  Acc a{lc, wk.breakdown};
  const int tp = std::max(wk.tp, 1);
  const std::int64_t n = wk.B * wk.S, d = cfg.hidden_size, V = cfg.vocab_size / tp, ns = n / tp;
  a.add(Phase::forward, "rmsnorm_forward", c.rmsnorm_forward(ns, d));
  a.add(Phase::forward, "linear_forward", c.linear_forward(n, d, V));
  a.add(Phase::forward, "cross_entropy_forward", c.cross_entropy_forward(n, V));
  a.add(Phase::backward_input, "cross_entropy_backward", c.cross_entropy_backward(n, V));
  a.add(Phase::backward_input, "linear_backward_dx", c.linear_backward(n, d, V, true, false));
  a.add(Phase::backward_input, "rmsnorm_backward", c.rmsnorm_backward(ns, d));
  a.add(Phase::backward_weight, "linear_backward_dw", c.linear_backward(n, d, V, false, true));
  a.rebuild("final_norm.out", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});
  a.rebuild("final_norm.rstd", {{"rmsnorm_forward", c.rmsnorm_forward(ns, d), 1}});
  a.rebuild("lm_head.probs", {{"linear_forward", c.linear_forward(n, d, V), 1},
                              {"cross_entropy_forward", c.cross_entropy_forward(n, V), 1}});
  if (tp > 1) lc.tp_collective_bytes = n * d * wk.element_bytes;
  return lc;
}

LayerCost embedding_cost(const CostModel& c, const ModelConfig& cfg, const LayerWork& wk) {
  LayerCost lc;
  Acc a{lc, wk.breakdown};
  const std::int64_t ns = wk.B * wk.S / std::max(wk.tp, 1), d = cfg.hidden_size;
  a.add(Phase::forward, "embedding_forward", c.embedding_forward(ns, d));
  a.add(Phase::backward_weight, "embedding_backward", c.embedding_backward(ns, d));
  return lc;
}

LayerCost stage_copy_cost(const CostModel& c, const ModelConfig& cfg, const LayerWork& wk, bool embedding, bool head) {
  LayerCost lc;
  Acc a{lc, wk.breakdown};
  const std::int64_t ns = wk.B * wk.S / std::max(wk.tp, 1), d = cfg.hidden_size;
  if (!embedding) a.add(Phase::forward, "copy", copy(c, ns * d));
  if (!head) a.add(Phase::backward_input, "copy", copy(c, ns * d));
  if (!embedding) a.add(Phase::backward_input, "copy", copy(c, ns * d));
  return lc;
}

double layer_forward_flops(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S) {
  const double n = double(B * S), d = double(cfg.hidden_size), H = double(cfg.num_attention_heads),
               hd = double(cfg.head_dim());
  const double kv = double(cfg.kv_heads());
  double f = 2 * n * d * (2 * H * hd + 2 * kv * hd)             // q and o (H heads), k and v (kv heads)
             + 4 * double(B) * H * double(S) * double(S) * hd;  // scores and weighted sum, full S x S
  if (cfg.mla())  // the projections' GEMMs (their norms' few weights aside); q k^T over qk, p v over v
    f = 2 * n * double(cfg.attention_params() - cfg.q_lora_rank - cfg.kv_lora_rank) +
        2 * double(B) * H * double(S) * double(S) * double(cfg.qk_head_dim() + cfg.v_head_dim);
  if (!cfg.is_moe_layer(layer)) return f + 6 * n * d * double(cfg.intermediate_size);
  f += 2 * n * d * double(cfg.num_experts);  // router
  f += 6 * n * d * double(cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_width());
  return f;
}

double head_forward_flops(const ModelConfig& cfg, std::int64_t B, std::int64_t S) {
  return 2 * double(B * S) * double(cfg.hidden_size) * double(cfg.vocab_size);
}

}  // namespace moeflex
