#!/usr/bin/env bash
# The time model against a real training step ("report the time model's
# error against measured op and step times"; goal: mean error <= 1.5%).
# Each config trains STEPS steps under `mpirun -np 2` with one thread per rank and
# `--profile-ops`: every backend op of every step is timed (thread CPU and wall) and
# priced by the cost model from the hardware profile (HARDWARE_PROFILE, default
# data/hardware/this-machine.json) at the same shapes. Prints, per config, the op
# kinds (count, median measured and predicted, mean |error| per op, net error of
# the kind's total) and the headline figures; the first step of each run is left
# out (cold caches, page faults). Results stay in OUT (op_times.json per run).
#   op error   = sum |predicted - measured| / sum measured, over every op (thread CPU time,
#                the clock calibrate measures with one thread)
#   step error = mean over steps and ranks of |predicted - measured| / measured, the
#                prediction being the sum of the step's op predictions, measured the
#                step's wall time (forward, backward, gradient reduction, clipping, AdamW)
#   step error (ops) = the same against the sum of the step's measured op times: what
#                the op model alone gets wrong, without the time spent outside ops
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moeflex}
STEPS=${STEPS:-6}
OUT=${OUT:-$(mktemp -d)}
PROFILE=${HARDWARE_PROFILE:-data/hardware/this-machine.json}
mkdir -p "$OUT"
CFG=bench/sim_check.toml
echo "time_model: $STEPS steps per config, $CFG, profile $PROFILE, results in $OUT (load: $(cut -d' ' -f1-3 /proc/loadavg))"
# name | train flags
CONFIGS=("dp2|--dp 2" "dp2-ep2|--ep 2" "pp2-1f1b|--pp 2")
for c in "${CONFIGS[@]}"; do
  IFS='|' read -r name flags <<< "$c"
  rm -rf "${OUT:?}/$name"
  # shellcheck disable=SC2086
  mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$BIN" train --config "$CFG" \
    --steps "$STEPS" --threads 1 $flags --profile-ops --hardware-profile "$PROFILE" --out "$OUT/$name" --quiet \
    > "$OUT/$name.train.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.train.log"; exit 1; }
done
/usr/bin/python3 bench/time_model_report.py "$OUT" "${CONFIGS[@]%%|*}"
