#!/usr/bin/env bash
# Slow-rank detection: the default model (CONFIG to change it) on NP ranks with
# expert parallelism trains STEPS steps, calm and with rank 1's PHASE made 1.1x,
# 1.3x and 2x slower from step FROM. Prints, per run, what summary.json's
# slow_ranks names, the detection latency in steps (the step the windowed score
# crossed the threshold for good, minus FROM; the note and metrics.jsonl carry it
# at the next exchange, at most slow_rank_every - 1 steps later), and the
# tokens/s of the calm run with detection on against off (medians of ROUNDS
# alternating pairs: the phase clock's and the exchanges' cost).
#   bash bench/slow_rank.sh          # NP=2 STEPS=40 FROM=11 PHASE=forward ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-build/moeflex}
np=${NP:-2}
steps=${STEPS:-40}
from=${FROM:-11}
phase=${PHASE:-forward}
rounds=${ROUNDS:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
config=()
[[ -n ${CONFIG:-} ]] && config=(--config "$CONFIG")
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$np" -x OMP_NUM_THREADS=1)
train() {  # NAME ARGS...
  local name=$1
  shift
  "${mpi[@]}" "$bin" train "${config[@]}" --ep "$np" --steps "$steps" --checkpoint-every 0 --quiet \
    --out "$out/$name" "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  train "on-$r"
  train "off-$r" --slow-rank-every 0
done
for f in 1.1 1.3 2; do train "x$f" --inject-slowdown "rank=1:phase=$phase:factor=$f:from=$from"; done
/usr/bin/python3 - "$out" "$rounds" "$from" "$phase" "$np" "$steps" <<'PY'
import json, statistics, sys
out, rounds, start, phase, np_, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
def s(name):
    return json.load(open(f"{out}/{name}/summary.json"))
def named(reports):
    return ", ".join("%d %s %.2f" % (x["rank"], x["phase"], x["factor"]) for x in reports) or "nobody"
print(f"slow-rank detection: {np_} ranks (--ep {np_}), {steps} steps, rank 1's {phase} slowed from step {start}")
print(f"{'run':10} {'named (rank phase factor)':34} {'latency (steps)':>15}")
for r in range(1, rounds + 1):
    got = s(f"on-{r}")["slow_ranks"]
    print(f"{'calm ' + str(r):10} {named(got):34} {'':>15}")
for f in ("1.1", "1.3", "2"):
    got = s(f"x{f}")["slow_ranks"]
    hit = [x for x in got if x["rank"] == 1 and x["phase"] == phase]
    lat = str(hit[0]["report_step"] - start) if hit else "-"
    print(f"{f + 'x':10} {named(got):34} {lat:>15}")
on = [s(f"on-{r}")["tokens_per_second"] for r in range(1, rounds + 1)]
off = [s(f"off-{r}")["tokens_per_second"] for r in range(1, rounds + 1)]
print(f"tokens/s calm, detection on {statistics.median(on):.0f}, off {statistics.median(off):.0f}: "
      f"{statistics.median(on) / statistics.median(off):.3f}x")
PY
