#!/usr/bin/env bash
# `moeflex train` under mpirun: 4 ranks, pp 2 x dp 2 with experts over 2 ranks,
# then a resume of the same run (after a refused resume on 1 process); checks the
# run directory rank 0 wrote.
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpi=(mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1)
cd "$src"
"${mpi[@]}" "$bin" train --config tests/configs/tiny.toml --pp 2 --ep 2 --schedule zb-h1 --stop-after 2 \
  --out "$out/run" --quiet
# Resuming on another number of ranks is refused, naming the right one, and
# leaves the run as it was.
set +e
"$bin" train --resume "$out/run" --quiet > "$out/wrong-ranks.log" 2>&1
rc=$?
set -e
[[ $rc -eq 2 ]] && grep -q "trained on 4 ranks, not 1; resume it with mpirun -np 4" "$out/wrong-ranks.log" ||
  { echo "a 4-rank run resumed on 1 process: rc $rc"; cat "$out/wrong-ranks.log"; exit 1; }
# Without --threads or OMP_NUM_THREADS, the ranks share the node's cores (4 ranks
# each taking every core would wait on each other's descheduled threads).
env -u OMP_NUM_THREADS mpirun --allow-run-as-root --oversubscribe -np 4 "$bin" train --resume "$out/run" \
  > "$out/resume.log" 2>&1 || { cat "$out/resume.log"; exit 1; }
grep -q "4 ranks on this node of [0-9]* cores: [0-9]* thread" "$out/resume.log" ||
  { echo "no thread split note"; cat "$out/resume.log"; exit 1; }
# With fewer cores than 4 ranks x 1 thread, waiting ranks nap instead of yielding
# (comm::host_oversubscribed), and the run says so; with enough cores it does not.
cores=$(getconf _NPROCESSORS_ONLN)
if ((cores < 4)); then
  grep -q "4 threads on this node's $cores cores (ranks x threads): waiting ranks sleep" "$out/resume.log" ||
    { echo "no oversubscription note on $cores cores"; cat "$out/resume.log"; exit 1; }
elif grep -q "waiting ranks sleep" "$out/resume.log"; then
  echo "an oversubscription note on $cores cores"; cat "$out/resume.log"; exit 1
fi
# OpenBLAS's generic SSE3 kernels ("Prescott", its choice for a CPU model it does not
# know) are replaced by the ones the CPU runs: rank 0 alone says so, once.
if [[ -z "${OPENBLAS_CORETYPE:-}" ]] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  backend=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["blas_core"])' "$out/run/summary.json")
  [[ $backend != *Prescott* ]] || { echo "a CPU with AVX2 trained on OpenBLAS's SSE3 kernels: $backend"; exit 1; }
  n=$(grep -c "restarting with OPENBLAS_CORETYPE" "$out/resume.log" || true)
  ((n <= 1)) || { echo "the BLAS restart note came $n times"; cat "$out/resume.log"; exit 1; }
  # what computes nothing does not restart (checked where the training restarted)
  if ((n == 1)); then
    for args in "train --help" "calibrate -h" "calibrate --from-run $out/run --out $out/in-situ.json"; do
      # shellcheck disable=SC2086
      note=$("$bin" $args 2>&1 >/dev/null | grep "restarting with OPENBLAS_CORETYPE" || true)
      [[ -z $note ]] || { echo "moeflex $args restarted for BLAS kernels: $note"; exit 1; }
    done
  fi
fi
# A spike past what the experts allow is capped with a warning, --quiet or not.
capped=$("$bin" train --config tests/configs/tiny.toml --steps 1 --quiet --inject-imbalance every=1:ratio=100 \
  --out "$out/capped" 2>&1) || { echo "$capped"; exit 1; }
[[ $capped == *"warning: --inject-imbalance: ratio 100 is above the most 4 groups of experts allow"* ]] ||
  { echo "no warning for an unreachable --inject-imbalance ratio: $capped"; exit 1; }
# generate gathers the stages and expert shards of every rank's checkpoint
text=$("$bin" generate --run "$out/run" --prompt "The jury" --max-new-tokens 8 --temperature 0)
[[ $text == "The jury"* ]] || { echo "generate failed: $text"; exit 1; }
# It reads every rank at the newest step all of them hold, never a mix of steps (rank
# 1 lost its step 4 here, and rank 0's step 4, damaged, must not be read at all) ...
cp -a "$out/run" "$out/mixed"
rm -rf "$out/mixed/rank00001/checkpoints/step_00000004"
printf 'XXXXXXXX' | dd of="$out/mixed/rank00000/checkpoints/step_00000004/model.safetensors" bs=1 seek=0 conv=notrunc 2>/dev/null
"$bin" generate --run "$out/mixed" --prompt "The jury" --max-new-tokens 4 --temperature 0 > "$out/mixed.log" 2>&1 ||
  { echo "generate did not fall back to the step every rank holds"; cat "$out/mixed.log"; exit 1; }
