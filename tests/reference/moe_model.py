"""Independent PyTorch reference of the moeflex model (docs/model.md).

Written from the spec only, for clarity rather than speed: every routed expert is
evaluated on every token and the results are combined with a dense [n, E] weight
matrix that is zero for unselected and dropped assignments.  In exact arithmetic
(and bit-for-bit in IEEE, since 0 * finite = 0) this equals the sparse sum of the
spec.  Gradients come from autograd.

The router follows Hugging Face's DeepSeek-V2/V3 fields as well (scoring_func,
topk_method with n_group / topk_group, routed_scaling_factor and noaux_tc's
e_score_correction_bias buffer); see select_experts and moe_ffn.

Works in float64 and float32 (pass dtype= to MoEModel / init functions).

Run with Debian's torch: /usr/bin/python3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass
class MoEConfig:
    """The `[model]` fields of docs/model.md (Hugging Face names)."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 0  # 0 means num_attention_heads (multi-head); fewer: GQA
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    qk_norm: str = "none"  # "head": RMSNorm over each head (Qwen3-MoE); "full": over all of q and k (OLMoE)
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 16
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # 0 means n_shared_experts * moe_intermediate_size
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1  # Qwen2/3-MoE: layer l >= first_k_dense_replace is MoE iff (l + 1) % step == 0
    intermediate_size: int = 64
    norm_topk_prob: bool = True
    # DeepSeek-V2/V3 routing (Hugging Face's names; the defaults are Mixtral's / Qwen's router).
    scoring_func: str = "softmax"  # "softmax" over the experts, or "sigmoid" of each logit
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3, with a score bias)
    n_group: int = 1  # the experts form n_group contiguous groups of num_experts / n_group ...
    topk_group: int = 1  # ... and a token's experts come from its topk_group best groups
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (after norm_topk_prob)
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    capacity_factor: float = 0.0  # <= 0: dropless
    initializer_range: float = 0.02

    # ---- derived quantities -------------------------------------------------
    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim when given, else hidden_size / heads."""
        return self.head_dim if self.head_dim > 0 else self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads if self.num_key_value_heads > 0 else self.num_attention_heads

    @property
    def shared_width(self) -> int:
        if self.n_shared_experts <= 0:
            return 0
        if self.shared_expert_intermediate_size > 0:
            return self.shared_expert_intermediate_size
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def group_limited(self) -> bool:
        """Group-limited routing: groups are used by the two non-greedy methods only
        (HF DeepSeek-V2's "greedy" ignores n_group / topk_group)."""
        return self.topk_method != "greedy" and self.n_group > 1 and self.topk_group < self.n_group

    @property
    def score_bias(self) -> bool:
        """noaux_tc: every MoE layer has the buffer mlp.gate.e_score_correction_bias [E]."""
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and (layer + 1) % self.decoder_sparse_step == 0

    def validate(self) -> None:
        assert self.head_dim > 0 or self.hidden_size % self.num_attention_heads == 0, \
            "hidden_size % num_attention_heads"
        assert self.head_size % 2 == 0, "head_dim must be even for RoPE"
        assert self.num_attention_heads % self.kv_heads == 0, "num_key_value_heads must divide the heads"
        assert self.qk_norm in ("none", "head", "full"), "qk_norm must be none, head or full"
        assert 1 <= self.num_experts_per_tok <= self.num_experts, "1 <= num_experts_per_tok <= num_experts"
        assert 0 <= self.first_k_dense_replace <= self.num_hidden_layers
        assert self.decoder_sparse_step >= 1
        assert self.scoring_func in ("softmax", "sigmoid"), "scoring_func must be softmax or sigmoid"
        assert self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc"), \
            "topk_method must be greedy, group_limited_greedy or noaux_tc"
        assert self.n_group >= 1 and self.num_experts % self.n_group == 0, "n_group must divide num_experts"
        assert 1 <= self.topk_group <= self.n_group, "1 <= topk_group <= n_group"
        if self.group_limited:
            G = self.num_experts // self.n_group
            assert self.num_experts_per_tok <= self.topk_group * G, "the picked groups hold fewer than k experts"
            assert self.topk_method != "noaux_tc" or G >= 2, "noaux_tc scores a group by its two best experts"

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict) -> "MoEConfig":
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key not in names:
                continue  # e.g. batch_size / seq_len in the golden metadata
            ftype = names[key].type
            if ftype in ("int", int):
                value = int(value)
            elif ftype in ("float", float):
                value = float(value)
            elif ftype in ("bool", bool):
                value = bool(value)
            kwargs[key] = value
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

