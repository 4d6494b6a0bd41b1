#!/usr/bin/env python3
"""Formats the GPU check's results table (scripts/gpu-check.sh, step 5).

Joins the CUDA op harness report (MOEFLEX_OP_REPORT rows: op, dtype, shape, err,
tol, ms, TFLOP/s, GB/s, note) with PyTorch's timings of the same rows
(bench/gpu_torch_ops.py) and prints, per op: the relative error against the CPU
reference and its tolerance (rows without a reference, the training-size timings,
show '-'), the median time, the rate, PyTorch's time and the ratio; then the card's
measured bf16 GEMM rate. Plain text, fixed-width columns.
"""
import argparse
import math
import sys


def read_rows(path):
    rows, meta = [], {}
    if not path:
        return rows, meta
    try:
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                if line.startswith("#"):
                    key, _, value = line[1:].partition("\t")
                    meta[key] = value
                    continue
                rows.append(line.split("\t"))
    except FileNotFoundError:
        pass
    return rows, meta


def num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return float("nan")


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", required=True)
    ap.add_argument("--torch", default="")
    ap.add_argument("--torch-note", default="", help="why there are no PyTorch timings, if there are none")
    args = ap.parse_args()

    ops, meta = read_rows(args.report)
    torch_rows, torch_meta = read_rows(args.torch)
    torch_ms = {(r[0], r[1], r[2]): (num(r[3]), r[4] if len(r) > 4 else "") for r in torch_rows if len(r) >= 4}

    print("device: %s" % meta.get("device", "(not reported)"))
    if "torch" in torch_meta:
        print("PyTorch: %s" % torch_meta["torch"].replace("\t", " on "))
    elif args.torch_note:
        print("PyTorch: %s" % args.torch_note)
    print()
    head = ("op", "dtype", "shape", "rel.err", "tol", "check", "ms", "TFLOP/s", "GB/s", "torch ms", "vs torch", "notes")
    widths = (20, 9, 46, 9, 7, 6, 10, 8, 8, 10, 8, 0)
    line = "  ".join(h.ljust(w) if w else h for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    failed = 0
    gemm_rate = None
    for r in ops:
        r = r + [""] * (9 - len(r))
        op, dtype, shape = r[0], r[1], r[2]
        err, tol, ms, tflops, gbs, note = num(r[3]), num(r[4]), num(r[5]), num(r[6]), num(r[7]), r[8]
        if math.isnan(err):
            check = "-"
        elif err < tol or (tol == 0 and err == 0):
            check = "ok"
        else:
            check = "FAIL"
            failed += 1
        t_ms, t_note = torch_ms.get((op, dtype, shape), (float("nan"), ""))
        ratio = t_ms / ms if ms > 0 and not math.isnan(t_ms) else float("nan")
        notes = "; ".join(x for x in (note, ("torch: " + t_note) if t_note else "") if x)
        cells = (op, dtype, shape, fmt(err, ".2e") if tol else ("exact" if err == 0 else fmt(err, ".2e")),
                 fmt(tol, ".0e") if tol else "-", check, fmt(ms, ".4f"), fmt(tflops, ".1f") if tflops else "-",
                 fmt(gbs, ".0f") if gbs else "-", fmt(t_ms, ".4f"), fmt(ratio, ".2f") + "x" if not math.isnan(ratio) else "-",
                 notes)
        print("  ".join(str(c).ljust(w) if w else str(c) for c, w in zip(cells, widths)))
        if op == "gemm_rate":
            gemm_rate = (shape, tflops)
    print()
    print("'vs torch' is PyTorch's time / moeflex's time (above 1: moeflex is faster).")
    if gemm_rate:
        print("measured bf16 matmul rate (cuBLAS, %s, random data): %.1f TFLOP/s" % gemm_rate)
    else:
        print("measured bf16 matmul rate: not measured (the harness ran without MOEFLEX_OP_BENCH=1)")
    if failed:
        print("%d row(s) above their tolerance" % failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
