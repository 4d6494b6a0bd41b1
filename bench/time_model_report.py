#!/usr/bin/env python3
"""Prints the op-time tables of runs trained with `moeflex train --profile-ops`.

usage: time_model_report.py OUT_DIR RUN_NAME [RUN_NAME ...]   (reads OUT_DIR/RUN_NAME/op_times.json)
"""
import json
import sys


def us(s):
    return f"{s * 1e6:.1f}"


def report(name, doc):
    ops = doc["ops"]
    print(f"\n{name}: {ops['count']} ops over steps >= {doc['first_step']}, clock {doc['clock']}")
    print(f"{'op kind':<28} {'count':>6} {'meas med us':>12} {'pred med us':>12} {'|err| per op':>13} "
          f"{'net err':>8} {'share':>6}")
    total = ops["measured_total_s"] or 1.0
    for k in ops["kinds"]:
        net = (k["predicted_total_s"] - k["measured_total_s"]) / k["measured_total_s"] if k["measured_total_s"] else 0
        print(f"{k['kind']:<28} {k['count']:>6} {us(k['measured_median_s']):>12} {us(k['predicted_median_s']):>12} "
              f"{100 * k['mean_abs_rel_error']:>12.1f}% {100 * net:>7.1f}% {100 * k['measured_total_s'] / total:>5.1f}%")
    misses = sorted(doc.get("shapes", []), key=lambda x: -abs(x["predicted_total_s"] - x["measured_total_s"]))[:8]
    if misses:
        print("largest misses by shape: " + "; ".join(
            f"{m['kind']} {m['shape'] if len(m['shape']) <= 4 else '[' + str(len(m['shape']) - 2) + ' groups]'} "
            f"{us(m['measured_median_s'])}/{us(m['predicted_median_s'])} us" for m in misses))
    print("phase: " + ", ".join(f"{p} {100 * v['weighted_error']:.1f}% (net {100 * v['total_error']:+.1f}%)"
                                 for p, v in doc["phases"].items()))
    steps = doc["steps"]
    if steps:
        wall = sum(s["measured_wall_s"] for s in steps) / len(steps)
        inops = sum(s["ops_wall_s"] for s in steps) / len(steps)
        pred = sum(s["predicted_s"] for s in steps) / len(steps)
        print(f"step (mean over {len(steps)} rank-steps): measured wall {wall * 1e3:.1f} ms, in ops {inops * 1e3:.1f} ms "
              f"(wall), predicted {pred * 1e3:.1f} ms")
    print(f"by shape: median error {100 * doc['op_median_error']:.2f}% (time-weighted |predicted - measured| of "
          f"each (kind, shape)'s medians); noise floor {100 * doc['op_noise_floor']:.2f}% (the op error of a model "
          f"knowing every shape's median)")
    print(f"op error {100 * doc['op_error']:.2f}% (wall clock: {100 * doc['op_error_wall']:.2f}%), "
          f"net {100 * doc['op_total_error']:+.2f}%; step error {100 * doc['step_error']:.2f}% "
          f"(wall clock: {100 * doc['step_error_wall']:.2f}%; against the step's ops: {100 * doc['step_error_ops']:.2f}%)")
    return doc


def main():
    out, names = sys.argv[1], sys.argv[2:]
    docs = {}
    for n in names:
        with open(f"{out}/{n}/op_times.json") as f:
            docs[n] = report(n, json.load(f))
    print("\n| run | clock | op error | noise floor | median error | net | step error | step error (wall) | "
          "step error vs ops |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, d in docs.items():
        print(f"| {n} | {d['clock']} | {100 * d['op_error']:.2f}% | {100 * d['op_noise_floor']:.2f}% | "
              f"{100 * d['op_median_error']:.2f}% | {100 * d['op_total_error']:+.2f}% | "
              f"{100 * d['step_error']:.2f}% | {100 * d['step_error_wall']:.2f}% | {100 * d['step_error_ops']:.2f}% |")



if __name__ == "__main__":
    main()
