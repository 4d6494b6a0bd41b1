#!/usr/bin/env python3
"""Training rows of the GPU check (scripts/gpu-check.sh, steps 3-4): tokens/s and MFU
of `moeflex train --device cuda` runs, and the same model config in PyTorch.

    gpu_train_report.py --report OPS.tsv --run NAME RUN_DIR [TORCH.json] [--run ...]

RUN_DIR is a moeflex run directory (summary.json, metrics.jsonl, config.toml);
TORCH.json the JSON line of bench/torch_bench.py for the same config (optional).
Steady-state tokens/s: the median of the per-step rates after the first 20% of the
steps (start-up: cuBLAS handles, first allocations). Model FLOPs per token (the
PaLM appendix-B count, causal attention as half of the full S x S):
    6 * active_params + 6 * layers * seq_len * hidden_size
MFU: model FLOP/s over the card's measured bf16 GEMM rate (the harness's gemm_rate
row of OPS.tsv), the issue's yardstick; the engine runs fp32 in this slice, so the
fp32 MFU against the bf16 rate is low by construction.
"""

import argparse
import json
import math
import re
import statistics
import sys


def toml_int(text, key):
    m = re.search(r"^\s*%s\s*=\s*(\d+)" % re.escape(key), text, re.M)
    return int(m.group(1)) if m else None


def gemm_rate(path):
    try:
        with open(path) as fh:
            for line in fh:
                r = line.rstrip("\n").split("\t")
                if r and r[0] == "gemm_rate" and len(r) > 6:
                    return float(r[6]) * 1e12
    except OSError:
        pass
    return None


def run_row(name, run_dir, torch_json, rate):
    with open(run_dir + "/summary.json") as fh:
        s = json.load(fh)
    with open(run_dir + "/config.toml") as fh:
        conf = fh.read()
    steps = []
    with open(run_dir + "/metrics.jsonl") as fh:
        for line in fh:
            if line.strip():
                m = json.loads(line)
                if not m.get("oom") and "tokens_per_second" in m:
                    steps.append(m)
    rates = [m["tokens_per_second"] for m in steps]
    steady = rates[len(rates) // 5:] or rates
    tps = statistics.median(steady) if steady else float("nan")
    L, d, S = toml_int(conf, "num_hidden_layers"), toml_int(conf, "hidden_size"), toml_int(conf, "seq_len")
    flops_per_token = 6.0 * s["active_params"] + 6.0 * L * S * d
    mfu = tps * flops_per_token / rate if rate else float("nan")
    torch_tps = float("nan")
    if torch_json:
        try:
            with open(torch_json) as fh:
                lines = [x for x in fh.read().splitlines() if x.startswith("{")]
            torch_tps = float(json.loads(lines[-1])["tokens_per_second"])
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return {
        "name": name, "params": s["params"], "active": s["active_params"], "steps": s["steps"], "tps": tps,
        "tflops": tps * flops_per_token / 1e12, "mfu": mfu, "peak": s["peak_device_bytes"],
        "loss0": steps[0]["loss"] if steps else float("nan"), "loss": s["final_train_loss"],
        "torch": torch_tps, "ratio": tps / torch_tps if torch_tps > 0 else float("nan"),
    }


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", required=True)
    ap.add_argument("--run", nargs="+", action="append", default=[], metavar="NAME RUN_DIR [TORCH.json]")
    args = ap.parse_args()
    rate = gemm_rate(args.report)
    head = ("run", "params", "active", "steps", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "loss first->last",
            "torch tok/s", "vs torch")
    widths = (12, 8, 8, 6, 10, 8, 7, 9, 17, 12, 8)
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print("training on the GPU (moeflex train --device cuda, fp32, one GPU)")
    print(line)
    print("-" * len(line))
    failed = 0
    for spec in args.run:
        name, run_dir = spec[0], spec[1]
        torch_json = spec[2] if len(spec) > 2 else None
        try:
            r = run_row(name, run_dir, torch_json, rate)
        except (OSError, ValueError, KeyError) as e:
            print("%s: no result (%s)" % (name, e))
            failed += 1
            continue
        cells = (r["name"], "%.0fM" % (r["params"] / 1e6), "%.0fM" % (r["active"] / 1e6), str(r["steps"]),
                 fmt(r["tps"], ".0f"), fmt(r["tflops"], ".2f"), (fmt(100 * r["mfu"], ".1f") + "%") if not math.isnan(r["mfu"]) else "-",
                 fmt(r["peak"] / 2**30, ".2f"), "%.3f->%.3f" % (r["loss0"], r["loss"]), fmt(r["torch"], ".0f"),
                 fmt(r["ratio"], ".2f") + "x" if not math.isnan(r["ratio"]) else "-")
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)))
    print()
    print("tokens/s: median of the per-step rates after the first 20%% of the steps. MFU = model FLOP/s "
          "(6 N_active + 6 L S d per token) / the measured bf16 GEMM rate (%s). 'vs torch': moeflex / PyTorch "
          "tokens/s (bench/torch_bench.py, same config, fp32 without TF32)."
          % ("%.1f TFLOP/s" % (rate / 1e12) if rate else "not measured"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
