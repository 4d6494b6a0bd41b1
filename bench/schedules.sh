#!/usr/bin/env bash
# Pipeline schedules on NP CPU ranks (default 4, oversubscribed on small machines):
# measured bubble fraction (share of the forward/backward phase a rank is not
# computing, mean over ranks, median over steps) and tokens/s, per schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
STEPS=${STEPS:-8}
BIN=${BIN:-build/moeflex}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
MPI=(mpirun --allow-run-as-root --oversubscribe -np "$NP" -x OMP_NUM_THREADS=1)
echo "schedules: $NP ranks (pp $NP), $STEPS steps each, bench/schedules.toml (load: $(cut -d' ' -f1-3 /proc/loadavg))"
for sched in gpipe 1f1b interleaved 1f1b-overlap zb-h1 dualpipev; do
  vpp=1
  [[ $sched == interleaved || $sched == 1f1b-overlap || $sched == dualpipev ]] && vpp=2
  "${MPI[@]}" "$BIN" train --config bench/schedules.toml --steps "$STEPS" --pp "$NP" --vpp "$vpp" \
    --schedule "$sched" --threads 1 --out "$tmp/$sched" --quiet > /dev/null
done
/usr/bin/python3 - "$tmp" "$NP" <<'PY'
import json, statistics, sys
tmp, p = sys.argv[1], int(sys.argv[2])
print(f"{'schedule':<12} {'bubble':>7} {'(1F1B formula (p-1)/(m+p-1))':>30} {'tokens/s':>9} {'peak MiB':>9}")
m = 8
for s in ["gpipe", "1f1b", "interleaved", "1f1b-overlap", "zb-h1", "dualpipev"]:
    L = [json.loads(l) for l in open(f"{tmp}/{s}/metrics.jsonl")][1:]
    b = statistics.median(x["bubble_fraction"] for x in L)
    t = statistics.median(x["tokens_per_second"] for x in L)
    pk = max(x["peak_device_bytes"] for x in L) / 2**20
    print(f"{s:<12} {b:>7.3f} {(p-1)/(m+p-1):>30.3f} {t:>9.0f} {pk:>9.1f}")
PY
