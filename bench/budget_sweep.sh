#!/usr/bin/env bash
# Adaptive provisioning against every static policy that fits, from the printed
# minimum budget to the unbudgeted peak: the default model at EP 2 on 2 ranks (and
# PP 2 x EP 2, 1F1B, on 4 ranks with LAYOUTS=ep2,pp2ep2), a 2x routing spike every 4th
# step (--inject-imbalance every=4:ratio=2, the most EP 2 allows with top-2 of 8),
# budgets in POINTS equal steps from the minimum to the unbudgeted `none` run's peak.
# At each budget: adaptive, every static policy whose unbudgeted peak fits, and the
# unbudgeted reference, alternately, ROUNDS times; each run's tokens/s over its steps
# after the first. Prints a table (median tokens/s; adaptive over the same round's
# fastest static policy and over the same round's unbudgeted run, medians over rounds)
# and writes RESULT.md and RESULT.png (RESULT: bench/results/budget-sweep).
#
# Goal (the issue "The no-OOM promise at its edge"): adaptive >= the fastest static
# policy that fits at every budget, and >= 0.90x the unbudgeted run from 1.15x the
# minimum up. The planner prices with data/hardware/this-machine.json; the script runs
# `moeflex calibrate` first when that profile is missing.
#
# Variables: LAYOUTS (ep2; also pp2ep2, pp2ep2-zbh1), STEPS (12), POINTS (8), ROUNDS (3), RATIO (2),
# SPIKE_EVERY (4), POLICIES (none full selective moe-light moe-medium moe-full), RESULT,
# BIN (build/moeflex). About 25 minutes for ep2 with the defaults on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moeflex}
RESULT=${RESULT:-bench/results/budget-sweep}
[[ -f data/hardware/this-machine.json ]] || "$BIN" calibrate --threads 1 --seconds 30
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
mkdir -p bench/results
{
  echo "# Adaptive against the static policies, minimum to unbudgeted"
  echo
  echo '```sh'
  echo "LAYOUTS=${LAYOUTS:-ep2} RESULT=$RESULT STEPS=${STEPS:-12} POINTS=${POINTS:-8} ROUNDS=${ROUNDS:-3} bash bench/budget_sweep.sh"
  echo '```'
  echo
  echo "Measured $(date -u +%F) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))."
  echo "Cells: median tokens/s over rounds (steps after the first); ratios: medians over rounds of"
  echo "ratios within one round. '-': the policy's unbudgeted peak exceeds the budget."
  echo
} > "$work/head.md"
/usr/bin/python3 bench/budget_sweep.py --binary "$BIN" --data data/brown --work "$work" \
  --layout "${LAYOUTS:-ep2}" --steps "${STEPS:-12}" --points "${POINTS:-8}" --rounds "${ROUNDS:-3}" \
  --ratio "${RATIO:-2}" --spike-every "${SPIKE_EVERY:-4}" \
  --policies "${POLICIES:-none full selective moe-light moe-medium moe-full}" \
  --table "$work/table.md" --plot "$RESULT.png"
cat "$work/head.md" "$work/table.md" > "$RESULT.md"
echo "wrote $RESULT.md ($(( $(date +%s) - t0 )) s)"
