#!/usr/bin/python3
"""Plots device memory over a run against its budget, as a PNG.

Usage:
  /usr/bin/python3 bench/plot_memory.py RUN_DIR [RUN_DIR...] --out FILE.png [--title T]
                                        [--grid] [--each DIR]

Each RUN_DIR holds
  metrics.jsonl  one JSON object per step: "step", "peak_device_bytes", and
                 optionally "bytes_recomputed", "bytes_offloaded", "oom"
  summary.json   (optional) "policy", "device_budget_bytes" (null = unlimited)

The figure has one line per run (peak device memory per step, MiB), labelled by
its policy, a dashed horizontal line per distinct budget, and a red cross on
every step whose metrics line reports an OOM (drawn at the step's demand, which
--on-oom=restart records, since the arena then served the overflow from the heap).
--grid puts each run in its own panel; --each DIR also writes one PNG per run,
DIR/memory-<run directory name>.png. When a run restarted from a
checkpoint (its step numbers go back), the line is broken there and the restart
is marked with a dotted vertical line. If any run recomputed or offloaded
activations, a lower panel shows those bytes per step.

Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import os
import sys

MIB = 1024.0 * 1024.0


def fail(msg):
    print(f"plot_memory: error: {msg}", file=sys.stderr)
    sys.exit(2)


def warn(msg):
    print(f"plot_memory: warning: {msg}", file=sys.stderr)


def truthy_oom(value):
    """`oom` may be a flag, a count, or a description; 0/false/null/"" mean none."""
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "none")
    return bool(value)


def load_run(run_dir):
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        fail(f"'{run_dir}' has no metrics.jsonl (expected {metrics_path})")
    rows = []
    with open(metrics_path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # A crashed run may leave a truncated last line: skip it with a warning.
    last_nonempty = max((i for i, l in enumerate(lines) if l.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last_nonempty:
                warn(f"{metrics_path}:{i + 1}: skipping a truncated last line ({e.msg})")
                continue
            fail(f"{metrics_path}:{i + 1}: not valid JSON: {e.msg}")
        if not isinstance(row, dict) or "step" not in row:
            continue  # not a per-step line
        rows.append(row)
    if not rows:
        fail(f"{metrics_path} has no per-step lines (objects with a \"step\" field)")

    summary = {}
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary_path):
        try:
            with open(summary_path, encoding="utf-8") as f:
                summary = json.load(f)
        except json.JSONDecodeError as e:
            fail(f"{summary_path}: not valid JSON: {e.msg}")
    else:
        warn(f"'{run_dir}' has no summary.json: budget unknown, policy taken from the directory name")

    name = os.path.basename(os.path.normpath(run_dir))
    budget = summary.get("device_budget_bytes")
    if budget is not None and (not isinstance(budget, (int, float)) or budget < 0):
        budget = None  # negative / odd values mean unlimited
    return {
        "dir": run_dir,
        "name": name,
        "policy": summary.get("policy") or name,
        "budget": budget,
        "rows": rows,
    }


def segments(rows, key):
    """Splits rows into runs of increasing step (a restart starts a new one).
    Returns [(steps, values)], skipping rows without a numeric `key` and the
    dropped (OOM) steps, and the steps at which a restart went back."""
    segs, cur_x, cur_y, last_step = [], [], [], None
    restarts = []
    for r in rows:
        step = r["step"]
        if last_step is not None and step <= last_step:
            restarts.append(step)
            if cur_x:
                segs.append((cur_x, cur_y))
            cur_x, cur_y = [], []
        last_step = step
        v = r.get(key)
        if truthy_oom(r.get("oom")):
            continue  # a dropped step: marked by a cross at its demand, not part of the line
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            cur_x.append(step)
            cur_y.append(v / MIB)
    if cur_x:
        segs.append((cur_x, cur_y))
    return segs, restarts


def draw(ax, ax2, runs, plt, color_offset=0, legend_size=9):
    """Draws `runs` on `ax` (peak memory per step against the budgets) and, if
    `ax2` is given, their recomputed / offloaded bytes per step on `ax2`."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    budgets = sorted({r["budget"] for r in runs if r["budget"] is not None})
    one_budget = len(budgets) == 1
    oom_labelled = restart_labelled = False
    for i, r in enumerate(runs):
        color = colors[(i + color_offset) % len(colors)]
        label = r["label"] + (" (no budget)" if budgets and r["budget"] is None and "no budget" not in r["label"] else "")
        segs, restarts = segments(r["rows"], "peak_device_bytes")
        for j, (xs, ys) in enumerate(segs):
            ax.plot(xs, ys, color=color, lw=1.6, marker="." if len(xs) <= 60 else None,
                    label=label if j == 0 else None)
        if not segs:
            warn(f"{r['dir']}: no step has peak_device_bytes")
            ax.plot([], [], color=color, label=label)
        for s in restarts:
            ax.axvline(s, color=color, ls=":", lw=1.0,
                       label=None if restart_labelled else "restart: steps redone from here")
            restart_labelled = True
        if r["budget"] is not None and not one_budget:
            ax.axhline(r["budget"] / MIB, color=color, ls="--", lw=1.2,
                       label=f"budget {r['label']}: {r['budget'] / MIB:,.1f} MiB")
        # OOM steps: at the step's measured peak (its demand, with --on-oom=restart),
        # or at the budget if none was recorded.
        ox, oy = [], []
        for row in r["rows"]:
            if truthy_oom(row.get("oom")):
                v = row.get("peak_device_bytes")
                if not isinstance(v, (int, float)):
                    v = r["budget"] if r["budget"] is not None else None
                if v is None:
                    continue
                ox.append(row["step"])
                oy.append(v / MIB)
        if ox:
            ax.scatter(ox, oy, marker="x", s=70, linewidths=2.2, color="red", zorder=5,
                       label=None if oom_labelled else "OOM (step dropped)")
            oom_labelled = True
        r["oom_steps"] = len(ox)
        r["max_peak"] = max((y for _, ys in segs for y in ys), default=float("nan"))
        r["max_oom"] = max(oy, default=float("nan"))

        if ax2 is not None:
            for key, ls, what in (("bytes_recomputed", "-", "recomputed"), ("bytes_offloaded", "--", "offloaded")):
                if any((row.get(key) or 0) > 0 for row in r["rows"]):
                    psegs, _ = segments(r["rows"], key)
                    for j, (xs, ys) in enumerate(psegs):
                        ax2.plot(xs, ys, color=color, ls=ls, lw=1.3,
                                 label=f"{r['label']} {what}" if j == 0 else None)

    if one_budget:
        ax.axhline(budgets[0] / MIB, color="black", ls="--", lw=1.4,
                   label=f"budget {budgets[0] / MIB:,.1f} MiB")
    if not budgets:
        ax.text(0.99, 0.02, "no budget (unlimited)", transform=ax.transAxes, ha="right", va="bottom",
                fontsize=9, color="gray")
    ax.set_ylabel("peak device memory (MiB)")
    # Headroom above the highest peak, OOM demand or budget, so nothing hides in the frame.
    tops = [x for r in runs for x in (r["max_peak"], r["max_oom"]) if x == x]
    top = max(tops + [b / MIB for b in budgets] + [1.0])
    ax.set_ylim(0, top * 1.08)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=legend_size, framealpha=0.9)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    if ax2 is not None:
        ax2.set_ylabel("activations (MiB)")
        ax2.set_ylim(bottom=0)
        ax2.grid(True, alpha=0.3)
        ax2.legend(loc="best", fontsize=legend_size - 1, framealpha=0.9)
        ax2.set_xlabel("step")
    else:
        ax.set_xlabel("step")


