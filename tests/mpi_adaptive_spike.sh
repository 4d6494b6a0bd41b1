#!/usr/bin/env bash
# The point of moeflex, end to end: 2 ranks with expert parallelism, an injected
# 2x routing spike on step 4, and a device budget (250 MiB) that the calm steps fit
# but the spike does not. The static `none` policy must die of OOM (exit 3); the
# adaptive planner must finish under the budget with the same losses as an
# unbudgeted run.
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
grep -q "device out of memory" "$out/none.log" || { cat "$out/none.log"; exit 1; }
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
