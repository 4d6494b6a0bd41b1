#!/usr/bin/env python3
"""Times in PyTorch the same ops, dtypes and shapes as moeflex's CUDA op harness.

Reads the harness report (tab-separated rows written by tests/test_cuda_ops.cpp
through MOEFLEX_OP_REPORT: op, dtype, shape, err, tol, ms, TFLOP/s, GB/s, note) and,
for every row whose op it knows, builds the idiomatic PyTorch equivalent at that
shape, times it with CUDA events (median of runs after warm-up) and writes
    op <TAB> dtype <TAB> shape <TAB> torch_ms <TAB> note
to --out. Backward rows time torch.autograd.grad of the op's output only (the
forward graph is built once, outside the timing).

Used by scripts/gpu-check.sh. --device cpu runs the same code on the CPU (a smoke
test of this script, with small shapes; the timings mean nothing there).
"""
import argparse
import math
import statistics
import sys
import time


def parse_shape(text):
    dims = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            dims[k] = int(v)
    return dims


def bench_offsets(rows, experts):
    """The harness's expert row counts: every 8th expert 3x the load, remainder to 0."""
    units = sum(3 if e % 8 == 0 else 1 for e in range(experts))
    counts = [rows * (3 if e % 8 == 0 else 1) // units for e in range(experts)]
    counts[0] += rows - sum(counts)
    return counts


class Timer:
    def __init__(self, torch, device, runs):
        self.torch, self.device, self.runs = torch, device, runs

    def __call__(self, fn):
        torch = self.torch
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.runs):
            if self.device == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def make_ops(torch, device):
    F = torch.nn.functional
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}

    def rnd(*shape, dtype=torch.float32, grad=False, scale=0.5):
        t = (torch.rand(*shape, device=device, dtype=torch.float32) * 2 - 1) * scale
        return t.to(dtype).requires_grad_(grad)

    def backward_of(out, inputs):
        grad_out = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    def gemm(d, dtype):
        a_t, c_t = dtype.split(">") if ">" in dtype else (dtype, dtype)
        M, N, K = d["M"], d["N"], d["K"]
        a = rnd(K, M, dtype=dt[a_t]).t() if d.get("ta") else rnd(M, K, dtype=dt[a_t])
        b = rnd(N, K, dtype=dt[a_t]).t() if d.get("tb") else rnd(K, N, dtype=dt[a_t])
        if c_t != a_t:
            return (lambda: torch.mm(a, b).to(dt[c_t])), "mm then cast to " + c_t
        return (lambda: torch.mm(a, b)), "torch.mm"

    def linear(d, dtype, bwd):
        x = rnd(d["n"], d["in"], dtype=dt[dtype], grad=bwd)
        w = rnd(d["out"], d["in"], dtype=dt[dtype], grad=bwd)
        if not bwd:
            return (lambda: F.linear(x, w)), "F.linear"
        return backward_of(F.linear(x, w), [x, w]), "autograd of F.linear (dw in " + dtype + ")"

    def grouped(d, dtype, bwd):
        E, rows, i, o = d["E"], d["rows"], d["in"], d["out"]
        counts = bench_offsets(rows, E)
        x = rnd(rows, i, dtype=dt[dtype], grad=bwd)
        w = rnd(E, o, i, dtype=dt[dtype], grad=bwd)
        gm = getattr(torch, "_grouped_mm", None)
        if gm is not None and device == "cuda" and dtype == "bf16":
            try:
                offs = torch.tensor(counts, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)
                wt = w.transpose(-2, -1)
                fwd = lambda: gm(x, wt, offs=offs)
                fwd()
                if not bwd:
                    return fwd, "torch._grouped_mm"
                return backward_of(fwd(), [x, w]), "autograd of torch._grouped_mm"
            except Exception as exc:  # shapes or version it does not take: the loop below
                note = "loop of torch.mm (_grouped_mm: %s)" % str(exc).splitlines()[0][:60]
        else:
            note = "loop of torch.mm per expert"
        def fwd():
            out, start = [], 0
            for e, c in enumerate(counts):
                out.append(x[start:start + c] @ w[e].t())
                start += c
            return torch.cat(out)
        if not bwd:
            return fwd, note
        return backward_of(fwd(), [x, w]), "autograd of " + note

    def rmsnorm(d, dtype, bwd):
        x = rnd(d["n"], d["d"], dtype=dt[dtype], grad=bwd, scale=2.0)
        w = rnd(d["d"], dtype=dt[dtype], grad=bwd)
        if hasattr(F, "rms_norm"):
            f, note = (lambda: F.rms_norm(x, (d["d"],), w, 1e-6)), "F.rms_norm"
        else:
            f = lambda: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w
            note = "x * rsqrt(mean(x^2) + eps) * w"
        return (f, note) if not bwd else (backward_of(f(), [x, w]), "autograd of " + note)

    def rope(d, dtype, bwd):
        B, S, H, hd = d["B"], d["S"], d["H"], d["hd"]
        x = rnd(B, S, H, hd, dtype=dt[dtype], grad=bwd)
        inv = 10000.0 ** (-torch.arange(0, hd // 2, device=device, dtype=torch.float64) * 2 / hd)
        ang = torch.arange(S, device=device, dtype=torch.float64)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt[dtype])[None, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt[dtype])[None, :, None, :]
        def f():
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin
        return (f, "rotate-half with cached cos/sin") if not bwd else (backward_of(f(), [x]), "autograd of rotate-half")

    def swiglu(d, dtype, bwd):
        g = rnd(d["n"], dtype=dt[dtype], grad=bwd, scale=4.0)
        u = rnd(d["n"], dtype=dt[dtype], grad=bwd)
        f = lambda: F.silu(g) * u
        return (f, "F.silu(g) * u") if not bwd else (backward_of(f(), [g, u]), "autograd of F.silu(g) * u")

    def residual(d, dtype):
        a, b = rnd(d["n"], dtype=dt[dtype]), rnd(d["n"], dtype=dt[dtype])
        return (lambda: a + b), "a + b"

    def routing(n, E, k):
        logits = rnd(n, E, scale=3.0)
        return torch.softmax(logits, -1).topk(k, -1).indices.to(torch.int64)

    def moe_plan(d):
        n, E, k = d["n"], d["E"], d["k"]
        idx = routing(n, E, k)
        def f():
            flat = idx.flatten()
            counts = torch.bincount(flat, minlength=E)
            order = torch.sort(flat, stable=True).indices
            offsets = torch.cumsum(counts, 0).cpu()
            return order, offsets
        return f, "bincount + stable sort + offsets to host"

    def permute_setup(d, dtype, grad):
        n, E, k, dd = d["n"], d["E"], d["k"], d["d"]
        idx = routing(n, E, k)
        order = torch.sort(idx.flatten(), stable=True).indices
        token = order // k
        x = rnd(n, dd, dtype=dt[dtype], grad=grad)
        return n, k, dd, order, token, x

    def permute(d, dtype, bwd):
        n, k, dd, order, token, x = permute_setup(d, dtype, bwd)
        f = lambda: x.index_select(0, token)
        return (f, "index_select") if not bwd else (backward_of(f(), [x]), "autograd of index_select")

    def unpermute(d, dtype, bwd):
        n, k, dd, order, token, _ = permute_setup(d, dtype, False)
        yp = rnd(order.numel(), dd, dtype=dt[dtype], grad=bwd)
        w = rnd(n, k, grad=bwd)
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=device)
        def f():
            return (yp[slot].view(n, k, dd).float() * w[..., None]).sum(1).to(dt[dtype])
        return (f, "gather + weighted sum") if not bwd else (backward_of(f(), [yp, w]), "autograd of gather + weighted sum")

    def router(d, bwd):
        n, E, k = d["n"], d["E"], d["k"]
        logits = rnd(n, E, grad=bwd, scale=3.0)
        def f():
            p = torch.softmax(logits, -1)
            w, _ = p.topk(k, -1)
            return w / w.sum(-1, keepdim=True) if d.get("norm") else w
        return (f, "softmax + topk") if not bwd else (backward_of(f(), [logits]), "autograd of softmax + topk")

    def attention(d, dtype, bwd):
        B, S, H, hd = d["B"], d["S"], d["H"], d["hd"]
        q, k, v = (rnd(B, H, S, hd, dtype=dt[dtype], grad=bwd, scale=1.5) for _ in range(3))
        sdpa = getattr(F, "scaled_dot_product_attention", None)
        if sdpa is not None:
            f, note = (lambda: sdpa(q, k, v, is_causal=True)), "F.scaled_dot_product_attention(is_causal)"
        else:
            mask = torch.ones(S, S, device=device, dtype=torch.bool).triu(1)
            def f():
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v
            note = "explicit softmax(q k^T) v"
        return (f, note) if not bwd else (backward_of(f(), [q, k, v]), "autograd of " + note)

    def copy(d, d2h):
        n = d["bytes"]
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=(device == "cuda"))
        if d2h:
            return (lambda: host.copy_(dev, non_blocking=True)), "pinned copy_"
        return (lambda: dev.copy_(host, non_blocking=True)), "pinned copy_"

    table = {
        "gemm": lambda d, t: gemm(d, t),
        "gemm_rate": lambda d, t: gemm(d, t),
        "linear_fwd": lambda d, t: linear(d, t, False),
        "linear_bwd": lambda d, t: linear(d, t, True),
        "grouped_linear_fwd": lambda d, t: grouped(d, t, False),
        "grouped_linear_bwd": lambda d, t: grouped(d, t, True),
        "rmsnorm_fwd": lambda d, t: rmsnorm(d, t, False),
        "rmsnorm_bwd": lambda d, t: rmsnorm(d, t, True),
        "rope_fwd": lambda d, t: rope(d, t, False),
        "rope_bwd": lambda d, t: rope(d, t, True),
        "swiglu_fwd": lambda d, t: swiglu(d, t, False),
        "swiglu_bwd": lambda d, t: swiglu(d, t, True),
        "residual_add": lambda d, t: residual(d, t),
        "moe_plan": lambda d, t: moe_plan(d),
        "permute_fwd": lambda d, t: permute(d, t, False),
        "permute_bwd": lambda d, t: permute(d, t, True),
        "unpermute_fwd": lambda d, t: unpermute(d, t, False),
        "unpermute_bwd": lambda d, t: unpermute(d, t, True),
        "router_fwd": lambda d, t: router(d, False),
        "router_bwd": lambda d, t: router(d, True),
        "attention_fwd": lambda d, t: attention(d, t, False),
        "attention_bwd": lambda d, t: attention(d, t, True),
        "copy_d2h": lambda d, t: copy(d, True),
        "copy_h2d": lambda d, t: copy(d, False),
    }
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", required=True, help="the harness's MOEFLEX_OP_REPORT file")
    ap.add_argument("--out", required=True, help="where to write the PyTorch timings (tab-separated)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_torch_ops: this PyTorch (%s) has no CUDA device" % torch.__version__, file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the harness's fp32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    ops = make_ops(torch, args.device)
    timer = Timer(torch, args.device, args.runs)
    rows, seen, errors = [], set(), 0
    with open(args.report) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            op, dtype, shape = line.rstrip("\n").split("\t")[:3]
            if op not in ops or (op, dtype, shape) in seen:
                continue
            seen.add((op, dtype, shape))
            try:
                fn, note = ops[op](parse_shape(shape), dtype)
                ms = timer(fn)
            except Exception as exc:  # reported, not fatal: the row shows why
                errors += 1
                ms, note = float("nan"), "torch error: %s" % str(exc).splitlines()[0][:100]
            rows.append((op, dtype, shape, ms, note))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("#torch\t%s\t%s\n" % (torch.__version__, torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"))
        for op, dtype, shape, ms, note in rows:
            f.write("%s\t%s\t%s\t%.5f\t%s\n" % (op, dtype, shape, ms, note))
    print("gpu_torch_ops: timed %d ops in PyTorch %s (%d errors)" % (len(rows), torch.__version__, errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
