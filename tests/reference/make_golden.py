#!/usr/bin/python3
"""Write the moeflex golden files (docs/model.md, "Golden file") from the PyTorch reference.

    /usr/bin/python3 tests/reference/make_golden.py [--out-dir tests/reference]

Writes
  golden_v1.safetensors           dropless, untied LM head, B=2, S=8
  golden_v1_capacity.safetensors  capacity_factor=1.0, tied embeddings, B=4, S=8, with a
                                  router skewed on purpose so that assignments are dropped
  golden_v1_gqa.safetensors       grouped-query attention (4 query heads, 2 kv heads) with
                                  head_dim 12 != hidden 32 / 4 heads, B=2, S=8
  golden_v1_qk_norm_head.safetensors  the same heads with QK-norm per head (Qwen3-MoE), B=2, S=8
  golden_v1_qk_norm_full.safetensors  QK-norm over all of q and k (OLMoE), multi-head, B=2, S=8
  golden_v1_sparse_step.safetensors   4 layers, dense and MoE alternating (decoder_sparse_step 2), B=2, S=8
  golden_v1_noaux_tc.safetensors      DeepSeek-V3 routing: sigmoid scores, a score bias (noaux_tc), 2 of 4
                                      expert groups, routed_scaling_factor 2.5, E=8, B=2, S=8
  golden_v1_group_limited.safetensors DeepSeek-V2 routing: softmax, group_limited_greedy, 2 of 4 groups,
                                      no renormalisation, routed_scaling_factor 1.5, E=8, k=3, B=2, S=8
and checks the reference's own float64 gradients against finite differences.
Deterministic: the same torch build gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_model import MoEConfig, forward, init_params_golden, is_buffer, param_shapes  # noqa: E402

MAGIC = "moeflex-golden"
VERSION = "1"


# ---------------------------------------------------------------------------
# safetensors writer (no python package needed)
# ---------------------------------------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.int32: "I32", torch.int64: "I64"}


def write_safetensors(path: str, tensors: "list[tuple[str, torch.Tensor]]", metadata: dict) -> None:
    """tensors: ordered (name, tensor); laid out contiguously in this order."""
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    blobs = []
    offset = 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)  # pad so the data buffer is 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hjson)))
        fh.write(hjson)
        for b in blobs:
            fh.write(b)


def read_safetensors(path: str):
    """Minimal reader, used to verify what was written."""
    import numpy as np
    np_types = {"F64": np.float64, "F32": np.float32, "I32": np.int32, "I64": np.int64}
    with open(path, "rb") as fh:
        raw = fh.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    meta = header.pop("__metadata__", {})
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        arr = np.frombuffer(raw[base + b:base + e], dtype=np.dtype(np_types[info["dtype"]]).newbyteorder("<"))
        out[name] = torch.from_numpy(arr.reshape(info["shape"]).copy())
    return meta, out


# ---------------------------------------------------------------------------
# Golden cases
# ---------------------------------------------------------------------------

def tiny_config(**overrides) -> MoEConfig:
    base = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, shared_expert_intermediate_size=0,
                first_k_dense_replace=1, intermediate_size=48, norm_topk_prob=True,
                router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
                tie_word_embeddings=False, capacity_factor=0.0, initializer_range=0.02)
    base.update(overrides)
    cfg = MoEConfig(**base)
    cfg.validate()
    return cfg


def skew_router(cfg: MoEConfig, P: dict, expert: int, strength: float) -> None:
    """Make `expert` popular in every MoE layer: give every embedding row a common
    direction u (so the residual stream, hence the normalised router input, carries it)
    and add strength * u to that expert's gate row."""
    g = torch.Generator().manual_seed(12345)
    u = torch.randn(cfg.hidden_size, generator=g, dtype=torch.float64)
    u = u / u.norm()
    with torch.no_grad():
        P["model.embed_tokens.weight"] += 0.3 * u
        for l in range(cfg.num_hidden_layers):
            key = f"model.layers.{l}.mlp.gate.weight"
            if key in P:
                P[key][expert] += strength * u