def param_shapes(cfg: MoEConfig) -> "Dict[str, Tuple[int, ...]]":
    """Every parameter name of the spec's key list with its shape, in a fixed order."""
    V, d, E = cfg.vocab_size, cfg.hidden_size, cfg.num_experts
    f, I, fs = cfg.moe_intermediate_size, cfg.intermediate_size, cfg.shared_width
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (V, d)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (d,)
        qw, kvw = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        shapes[p + "self_attn.q_proj.weight"] = (qw, d)
        shapes[p + "self_attn.k_proj.weight"] = (kvw, d)
        shapes[p + "self_attn.v_proj.weight"] = (kvw, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, qw)
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_size if per_head else qw,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_size if per_head else kvw,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.is_moe_layer(l):
            shapes[p + "mlp.gate.weight"] = (E, d)
            if cfg.score_bias:  # a buffer, not trained: listed here so files carry it (its grad is 0)
                shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
            shapes[p + "mlp.experts.gate_proj.weight"] = (E, f, d)
            shapes[p + "mlp.experts.up_proj.weight"] = (E, f, d)
            shapes[p + "mlp.experts.down_proj.weight"] = (E, d, f)
            if fs > 0:
                shapes[p + "mlp.shared_experts.gate_proj.weight"] = (fs, d)
                shapes[p + "mlp.shared_experts.up_proj.weight"] = (fs, d)
                shapes[p + "mlp.shared_experts.down_proj.weight"] = (d, fs)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (I, d)
            shapes[p + "mlp.up_proj.weight"] = (I, d)
            shapes[p + "mlp.down_proj.weight"] = (d, I)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def is_norm_weight(name: str) -> bool:
    return (name.endswith("layernorm.weight") or name == "model.norm.weight"
            or name.endswith("self_attn.q_norm.weight") or name.endswith("self_attn.k_norm.weight"))


def is_buffer(name: str) -> bool:
    """Entries of param_shapes that are not trained: the noaux_tc score bias.  Their
    value never reaches the loss through autograd, so their gradient is 0."""
    return name.endswith("mlp.gate.e_score_correction_bias")


def init_params_spec(cfg: MoEConfig, generator: torch.Generator,
                     dtype: torch.dtype = torch.float64) -> "Dict[str, torch.Tensor]":
    """The engine's initialisation from the spec: N(0, initializer_range^2) matrices,
    o_proj / down_proj scaled by 1/sqrt(2L), norm weights 1, score biases 0."""
    out = {}
    scale_resid = 1.0 / math.sqrt(2.0 * cfg.num_hidden_layers)
    for name, shape in param_shapes(cfg).items():
        if is_norm_weight(name):
            t = torch.ones(shape, dtype=dtype)
        elif is_buffer(name):
            t = torch.zeros(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=generator, dtype=dtype) * cfg.initializer_range
            if "o_proj" in name or "down_proj" in name:
                t = t * scale_resid
        out[name] = t
    return out