# ... and checks each shard's checksum: a damaged tensor is refused, not sampled from.
cp -a "$out/run" "$out/damaged"
f="$out/damaged/rank00001/checkpoints/step_00000004/model.safetensors"
printf '\xff\xff\xff\xff' | dd of="$f" bs=1 seek=$(($(stat -c %s "$f") - 64)) conv=notrunc 2>/dev/null
set +e
"$bin" generate --run "$out/damaged" --prompt "The jury" --max-new-tokens 4 --temperature 0 > "$out/damaged.log" 2>&1
rc=$?
set -e
[[ $rc -ne 0 ]] && grep -q "is corrupted: its SHA-256" "$out/damaged.log" ||
  { echo "generate sampled from a damaged shard: rc $rc"; cat "$out/damaged.log"; exit 1; }
# --init-from: a run on pre-tokenized data, exported, is the start of runs under EP 2
# and PP 2, each rank reading its stages and expert shard: before step 1 they
# evaluate what the exported run did after its last step (to 1e-6: EP sums the
# evaluation's experts in another order).
data=tests/reference/megatron_uint16
"$bin" train --config tests/configs/qwen3-tiny.toml --data "$data" --steps 8 --out "$out/src" --quiet
"$bin" export-hf --run "$out/src" --out "$out/hf" > /dev/null
val() { /usr/bin/python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$1/summary.json" "$2"; }
want=$(val "$out/src" final_val_loss)
/usr/bin/python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) < 1e-2)' "$want" \
  "$(val "$out/src" initial_val_loss)" || { echo "the exported run learned too little to tell a start from it"; exit 1; }
for layout in "--ep 2" "--pp 2"; do
  # shellcheck disable=SC2086
  mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$bin" train --config tests/configs/qwen3-tiny.toml \
    --init-from "$out/hf" --data "$data" --steps 1 $layout --out "$out/init${layout// /}" --quiet
  got=$(val "$out/init${layout// /}" initial_val_loss)
  /usr/bin/python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1e-6 * abs(b))' "$got" "$want" ||
    { echo "--init-from under $layout starts at val loss $got, not $want"; exit 1; }
done
/usr/bin/python3 - "$out/run" <<'PY'
import json, sys
run = sys.argv[1]
s = json.load(open(f"{run}/summary.json"))
lines = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
assert s["steps"] == 4, s["steps"]
assert s["layout"] == {"pp": 2, "dp": 2, "ep": 2, "vpp": 1}, s["layout"]
assert len(s["peak_device_bytes_per_rank"]) == 4
assert s["peak_device_bytes"] == max(s["peak_device_bytes_per_rank"]), s
assert [l["step"] for l in lines] == [1, 2, 3, 4], [l["step"] for l in lines]
assert all(len(l["ep_received_tokens"]) > 0 and l["ep_imbalance"] >= 1.0 for l in lines)
t = json.load(open(f"{run}/trace.json"))["traceEvents"]
assert {e["pid"] for e in t} == {0, 1, 2, 3}, "trace.json must merge the 4 ranks"
names = sorted((e["pid"], e["args"]["name"]) for e in t if e["ph"] == "M" and e["name"] == "process_name")
assert names == [(r, f"rank {r}") for r in range(4)], names  # each rank named once
assert any(e["ph"] == "X" and e["name"].startswith("Bi(") for e in t)
assert any(e["ph"] == "C" and e["name"] == "device memory" for e in t)
# Each traced step's tail on every rank: the gradient and loss reductions, then the
# optimizer (clipping and AdamW), then the step's statistics, one after the other.
for pid in range(4):
    tail = sorted((e["ts"], e["name"], e["dur"]) for e in t if e["ph"] == "X" and e["pid"] == pid
                  and e["name"] in ("dp all-reduce", "optimizer", "step stats"))
    names = [n for _, n, _ in tail]
    assert len(names) > 0 and names == ["dp all-reduce", "optimizer", "step stats"] * (len(names) // 3), names
    for (t0, _, d0), (t1, _, _) in zip(tail, tail[1:]):
        assert t1 >= t0 + d0 - 1e-3, (pid, tail)
    last_compute = max(e["ts"] + e["dur"] for e in t if e["ph"] == "X" and e["pid"] == pid
                       and e["name"][:2] in ("F(", "B(", "Bi", "W(") and e["ts"] < tail[0][0])
    assert tail[0][0] >= last_compute - 1e-3, (pid, tail[0], last_compute)
print("mpi_train_smoke: ok", s["final_val_loss"])
PY
