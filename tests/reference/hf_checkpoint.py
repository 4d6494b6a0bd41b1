#!/usr/bin/python3
"""Hugging Face MoE checkpoints with the published tensor names: the independent side of
moeflex's export-hf and import tests.

    /usr/bin/python3 tests/reference/hf_checkpoint.py logits HF_DIR IDS.safetensors OUT.safetensors
    /usr/bin/python3 tests/reference/hf_checkpoint.py write HF_DIR MODEL_TYPE SEED [--shards N] [--dtype f32|bf16]

The layouts (MODEL_TYPE, config.json's model_type):
  qwen3_moe  Qwen3MoeForCausalLM: self_attn.q_norm/k_norm per head,
             mlp.gate, mlp.experts.<e>.{gate,up,down}_proj, decoder_sparse_step;
  olmoe      OlmoeForCausalLM: q_norm over all of q, k_norm over all of k, the
             experts intermediate_size wide;
  mixtral    MixtralForCausalLM: block_sparse_moe.gate,
             block_sparse_moe.experts.<e>.w1 (gate) / w3 (up) / w2 (down).

logits: reads HF_DIR's config.json and its weights, either one model.safetensors or the
shards that model.safetensors.index.json maps ({"metadata": {...}, "weight_map": {name:
file}}), tensors F32, F64, F16 or BF16, and runs the reference model (moe_model.py) in
float64. IDS.safetensors holds input.ids (I32 [B, S]); OUT.safetensors gets out.logits
(F64 [B*S, V]), its metadata model_type and topk_margin (the smallest gap over the MoE
layers and tokens between the k-th and the next router probability: how far the routing
is from a tie). Exits 1 naming any tensor the layout lacks, has twice (in two shards or
twice in a header) or does not use, one the index and the shards disagree on, any shape
that differs from the config's, and a file that breaks the safetensors format.

write: makes HF_DIR (refused when it exists and is not an empty folder) and writes into
it a tiny MODEL_TYPE model: config.json with that architecture's Hugging Face field
names (vocab 96, hidden 32, 4 heads of which 2 kv heads, 4 experts, top-2; 2 layers, or
4 for qwen3_moe with decoder_sparse_step 2 so that layers 0 and 2 are dense), and its
weights in the published tensor names and the Hugging Face module order, drawn from
torch.Generator().manual_seed(SEED): N(0, 0.1^2) matrices, 1 + 0.1 N(0, 1) norm
weights (float32 draws, stored as F32 or rounded to nearest-even BF16). --shards N > 1
splits the ordered tensors into N runs of nearly equal count (so layers straddle
files), model-0000i-of-0000N.safetensors, with model.safetensors.index.json; else one
model.safetensors. The same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import read_safetensors, write_safetensors  # noqa: E402
from moe_model import MoEConfig, forward, param_shapes  # noqa: E402

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------
# safetensors: an 8-byte little-endian header length, a JSON header {name: {"dtype",
# "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the data
# buffer, offsets relative to its start, little-endian, row-major.
# ---------------------------------------------------------------------------

# dtype -> bytes per element
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def st_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """The little-endian bytes of t stored as dtype ("F32" or "BF16", rounded to nearest even)."""
    t = t.detach().contiguous().cpu()
    if dtype == "F32":
        return t.to(torch.float32).numpy().astype("<f4").tobytes()
    if dtype == "BF16":  # the bits of the bfloat16 values, as 16-bit integers
        return t.to(torch.float32).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    raise ValueError(f"cannot write dtype {dtype}")


def write_st_file(path: str, tensors: "list[tuple[str, torch.Tensor]]", dtype: str) -> int:
    """Writes tensors (in this order, contiguous) as dtype; returns the data bytes."""
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors:
        data = st_bytes(t, dtype)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)  # the data buffer starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hjson)))
        fh.write(hjson)
        for b in blobs:
            fh.write(b)
    return offset


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SystemExit(f"tensor {k} twice in one safetensors header")
        out[k] = v
    return out


def read_st_file(path: str) -> "dict[str, torch.Tensor]":
    """A safetensors file's tensors as float64, after the format's checks: known dtypes,
    sizes that match the shapes, and tensors that tile the data buffer exactly."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 8:
        raise SystemExit(f"{path}: shorter than a safetensors header length")
    (hlen,) = struct.unpack("<Q", raw[:8])
    if 8 + hlen > len(raw):
        raise SystemExit(f"{path}: header length {hlen} runs past the file ({len(raw)} bytes)")
    header = json.loads(raw[8:8 + hlen].decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    header.pop("__metadata__", None)
    data = raw[8 + hlen:]
    spans = []
    out = {}
    for name, info in header.items():
        dtype, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        if dtype not in ST_ITEMSIZE:
            raise SystemExit(f"{path}: {name} has dtype {dtype}, not one of {sorted(ST_ITEMSIZE)}")
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= b <= e <= len(data) or e - b != n * ST_ITEMSIZE[dtype]:
            raise SystemExit(f"{path}: {name} {dtype} {shape} has data_offsets [{b}, {e}] "
                             f"in a {len(data)}-byte buffer")
        spans.append((b, e, name))
        blob = data[b:e]
        if dtype == "BF16":  # the top 16 bits of a float32
            arr = (np.frombuffer(blob, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(blob, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype])
        out[name] = torch.from_numpy(arr.astype(np.float64).reshape(shape))
    end = 0
    for b, e, name in sorted(spans):
        if b != end:
            raise SystemExit(f"{path}: {name} starts at byte {b} of the data buffer, not at {end} "
                             f"(tensors overlap or leave a hole)")
        end = e
    if end != len(data):
        raise SystemExit(f"{path}: the tensors end at byte {end} of a {len(data)}-byte data buffer")
    return out


def read_checkpoint(hf_dir: str) -> "dict[str, torch.Tensor]":
    """Every tensor of HF_DIR: model.safetensors, or the shards of model.safetensors.index.json."""
    single, index = os.path.join(hf_dir, SINGLE_FILE), os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(single) and os.path.exists(index):
        raise SystemExit(f"{hf_dir} holds both {SINGLE_FILE} and {INDEX_FILE}: which is the checkpoint?")
    if not os.path.exists(index):
        if not os.path.exists(single):
            raise SystemExit(f"{hf_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        return read_st_file(single)
    with open(index) as fh:
        weight_map = json.load(fh, object_pairs_hook=_no_duplicate_keys)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard:
            raise SystemExit(f"{INDEX_FILE} names the shard {shard!r}, not a file of {hf_dir}")
        if not os.path.isfile(os.path.join(hf_dir, shard)):
            raise SystemExit(f"{INDEX_FILE} maps tensors to {shard}, which {hf_dir} lacks")
        for name, t in read_st_file(os.path.join(hf_dir, shard)).items():
            if name in tensors:
                raise SystemExit(f"tensor {name} twice: in {shard} and in an earlier shard")
            if weight_map.get(name) != shard:
                raise SystemExit(f"tensor {name} is in {shard}, {INDEX_FILE} says "
                                 f"{weight_map.get(name, 'nothing of it')}")
            tensors[name] = t
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise SystemExit(f"{INDEX_FILE} maps tensors no shard holds: {absent[:5]}")
    return tensors


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


# ---------------------------------------------------------------------------
# write: a tiny model in each layout
# ---------------------------------------------------------------------------

def tiny_hf_config(model_type: str, torch_dtype: str) -> dict:
    """config.json of a tiny model_type model, with that architecture's field names."""
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, hidden_act="silu", initializer_range=0.02,
                  attention_dropout=0.0, tie_word_embeddings=False, output_router_logits=False, use_cache=True,
                  model_type=model_type, torch_dtype=torch_dtype)
    if model_type == "qwen3_moe":  # Qwen3MoeConfig; head_dim 16 != 32 / 4, as Qwen3's 128 != 2048 / 32
        return dict(common, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4, head_dim=16,
                    attention_bias=False, use_sliding_window=False, decoder_sparse_step=2, mlp_only_layers=[],
                    num_experts=4, moe_intermediate_size=16, intermediate_size=48, norm_topk_prob=True,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, router_aux_loss_coef=0.001)
    if model_type == "olmoe":  # OlmoeConfig: intermediate_size is the experts' width
        return dict(common, architectures=["OlmoeForCausalLM"], attention_bias=False, num_experts=4,
                    intermediate_size=16, norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10000.0,
                    router_aux_loss_coef=0.01)
    if model_type == "mixtral":  # MixtralConfig: no head_dim (hidden / heads), no sliding_window
        return dict(common, architectures=["MixtralForCausalLM"], num_local_experts=4, intermediate_size=24,
                    rms_norm_eps=1e-5, rope_theta=1000000.0, router_aux_loss_coef=0.02)
    raise SystemExit(f"unknown model_type {model_type!r} (qwen3_moe, olmoe or mixtral)")


def hf_tensor_shapes(hf: dict) -> "list[tuple[str, tuple[int, ...]]]":
    """Every tensor of the Hugging Face model with its shape, in the modules' order
    (the order of its state_dict), from config.json alone."""
    kind = hf["model_type"]
    V, d, H, Hkv = hf["vocab_size"], hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // H
    out = [("model.embed_tokens.weight", (V, d))]
    for l in range(hf["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "self_attn.q_proj.weight", (H * hd, d)), (p + "self_attn.k_proj.weight", (Hkv * hd, d)),
                (p + "self_attn.v_proj.weight", (Hkv * hd, d)), (p + "self_attn.o_proj.weight", (d, H * hd))]
        if kind == "qwen3_moe":  # one norm of head_dim, shared by the heads
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        elif kind == "olmoe":  # one norm over all of q, one over all of k
            out += [(p + "self_attn.q_norm.weight", (H * hd,)), (p + "self_attn.k_norm.weight", (Hkv * hd,))]
        if kind == "mixtral":
            E, f = hf["num_local_experts"], hf["intermediate_size"]
            out.append((p + "block_sparse_moe.gate.weight", (E, d)))
            for e in range(E):
                q = f"{p}block_sparse_moe.experts.{e}."
                out += [(q + "w1.weight", (f, d)), (q + "w2.weight", (d, f)), (q + "w3.weight", (f, d))]
        else:
            E = hf["num_experts"]
            moe = True
            f = hf["intermediate_size"]  # OLMoE: every layer MoE, the experts intermediate_size wide
            if kind == "qwen3_moe":
                moe = l not in hf["mlp_only_layers"] and (l + 1) % hf["decoder_sparse_step"] == 0
                f = hf["moe_intermediate_size"] if moe else hf["intermediate_size"]
            if moe:
                out.append((p + "mlp.gate.weight", (E, d)))
                mlps = [f"{p}mlp.experts.{e}." for e in range(E)]
            else:
                mlps = [p + "mlp."]
            for q in mlps:
                out += [(q + "gate_proj.weight", (f, d)), (q + "up_proj.weight", (f, d)),
                        (q + "down_proj.weight", (d, f))]
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
    out.append(("model.norm.weight", (d,)))
    if not hf["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, d)))
    return out


def write_checkpoint(hf_dir: str, model_type: str, seed: int, shards: int, dtype: str) -> None:
    if os.path.lexists(hf_dir) and not (os.path.isdir(hf_dir) and not os.listdir(hf_dir)):
        raise SystemExit(f"{hf_dir} exists and is not an empty folder")
    st_dtype, torch_dtype = {"f32": ("F32", "float32"), "bf16": ("BF16", "bfloat16")}[dtype]
    hf = tiny_hf_config(model_type, torch_dtype)
    shapes = hf_tensor_shapes(hf)
    if not 1 <= shards <= len(shapes):
        raise SystemExit(f"--shards {shards}: the model has {len(shapes)} tensors")
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for name, shape in shapes:  # drawn in float32, in the modules' order
        z = torch.randn(shape, generator=g, dtype=torch.float32)
        tensors.append((name, 1.0 + 0.1 * z if name.endswith("norm.weight") else 0.1 * z))
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as fh:  # as transformers writes it
        fh.write(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if shards == 1:
        write_st_file(os.path.join(hf_dir, SINGLE_FILE), tensors, st_dtype)
        return
    weight_map, total_size = {}, 0
    n = len(tensors)
    for i in range(shards):  # run i: tensors [i n / N, (i + 1) n / N)
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        run = tensors[i * n // shards:(i + 1) * n // shards]
        total_size += write_st_file(os.path.join(hf_dir, shard), run, st_dtype)
        weight_map.update((name, shard) for name, _ in run)
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    with open(os.path.join(hf_dir, INDEX_FILE), "w") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------

def logits(hf_dir: str, ids_path: str, out_path: str) -> None:
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise SystemExit(f"{hf_dir} has no config.json")
    with open(os.path.join(hf_dir, "config.json")) as fh:
        hf = json.load(fh)
    cfg = config_of(hf)
    P = spec_params(hf["model_type"], cfg, read_checkpoint(hf_dir))
    _, inp = read_safetensors(ids_path)
    ids = inp["input.ids"].long()
    stats = []
    _, _, _, _, out = forward(cfg, P, ids, torch.zeros_like(ids), stats)
    margin = min((st.margin for st in stats), default=float("inf"))
    write_safetensors(out_path, [("out.logits", out.detach())],
                      {"model_type": hf["model_type"], "topk_margin": repr(margin)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("logits", help="the reference logits of a checkpoint")
    lp.add_argument("hf_dir")
    lp.add_argument("ids")
    lp.add_argument("out")
    wp = sub.add_parser("write", help="write a tiny random checkpoint")
    wp.add_argument("hf_dir")
    wp.add_argument("model_type", choices=["qwen3_moe", "olmoe", "mixtral"])
    wp.add_argument("seed", type=int)
    wp.add_argument("--shards", type=int, default=1)
    wp.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.command == "logits":
        logits(args.hf_dir, args.ids, args.out)
    else:
        write_checkpoint(args.hf_dir, args.model_type, args.seed, args.shards, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