def init_params_golden(cfg: MoEConfig, generator: torch.Generator, std: float = 0.1,
                       dtype: torch.dtype = torch.float64, bias_std: float = 0.05) -> "Dict[str, torch.Tensor]":
    """Golden-file weights: matrices N(0, std^2) so routing is far from uniform,
    norm weights 1 + 0.1 N(0, 1) so their gradients matter, score biases (noaux_tc)
    N(0, bias_std^2) so that they change the selection."""
    out = {}
    for name, shape in param_shapes(cfg).items():
        z = torch.randn(shape, generator=generator, dtype=dtype)
        if is_norm_weight(name):
            out[name] = 1.0 + 0.1 * z
        elif is_buffer(name):
            out[name] = bias_std * z
        else:
            out[name] = std * z
    return out


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype):
    half = head_dim // 2
    # inv_freq_i = theta^(-2i/hd), computed in float64 then cast
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    pos = torch.arange(seq_len, dtype=torch.float64)
    angle = pos[:, None] * inv_freq[None, :]  # [S, hd/2]
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, hd]; rotate-half: out[i] = x[i] c - x[i+h] s, out[i+h] = x[i+h] c + x[i] s."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def causal_attention(a: torch.Tensor, P: Dict[str, torch.Tensor], prefix: str, cfg: MoEConfig,
                     B: int, S: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    H, Hkv, hd = cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
    q = a @ P[prefix + "q_proj.weight"].T
    k = a @ P[prefix + "k_proj.weight"].T
    if cfg.qk_norm == "full":  # OLMoE: one norm over all of q, one over all of k
        q = rms_norm(q, P[prefix + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, P[prefix + "k_norm.weight"], cfg.rms_norm_eps)
    q, k = q.view(B, S, H, hd), k.view(B, S, Hkv, hd)
    if cfg.qk_norm == "head":  # Qwen3-MoE: each head normed over its head_dim
        q = rms_norm(q, P[prefix + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, P[prefix + "k_norm.weight"], cfg.rms_norm_eps)
    v = (a @ P[prefix + "v_proj.weight"].T).view(B, S, Hkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Grouped-query attention: kv head g serves query heads g*H/Hkv .. (g+1)*H/Hkv - 1.
    k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, hd]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # [B, H, S, S]
    mask = torch.ones(S, S, dtype=torch.bool).tril()  # key j visible to query i iff j <= i
    scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.softmax(scores, dim=-1) @ v  # [B, H, S, hd]
    o = o.permute(0, 2, 1, 3).reshape(B * S, H * hd)
    return o @ P[prefix + "o_proj.weight"].T


def swiglu(m: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.silu(m @ w1.T) * (m @ w3.T)) @ w2.T


def stable_topk_desc(p: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k sorted by decreasing value, ties broken toward the lower index."""
    vals, idx = torch.sort(p, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def capacity_of(cfg: MoEConfig, n: int) -> Optional[int]:
    if cfg.capacity_factor <= 0:
        return None
    return int(math.ceil(cfg.capacity_factor * n * cfg.num_experts_per_tok / cfg.num_experts))


def capacity_keep(idx: torch.Tensor, num_experts: int, capacity: Optional[int]) -> torch.Tensor:
    """idx: [n, k] expert ids.  Keep the first `capacity` assignments of each expert,
    assignments taken in (token, slot) order, i.e. row-major over idx."""
    if capacity is None:
        return torch.ones_like(idx, dtype=torch.bool)
    flat = idx.reshape(-1)
    onehot = F.one_hot(flat, num_experts)  # [n*k, E]
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=1) - 1  # rank of this assignment within its expert
    return (position < capacity).reshape(idx.shape)


class RouterStats:
    """What a MoE layer's router decided (for tests / printing)."""

    def __init__(self, idx, keep, counts, capacity, margin, group_margin=float("inf"), idx_without_bias=None,
                 idx_without_groups=None):
        self.idx = idx            # [n, k] expert ids
        self.keep = keep          # [n, k] bool
        self.counts = counts      # [E] assignments before dropping
        self.capacity = capacity  # None when dropless
        self.margin = margin      # min over tokens of c_(k) - c_(k+1) among the allowed experts (robustness)
        self.group_margin = group_margin  # min over tokens of the topk_group-th minus the next group score
        self.idx_without_bias = idx_without_bias  # [n, k] what the same scores pick with a zero bias (noaux_tc)
        self.idx_without_groups = idx_without_groups  # [n, k] what they pick from all experts (group-limited)

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())

    def _tokens_changed(self, other) -> int:
        if other is None:
            return 0
        a = torch.sort(self.idx, dim=-1).values
        b = torch.sort(other, dim=-1).values
        return int((a != b).any(dim=-1).sum())

    def tokens_changed_by_bias(self) -> int:
        """Tokens whose set of experts differs from the one a zero bias would pick."""
        return self._tokens_changed(self.idx_without_bias)

    def tokens_changed_by_groups(self) -> int:
        """Tokens whose set of experts differs from the top-k over all experts."""
        return self._tokens_changed(self.idx_without_groups)


def router_scores(logits: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """p [n, E]: softmax over the experts, or an independent sigmoid per expert."""
    if cfg.scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def select_experts(p: torch.Tensor, bias: Optional[torch.Tensor], cfg: MoEConfig):
    """The router's choice of experts per token (DeepSeek-V2/V3 rules), not differentiated.

    Choice scores c = p + bias (bias: the noaux_tc buffer, else none).  Group-limited
    routing keeps the experts of each token's topk_group best groups (group score: the
    max of c in the group for group_limited_greedy, the sum of its two largest c for
    noaux_tc; ties to the lower group) and excludes the others.  Then the top-k of c
    among the allowed experts, ties to the lower expert, in decreasing c.

    Returns (idx [n, k], top-k margin, group margin): the smallest gaps over the tokens
    between the last picked and the first unpicked choice score / group score."""
    n, E = p.shape
    k = cfg.num_experts_per_tok
    with torch.no_grad():
        c = p.detach().clone()
        if bias is not None:
            c = c + bias.detach()
        group_margin = float("inf")
        if cfg.group_limited:
            G = E // cfg.n_group
            grouped = c.view(n, cfg.n_group, G)  # group g holds experts g*G .. g*G + G - 1
            if cfg.topk_method == "group_limited_greedy":
                group_score = grouped.max(dim=-1).values
            else:  # noaux_tc: the sum of the group's two largest choice scores
                group_score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(dim=-1)
            gs_sorted, g_order = torch.sort(group_score, dim=-1, descending=True, stable=True)
            picked = torch.zeros(n, cfg.n_group, dtype=torch.bool)
            picked.scatter_(1, g_order[:, :cfg.topk_group], True)
            allowed = picked.repeat_interleave(G, dim=1)  # [n, E]
            # Excluded experts are never chosen (not merely scored 0 as some HF code does).
            c = c.masked_fill(~allowed, float("-inf"))
            group_margin = float((gs_sorted[:, cfg.topk_group - 1] - gs_sorted[:, cfg.topk_group]).min())
        c_sorted, order = torch.sort(c, dim=-1, descending=True, stable=True)
        idx = order[:, :k]
        # The first unpicked score is -inf when exactly k experts are allowed: an infinite margin.
        margin = float((c_sorted[:, k - 1] - c_sorted[:, k]).min()) if k < E else float("inf")
    return idx, margin, group_margin


def moe_ffn(m: torch.Tensor, P: Dict[str, torch.Tensor], prefix: str, cfg: MoEConfig):
    """Returns (y [n, d], aux scalar, z scalar, RouterStats)."""
    n = m.shape[0]
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    logits_r = m @ P[prefix + "gate.weight"].T  # [n, E]
    p = router_scores(logits_r, cfg)
    # The noaux_tc bias is a buffer: detached, so no gradient ever reaches it.
    bias = P[prefix + "gate.e_score_correction_bias"].detach() if cfg.score_bias else None
    idx, margin, group_margin = select_experts(p, bias, cfg)
    # For the golden files' checks only: what the same scores would pick without the
    # bias, and without the group limit.
    idx_without_bias = select_experts(p, None, cfg)[0] if bias is not None else None
    idx_without_groups = None
    if cfg.group_limited:
        idx_without_groups = select_experts(p, bias, dataclasses.replace(cfg, n_group=1, topk_group=1))[0]
    # Weights: the unbiased scores of the picked experts (differentiable), optionally
    # renormalised over the k, then scaled (always, after the renormalisation).
    w = p.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * cfg.routed_scaling_factor
    capacity = capacity_of(cfg, n)
    keep = capacity_keep(idx, E, capacity)
    w_kept = torch.where(keep, w, torch.zeros_like(w))

    # Dense combine matrix: combine[i, e] = sum of kept weights of token i to expert e.
    combine = torch.zeros(n, E, dtype=m.dtype).scatter_add(1, idx, w_kept)
    W1 = P[prefix + "experts.gate_proj.weight"]  # [E, f, d]
    W3 = P[prefix + "experts.up_proj.weight"]    # [E, f, d]
    W2 = P[prefix + "experts.down_proj.weight"]  # [E, d, f]
    y = torch.zeros_like(m)
    for e in range(E):
        y = y + combine[:, e:e + 1] * swiglu(m, W1[e], W3[e], W2[e])
    if cfg.shared_width > 0:
        y = y + swiglu(m, P[prefix + "shared_experts.gate_proj.weight"],
                       P[prefix + "shared_experts.up_proj.weight"],
                       P[prefix + "shared_experts.down_proj.weight"])

    # Switch load-balancing loss; f_e counts assignments before dropping, no gradient.
    # P_e: the mean score; sigmoid scores are first normalised per token (as Megatron does).
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    f_e = (counts.to(m.dtype) / (n * k)).detach()
    if cfg.scoring_func == "sigmoid":
        P_e = (p / p.sum(dim=-1, keepdim=True)).mean(dim=0)
    else:
        P_e = p.mean(dim=0)
    aux = cfg.router_aux_loss_coef * E * (f_e * P_e).sum()
    z = cfg.router_z_loss_coef * (torch.logsumexp(logits_r, dim=-1) ** 2).mean()
    return y, aux, z, RouterStats(idx.detach(), keep, counts, capacity, margin, group_margin, idx_without_bias,
                                  idx_without_groups)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

def forward(cfg: MoEConfig, P: Dict[str, torch.Tensor], ids: torch.Tensor, targets: torch.Tensor,
            stats: Optional[List[RouterStats]] = None):
    """ids, targets: [B, S] int64.  Returns (loss, ce, aux, z, logits [B*S, V]).

    aux and z are summed over the MoE layers (coefficients included);
    loss = ce + aux + z."""
    B, S = ids.shape
    dtype = P["model.embed_tokens.weight"].dtype
    eps = cfg.rms_norm_eps
    cos, sin = rope_cos_sin(S, cfg.head_size, cfg.rope_theta, dtype)
    x = P["model.embed_tokens.weight"][ids.reshape(-1)]  # [n, d]
    aux_total = torch.zeros((), dtype=dtype)
    z_total = torch.zeros((), dtype=dtype)
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        a = rms_norm(x, P[p + "input_layernorm.weight"], eps)
        x = x + causal_attention(a, P, p + "self_attn.", cfg, B, S, cos, sin)
        m = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        if cfg.is_moe_layer(l):
            y, aux, z, st = moe_ffn(m, P, p + "mlp.", cfg)
            aux_total = aux_total + aux
            z_total = z_total + z
            if stats is not None:
                stats.append(st)
        else:
            y = swiglu(m, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                       P[p + "mlp.down_proj.weight"])
        x = x + y
    h = rms_norm(x, P["model.norm.weight"], eps)
    W_lm = P["model.embed_tokens.weight"] if cfg.tie_word_embeddings else P["lm_head.weight"]
    logits = h @ W_lm.T
    ce = F.cross_entropy(logits, targets.reshape(-1), reduction="mean")
    loss = ce + aux_total + z_total
    return loss, ce, aux_total, z_total, logits


class MoEModel(torch.nn.Module):
    """nn.Module wrapper: parameters registered under the spec's names (dots kept via a
    name map, since nn.Module forbids '.' in parameter names)."""

    def __init__(self, cfg: MoEConfig, params: Dict[str, torch.Tensor]):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.names = list(params.keys())
        self.store = torch.nn.ParameterDict(
            {name.replace(".", "__"): torch.nn.Parameter(t.clone(), requires_grad=not is_buffer(name))
             for name, t in params.items()})  # the noaux_tc score bias is not trained

    def params(self) -> Dict[str, torch.Tensor]:
        return {name: self.store[name.replace(".", "__")] for name in self.names}

    def forward(self, ids, targets, stats=None):
        return forward(self.cfg, self.params(), ids, targets, stats)