def run_case(cfg: MoEConfig, B: int, S: int, seed: int, skew: "tuple[int, float] | None" = None):
    g = torch.Generator().manual_seed(seed)
    P = init_params_golden(cfg, g, std=0.1, dtype=torch.float64)
    if skew is not None:
        skew_router(cfg, P, *skew)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    # The noaux_tc score bias is a buffer: not a leaf that autograd tracks, gradient 0.
    leaves = {k: v.clone().requires_grad_(not is_buffer(k)) for k, v in P.items()}
    stats = []
    loss, ce, aux, z, logits = forward(cfg, leaves, ids, targets, stats)
    loss.backward()
    grads = {k: torch.zeros_like(v) if is_buffer(k) else v.grad.detach().clone() for k, v in leaves.items()}
    return dict(P=P, ids=ids, targets=targets, loss=loss.item(), ce=ce.item(), aux=aux.item(),
                z=z.item(), logits=logits.detach(), grads=grads, stats=stats)


def write_case(path: str, cfg: MoEConfig, B: int, S: int, r: dict) -> None:
    conf = cfg.to_dict()
    for key in ("num_key_value_heads", "head_dim"):  # 0 = the default: left out, as HF does
        if conf[key] == 0:
            del conf[key]
    for key, default in (("qk_norm", "none"), ("decoder_sparse_step", 1), ("scoring_func", "softmax"),
                         ("topk_method", "greedy"), ("n_group", 1), ("topk_group", 1),
                         ("routed_scaling_factor", 1.0)):  # defaults, left out as in older files
        if conf[key] == default:
            del conf[key]
    conf["batch_size"] = B
    conf["seq_len"] = S
    meta = {"magic": MAGIC, "version": VERSION, "config": json.dumps(conf, sort_keys=True),
            "loss": repr(r["loss"]), "ce_loss": repr(r["ce"]), "aux_loss": repr(r["aux"]),
            "z_loss": repr(r["z"])}
    names = list(param_shapes(cfg).keys())
    tensors = [("param." + n, r["P"][n]) for n in names]
    tensors += [("input.ids", r["ids"].to(torch.int32)), ("input.targets", r["targets"].to(torch.int32)),
                ("out.logits", r["logits"])]
    tensors += [("grad." + n, r["grads"][n]) for n in names]
    write_safetensors(path, tensors, meta)

    # Read back and verify.
    meta2, t2 = read_safetensors(path)
    assert meta2["magic"] == MAGIC and meta2["version"] == VERSION
    assert float(meta2["loss"]) == r["loss"]
    for name, t in tensors:
        assert torch.equal(t2[name], t.detach().to(t2[name].dtype)), name


def describe(label: str, path: str, cfg: MoEConfig, r: dict) -> None:
    print(f"[{label}] {os.path.relpath(path)}  ({os.path.getsize(path)} bytes)")
    print(f"  loss={r['loss']!r} ce={r['ce']!r} aux={r['aux']!r} z={r['z']!r}")
    dropped = 0
    moe_layers = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)]
    for layer, st in zip(moe_layers, r["stats"]):
        dropped += st.dropped
        line = (f"  layer {layer}: counts={st.counts.tolist()} capacity={st.capacity} "
                f"dropped={st.dropped} min top-k margin={st.margin:.3e}")
        if cfg.group_limited:
            line += f" min group margin={st.group_margin:.3e}"
        if st.idx_without_groups is not None:
            line += f" tokens whose experts the groups change={st.tokens_changed_by_groups()}"
        if st.idx_without_bias is not None:
            line += f" tokens whose experts the bias changes={st.tokens_changed_by_bias()}"
        print(line)
    print(f"  dropped assignments in total: {dropped}")


# ---------------------------------------------------------------------------
# Self-check: autograd vs finite differences, float64
# ---------------------------------------------------------------------------

