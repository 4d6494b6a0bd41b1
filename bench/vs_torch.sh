#!/usr/bin/env bash
# One config (CONFIG, default configs/default.toml) trained by moeflex and by the
# PyTorch model of bench/torch_bench.py (the reference's model, checked against its
# golden files) on this machine, in one run, with the same threads, batch and
# sequence length. Prints tokens/s of each (from the median step
# time, warm-up steps excluded) and their ratio. Shared, noisy machines: the two
# are run alternately, ROUNDS times, and the medians compared.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-$(nproc)}
STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-2}
CONFIG=${CONFIG:-configs/default.toml}
BIN=${BIN:-build/moeflex}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "bench: config $CONFIG, $THREADS threads, $STEPS steps x $ROUNDS rounds each (load: $(cut -d' ' -f1-3 /proc/loadavg))"
for r in $(seq 1 "$ROUNDS"); do
  OMP_NUM_THREADS=$THREADS "$BIN" train --config "$CONFIG" --steps "$STEPS" --threads "$THREADS" \
    --out "$tmp/moeflex_$r" --quiet > /dev/null
  # PyTorch's GEMMs go through the system's OpenBLAS too: give it the kernel set moeflex
  # ran on (moeflex replaces OpenBLAS's SSE3 fallback for a CPU model it does not know).
  core=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("blas_core", ""))' \
    "$tmp/moeflex_$r/summary.json")
  [[ $r -gt 1 ]] || echo "BLAS kernels: OpenBLAS ${core:-?} for both"
  torch_env=()  # a user's OPENBLAS_CORETYPE is inherited as it is
  [[ -n "${OPENBLAS_CORETYPE:-}" || -z "$core" ]] || torch_env=(OPENBLAS_CORETYPE="$core")
  env "${torch_env[@]}" /usr/bin/python3 bench/torch_bench.py "$CONFIG" --threads "$THREADS" --steps "$STEPS" --warmup 3 \
    > "$tmp/torch_$r.json" 2> "$tmp/torch_$r.log"
done

/usr/bin/python3 - "$tmp" "$ROUNDS" "$CONFIG" <<'PY'
import json, statistics, sys, tomllib
tmp, rounds, config = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = tomllib.load(open("configs/default.toml", "rb"))
user = tomllib.load(open(config, "rb"))
for sec in user:
    cfg.setdefault(sec, {}).update(user[sec])
t = cfg["train"]
tokens_per_step = t["micro_batch_size"] * t["seq_len"] * t.get("grad_accum", 1)
mf_steps, pt_steps = [], []
for r in range(1, rounds + 1):
    lines = [json.loads(l) for l in open(f"{tmp}/moeflex_{r}/metrics.jsonl")]
    mf_steps += [l["step_seconds"] for l in lines[3:]]
    pt = json.loads(open(f"{tmp}/torch_{r}.json").read().strip().splitlines()[-1])
    pt_steps.append(pt["step_seconds_median"])
mf = tokens_per_step / statistics.median(mf_steps)
pt = tokens_per_step / statistics.median(pt_steps)
print(f"{'impl':<10} {'tokens/s':>10}  (median step time, {tokens_per_step} tokens per step)")
print(f"{'moeflex':<10} {mf:>10.0f}")
print(f"{'pytorch':<10} {pt:>10.0f}")
print(f"ratio moeflex/pytorch: {mf / pt:.2f}x")
mf_loss = [json.loads(l)["loss"] for l in open(f"{tmp}/moeflex_1/metrics.jsonl")]
print(f"moeflex training loss: step 1 {mf_loss[0]:.4f}, step {len(mf_loss)} {mf_loss[-1]:.4f}")
PY
