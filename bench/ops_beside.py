#!/usr/bin/env python3
"""Op speed against the cost model by what the other ranks did meanwhile.

Usage: bench/ops_beside.py RUN   (the directory, or its trace.json, of a run of
`moeflex train --profile-ops` under mpirun)

Each op of 0.3 ms or more on a rank's ops track (forward and backward, not the
optimizer) is classed by how much of its time the other ranks spent inside ops of
their own (the ranks' tracks share one clock): "others computing" (over 90%),
"others waiting" (under 10%: polling for a message, or napping once a wait is
long) or "mixed". Prints, per class, the op time summed over ranks and traced steps
and its measured / predicted ratio weighted by time. As op_times.json does, the
first step (warm-up) is left out when the trace holds more than one. On cores that
share execution units (hyperthreads), ops beside a polling rank run slower than
beside a computing one, and beside a napping or idle one faster.
"""
import bisect
import json
import os
import statistics
import sys


def covered(intervals, starts, a, b):
    """The fraction of [a, b] inside the sorted, disjoint intervals."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    c = 0.0
    while i < len(intervals) and intervals[i][0] < b:
        s, e = intervals[i]
        c += max(0.0, min(e, b) - max(s, a))
        i += 1
    return c / (b - a) if b > a else 1.0


def main(path):
    if os.path.isdir(path):
        path = os.path.join(path, "trace.json")
    try:
        t = json.load(open(path))
        events = t["traceEvents"] if isinstance(t, dict) else t
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"{path}: not a readable trace.json ({e})")
    ops, step_ends = {}, {}
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and "predicted_us" in a and "cpu_us" in a:
            ops.setdefault(e["pid"], []).append(e)
        elif e.get("ph") == "X" and e.get("name") == "optimizer":  # a traced step's end, per rank
            step_ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
    if not ops:
        sys.exit(f"{path}: holds no op events; train with --profile-ops")
    if len(ops) < 2:
        sys.exit(f"{path}: the ops of one rank only; the classes need a run of 2 or more ranks (mpirun)")
    for p, v in ops.items():
        ends = sorted(step_ends.get(p, []))
        if len(ends) > 1:  # leave the warm-up step out
            v[:] = [e for e in v if e["ts"] >= ends[0]]
        v.sort(key=lambda e: e["ts"])
    spans = {p: [(e["ts"], e["ts"] + e["dur"]) for e in v] for p, v in ops.items()}
    starts = {p: [s for s, _ in v] for p, v in spans.items()}
    classes = {}
    for p, v in ops.items():
        others = [q for q in ops if q != p]
        for e in v:
            if e["dur"] < 300 or e["args"].get("phase") == "optimizer" or e["args"]["predicted_us"] <= 0:
                continue
            f = statistics.mean(covered(spans[q], starts[q], e["ts"], e["ts"] + e["dur"]) for q in others)
            c = "others computing" if f > 0.9 else "others waiting" if f < 0.1 else "mixed"
            classes.setdefault(c, []).append((e["args"]["cpu_us"] / e["args"]["predicted_us"], e["dur"]))
    total = sum(d for v in classes.values() for _, d in v)
    print(f"{'ops while':<18} {'op s':>8} {'share':>7} {'meas/pred':>10}")
    for c in ("others computing", "mixed", "others waiting"):
        v = classes.get(c, [])
        if not v:
            continue
        w = sum(d for _, d in v)
        print(f"{c:<18} {w / 1e6:>8.2f} {100 * w / total:>6.1f}% {sum(r * d for r, d in v) / w:>10.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
