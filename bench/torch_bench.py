#!/usr/bin/python3
"""PyTorch baseline for `make bench`: train the moeflex model (docs/model.md) in float32
on the CPU with AdamW and report throughput as one JSON line on stdout.

    /usr/bin/python3 bench/torch_bench.py [CONFIG.toml] --threads 2 --steps 20 --warmup 3
        [--micro-batch-size B] [--seq-len S] [--set model.num_experts=8 ...]
        [--data SHARD.bin --data-dtype uint16] [--device cuda] [--bf16]
    /usr/bin/python3 bench/torch_bench.py --check     # compare with tests/reference in float64

CONFIG.toml: the `[model]` table of docs/model.md and a `[train]` table with
`micro_batch_size`, `seq_len` (and optionally lr, weight_decay, beta1, beta2, eps,
grad_clip, grad_accum_steps, seed).  Command-line values override the file.

The expert computation is the idiomatic efficient eager-PyTorch one (as in HF
Mixtral / Qwen-MoE): sort the (token, slot) assignments by expert, then loop over
the experts with index_select / one matmul chain per expert / index_add_.

The router also runs DeepSeek-V2/V3's rules (Hugging Face's scoring_func, topk_method
with n_group / topk_group, routed_scaling_factor).  noaux_tc's e_score_correction_bias
is a buffer that starts at zero; after each optimizer step it moves by
router_bias_update_rate * sign(mean load - load_e) (the load of that step's forwards;
rate 0 keeps it frozen), the aux-loss-free balancing of DeepSeek-V3.

--bf16: PyTorch's usual mixed precision, the counterpart of `moeflex train --bf16`:
torch.autocast(device_type, dtype=torch.bfloat16) around forward and loss (matmuls in
bf16; the ops on autocast's float32 list in float32: cross-entropy, and on CUDA also
softmax / logsumexp), backward outside it; the parameters, their gradients and the
AdamW state stay float32 (no GradScaler: bf16 has float32's exponent range).  Works on
the CPU too (torch >= 1.10).
Output: {"impl": "pytorch", "precision": "fp32"|"bf16", "tokens_per_second": ...,
"step_seconds_median": ..., "threads": ..., ...}.  Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MODEL_DEFAULTS = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=0,
    shared_expert_intermediate_size=0, first_k_dense_replace=0, decoder_sparse_step=1, intermediate_size=1024,
    norm_topk_prob=True, router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
    tie_word_embeddings=False, capacity_factor=0.0, initializer_range=0.02,
    head_dim=0, num_key_value_heads=0, qk_norm="none",
    # DeepSeek-V2/V3 routing (Hugging Face's names); the defaults are the plain softmax top-k
    scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
    router_bias_update_rate=1e-3)  # noaux_tc: step of the score bias after each optimizer step (0: frozen)
TRAIN_DEFAULTS = dict(micro_batch_size=8, seq_len=128, lr=3e-4, weight_decay=0.1, beta1=0.9,
                      beta2=0.95, eps=1e-8, grad_clip=1.0, grad_accum_steps=1, seed=1234)
TRAIN_ALIASES = {"learning_rate": "lr", "max_lr": "lr", "adam_beta1": "beta1", "adam_beta2": "beta2",
                 "adam_eps": "eps", "max_grad_norm": "grad_clip", "clip_grad_norm": "grad_clip",
                 "gradient_accumulation_steps": "grad_accum_steps", "grad_accum": "grad_accum_steps",
                 "batch_size": "micro_batch_size"}


class Cfg:
    """Plain attribute bag over the [model] fields."""

    def __init__(self, d: dict):
        for k, v in d.items():
            setattr(self, k, v)
        self.head_dim = self.head_dim if getattr(self, "head_dim", 0) else self.hidden_size // self.num_attention_heads
        self.kv_heads = getattr(self, "num_key_value_heads", 0) or self.num_attention_heads
        self.qk_norm = getattr(self, "qk_norm", "none")
        if self.n_shared_experts > 0:
            self.shared_width = (self.shared_expert_intermediate_size
                                 if self.shared_expert_intermediate_size > 0
                                 else self.n_shared_experts * self.moe_intermediate_size)
        else:
            self.shared_width = 0
        assert self.head_dim % 2 == 0 and self.num_attention_heads % self.kv_heads == 0
        assert self.qk_norm in ("none", "head", "full")
        assert 1 <= self.num_experts_per_tok <= self.num_experts
        for name, default in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("n_group", 1),
                              ("topk_group", 1), ("routed_scaling_factor", 1.0), ("router_bias_update_rate", 1e-3)):
            setattr(self, name, getattr(self, name, default))
        assert self.scoring_func in ("softmax", "sigmoid")
        assert self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc")
        assert self.n_group >= 1 and self.num_experts % self.n_group == 0 and 1 <= self.topk_group <= self.n_group
        # HF DeepSeek-V2's "greedy" ignores the groups
        self.group_limited = self.topk_method != "greedy" and self.n_group > 1 and self.topk_group < self.n_group
        if self.group_limited:
            G = self.num_experts // self.n_group
            assert self.num_experts_per_tok <= self.topk_group * G
            assert self.topk_method != "noaux_tc" or G >= 2


def coerce(value, like):
    if isinstance(like, bool):
        if isinstance(value, str):
            return value.lower() in ("1", "true", "yes", "on")
        return bool(value)
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    return value


# ---------------------------------------------------------------------------
# Model (efficient eager PyTorch)
# ---------------------------------------------------------------------------

class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(torch.nn.Module):
    """Grouped-query attention (Hkv key/value heads; Hkv = H is multi-head) with
    optional QK-norm: per head (Qwen3-MoE) or over all of q and k (OLMoE)."""

    def __init__(self, cfg: Cfg):
        super().__init__()
        d = cfg.hidden_size
        self.H, self.Hkv, self.hd, self.qk_norm = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, cfg.qk_norm
        qw, kvw = self.H * self.hd, self.Hkv * self.hd
        self.q_proj = torch.nn.Linear(d, qw, bias=False)
        self.k_proj = torch.nn.Linear(d, kvw, bias=False)
        self.v_proj = torch.nn.Linear(d, kvw, bias=False)
        self.o_proj = torch.nn.Linear(qw, d, bias=False)
        if self.qk_norm != "none":
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(self.hd if per_head else qw, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd if per_head else kvw, cfg.rms_norm_eps)

    @staticmethod
    def rope(x, cos, sin):  # x [B, H, S, hd]; cos/sin [S, hd/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, a, B, S, cos, sin, mask):
        q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.H, self.hd)
        k = k.view(B, S, self.Hkv, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, S, self.Hkv, self.hd).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.Hkv != self.H:
            k = k.repeat_interleave(self.H // self.Hkv, dim=1)
            v = v.repeat_interleave(self.H // self.Hkv, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd)) + mask
        o = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o_proj(o.transpose(1, 2).reshape(B * S, self.H * self.hd))


class SwiGLU(torch.nn.Module):
    def __init__(self, d, width):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, width, bias=False)
        self.up_proj = torch.nn.Linear(d, width, bias=False)
        self.down_proj = torch.nn.Linear(width, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(torch.nn.Module):
    """E SwiGLU experts with stacked weights [E, f, d], [E, f, d], [E, d, f]."""

    def __init__(self, E, d, f):
        super().__init__()
        self.gate_proj = torch.nn.Parameter(torch.empty(E, f, d))
        self.up_proj = torch.nn.Parameter(torch.empty(E, f, d))
        self.down_proj = torch.nn.Parameter(torch.empty(E, d, f))


class MoE(torch.nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = torch.nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_width) if cfg.shared_width > 0 else None
        if cfg.topk_method == "noaux_tc":
            # DeepSeek-V3's score bias: a buffer (not trained by the optimizer, no gradient),
            # HF's name mlp.gate.e_score_correction_bias; starts at zero.  The expert load
            # of the forwards since the last update drives update_score_bias.
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
            self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False)

    def select(self, p):
        """Expert ids [n, k] of the k best choice scores p + bias among the allowed experts
        (those of each token's topk_group best groups when group-limited), in decreasing
        order.  Not differentiated.  (torch.topk: ties in any order; the golden files have none.)"""
        cfg = self.cfg
        n, E, k = p.shape[0], cfg.num_experts, cfg.num_experts_per_tok
        with torch.no_grad():
            c = p.detach()
            if cfg.topk_method == "noaux_tc":
                c = c + self.gate.e_score_correction_bias
            if cfg.group_limited:
                grouped = c.view(n, cfg.n_group, E // cfg.n_group)  # contiguous groups
                if cfg.topk_method == "group_limited_greedy":
                    group_score = grouped.amax(dim=-1)
                else:  # noaux_tc: the sum of the group's two best
                    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
                groups = group_score.topk(cfg.topk_group, dim=-1).indices
                allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
                # the other groups' experts are excluded (-inf), not scored 0
                c = c.masked_fill(~allowed.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
            return torch.topk(c, k, dim=-1).indices

    @torch.no_grad()
    def update_score_bias(self, rate):
        """Aux-loss-free balancing (DeepSeek-V3): b_e += rate * sign(mean load - load_e),
        the load counted over the forwards since the last call."""
        load = self.expert_load.to(self.gate.e_score_correction_bias.dtype)
        self.gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
        self.expert_load.zero_()

    def forward(self, m):
        cfg = self.cfg
        n, E, k = m.shape[0], cfg.num_experts, cfg.num_experts_per_tok
        logits_r = self.gate(m)
        p = torch.sigmoid(logits_r) if cfg.scoring_func == "sigmoid" else torch.softmax(logits_r, dim=-1)
        idx = self.select(p)
        w = p.gather(1, idx)  # the unbiased scores of the picked experts
        if cfg.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if cfg.routed_scaling_factor != 1.0:
            w = w * cfg.routed_scaling_factor

        # Permute: assignments sorted by expert; stable, so (token, slot) order within an expert.
        flat_idx = idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=E)
        tokens = order // k
        weights = w.reshape(-1)[order]
        if cfg.capacity_factor > 0:
            capacity = int(math.ceil(cfg.capacity_factor * n * k / E))
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
            kept = pos < capacity
            tokens, weights = tokens[kept], weights[kept]
            seg = torch.clamp(counts, max=capacity).tolist()
        else:
            seg = counts.tolist()

        x_sorted = m.index_select(0, tokens)
        W1, W3, W2 = self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj
        outs = []
        start = 0
        for e, c in enumerate(seg):
            if c == 0:
                continue
            xe = x_sorted[start:start + c]
            outs.append(F.linear(F.silu(F.linear(xe, W1[e])) * F.linear(xe, W3[e]), W2[e]))
            start += c
        y = torch.zeros_like(m)
        if outs:
            # .to(): under autocast the expert outputs are bf16 while y follows m
            y = y.index_add(0, tokens, (torch.cat(outs, 0) * weights.unsqueeze(1)).to(y.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(m)

        if cfg.topk_method == "noaux_tc":
            self.expert_load += counts.detach()
        f_e = (counts.to(p.dtype) / (n * k)).detach()
        # sigmoid scores enter the balance loss normalised per token (as Megatron does)
        P_e = (p / p.sum(-1, keepdim=True)).mean(0) if cfg.scoring_func == "sigmoid" else p.mean(0)
        aux = cfg.router_aux_loss_coef * E * torch.dot(f_e, P_e)
        z = cfg.router_z_loss_coef * torch.logsumexp(logits_r, dim=-1).pow(2).mean()
        return y, aux + z


class Layer(torch.nn.Module):
    def __init__(self, cfg: Cfg, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = moe
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, B, S, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), B, S, cos, sin, mask)
        m = self.post_attention_layernorm(x)
        if self.moe:
            y, router_loss = self.mlp(m)
        else:
            y, router_loss = self.mlp(m), None
        return x + y, router_loss


class Inner(torch.nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(
            [Layer(cfg, l >= cfg.first_k_dense_replace and (l + 1) % cfg.decoder_sparse_step == 0)
             for l in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoEForCausalLM(torch.nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else torch.nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_cache = {}

    def spec_params(self):
        """(spec name, parameter) for every parameter, in the docs/model.md naming."""
        out = []
        for name, p in self.named_parameters():
            if name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
                name += ".weight"  # stacked experts are bare Parameters here
            out.append((name, p))
        return out

    def spec_buffers(self):
        """(spec name, buffer) for the entries of the spec's list that are not trained:
        the noaux_tc score biases (mlp.gate.e_score_correction_bias)."""
        return [(name, b) for name, b in self.named_buffers() if name.endswith(".e_score_correction_bias")]

    def update_score_biases(self, rate):
        """After an optimizer step: move every noaux_tc score bias toward balance."""
        if rate > 0:
            for layer in self.model.layers:
                if layer.moe and self.cfg.topk_method == "noaux_tc":
                    layer.mlp.update_score_bias(rate)

    def init_weights(self, generator):
        cfg = self.cfg
        scale = 1.0 / math.sqrt(2.0 * cfg.num_hidden_layers)
        with torch.no_grad():
            for name, p in self.spec_params():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, cfg.initializer_range, generator=generator)
                    if "o_proj" in name or "down_proj" in name:
                        p.mul_(scale)

    def rope(self, S, dtype):
        key = (S, dtype)
        if key not in self._rope_cache:
            hd = self.cfg.head_dim
            inv = self.cfg.rope_theta ** (-2.0 * torch.arange(hd // 2, dtype=torch.float64) / hd)
            ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
            mask = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
            dev = self.model.embed_tokens.weight.device
            self._rope_cache[key] = (ang.cos().to(dtype=dtype, device=dev), ang.sin().to(dtype=dtype, device=dev),
                                     mask.to(dtype=dtype, device=dev))
        return self._rope_cache[key]

    def forward(self, ids, targets):
        B, S = ids.shape
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin, mask = self.rope(S, dtype)
        x = self.model.embed_tokens(ids.reshape(-1))
        router_loss = torch.zeros((), dtype=dtype, device=ids.device)
        for layer in self.model.layers:
            x, rl = layer(x, B, S, cos, sin, mask)
            if rl is not None:
                router_loss = router_loss + rl
        h = self.model.norm(x)
        W = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, W)
        ce = F.cross_entropy(logits, targets.reshape(-1))
        return ce + router_loss, ce, logits


# ---------------------------------------------------------------------------
# Cross-check against the reference (float64)
# ---------------------------------------------------------------------------

def check_against_reference() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "reference"))
    from moe_model import MoEConfig, forward as ref_forward  # noqa: E402
    from make_golden import read_safetensors  # noqa: E402

    worst_all = 0.0
    for fname in ("golden_v1.safetensors", "golden_v1_capacity.safetensors", "golden_v1_gqa.safetensors",
                  "golden_v1_qk_norm_head.safetensors", "golden_v1_qk_norm_full.safetensors",
                  "golden_v1_sparse_step.safetensors", "golden_v1_noaux_tc.safetensors",
                  "golden_v1_group_limited.safetensors"):
        meta, t = read_safetensors(os.path.join(here, "..", "tests", "reference", fname))
        conf = json.loads(meta["config"])
        B, S = conf.pop("batch_size"), conf.pop("seq_len")
        cfg = Cfg(dict(MODEL_DEFAULTS, **conf))
        model = MoEForCausalLM(cfg).double()
        with torch.no_grad():
            for name, p in model.spec_params():
                p.copy_(t["param." + name])
            for name, b in model.spec_buffers():  # the noaux_tc score biases
                b.copy_(t["param." + name])
        ids = t["input.ids"].long()
        targets = t["input.targets"].long()
        loss, _, logits = model(ids, targets)
        loss.backward()
        worst = abs(loss.item() - float(meta["loss"])) / abs(float(meta["loss"]))
        worst = max(worst, (logits.detach() - t["out.logits"]).abs().max().item())
        for name, p in model.spec_params():
            worst = max(worst, (p.grad - t["grad." + name]).abs().max().item())
        for name, _ in model.spec_buffers():  # a buffer's gradient is 0 in the file
            worst = max(worst, t["grad." + name].abs().max().item())
        spec_names = [name for name, _ in model.spec_params() + model.spec_buffers()]
        if sorted(spec_names) != sorted(k[len("param."):] for k in t if k.startswith("param.")):
            worst = 1.0  # the bench model's names must be exactly the file's
        # and the reference recomputed in float32 (it must work in both precisions)
        P32 = {name: t["param." + name].float() for name in spec_names}
        loss32 = ref_forward(MoEConfig.from_dict(conf), P32, ids, targets)[0].item()
        rel32 = abs(loss32 - float(meta["loss"])) / abs(float(meta["loss"]))
        print(f"{fname}: bench model vs golden max diff {worst:.2e}; reference float32 loss rel diff "
              f"{rel32:.2e}", file=sys.stderr)
        worst_all = max(worst_all, worst)
        if rel32 > 1e-5:
            worst_all = max(worst_all, 1.0)
    ok = worst_all < 1e-10
    print("check " + ("PASS" if ok else "FAIL"), file=sys.stderr)
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------

def load_config(args):
    model = dict(MODEL_DEFAULTS)
    train = dict(TRAIN_DEFAULTS)
    if args.config:
        import tomllib
        # As moeflex reads a run config: configs/default.toml, then the file's keys.
        default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "default.toml")
        for path in (default, args.config):
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
            for k, v in doc.get("model", {}).items():
                if k in model:
                    model[k] = coerce(v, model[k])
            for k, v in doc.get("train", {}).items():
                k = TRAIN_ALIASES.get(k, k)
                if k in train:
                    train[k] = coerce(v, train[k])
                elif k == "router_bias_update_rate":  # a training rule: accepted in [train] too
                    model[k] = coerce(v, model[k])
    for item in args.set:
        key, _, value = item.partition("=")
        table, _, field = key.partition(".")
        if not field:
            table, field = ("model" if key in model else "train"), key
        target = model if table == "model" else train
        field = TRAIN_ALIASES.get(field, field) if target is train else field
        if field not in target:
            raise SystemExit(f"unknown field {key!r}")
        target[field] = coerce(value, target[field])
    if args.micro_batch_size:
        train["micro_batch_size"] = args.micro_batch_size
    if args.seq_len:
        train["seq_len"] = args.seq_len
    return model, train


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="TOML file with [model] and [train] tables")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    ap.add_argument("--micro-batch-size", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="[model.|train.]FIELD=VALUE")
    ap.add_argument("--data", help="token shard: raw little-endian token ids")
    ap.add_argument("--data-dtype", default="uint16", choices=["uint16", "uint32", "int32"])
    ap.add_argument("--data-offset", type=int, default=0, help="header bytes to skip in --data")
    ap.add_argument("--check", action="store_true", help="compare with tests/reference in float64 and exit")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (float32 without TF32, as moeflex --device cuda)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 mixed precision: torch.autocast around forward and loss, float32 parameters, "
                         "gradients and AdamW state (as moeflex train --bf16)")
    args = ap.parse_args()

    if args.check:
        torch.set_num_threads(1)
        return check_against_reference()

    torch.set_num_threads(args.threads)
    model_conf, train = load_config(args)
    cfg = Cfg(model_conf)
    B, S, M = train["micro_batch_size"], train["seq_len"], max(1, train["grad_accum_steps"])

    torch.manual_seed(train["seed"])
    gen = torch.Generator().manual_seed(train["seed"])
    model = MoEForCausalLM(cfg)
    model.init_weights(gen)
    device = torch.device(args.device)
    if device.type == "cuda":
        # fp32 GEMMs, as moeflex's CUDA backend; under --bf16 autocast sends the matmuls to bf16
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.bf16 and device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--bf16: torch.autocast supports cpu and cuda, not {device.type!r}")
    precision = "bf16" if args.bf16 else "fp32"

    def autocast():
        """bf16 autocast for --bf16, else a no-op context (float32 throughout)."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())

    decay = [p for name, p in model.spec_params() if p.dim() >= 2]
    no_decay = [p for name, p in model.spec_params() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=train["lr"], betas=(train["beta1"], train["beta2"]), eps=train["eps"])

    if args.data:
        import numpy as np
        tokens = np.memmap(args.data, dtype=np.dtype(args.data_dtype).newbyteorder("<"), mode="r",
                           offset=args.data_offset)
        tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        if tokens.numel() < S + 2:
            raise SystemExit(f"{args.data}: only {tokens.numel()} tokens")
        if int(tokens.max()) >= cfg.vocab_size:
            raise SystemExit(f"{args.data}: token id {int(tokens.max())} >= vocab_size {cfg.vocab_size}")

        def batch():
            starts = torch.randint(0, tokens.numel() - S - 1, (B,), generator=gen)
            rows = torch.stack([tokens[s:s + S + 1] for s in starts.tolist()])
            return rows[:, :-1], rows[:, 1:]
    else:
        def batch():
            rows = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen)
            return rows[:, :-1], rows[:, 1:]

    times, losses = [], []
    for step in range(args.warmup + args.steps):
        micro = [tuple(t.to(device) for t in batch()) for _ in range(M)]  # data outside the timed region
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, targets in micro:
            with autocast():
                loss, _, _ = model(ids, targets)
            (loss / M).backward()
            total += loss.item() / M
        if train["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
        opt.step()
        model.update_score_biases(cfg.router_bias_update_rate)  # noaux_tc only; a no-op otherwise
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
        losses.append(total)
        print(f"step {step:4d} loss {total:.4f} {dt * 1000:.1f} ms"
              + (" (warm-up)" if step < args.warmup else ""), file=sys.stderr)

    tokens_per_step = B * S * M
    result = {
        "impl": "pytorch",
        "precision": precision,
        "tokens_per_second": tokens_per_step * len(times) / sum(times) if times else None,
        "step_seconds_median": statistics.median(times) if times else None,
        "threads": args.threads,
        "device": str(device),
        "steps": len(times),
        "warmup_steps": args.warmup,
        "tokens_per_step": tokens_per_step,
        "params": n_params,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "torch": torch.__version__,
        # OpenMP runs collapse when the cores are shared (each parallel region waits a
        # scheduler slice): a 1-minute load average above the thread count flags that.
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
