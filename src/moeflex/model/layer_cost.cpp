// Layer times from the cost model, op for op as model.cpp runs them (see layer_cost.h).
#include "moeflex/model/layer_cost.h"

#include <algorithm>

namespace moeflex {

namespace {

/// add_inplace(y, x, n): reads y and x, writes y.
Seconds add_inplace(const CostModel& c, std::int64_t n) { return c.elementwise(Bytes(3) * n * kActivationBytes); }
/// A plain copy of n elements (copy_of, the all-to-all's local scratch, memcpy of a stage input).
Seconds copy(const CostModel& c, std::int64_t n) { return c.elementwise(Bytes(2) * n * kActivationBytes); }
/// Zero-filling n elements (Tensor::zero).
Seconds zero(const CostModel& c, std::int64_t n) { return c.elementwise(Bytes(n) * kActivationBytes); }

/// A SwiGLU MLP of width w on n tokens (dense layers, shared experts), as
/// swiglu_mlp_forward/backward run it, adding into `lc` and its recompute table.
void swiglu_mlp(const CostModel& c, std::int64_t n, std::int64_t d, std::int64_t w, const std::string& prefix,
                LayerCost& lc) {
  lc.forward += 2 * c.linear_forward(n, d, w) + c.swiglu_forward(n * w) + c.linear_forward(n, w, d);
  // backward: down (dx), swiglu, gate and up (dx); W: the three dW GEMMs.
  lc.backward_input += c.linear_backward(n, w, d, true, false) + c.swiglu_backward(n * w) +
                       2 * c.linear_backward(n, d, w, true, false);
  lc.backward_weight += c.linear_backward(n, w, d, false, true) + 2 * c.linear_backward(n, d, w, false, true);
  lc.recompute.emplace_back(prefix + ".gate_out", c.linear_forward(n, d, w));
  lc.recompute.emplace_back(prefix + ".up_out", c.linear_forward(n, d, w));
  lc.recompute.emplace_back(prefix + ".act", c.swiglu_forward(n * w));
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

Seconds LayerCost::recompute_seconds(const std::string& name) const {
  for (const auto& [n, s] : recompute)
    if (n == name) return s;
  return 0;
}

std::vector<std::int64_t> even_groups(std::int64_t rows, std::int64_t experts) {
  std::vector<std::int64_t> g(std::size_t(std::max<std::int64_t>(experts, 1)), 0);
  if (experts <= 0 || rows <= 0) return g;
  const std::int64_t base = rows / experts, extra = rows % experts;
  for (std::int64_t e = 0; e < experts; ++e) g[std::size_t(e)] = base + (e < extra ? 1 : 0);
  return g;
}

LayerCost layer_cost(const CostModel& c, const ModelConfig& cfg, int layer, const LayerWork& wk) {
  LayerCost lc;
  const int tp = std::max(wk.tp, 1);
  const std::int64_t B = wk.B, S = wk.S, n = B * S, d = cfg.hidden_size;
  const std::int64_t ns = n / tp;  // tokens of this rank's sequence-parallel shard
  const std::int64_t H = cfg.num_attention_heads / tp, hd = cfg.head_dim(), dh = H * hd;
  const bool split = wk.split_backward;

  // ---- attention block (model.cpp attention_forward / attention_backward)
  lc.forward += c.rmsnorm_forward(ns, d) + 3 * c.linear_forward(n, d, dh) + 2 * c.rope(B, S, H, hd) +
                c.attention_forward(B, S, H, hd) + c.linear_forward(n, dh, d) + add_inplace(c, ns * d);
  lc.backward_input += (split ? copy(c, ns * d) : 0) + c.linear_backward(n, dh, d, true, false) +
                       c.attention_backward(B, S, H, hd) + 2 * c.rope(B, S, H, hd) +
                       3 * c.linear_backward(n, d, dh, true, false) + c.rmsnorm_backward(ns, d) +
                       add_inplace(c, ns * d);
  lc.backward_weight += c.linear_backward(n, dh, d, false, true) + 3 * c.linear_backward(n, d, dh, false, true);
  lc.recompute.emplace_back("attn_norm.out", c.rmsnorm_forward(ns, d));
  lc.recompute.emplace_back("attn_norm.rstd", c.rmsnorm_forward(ns, d));
  lc.recompute.emplace_back("attn.q", c.linear_forward(n, d, dh) + c.rope(B, S, H, hd));
  lc.recompute.emplace_back("attn.k", c.linear_forward(n, d, dh) + c.rope(B, S, H, hd));
  lc.recompute.emplace_back("attn.v", c.linear_forward(n, d, dh));
  lc.recompute.emplace_back("attn.probs", c.attention_forward(B, S, H, hd));
  lc.recompute.emplace_back("attn.out", c.attention_forward(B, S, H, hd));

  // ---- FFN block (ffn_forward / ffn_backward)
  lc.forward += c.rmsnorm_forward(ns, d) + add_inplace(c, ns * d);
  lc.backward_input += (split ? copy(c, ns * d) : 0) + c.rmsnorm_backward(ns, d) + add_inplace(c, ns * d);
  lc.recompute.emplace_back("ffn_norm.out", c.rmsnorm_forward(ns, d));
  lc.recompute.emplace_back("ffn_norm.rstd", c.rmsnorm_forward(ns, d));
  if (!cfg.is_moe_layer(layer)) {
    lc.backward_input += zero(c, ns * d);  // dm.zero()
    swiglu_mlp(c, n, d, cfg.intermediate_size / tp, "dense", lc);
  } else {
    const std::int64_t E = cfg.num_experts, k = cfg.num_experts_per_tok, f = cfg.moe_intermediate_size;
    const std::int64_t R = wk.rows.permuted, Rr = wk.rows.received;
    const bool ep = wk.ep > 1;
    const std::int64_t El = E / std::max(wk.ep, 1);
    const std::vector<std::int64_t> groups = even_groups(Rr, El);
    // router: gate GEMM, softmax/top-k, aux loss and dispatch planning (elementwise over [n, E] and [n, k])
    const Seconds router_f = c.linear_forward(ns, d, E) + c.router_forward(ns, E, k);
    lc.forward += router_f + c.elementwise(Bytes(ns) * (E + 2 * k) * kActivationBytes);
    if (cfg.router_z_loss_coef > 0) lc.forward += c.elementwise(Bytes(ns) * E * kActivationBytes);
    lc.forward += c.permute_forward(ns, k, d);
    if (ep) lc.forward += 2 * copy(c, Rr * d);  // dispatch and combine through the local scratch
    // The experts' FFN runs chunk by chunk (model.expert_chunk_rows): each chunk's
    // GEMMs priced at the chunk's group sizes. Their weight gradients are part of B
    // when a split backward runs over more than one chunk (model.cpp computes them at once).
    Seconds fc1 = 0, act = 0, fc2 = 0, expert_b = 0, expert_w = 0;
    std::int64_t chunks = 0;
    for (const ExpertChunkShape& ch : expert_chunk_shapes(cfg, groups)) {
      const double m = double(ch.count);
      chunks += ch.count;
      fc1 += m * c.grouped_linear_forward(ch.groups, d, f);
      act += m * c.swiglu_forward(ch.rows * f);
      fc2 += m * c.grouped_linear_forward(ch.groups, f, d);
      expert_b += m * (c.grouped_linear_backward(ch.groups, f, d, true, false) + c.swiglu_backward(ch.rows * f) +
                       2 * c.grouped_linear_backward(ch.groups, d, f, true, false) + add_inplace(c, ch.rows * d));
      expert_w += m * (c.grouped_linear_backward(ch.groups, f, d, false, true) +
                       2 * c.grouped_linear_backward(ch.groups, d, f, false, true));
    }
    lc.forward += 2 * fc1 + act + fc2 + c.unpermute_forward(ns, k, d);
    // backward: unpermute, dispatch, down (dx), swiglu, gate/up (dx) + add, combine, permute
    lc.backward_input += c.unpermute_backward(ns, k, d) + (ep ? 2 * copy(c, Rr * d) : 0) + expert_b +
                         c.permute_backward(ns, k, d);
    (split && chunks > 1 ? lc.backward_input : lc.backward_weight) += expert_w;
    // router backward: dprobs zero, aux loss, softmax/top-k backward, gate GEMM dx (dW in W)
    lc.backward_input += zero(c, ns * E) + c.elementwise(Bytes(ns) * (E + k) * kActivationBytes) +
                         c.router_backward(ns, E, k) + c.linear_backward(ns, d, E, true, false);
    if (cfg.router_z_loss_coef > 0) lc.backward_input += c.elementwise(Bytes(2) * ns * E * kActivationBytes);
    lc.backward_weight += c.linear_backward(ns, d, E, false, true);
    if (cfg.shared_width() > 0) swiglu_mlp(c, ns, d, cfg.shared_width() / tp, "shared", lc);
    lc.recompute.emplace_back("router.logits", c.linear_forward(ns, d, E));
    lc.recompute.emplace_back("router.probs", c.router_forward(ns, E, k));
    lc.recompute.emplace_back("router.topk_w", c.router_forward(ns, E, k));
    if (!ep) {
      lc.recompute.emplace_back("experts.in", c.permute_forward(ns, k, d));
      lc.recompute.emplace_back("moe.combined", fc2);
    }
    lc.recompute.emplace_back("experts.gate_out", fc1);
    lc.recompute.emplace_back("experts.up_out", fc1);
    lc.recompute.emplace_back("experts.act", act);
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
  const int tp = std::max(wk.tp, 1);
  const std::int64_t n = wk.B * wk.S, d = cfg.hidden_size, V = cfg.vocab_size / tp, ns = n / tp;
  lc.forward = c.rmsnorm_forward(ns, d) + c.linear_forward(n, d, V) + c.cross_entropy_forward(n, V);
  lc.backward_input = c.cross_entropy_backward(n, V) + c.linear_backward(n, d, V, true, false) +
                      c.rmsnorm_backward(ns, d);
  lc.backward_weight = c.linear_backward(n, d, V, false, true);
  lc.recompute.emplace_back("final_norm.out", c.rmsnorm_forward(ns, d));
  lc.recompute.emplace_back("final_norm.rstd", c.rmsnorm_forward(ns, d));
  lc.recompute.emplace_back("lm_head.probs", c.linear_forward(n, d, V) + c.cross_entropy_forward(n, V));
  if (tp > 1) lc.tp_collective_bytes = n * d * wk.element_bytes;
  return lc;
}

LayerCost embedding_cost(const CostModel& c, const ModelConfig& cfg, const LayerWork& wk) {
  LayerCost lc;
  const std::int64_t ns = wk.B * wk.S / std::max(wk.tp, 1), d = cfg.hidden_size;
  lc.forward = copy(c, ns * d);           // a gather of rows: reads and writes n x d
  lc.backward_weight = add_inplace(c, ns * d);  // scatter-add into the table
  return lc;
}

double layer_forward_flops(const ModelConfig& cfg, int layer, std::int64_t B, std::int64_t S) {
  const double n = double(B * S), d = double(cfg.hidden_size), H = double(cfg.num_attention_heads),
               hd = double(cfg.head_dim());
  double f = 2 * n * d * (4 * H * hd)               // q, k, v, o
             + 4 * double(B) * H * double(S) * double(S) * hd;  // scores and weighted sum, full S x S
  if (!cfg.is_moe_layer(layer)) return f + 6 * n * d * double(cfg.intermediate_size);
  f += 2 * n * d * double(cfg.num_experts);  // router
  f += 6 * n * d * double(cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_width());
  return f;
}

double head_forward_flops(const ModelConfig& cfg, std::int64_t B, std::int64_t S) {
  return 2 * double(B * S) * double(cfg.hidden_size) * double(cfg.vocab_size);
}

}  // namespace moeflex
