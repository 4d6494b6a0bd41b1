#!/usr/bin/env python3
"""Training rows of the GPU check (scripts/gpu-check.sh, steps 3-4): tokens/s and MFU
of `moeflex train --device cuda` runs (fp32 and --bf16), and the same model config in
the same precision in PyTorch.

    gpu_train_report.py --report OPS.tsv --run NAME RUN_DIR [TORCH.json] [--run ...]

RUN_DIR is a moeflex run directory (summary.json, metrics.jsonl, config.toml); its
precision is summary.json's "precision" ("fp32" when absent: runs from before bf16).
TORCH.json the JSON line of bench/torch_bench.py for the same config (optional); its
"precision" must be the run's (--bf16 for a bf16 run), else the row shows no ratio
and the exit status is 1.
Steady-state tokens/s: the median of the per-step rates after the first 20% of the
steps (start-up: cuBLAS handles, first allocations). Model FLOPs per token (the
PaLM appendix-B count, causal attention as half of the full S x S):
    6 * active_params + 6 * layers * seq_len * hidden_size
MFU: model FLOP/s over the card's measured GEMM rate of the precision in
MFU_RATE_DTYPE (the harness's gemm_rate rows of OPS.tsv, keyed by their dtype column):
bf16 runs against the bf16 rate; fp32 runs also against the bf16 rate, the issue's
yardstick, so their MFU is low by construction. The "MFU vs" column names the rate.
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


# The measured GEMM rate each run precision's MFU is taken against (a gemm_rate row's
# dtype). fp32 keeps the bf16 rate: the card's bf16 peak is the yardstick of the issue.
MFU_RATE_DTYPE = {"bf16": "bf16", "fp32": "bf16"}


def gemm_rates(path):
    """{dtype: FLOP/s} from the gemm_rate rows of the harness report (op, dtype, shape,
    err, tol, ms, TFLOP/s, ...); {} when the file or the rows are missing."""
    rates = {}
    try:
        with open(path) as fh:
            for line in fh:
                r = line.rstrip("\n").split("\t")
                if r and r[0] == "gemm_rate" and len(r) > 6:
                    try:
                        rates[r[1]] = float(r[6]) * 1e12
                    except ValueError:
                        pass
    except OSError:
        pass
    return rates


def run_row(name, run_dir, torch_json, rates):
    with open(run_dir + "/summary.json") as fh:
        s = json.load(fh)
    precision = s.get("precision", "fp32")
    rate_dtype = MFU_RATE_DTYPE.get(precision)
    rate = rates.get(rate_dtype) if rate_dtype else None
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
    torch_tps, torch_precision, mismatch = float("nan"), None, None
    if torch_json:
        try:
            with open(torch_json) as fh:
                lines = [x for x in fh.read().splitlines() if x.startswith("{")]
            t = json.loads(lines[-1])
            torch_precision = t.get("precision", "fp32")  # torch_bench.py wrote fp32 only before --bf16
            torch_tps = float(t["tokens_per_second"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            pass
        if torch_precision is not None and torch_precision != precision:
            mismatch = "%s: the PyTorch run is %s, moeflex's %s: no ratio" % (name, torch_precision, precision)
            torch_tps = float("nan")
    return {
        "name": name, "precision": precision, "mfu_vs": "%s GEMM" % rate_dtype if rate else "-",
        "mismatch": mismatch, "params": s["params"], "active": s["active_params"], "steps": s["steps"], "tps": tps,
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
    rates = gemm_rates(args.report)
    head = ("run", "precision", "params", "active", "steps", "tokens/s", "TFLOP/s", "MFU", "MFU vs", "peak GiB",
            "loss first->last", "torch tok/s", "vs torch")
    widths = [12, 9, 8, 8, 6, 10, 8, 7, 9, 9, 17, 12, 8]
    widths[0] = max([widths[0]] + [len(spec[0]) for spec in args.run])
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print("training on the GPU (moeflex train --device cuda, fp32 or --bf16, one GPU)")
    print(line)
    print("-" * len(line))
    failed, notes = 0, []
    for spec in args.run:
        name, run_dir = spec[0], spec[1]
        torch_json = spec[2] if len(spec) > 2 else None
        try:
            r = run_row(name, run_dir, torch_json, rates)
        except (OSError, ValueError, KeyError) as e:
            print("%s: no result (%s)" % (name, e))
            failed += 1
            continue
        if r["mismatch"]:
            notes.append(r["mismatch"])
            failed += 1
        cells = (r["name"], r["precision"], "%.0fM" % (r["params"] / 1e6), "%.0fM" % (r["active"] / 1e6),
                 str(r["steps"]), fmt(r["tps"], ".0f"), fmt(r["tflops"], ".2f"),
                 (fmt(100 * r["mfu"], ".1f") + "%") if not math.isnan(r["mfu"]) else "-", r["mfu_vs"],
                 fmt(r["peak"] / 2**30, ".2f"), "%.3f->%.3f" % (r["loss0"], r["loss"]), fmt(r["torch"], ".0f"),
                 fmt(r["ratio"], ".2f") + "x" if not math.isnan(r["ratio"]) else "-")
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)))
    for note in notes:
        print("mismatch: " + note)
    print()
    measured = ", ".join("%s %.1f TFLOP/s" % (k, v / 1e12) for k, v in sorted(rates.items())) or "not measured"
    print("tokens/s: median of the per-step rates after the first 20%% of the steps. MFU = model FLOP/s "
          "(6 N_active + 6 L S d per token) / the measured GEMM rate named in 'MFU vs' (%s; fp32 runs are "
          "held to the bf16 rate too, so their MFU is low by construction). 'vs torch': moeflex / PyTorch "
          "tokens/s (bench/torch_bench.py, same config and precision: fp32 without TF32, or bf16 "
          "torch.autocast with fp32 weights and AdamW)." % measured)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
