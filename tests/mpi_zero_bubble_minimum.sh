#!/usr/bin/env bash
# The zero-bubble schedules at exactly their minimum budget (in bytes, as the
# refusal names it): the adaptive planner's minimum carries no margin but the
# placement reserve, so the arena must absorb every fragmentation. What queued weight-gradient work (W)
# reads stays held from B to W across other micro-batches' F and B; pinned, those
# blocks split the free bytes and these runs died of OOM with the free bytes
# covering the request (zb-h1: 'attn.dprobs' asked 512 KiB with 512 KiB free,
# largest block 475 KiB). The arena now moves and evicts them (MoEModel's W queue
# is a compaction source), and the planner offloads them layer by layer when the
# budget needs it. A small model, whose single transients are a large
# part of the budget; 2 ranks (zb-h1 fp32 and bf16, dualpipev) and 4 ranks
# (pp 2 x ep 2, zb-h1, 2x routing spikes).
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd "$src"
cfg="$out/small.toml"
printf '[model]\nvocab_size = 2048\nhidden_size = 128\nmoe_intermediate_size = 192\n[train]\neval_batches = 1\ncheckpoint_every = 0\nkeep_checkpoints = 1\nmicro_batch_size = 2\ngrad_accum = 4\neval_every = 0\n' > "$cfg"

# run_at_minimum NAME NP ARGS...: probes the minimum, trains 2 steps at exactly it.
run_at_minimum() {
  local name=$1 np=$2
  shift 2
  local mpi=(mpirun --allow-run-as-root --oversubscribe -np "$np" -x OMP_NUM_THREADS=1)
  local min="" probe
  for probe in 16MiB 24MiB 26MiB 28MiB 29MiB 30MiB 31MiB 32MiB; do  # under the minimum, above the model state
    set +e
    "${mpi[@]}" "$bin" train --config "$cfg" "$@" --steps 1 --device-memory "$probe" --out "$out/probe-$name" \
      > "$out/probe-$name.log" 2>&1
    set -e
    min=$(sed -n 's/.*can guarantee no out-of-memory error: [0-9.]* MiB (\([0-9]*\) B.*/\1/p' "$out/probe-$name.log" | head -1)
    [[ -n "$min" ]] && break
    rm -rf "$out/probe-$name"
  done
  [[ -n "$min" ]] || { echo "$name: no minimum named"; cat "$out/probe-$name.log"; exit 1; }
  "${mpi[@]}" "$bin" train --config "$cfg" "$@" --steps 2 --device-memory "${min}B" --out "$out/$name" --quiet \
    > "$out/$name.log" 2>&1 || { echo "$name: failed at its minimum of $min B"; cat "$out/$name.log"; exit 1; }
  /usr/bin/python3 - "$out/$name" "$min" <<'PY'
import json, sys
run, budget = sys.argv[1], int(sys.argv[2])
s = json.load(open(f"{run}/summary.json"))
assert s["oom_count"] == 0 and s["steps"] == 2, s
assert s["peak_device_bytes"] <= budget, (s["peak_device_bytes"], budget)
for d in map(json.loads, open(f"{run}/metrics.jsonl")):
    assert d["infeasible_decisions"] == 0, d
    assert d["peak_device_bytes"] <= d["predicted_peak_bytes"] <= budget, d
# (At the minimum the planner offloads the W queue's reads, so defragmentation may not be needed.)
print(run.split("/")[-1], budget, "B ok at the minimum: compactions", s["arena_compactions"], "stitched",
      s["bytes_stitched"], "evicted", s["bytes_evicted"] / 2**20, "MiB")
PY
}

run_at_minimum zb-h1 2 --pp 2 --schedule zb-h1
run_at_minimum zb-h1-bf16 2 --pp 2 --schedule zb-h1 --bf16
run_at_minimum dualpipev 2 --pp 2 --schedule dualpipev
run_at_minimum zb-h1-ep 4 --pp 2 --ep 2 --schedule zb-h1 --inject-imbalance every=2:ratio=2