def has_provision(runs):
    return any((row.get("bytes_recomputed") or 0) > 0 or (row.get("bytes_offloaded") or 0) > 0
               for r in runs for row in r["rows"])


def save(fig, plt, path):
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    plt.close(fig)
    print(f"wrote {path}")


def plot_together(runs, path, title, plt):
    """All runs in one axes (and a lower panel for recomputed/offloaded bytes)."""
    if has_provision(runs):
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    else:
        fig, ax = plt.subplots(figsize=(10, 5.5))
        ax2 = None
    draw(ax, ax2, runs, plt)
    ax.set_title(title or "Device memory per step")
    save(fig, plt, path)


def plot_grid(runs, path, title, plt):
    """One panel per run, each against its own budget, on shared axes."""
    n = len(runs)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), sharex=True, sharey=True,
                             squeeze=False)
    for i, r in enumerate(runs):
        ax = axes[i // cols][i % cols]
        draw(ax, None, [r], plt, color_offset=i, legend_size=7)
        ax.set_title(r["label"], fontsize=10)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    top = max([x for r in runs for x in (r["max_peak"], r["max_oom"]) if x == x]
              + [r["budget"] / MIB for r in runs if r["budget"] is not None] + [1.0])
    axes[0][0].set_ylim(0, top * 1.08)
    fig.suptitle(title or "Device memory per step")
    save(fig, plt, path)


def main():
    ap = argparse.ArgumentParser(description="Plot peak device memory per step against the budget.")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory with metrics.jsonl and summary.json")
    ap.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    ap.add_argument("--title", default=None, help="figure title (default: 'Device memory per step')")
    ap.add_argument("--grid", action="store_true", help="one panel per run instead of all runs in one axes")
    ap.add_argument("--each", metavar="DIR", default=None,
                    help="also write one PNG per run, DIR/memory-<run directory name>.png, each against its budget")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("matplotlib is missing: install Debian's python3-matplotlib (scripts/setup.sh) "
             "and run with /usr/bin/python3")

    runs = [load_run(d) for d in args.run_dirs]
    # Labels: the policy, disambiguated by the directory when two runs share one.
    policies = [r["policy"] for r in runs]
    for r in runs:
        same = [q for q in runs if q["policy"] == r["policy"]]
        if len(same) == 1:
            r["label"] = r["policy"]
        elif r["budget"] is None and sum(q["budget"] is None for q in same) == 1:
            r["label"] = f"{r['policy']}, no budget"
        else:
            r["label"] = f"{r['policy']} ({r['name']})"

    if args.grid:
        plot_grid(runs, args.out, args.title, plt)
    else:
        plot_together(runs, args.out, args.title, plt)
    if args.each:
        for r in runs:
            safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in r["name"])
            budget = "no budget" if r["budget"] is None else f"budget {r['budget'] / MIB:,.1f} MiB"
            plot_together([r], os.path.join(args.each, f"memory-{safe}.png"),
                          f"{r['label']}: device memory per step, {budget}", plt)

    for r in runs:
        budget = "unlimited" if r["budget"] is None else f"{r['budget'] / MIB:,.1f} MiB"
        print(f"{r['label']}: {len(r['rows'])} steps, max peak {r['max_peak']:,.1f} MiB, "
              f"budget {budget}, OOM steps {r['oom_steps']}")


if __name__ == "__main__":
    main()
