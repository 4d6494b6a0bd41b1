#!/usr/bin/env bash
# The point of moeflex, end to end: 2 ranks with expert parallelism, an injected
# 2x routing spike on step 4, and a device budget (250 MiB) that the calm steps fit
# but the spike does not. The static `none` policy must die of OOM (exit 3); the
# adaptive planner must finish under the budget with the same losses as an
# unbudgeted run. Then pipelines just above their minimum (exact predictions), and a
# fragmentation case on 4 ranks (the arena compacts and evicts instead of failing).
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd "$src"
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
args=(train --ep 2 --steps 5 --inject-imbalance every=4:ratio=2.0 --quiet)
"${mpi[@]}" "$bin" "${args[@]}" --out "$out/free" > /dev/null
set +e
"${mpi[@]}" "$bin" "${args[@]}" --device-memory 250MiB --policy none --out "$out/none" > "$out/none.log" 2>&1
rc=$?
set -e
[[ $rc -ne 0 ]] || { echo "expected policy none to run out of memory on the spike"; exit 1; }
grep -q "step 4 of 5 ran out of device memory: device out of memory" "$out/none.log" || { cat "$out/none.log"; exit 1; }  # the spike's step, named
"${mpi[@]}" "$bin" "${args[@]}" --device-memory 250MiB --policy adaptive --out "$out/adaptive" > /dev/null
/usr/bin/python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
free = [json.loads(l) for l in open(f"{out}/free/metrics.jsonl")]
ada = [json.loads(l) for l in open(f"{out}/adaptive/metrics.jsonl")]
s = json.load(open(f"{out}/adaptive/summary.json"))
assert s["oom_count"] == 0 and s["steps"] == 5
assert s["peak_device_bytes"] <= 250 * 2**20, s["peak_device_bytes"]
assert [x["loss"] for x in ada] == [x["loss"] for x in free], "adaptive must not change the maths"
assert ada[3]["injected_imbalance"] == 2.0 and ada[3]["bytes_recomputed"] > 0
print("adaptive: ok, peak", s["peak_device_bytes"] / 2**20, "MiB, recomputed", s["bytes_recomputed"] / 2**20, "MiB")
PY

# Pipelines: the planner's projection walks the rank's schedule (warm-up micro-
# batches, pipeline buffers, the zero-bubble W queue, several chunks per rank with
# offloads). Just above the minimum it refuses nothing, every decision keeps a
# feasible completion, and each step's predicted peak is the measured one.
cfg="$out/pp.toml"
printf '[train]\ngrad_accum = 4\nmicro_batch_size = 2\neval_every = 0\neval_batches = 1\n' > "$cfg"
for sched in "zb-h1" "dualpipev --vpp 2"; do
  name=${sched%% *}
  min=""
  for probe in 120 110 100 90 80 70 60; do  # downwards until one is under the minimum
    rm -rf "$out/min-$name"
    set +e
    "${mpi[@]}" "$bin" train --config "$cfg" --pp 2 --schedule $sched --steps 1 --device-memory ${probe}MiB \
      --out "$out/min-$name" > "$out/min-$name.log" 2>&1
    set -e
    min=$(sed -n 's/.*smallest budget for which adaptive provisioning can guarantee no out-of-memory error: \([0-9.]*\) MiB.*/\1/p' \
          "$out/min-$name.log" | head -1)
    [[ -n "$min" ]] && break
  done
  [[ -n "$min" ]] || { echo "no minimum named for $sched"; cat "$out/min-$name.log"; exit 1; }
  budget=$(/usr/bin/python3 -c "print(f'{$min + 1:.2f}MiB')")
  "${mpi[@]}" "$bin" train --config "$cfg" --pp 2 --schedule $sched --steps 3 --inject-imbalance every=2:ratio=2 \
    --device-memory "$budget" --out "$out/pp-$name" --quiet > /dev/null
  /usr/bin/python3 - "$out/pp-$name" "$budget" <<'PY'
