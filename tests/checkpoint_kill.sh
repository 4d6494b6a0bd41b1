#!/usr/bin/env bash
# kill -9 during flash checkpoints: a run checkpointing every step (the write on its
# background thread most of the time) is killed at KILLS moments; each resume starts
# from an intact checkpoint (leftover temporary folders of an interrupted write do
# not disturb it) and the run ends with the losses of an uninterrupted one, bit for bit.
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd "$src"
cat > "$out/cfg.toml" <<'TOML'
[model]
hidden_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 64
[train]
micro_batch_size = 4
seq_len = 32
eval_every = 0
eval_batches = 1
checkpoint_every = 1
keep_checkpoints = 2
steps = 30
TOML
export OMP_NUM_THREADS=1
"$bin" train --config "$out/cfg.toml" --out "$out/whole" --quiet > /dev/null
lines() { if [[ -f $1/metrics.jsonl ]]; then wc -l < "$1/metrics.jsonl"; else echo 0; fi; }
"$bin" train --config "$out/cfg.toml" --out "$out/killed" --quiet > /dev/null 2>&1 &
pid=$!
for at in 6 13 21; do  # kill once the run has logged this many steps
  while (($(lines "$out/killed") < at)) && kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
  kill -9 "$pid" 2>/dev/null || { echo "the run ended before step $at"; exit 1; }
  wait "$pid" 2>/dev/null || true
  "$bin" train --resume "$out/killed" > "$out/resume-$at.log" 2>&1 &
  pid=$!
done
wait "$pid" || { echo "the last resume failed"; cat "$out"/resume-*.log; exit 1; }
grep -h "resum" "$out"/resume-*.log || true
/usr/bin/python3 - "$out/whole" "$out/killed" <<'PY'
import json, os, sys
whole, killed = sys.argv[1:]
def losses(run):
    return [json.loads(l)["loss"] for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
a, b = losses(whole), losses(killed)
assert len(a) == 30 and len(b) == 30, (len(a), len(b))
assert a == b, [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y][:5]
left = sorted(os.listdir(os.path.join(killed, "checkpoints")))
assert left[-1] == "step_00000030", left
print("checkpoint_kill: ok,", len(left), "entries left in checkpoints/:", left)
PY
