#!/usr/bin/env python3
"""Where a GPU training step's time goes, from a run trained with --profile-ops.

    gpu_op_profile.py RUN/op_times.json

On a device backend --profile-ops synchronises around every op (profile/op_profiler.h),
so each op's wall time is its kernels' time plus one synchronisation; the step's
wall time minus the sum of its ops is host work between ops (planning, dispatch,
the data). Prints, per op kind, its share of the measured step wall time, and per
phase its total. Times are per step (the profiled steps' totals / their count).
"""
import json
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit("gpu_op_profile: %s: %s" % (path, e))
    if not isinstance(d, dict):
        sys.exit("gpu_op_profile: %s is not an op_times.json (its top level is not an object)" % path)
    steps = d.get("steps") or []
    if not steps:
        sys.exit("gpu_op_profile: %s has no profiled steps" % path)
    try:
        n = len(steps)
        step_s = sum(s["measured_wall_s"] for s in steps) / n
        ops_s = sum(s["ops_wall_s"] for s in steps) / n
        kinds = d["ops_wall"]["kinds"]
        phases = d["phases"]
    except (KeyError, TypeError) as e:
        sys.exit("gpu_op_profile: %s lacks a field of moeflex's op_times.json (%s)" % (path, e))
    if step_s <= 0:
        sys.exit("gpu_op_profile: %s: the profiled steps' wall time is %g s" % (path, step_s))
    print("profiled steps: %d (from step %s), precision %s" % (n, d.get("first_step"), d.get("precision")))
    print("step wall %.2f ms; sum of op walls %.2f ms (%.0f%%); between ops %.2f ms" %
          (step_s * 1e3, ops_s * 1e3, 100 * ops_s / step_s, (step_s - ops_s) * 1e3))
    print()
    print("%-34s %8s %11s %9s %11s" % ("op kind", "calls", "ms/step", "share", "median ms"))
    kinds = sorted(kinds, key=lambda k: -k["measured_total_s"])
    for k in kinds:
        print("%-34s %8.0f %11.3f %8.1f%% %11.4f" % (k["kind"], k["count"] / n, k["measured_total_s"] / n * 1e3,
                                                    100 * k["measured_total_s"] / n / step_s,
                                                    k["measured_median_s"] * 1e3))
    print()
    for name, p in sorted(phases.items(), key=lambda kv: -kv[1]["measured_total_s"]):
        print("phase %-20s %11.3f ms/step %8.1f%%" % (name, p["measured_total_s"] / n * 1e3,
                                                      100 * p["measured_total_s"] / n / step_s))


if __name__ == "__main__":
    main()
