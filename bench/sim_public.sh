#!/usr/bin/env bash
# moeflex's predictions for the public MoE training figures of docs/simulator.md
# ("Public figures"): each layout simulated on the h100 preset with calm expert loads
# (every iteration balanced) and the policy named; prints MFU and model TFLOP/s per
# GPU (MFU x the preset's peak).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moeflex}
OUT=${OUT:-$(mktemp -d)}  # each run's summary.json goes to $OUT/runN
mkdir -p "$OUT"
peak=$(/usr/bin/python3 -c "import json; print(json.load(open('configs/clusters/h100.json'))['device']['peak_flops'])")
# name | model | --parallel | schedule | global batch | seq | policy | dispatcher (the public run's)
RUNS=(
  "Mixtral 8x7B, 64 H100, TP1 PP4 VPP8 EP8|mixtral-8x7b|tp=1,pp=4,vpp=8,ep=8,dp=16|interleaved|256|4096|none|alltoall"
  "DeepSeek-V3, 1024 H100, TP2 PP8 VPP4 EP64|deepseek-v3|tp=2,pp=8,vpp=4,ep=64,dp=64|interleaved|1024|4096|adaptive|alltoall"
  "Qwen3-235B-A22B, 256 H100, TP4 PP8 VPP4 EP8|qwen3-235b-a22b|tp=4,pp=8,vpp=4,ep=8,dp=8|interleaved|2048|4096|none|deepep"
  "Qwen3-235B-A22B, 256 H100, TP2 PP8 VPP4 EP32|qwen3-235b-a22b|tp=2,pp=8,vpp=4,ep=32,dp=16|interleaved|2048|4096|moe-light|deepep"
  "Qwen3-235B-A22B, 256 H100, TP2 PP8 VPP4 EP32 +1f1b overlap|qwen3-235b-a22b|tp=2,pp=8,vpp=4,ep=32,dp=16|1f1b-overlap|2048|4096|moe-light|deepep"
  "Qwen3-235B-A22B, 256 H100, TP2 PP32 VPP3 EP8|qwen3-235b-a22b|tp=2,pp=32,vpp=3,ep=8,dp=4|interleaved|2048|4096|moe-light|alltoall"
)
printf "%-58s %8s %12s %9s %9s %9s %9s\n" "run" "MFU" "TFLOP/s/GPU" "step s" "dispatch" "peak GiB" "limit GiB"
i=0
for r in "${RUNS[@]}"; do
  IFS='|' read -r name model par sched gb seq pol disp <<< "$r"
  "$BIN" simulate --model "$model" --cluster h100 --parallel "$par" --schedule "$sched" --global-batch "$gb" \
    --seq-len "$seq" --policy "$pol" --dispatcher "$disp" --imbalance calm=1.0:spike=1.0:p=0 --out "$OUT/run$i" > "$OUT/run$i.log"
  /usr/bin/python3 - "$OUT/run$i/summary.json" "$peak" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
oom = "  (over: out of memory in the simulator)" if s["ooms"] > 0 else ""
print(f"{sys.argv[3]:<58} {100 * s['mfu']:7.1f}% {s['mfu'] * float(sys.argv[2]) / 1e12:12.0f} {s['step_time_s']:9.2f} "
      f"{s['dispatcher']:>9} {s['peak_bytes'] / 2**30:9.1f} {s['memory_limit_bytes'] / 2**30:9.1f}{oom}")
PY
  i=$((i + 1))
done
