#!/usr/bin/env python3
"""The simulator's priced op stream against the engine's, kind by kind and phase by phase.

usage: sim_breakdown.py RUN_DIR SIM_SUMMARY_JSON

RUN_DIR is a `moeflex train --profile-ops` run (its op_times.json: every op the
engine executed, priced by the cost model); SIM_SUMMARY_JSON is the summary.json of
`moeflex simulate --breakdown` for the same config (its "ops": the simulator's
priced ops of one step, summed over the pipeline ranks). Both are shown in ms per
step summed over one pipeline (the engine's totals over all ranks and steps
divided by the steps and by dp). Kinds that are no backend op (a2a_local_copy) or
are priced whole in the simulator (optimizer_step: zero_grads, the norm, the clip,
AdamW, from the profile's table) have no engine row of their own.
"""
import json
import sys


def main():
    run, summary = sys.argv[1], sys.argv[2]
    ot = json.load(open(f"{run}/op_times.json"))
    sim = json.load(open(summary))
    dp = int(sim["parallel"].split("dp=")[1].split(",")[0])
    steps = len({s["step"] for s in ot["steps"]})
    per = 1.0 / (steps * dp)
    eng = {k["kind"]: (k["count"] * per, k["predicted_total_s"] * per) for k in ot["ops"]["kinds"]}
    kinds, phases = {}, {}
    for o in sim.get("ops", []):
        c, s = kinds.get(o["kind"], (0.0, 0.0))
        kinds[o["kind"]] = (c + o["count"], s + o["seconds"])
        phases[o["phase"]] = phases.get(o["phase"], 0.0) + o["seconds"]
    if not kinds:
        sys.exit(f"{summary}: no \"ops\" (simulate with --breakdown)")
    print(f"{'op kind':<28} {'eng calls':>9} {'sim calls':>9} {'eng ms':>9} {'sim ms':>9} {'sim-eng ms':>10}")
    rows = sorted(set(eng) | set(kinds), key=lambda k: -max(eng.get(k, (0, 0))[1], kinds.get(k, (0, 0))[1]))
    for k in rows:
        ec, es = eng.get(k, (0.0, 0.0))
        sc, ss = kinds.get(k, (0.0, 0.0))
        flag = "" if abs(ec - sc) < 1e-6 else "  <- calls differ"
        print(f"{k:<28} {ec:>9.1f} {sc:>9.1f} {1e3 * es:>9.3f} {1e3 * ss:>9.3f} {1e3 * (ss - es):>+10.3f}{flag}")
    print(f"{'phase':<28} {'':>9} {'':>9} {'eng ms':>9} {'sim ms':>9}")
    for p in sorted(set(ot["phases"]) | set(phases)):
        es = ot["phases"].get(p, {}).get("predicted_total_s", 0.0) * per
        print(f"{p:<28} {'':>9} {'':>9} {1e3 * es:>9.3f} {1e3 * phases.get(p, 0.0):>9.3f} {1e3 * (phases.get(p, 0.0) - es):>+10.3f}")
    et = sum(s for _, s in eng.values())
    st = sum(s for _, s in kinds.values())
    print(f"{'total':<28} {'':>9} {'':>9} {1e3 * et:>9.3f} {1e3 * st:>9.3f} {1e3 * (st - et):>+10.3f} "
          f"({100 * (st - et) / et:+.2f}%)")


if __name__ == "__main__":
    main()
