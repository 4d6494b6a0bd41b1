#!/usr/bin/env bash
# Scale targets: one iteration of DeepSeek-V3 on 12,288 simulated H100s
# (<= 10 s), and a search over >= 10,000 layouts (<= 60 s). Prints the wall times.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moeflex}
t0=$(date +%s.%N)
"$BIN" simulate --model deepseek-v3 --cluster h100 --parallel tp=2,pp=16,ep=64,dp=384 --schedule 1f1b \
  --global-batch 12288 --seq-len 4096 --policy adaptive | tail -9
t1=$(date +%s.%N)
echo "simulate: DeepSeek-V3 on 12288 ranks, 1 iteration: $(python3 -c "print(f'{$t1-$t0:.2f}')") s wall (target 10 s)"
t0=$(date +%s.%N)
"$BIN" search --model deepseek-v3 --cluster h100 --gpus 1024 --seq-len 4096 --top 10 --out "${OUT:-/tmp}/search-dsv3-1024.json"
t1=$(date +%s.%N)
echo "search: $(python3 -c "print(f'{$t1-$t0:.2f}')") s wall (target 60 s for >= 10,000 combinations)"