def finite_difference_check(cfg: MoEConfig, r: dict, B: int, S: int, label: str,
                            gradcheck_names: "list[str]", samples_per_param: int = 6) -> bool:
    P, ids, targets = r["P"], r["ids"], r["targets"]

    def loss_with(name, value):
        Q = dict(P)
        Q[name] = value
        return forward(cfg, Q, ids, targets)[0]

    ok = True
    # 1. torch.autograd.gradcheck on whole (small) parameters.
    for name in gradcheck_names:
        x = P[name].clone().requires_grad_(True)
        passed = torch.autograd.gradcheck(lambda t: loss_with(name, t), (x,), eps=1e-6,
                                          atol=1e-8, rtol=1e-6, raise_exception=False)
        print(f"  [{label}] gradcheck {name} {list(x.shape)}: {'PASS' if passed else 'FAIL'}")
        ok &= bool(passed)

    # 2. Central differences on sampled entries of every parameter.
    #    Pass when |num - ana| <= 1e-9 + 1e-6 |ana| (h = 1e-5: truncation ~h^2, roundoff ~1e-16/h).
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    worst_name = ""
    max_abs = 0.0
    h = 1e-5
    for name, value in P.items():
        flat = value.reshape(-1)
        picks = torch.randint(0, flat.numel(), (samples_per_param,), generator=g).tolist()
        for j in picks:
            plus = flat.clone(); plus[j] += h
            minus = flat.clone(); minus[j] -= h
            num = (loss_with(name, plus.view_as(value)) - loss_with(name, minus.view_as(value))).item() / (2 * h)
            ana = r["grads"][name].reshape(-1)[j].item()
            diff = abs(num - ana)
            max_abs = max(max_abs, diff)
            score = diff / (1e-9 + 1e-6 * abs(ana))
            if score > worst:
                worst, worst_name = score, f"{name}[{j}] num={num:.9e} ana={ana:.9e}"
    passed = worst <= 1.0
    print(f"  [{label}] central differences, {samples_per_param} entries x {len(P)} params: "
          f"max |num-ana| {max_abs:.2e}, worst vs tolerance {worst:.2f} at {worst_name} "
          f"{'PASS' if passed else 'FAIL'}")
    return ok and passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--no-check", action="store_true", help="skip the finite-difference self-check")
    args = ap.parse_args()
    torch.set_num_threads(1)  # reproducible reductions
    torch.set_default_dtype(torch.float64)
    os.makedirs(args.out_dir, exist_ok=True)
    ok = True

    # Case 1: dropless, untied.
    cfg1 = tiny_config()
    B1, S1 = 2, 8
    r1 = run_case(cfg1, B1, S1, seed=20240616)  # every expert used in every layer
    p1 = os.path.join(args.out_dir, "golden_v1.safetensors")
    write_case(p1, cfg1, B1, S1, r1)
    describe("dropless", p1, cfg1, r1)

    # Case 2: capacity factor 1, tied, skewed router so that assignments are dropped.
    cfg2 = tiny_config(capacity_factor=1.0, tie_word_embeddings=True)
    B2, S2 = 4, 8
    r2 = run_case(cfg2, B2, S2, seed=20240602, skew=(0, 3.0))
    dropped = sum(st.dropped for st in r2["stats"])
    if dropped == 0:
        print("error: the skewed capacity case dropped nothing", file=sys.stderr)
        ok = False
    p2 = os.path.join(args.out_dir, "golden_v1_capacity.safetensors")
    write_case(p2, cfg2, B2, S2, r2)
    describe("capacity", p2, cfg2, r2)

    # Case 3: grouped-query attention with a head_dim of its own (Qwen3's shape of heads).
    cfg3 = tiny_config(num_key_value_heads=2, head_dim=12)
    B3, S3 = 2, 8
    r3 = run_case(cfg3, B3, S3, seed=20241203)
    p3 = os.path.join(args.out_dir, "golden_v1_gqa.safetensors")
    write_case(p3, cfg3, B3, S3, r3)
    describe("gqa", p3, cfg3, r3)

    # Case 4 and 5: QK-norm over each head (Qwen3-MoE, with GQA and head_dim 12) and
    # over all of q and k (OLMoE).
    cfg4 = tiny_config(num_key_value_heads=2, head_dim=12, qk_norm="head")
    B4, S4 = 2, 8
    r4 = run_case(cfg4, B4, S4, seed=20241204)
    p4 = os.path.join(args.out_dir, "golden_v1_qk_norm_head.safetensors")
    write_case(p4, cfg4, B4, S4, r4)
    describe("qk-norm head", p4, cfg4, r4)
    cfg5 = tiny_config(qk_norm="full")
    r5 = run_case(cfg5, B4, S4, seed=20241205)
    p5 = os.path.join(args.out_dir, "golden_v1_qk_norm_full.safetensors")
    write_case(p5, cfg5, B4, S4, r5)
    describe("qk-norm full", p5, cfg5, r5)

    # Case 6: MoE and dense layers alternating (Qwen2/3-MoE's decoder_sparse_step 2):
    # layer 0 dense (the dense prefix), 1 MoE, 2 dense, 3 MoE.
    cfg6 = tiny_config(num_hidden_layers=4, decoder_sparse_step=2)
    r6 = run_case(cfg6, B4, S4, seed=20241206)
    p6 = os.path.join(args.out_dir, "golden_v1_sparse_step.safetensors")
    write_case(p6, cfg6, B4, S4, r6)
    describe("sparse step", p6, cfg6, r6)

    # Case 7: DeepSeek-V3's router: sigmoid scores, the noaux_tc score bias (a buffer,
    # drawn N(0, 0.05^2) here so that it changes the selection), 8 experts in 4 groups
    # of 2 of which each token keeps 2 (a group scored by the sum of its two best), the
    # top-2 weights renormalised, then scaled by 2.5.  Layer 0 dense, 1 and 2 MoE.
    cfg7 = tiny_config(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, scoring_func="sigmoid",
                       topk_method="noaux_tc", routed_scaling_factor=2.5, norm_topk_prob=True)
    r7 = run_case(cfg7, B4, S4, seed=20241247)
    p7 = os.path.join(args.out_dir, "golden_v1_noaux_tc.safetensors")
    write_case(p7, cfg7, B4, S4, r7)
    describe("noaux_tc", p7, cfg7, r7)
    if not any(st.tokens_changed_by_bias() for st in r7["stats"]):
        print("error: [noaux_tc] the score bias changes no token's experts", file=sys.stderr)
        ok = False
    if not any(st.tokens_changed_by_groups() for st in r7["stats"]):
        print("error: [noaux_tc] the group limit changes no token's experts", file=sys.stderr)
        ok = False

    # Case 8: DeepSeek-V2's router: softmax, group_limited_greedy (a group scored by its
    # best expert), top-3 from 2 of 4 groups of 2 (4 experts allowed >= k), weights not
    # renormalised, scaled by 1.5.  k = 3 > topk_group = 2: with max-scored groups and
    # k <= topk_group the limit could never change the selection (the best expert's group
    # ranks first, the second best's second), so this case could not see exclusion errors.
    cfg8 = tiny_config(num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, scoring_func="softmax",
                       topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.5)
    r8 = run_case(cfg8, B4, S4, seed=20241258)
    p8 = os.path.join(args.out_dir, "golden_v1_group_limited.safetensors")
    write_case(p8, cfg8, B4, S4, r8)
    describe("group-limited", p8, cfg8, r8)
    if not any(st.tokens_changed_by_groups() for st in r8["stats"]):
        print("error: [group-limited] the group limit changes no token's experts", file=sys.stderr)
        ok = False

    # Routing must not be near a tie, or an fp32 engine could pick other experts: neither
    # the top-k among the allowed experts nor, when group-limited, the choice of groups.
    for label, r in (("dropless", r1), ("capacity", r2), ("gqa", r3), ("qk-norm head", r4), ("qk-norm full", r5),
                     ("sparse step", r6), ("noaux_tc", r7), ("group-limited", r8)):
        margin = min(st.margin for st in r["stats"])
        if margin < 1e-4:
            print(f"error: [{label}] top-k margin {margin:.2e} too small", file=sys.stderr)
            ok = False
        group_margin = min(st.group_margin for st in r["stats"])
        if group_margin < 1e-4:
            print(f"error: [{label}] group margin {group_margin:.2e} too small", file=sys.stderr)
            ok = False

    if not args.no_check:
        print("self-check (float64, autograd vs finite differences):")
        ok &= finite_difference_check(cfg1, r1, B1, S1, "dropless",
                                      ["model.layers.1.mlp.gate.weight", "model.norm.weight",
                                       "model.layers.2.post_attention_layernorm.weight"])
        ok &= finite_difference_check(cfg2, r2, B2, S2, "capacity",
                                      ["model.layers.2.mlp.gate.weight",
                                       "model.layers.1.input_layernorm.weight"])
        ok &= finite_difference_check(cfg3, r3, B3, S3, "gqa",
                                      ["model.layers.0.self_attn.k_proj.weight",
                                       "model.layers.1.input_layernorm.weight"])
        ok &= finite_difference_check(cfg6, r6, B4, S4, "sparse step",
                                      ["model.layers.2.mlp.up_proj.weight", "model.layers.3.mlp.gate.weight"])
        for cfg, r, label in ((cfg4, r4, "qk-norm head"), (cfg5, r5, "qk-norm full")):
            ok &= finite_difference_check(cfg, r, B4, S4, label,
                                          ["model.layers.0.self_attn.q_norm.weight",
                                           "model.layers.2.self_attn.k_norm.weight",
                                           "model.layers.1.self_attn.q_proj.weight"])
        for cfg, r, label in ((cfg7, r7, "noaux_tc"), (cfg8, r8, "group-limited")):
            ok &= finite_difference_check(cfg, r, B4, S4, label,
                                          ["model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
                                           "model.layers.2.post_attention_layernorm.weight"])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
