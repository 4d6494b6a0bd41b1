#!/usr/bin/env bash
# Provisioning policies under routing spikes (issue 4's benchmark, first version):
# the default model on 2 ranks with expert parallelism, a 2x spike injected every
# 4th step, and a 250 MiB device budget that calm steps fit and spikes do not.
# Prints policy -> OOM, steps, tokens/s (median step), peak, recomputed per step;
# `none` without a budget is the speed reference. Writes the memory plot to
# bench/results/memory-policies.png.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-16}
BUDGET=${BUDGET:-250MiB}
BIN=${BIN:-build/moeflex}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
common=(train --ep 2 --steps "$STEPS" --inject-imbalance every=4:ratio=2.0 --threads 1 --quiet)
echo "policies: 2 ranks, --ep 2, $STEPS steps, spike 2.0x every 4th step, budget $BUDGET (load: $(cut -d' ' -f1-3 /proc/loadavg))"
"${mpi[@]}" "$BIN" "${common[@]}" --policy none --out "$tmp/none-unbudgeted" > /dev/null 2>&1 || true
for p in none full moe-full threshold adaptive; do
  "${mpi[@]}" "$BIN" "${common[@]}" --policy "$p" --device-memory "$BUDGET" --out "$tmp/$p" > "$tmp/$p.log" 2>&1 || true
done
/usr/bin/python3 - "$tmp" <<'PY'
import json, os, statistics, sys
tmp = sys.argv[1]
runs = ["none-unbudgeted", "none", "full", "moe-full", "threshold", "adaptive"]
ref = None
print(f"{'policy':<16} {'OOM':>4} {'steps':>6} {'tokens/s':>9} {'vs none':>8} {'peak MiB':>9} {'recomputed MiB/step':>20}")
for r in runs:
    path = f"{tmp}/{r}/metrics.jsonl"
    lines = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    oom = 0
    log = f"{tmp}/{r}.log"
    if os.path.exists(log) and "device out of memory" in open(log).read():
        oom = 1
    tps = statistics.median(l["tokens_per_second"] for l in lines[1:]) if len(lines) > 1 else 0.0
    if r == "none-unbudgeted":
        ref = tps
    peak = max((l["peak_device_bytes"] for l in lines), default=0) / 2**20
    rec = statistics.mean(l["bytes_recomputed"] for l in lines) / 2**20 if lines else 0.0
    rel = f"{tps / ref:.2f}x" if ref else "-"
    print(f"{r:<16} {oom:>4} {len(lines):>6} {tps:>9.0f} {rel:>8} {peak:>9.1f} {rec:>20.1f}")
PY
mkdir -p bench/results
/usr/bin/python3 bench/plot_memory.py "$tmp/none" "$tmp/full" "$tmp/adaptive" "$tmp/threshold" \
  --out bench/results/memory-policies.png --title "Device memory per step, budget $BUDGET, 2x spikes every 4th step" \
  > /dev/null 2>&1 && echo "plot: bench/results/memory-policies.png"
