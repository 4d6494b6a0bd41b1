#!/usr/bin/env bash
# make bench: moeflex against the PyTorch model (bench/vs_torch.sh) on the default
# config and on the small Qwen3-MoE and OLMoE shapes (GQA, QK-norm per head and over
# the whole width), then the pipeline schedules and the activation policies.
# CONFIGS overrides the list; the other variables are vs_torch.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
for c in ${CONFIGS:-configs/default.toml configs/qwen3-moe-small.toml configs/olmoe-small.toml configs/deepseek-v3-small.toml}; do
  CONFIG=$c bash bench/vs_torch.sh
  echo
done
bash bench/schedules.sh
echo; bash bench/policies.sh