import json, sys
run, budget = sys.argv[1], sys.argv[2]
lines = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
assert len(lines) == 3, lines
for d in lines:
    assert d["infeasible_decisions"] == 0, d
    # Exact, except where the arena evicted the zero-bubble W queue's reads to the
    # host to defragment: those bytes were off the device at the walk's peak.
    if d["bytes_evicted"] == 0:
        assert d["predicted_peak_bytes"] == d["peak_device_bytes"], (d["step"], d["predicted_peak_bytes"], d["peak_device_bytes"])
    else:
        assert d["peak_device_bytes"] <= d["predicted_peak_bytes"], d
    assert d["peak_device_bytes"] <= float(budget[:-3]) * 2**20, d
print(run.split("/")[-1], budget, "ok: predicted = measured on every step without eviction",
      f"({sum(d['bytes_evicted'] > 0 for d in lines)} of {len(lines)} evicted), no infeasible decision")
PY
  # At the minimum itself: no OOM, no
  # infeasible decision, the budget holds; fragmentation is the arena's to absorb.
  budget=$(/usr/bin/python3 -c "print(f'{$min + 0.01:.2f}MiB')")
  "${mpi[@]}" "$bin" train --config "$cfg" --pp 2 --schedule $sched --steps 2 --inject-imbalance every=2:ratio=2 \
    --device-memory "$budget" --out "$out/ppmin-$name" --quiet > /dev/null
  /usr/bin/python3 - "$out/ppmin-$name" "$budget" <<'PY'
import json, sys
run, budget = sys.argv[1], sys.argv[2]
s = json.load(open(f"{run}/summary.json"))
assert s["oom_count"] == 0 and s["steps"] == 2, s
for d in map(json.loads, open(f"{run}/metrics.jsonl")):
    assert d["infeasible_decisions"] == 0, d
    assert d["peak_device_bytes"] <= d["predicted_peak_bytes"] <= float(budget[:-3]) * 2**20, d
print(run.split("/")[-1], budget, "ok at the minimum: no OOM, peak", s["peak_device_bytes"] / 2**20, "MiB")
PY
done

# Fragmentation: a small model on 4 ranks (pp 2 x ep 2) just above its minimum,
# where single expert transients are several percent of the budget. Blocks the
# running operator holds split the free bytes; the arena compacts the stash's
# tensors and evicts some to the host when needed (Arena::make_room), so the run
# never fails on fragmentation, and the budget holds.
frag="$out/frag.toml"
printf '[model]\nhidden_size = 128\nnum_attention_heads = 2\nmoe_intermediate_size = 256\nintermediate_size = 512\n[train]\ngrad_accum = 4\neval_every = 0\neval_batches = 1\n' > "$frag"
mpi4=(mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1)
set +e
"${mpi4[@]}" "$bin" train --config "$frag" --pp 2 --ep 2 --steps 1 --device-memory 30MiB --out "$out/frag-min" \
  > "$out/frag-min.log" 2>&1
set -e
min=$(sed -n 's/.*smallest budget for which adaptive provisioning can guarantee no out-of-memory error: \([0-9.]*\) MiB.*/\1/p' \
      "$out/frag-min.log" | head -1)
[[ -n "$min" ]] || { echo "no minimum named for the fragmentation run"; cat "$out/frag-min.log"; exit 1; }
budget=$(/usr/bin/python3 -c "print(f'{$min * 1.05:.2f}MiB')")
"${mpi4[@]}" "$bin" train --config "$frag" --pp 2 --ep 2 --steps 6 --device-memory "$budget" --out "$out/frag" --quiet \
  > "$out/frag.log" 2>&1 || { cat "$out/frag.log"; exit 1; }
/usr/bin/python3 - "$out/frag" "$budget" <<'PY'
import json, sys
run, budget = sys.argv[1], sys.argv[2]
s = json.load(open(f"{run}/summary.json"))
assert s["oom_count"] == 0 and s["steps"] == 6, s
assert s["peak_device_bytes"] <= float(budget[:-3]) * 2**20, s
assert s["arena_compactions"] > 0, "the run must have needed defragmentation to test it"
print("fragmentation", budget, "ok: compactions", s["arena_compactions"], "moved", s["bytes_compacted"] / 2**20,
      "MiB, evicted", s["bytes_evicted"] / 2**20, "MiB")
PY
