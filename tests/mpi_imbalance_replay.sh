#!/usr/bin/env bash
# `--inject-imbalance replay=RUN` end to end, 2 ranks with --ep 2 and 2 micro-batches
# per step. A recording with a rotating hot EP rank (every rank and micro-batch met
# the same shares, so they are whole numbers of rows) is replayed row for row: each
# step's ep_received_tokens equals the recorded received rows of the step it replays
# (wrapping around: 5 steps over 4 recorded), and injected_imbalance is the recorded
# step's largest share times 2. A naturally routed recording is replayed within the
# rounding of share x rows: every rank and micro-batch routes n k = 2048 assignments,
# so each rounds the same x = received / 4 the same way, and with 2 groups the rest
# (a quarter or a half) is off by at most a half: 4 x 1/2 = 2 rows per EP rank.
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd "$src"
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
args=(train --ep 2 --grad-accum 2 --data "$src/data/brown" --quiet)
"${mpi[@]}" "$bin" "${args[@]}" --steps 4 --inject-imbalance every=1:ratio=1.8:hot=1:rotate=1 --out "$out/hot"
"${mpi[@]}" "$bin" "${args[@]}" --steps 5 --inject-imbalance "replay=$out/hot" --out "$out/hot-replay"
"${mpi[@]}" "$bin" "${args[@]}" --steps 2 --out "$out/natural"
"${mpi[@]}" "$bin" "${args[@]}" --steps 2 --inject-imbalance "replay=$out/natural/loads.jsonl" --out "$out/natural-replay"
/usr/bin/python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
lines = lambda path: [json.loads(l) for l in open(path)]

def recorded(run):
    """Per recorded step, per MoE layer: the rows each EP rank received, summed over micro-batches."""
    steps = []
    for rec in lines(f"{out}/{run}/loads.jsonl"):
        assert rec["ep"] == 2 and rec["dp"] == 2 and rec["microbatches"] == 2, rec
        steps.append([[sum(mb[q] for mb in layer) for q in range(2)] for layer in rec["received"]])
    return steps

def check(run, replay, tolerance):
    rec, got = recorded(run), lines(f"{out}/{replay}/metrics.jsonl")
    worst = 0
    for d in got:
        want = rec[(d["step"] - 1) % len(rec)]
        assert len(d["ep_received_tokens"]) == len(want), (d["step"], d["ep_received_tokens"], want)
        for layer_got, layer_want in zip(d["ep_received_tokens"], want):
            assert sum(layer_got) == sum(layer_want), (d["step"], layer_got, layer_want)
            worst = max(worst, max(abs(a - b) for a, b in zip(layer_got, layer_want)))
        injected = max(max(x) * 2 / sum(x) for x in want)
        assert abs(d["injected_imbalance"] - injected) < 1e-12, (d["step"], d["injected_imbalance"], injected)
    assert worst <= tolerance, (replay, "off by", worst, "rows, more than", tolerance)
    return len(got), worst

hot = lines(f"{out}/hot/metrics.jsonl")
assert [d["ep_received_tokens"] for d in hot] == recorded("hot"), "metrics.jsonl and loads.jsonl disagree"
assert len({max(range(2), key=lambda q: d["ep_received_tokens"][0][q]) for d in hot}) == 2, "the hot rank never moved"
n, worst = check("hot", "hot-replay", 0)
print(f"replay of a rotating hot rank: {n} steps, exact (off by {worst} rows)")
n, worst = check("natural", "natural-replay", 2)
print(f"replay of natural routing: {n} steps, off by at most {worst} rows per EP rank")
PY
