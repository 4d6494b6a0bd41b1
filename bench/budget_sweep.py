#!/usr/bin/env python3
"""Adaptive against every static policy that fits, at budgets from the printed minimum
to the unbudgeted peak (bench/budget_sweep.sh is the entry point; its header says what
is measured and how).

Usage: budget_sweep.py --binary build/moeflex --data data/brown --work DIR
       [--layout ep2|pp2ep2|pp2ep2-zbh1] [--steps 8] [--spike-every 4] [--ratio 2]
       [--points 8] [--rounds 1] [--policies "full selective ..."]
       [--table OUT.md] [--plot OUT.png]

Per layout it
  1. trains `none` without a budget: the speed reference and the top of the sweep (U,
     the largest per-step peak over ranks);
  2. finds the printed minimum M (tests/minimum_sweep.py's probes: a refusal names it);
  3. trains every static policy without a budget once: its peak says at which budgets
     it can fit;
  4. at POINTS budgets from M to U (equal steps), trains adaptive and every static
     policy whose unbudgeted peak fits, alternating within a round; ROUNDS > 1 repeats
     and quotes each run's median tokens/s.
A static policy that still runs out of memory under the budget (fragmentation) shows
as OOM. Ratios are tokens/s over the same budget's fastest static policy and over the
unbudgeted reference, both from the same round (the machine is shared and noisy).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from minimum_sweep import minimum  # noqa: E402  (the printed minimum, probed by bisection)

MIB = 2 ** 20
LAYOUTS = {"ep2": (2, ["--ep", "2"]), "pp2ep2": (4, ["--pp", "2", "--ep", "2", "--schedule", "1f1b"]),
           "pp2ep2-zbh1": (4, ["--pp", "2", "--ep", "2", "--schedule", "zb-h1"])}
STATIC = ["none", "full", "selective", "moe-light", "moe-medium", "moe-full"]


def run(binary, ranks, args, log):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), "-x", "OMP_NUM_THREADS=1",
           binary, "train", "--threads", "1", "--quiet"] + args
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode


def summary(run_dir):
    path = os.path.join(run_dir, "summary.json")
    return json.load(open(path)) if os.path.exists(path) else None


def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


class Run:
    """One training run's outcome: tokens/s over the steps after the first (None: it
    failed), peak, OOM, bytes moved."""

    def __init__(self, binary, ranks, args, out, log):
        self.rc = run(binary, ranks, args + ["--out", out], log)
        s, lines = summary(out), metrics(out)
        self.ok = self.rc == 0 and s is not None
        timed = [l for l in lines[1:] if not l.get("oom")]  # the first step warms up
        self.tps = (sum(l["tokens_per_second"] * l["step_seconds"] for l in timed) /
                    sum(l["step_seconds"] for l in timed)) if self.ok and timed else None
        self.peak = max((l["peak_device_bytes"] for l in lines), default=0)
        self.oom = not self.ok and ("out of device memory" in open(log).read() or self.rc == 3)
        kept = [l for l in lines if not l.get("oom")]
        self.recomputed = statistics.mean(l["bytes_recomputed"] for l in kept) / MIB if kept else 0.0
        self.offloaded = statistics.mean(l["bytes_offloaded"] for l in kept) / MIB if kept else 0.0


def sweep(a, layout):
    ranks, flags = LAYOUTS[layout]
    work = os.path.join(a.work, layout)
    os.makedirs(work, exist_ok=True)
    base = ["--data", a.data, "--steps", str(a.steps),
            "--inject-imbalance", f"every={a.spike_every}:ratio={a.ratio}"] + flags
    policies = a.policies.split()
    print(f"{layout}: {ranks} ranks ({' '.join(flags)}), {a.steps} steps, {a.ratio}x spike every "
          f"{a.spike_every}th step", flush=True)

    def train(tag, extra):
        return Run(a.binary, ranks, base + extra, os.path.join(work, tag), os.path.join(work, tag + ".log"))

    unbudgeted = {p: train(f"{p}-free", ["--policy", p]) for p in ["none"] + [p for p in policies if p != "none"]}
    if not unbudgeted["none"].ok:
        sys.exit(f"budget_sweep: the unbudgeted run failed; see {work}/none-free.log")
    top = unbudgeted["none"].peak
    least = minimum(a.binary, ranks, ["--data", a.data, "--quiet", "--threads", "1"] + flags, work)
    print(f"  minimum {least / MIB:.2f} MiB, unbudgeted peak {top / MIB:.2f} MiB; static peaks: " +
          ", ".join(f"{p} {r.peak / MIB:.1f}" for p, r in unbudgeted.items() if r.ok), flush=True)
    budgets = [least + (top - least) * i // (a.points - 1) for i in range(a.points)]
    rows = []
    for i, b in enumerate(budgets):
        fitting = [p for p in policies if unbudgeted[p].ok and unbudgeted[p].peak <= b]
        rounds = []
        for r in range(a.rounds):
            got = {"ref": train(f"ref-{i}-{r}", ["--policy", "none"])}
            for p in ["adaptive"] + fitting:
                got[p] = train(f"{p}-{i}-{r}", ["--policy", p, "--device-memory", f"{b}B"])
            rounds.append(got)
        rows.append((b, fitting, rounds))
        print("  " + line(b, least, fitting, rounds), flush=True)
    return {"layout": layout, "ranks": ranks, "flags": flags, "minimum": least, "top": top, "rows": rows}


def ratio_stats(rounds, num, den):
    """Median over rounds of tokens/s of `num` / `den` (den: a policy or 'best-static')."""
    out = []
    for got in rounds:
        n = got[num].tps
        if den == "best-static":
            fast = [r.tps for p, r in got.items() if p not in ("ref", "adaptive") and r.tps]
            d = max(fast) if fast else None
        else:
            d = got[den].tps
        if n and d:
            out.append(n / d)
    return statistics.median(out) if out else None


def best_static(rounds, fitting):
    """The static policy with the highest median tokens/s (None: none ran)."""
    med = {p: statistics.median([g[p].tps for g in rounds if g[p].tps] or [0]) for p in fitting}
    med = {p: v for p, v in med.items() if v > 0}
    return max(med, key=med.get) if med else None


def line(b, least, fitting, rounds):
    ad = rounds[0]["adaptive"]
    vs_static = ratio_stats(rounds, "adaptive", "best-static")
    vs_ref = ratio_stats(rounds, "adaptive", "ref")
    best = best_static(rounds, fitting)
    fmt = lambda x: f"{x:.2f}x" if x else "-"
    return (f"budget {b / MIB:7.2f} MiB ({b / least:.2f}x min): adaptive {fmt(vs_ref)} of unbudgeted, "
            f"{fmt(vs_static)} of the fastest static ({best or 'none fits'}), peak {ad.peak / MIB:.1f} MiB, "
            f"recomputed {ad.recomputed:.1f} MiB/step, offloaded {ad.offloaded:.1f} MiB/step"
            + ("" if ad.ok else f", FAILED (exit {ad.rc})"))


def table(results, policies):
    out = []
    for res in results:
        out.append(f"### {res['layout']}: {res['ranks']} ranks, `{' '.join(res['flags'])}`, minimum "
                   f"{res['minimum'] / MIB:.2f} MiB, unbudgeted peak {res['top'] / MIB:.2f} MiB\n")
        cols = ["adaptive"] + policies
        out.append("| budget MiB | x min | " + " | ".join(cols) + " | adaptive / fastest static | adaptive / unbudgeted |")
        out.append("|" + " --- |" * (len(cols) + 4))
        for b, fitting, rounds in res["rows"]:
            cells = []
            for p in cols:
                if p != "adaptive" and p not in fitting:
                    cells.append("-")
                    continue
                tps = [g[p].tps for g in rounds if g[p].tps]
                if not tps:
                    cells.append("OOM" if any(g[p].oom for g in rounds) else "failed")
                else:
                    cells.append(f"{statistics.median(tps):.0f}")
            vs_s = ratio_stats(rounds, "adaptive", "best-static")
            vs_r = ratio_stats(rounds, "adaptive", "ref")
            out.append(f"| {b / MIB:.2f} | {b / res['minimum']:.2f} | " + " | ".join(cells) +
                       f" | {f'{vs_s:.2f}x' if vs_s else '-'} | {f'{vs_r:.2f}x' if vs_r else '-'} |")
        out.append("")
    return "\n".join(out)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("budget_sweep: matplotlib missing, no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        series = {}
        for b, fitting, rounds in res["rows"]:
            for p in ["adaptive"] + fitting:
                v = [g[p].tps / g["ref"].tps for g in rounds if g[p].tps and g["ref"].tps]
                if v:
                    series.setdefault(p, []).append((b / res["minimum"], statistics.median(v)))
        for p, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", linewidth=2.5 if p == "adaptive" else 1.2, label=p)
        ax.axhline(0.90, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("budget / printed minimum")
        ax.set_ylabel("tokens/s / unbudgeted none (same round)")
        ax.set_title(f"{res['layout']} ({res['ranks']} ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", default="build/moeflex")
    p.add_argument("--data", default="data/brown")
    p.add_argument("--work", required=True)
    p.add_argument("--layout", default="ep2", help="comma-separated: " + ", ".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--spike-every", type=int, default=4)
    p.add_argument("--ratio", type=float, default=2.0)
    p.add_argument("--points", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--policies", default=" ".join(STATIC))
    p.add_argument("--table")
    p.add_argument("--plot")
    a = p.parse_args()
    if a.points < 2:
        sys.exit("budget_sweep: --points must be at least 2")
    for lay in a.layout.split(","):
        if lay not in LAYOUTS:
            sys.exit(f"budget_sweep: unknown layout '{lay}' (known: {', '.join(LAYOUTS)})")
    results = [sweep(a, lay) for lay in a.layout.split(",")]
    text = table(results, a.policies.split())
    print(text)
    if a.table:
        with open(a.table, "w") as f:
            f.write(text + "\n")
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
