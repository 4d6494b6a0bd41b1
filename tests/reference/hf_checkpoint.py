#!/usr/bin/python3
"""Reads a Hugging Face MoE checkpoint with the published tensor names and runs the
reference model (moe_model.py) on it: the independent side of moeflex's export-hf test.

    /usr/bin/python3 tests/reference/hf_checkpoint.py logits HF_DIR IDS.safetensors OUT.safetensors

HF_DIR holds config.json and model.safetensors in one of the layouts
  qwen3_moe  Qwen3MoeForCausalLM: self_attn.q_norm/k_norm per head,
             mlp.gate, mlp.experts.<e>.{gate,up,down}_proj, decoder_sparse_step;
  olmoe      OlmoeForCausalLM: q_norm over all of q, k_norm over all of k, the
             experts intermediate_size wide;
  mixtral    MixtralForCausalLM: block_sparse_moe.gate,
             block_sparse_moe.experts.<e>.w1 (gate) / w3 (up) / w2 (down).
IDS.safetensors holds input.ids (I32 [B, S]); OUT.safetensors gets out.logits (F64
[B*S, V]) computed in float64. Exits 1 naming any tensor the layout lacks, has twice or
does not use, or any shape that differs from the config's.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import read_safetensors, write_safetensors  # noqa: E402
from moe_model import MoEConfig, forward, param_shapes  # noqa: E402


def config_of(hf: dict) -> MoEConfig:
    """The reference config of a Hugging Face config.json."""
    kind = hf["model_type"]
    c = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_hidden_layers=hf["num_hidden_layers"],
             num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf.get("num_key_value_heads", 0),
             max_position_embeddings=hf["max_position_embeddings"], rope_theta=hf["rope_theta"],
             rms_norm_eps=hf["rms_norm_eps"], num_experts_per_tok=hf["num_experts_per_tok"],
             tie_word_embeddings=hf.get("tie_word_embeddings", False), n_shared_experts=0,
             first_k_dense_replace=0, router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.0),
             router_z_loss_coef=0.0)
    if kind == "qwen3_moe":
        c.update(num_experts=hf["num_experts"], moe_intermediate_size=hf["moe_intermediate_size"],
                 intermediate_size=hf["intermediate_size"], head_dim=hf["head_dim"], qk_norm="head",
                 norm_topk_prob=hf["norm_topk_prob"], decoder_sparse_step=hf.get("decoder_sparse_step", 1))
    elif kind == "olmoe":
        c.update(num_experts=hf["num_experts"], moe_intermediate_size=hf["intermediate_size"], qk_norm="full",
                 norm_topk_prob=hf["norm_topk_prob"])
    elif kind == "mixtral":
        c.update(num_experts=hf["num_local_experts"], moe_intermediate_size=hf["intermediate_size"],
                 norm_topk_prob=True)
        if hf.get("head_dim"):
            c["head_dim"] = hf["head_dim"]
    else:
        raise SystemExit(f"unknown model_type {kind!r}")
    cfg = MoEConfig(**c)
    cfg.validate()
    return cfg


def spec_params(kind: str, cfg: MoEConfig, tensors: dict) -> dict:
    """The reference's parameters (param_shapes names) from the checkpoint's tensors."""
    used = set()
    P = {}
    expert_re = {"mixtral": r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight",
                 "qwen3_moe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight",
                 "olmoe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight"}[kind]
    proj_of = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
               "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    experts = {}
    for name, t in tensors.items():
        m = re.fullmatch(expert_re, name)
        if m:
            layer, e, proj = int(m.group(1)), int(m.group(2)), proj_of[m.group(3)]
            experts.setdefault((layer, proj), {})[e] = t
            used.add(name)
    for name, shape in param_shapes(cfg).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+_proj)\.weight", name)
        if m:
            got = experts.get((int(m.group(1)), m.group(2)), {})
            if sorted(got) != list(range(cfg.num_experts)):
                raise SystemExit(f"{name}: the checkpoint holds experts {sorted(got)} of {cfg.num_experts}")
            t = torch.stack([got[e] for e in range(cfg.num_experts)])
        else:
            hf_name = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight") if kind == "mixtral" else name
            if hf_name not in tensors:
                raise SystemExit(f"missing tensor {hf_name}")
            t = tensors[hf_name]
            used.add(hf_name)
        if tuple(t.shape) != tuple(shape):
            raise SystemExit(f"{name}: shape {list(t.shape)}, the config says {list(shape)}")
        P[name] = t.to(torch.float64)
    unused = sorted(set(tensors) - used)
    if unused:
        raise SystemExit(f"tensors the {kind} layout does not use: {unused[:5]}")
    return P


def main() -> int:
    if len(sys.argv) != 5 or sys.argv[1] != "logits":
        print(__doc__, file=sys.stderr)
        return 2
    hf_dir, ids_path, out_path = sys.argv[2:]
    torch.set_num_threads(1)
    with open(os.path.join(hf_dir, "config.json")) as fh:
        hf = json.load(fh)
    cfg = config_of(hf)
    _, tensors = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    P = spec_params(hf["model_type"], cfg, tensors)
    _, inp = read_safetensors(ids_path)
    ids = inp["input.ids"].long()
    _, _, _, _, logits = forward(cfg, P, ids, torch.zeros_like(ids))
    write_safetensors(out_path, [("out.logits", logits.detach())], {"model_type": hf["model_type"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
