#!/usr/bin/env bash
# Flash checkpoints against synchronous ones: the default model (CONFIG to change it)
# trains STEPS steps with a checkpoint every CKPT_EVERY steps, checkpoint_mode "sync"
# and "async" alternating for ROUNDS rounds. Prints, per mode, the medians over
# rounds of: the training thread's seconds per checkpoint (summary.json's
# checkpoint_blocking_seconds / checkpoints), the writing's seconds per checkpoint
# (checkpoint_persist_seconds / checkpoints; async: on the background thread) and the
# run's wall seconds, then async's blocking time as a share of sync's.
#   bash bench/resilience.sh            # STEPS=20 CKPT_EVERY=5 ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-build/moeflex}
steps=${STEPS:-20}
every=${CKPT_EVERY:-5}
rounds=${ROUNDS:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
config=()
[[ -n ${CONFIG:-} ]] && config=(--config "$CONFIG")
for r in $(seq 1 "$rounds"); do
  for mode in sync async; do
    printf '[train]\ncheckpoint_mode = "%s"\ncheckpoint_every = %d\neval_every = 0\nkeep_checkpoints = 2\n' \
      "$mode" "$every" > "$out/$mode.toml"
    # (a --config given in CONFIG takes the model; the mode comes from this file's [train])
    if [[ ${#config[@]} -gt 0 ]]; then
      /usr/bin/python3 - "$CONFIG" "$out/$mode.toml" "$mode" "$every" <<'PY'
import sys
base, dst, mode, every = sys.argv[1:]
text = open(base).read()
extra = f'checkpoint_mode = "{mode}"\ncheckpoint_every = {every}\neval_every = 0\nkeep_checkpoints = 2\n'
text = text.replace("[train]\n", "[train]\n" + extra, 1) if "[train]\n" in text else text + "\n[train]\n" + extra
open(dst, "w").write(text)
PY
    fi
    start=$(date +%s%N)
    "$bin" train --config "$out/$mode.toml" --steps "$steps" --out "$out/$mode-$r" --quiet > /dev/null 2>&1
    end=$(date +%s%N)
    echo "$mode $r $(((end - start) / 1000000))" >> "$out/walls"  # ms
  done
done
/usr/bin/python3 - "$out" "$steps" "$every" "$rounds" <<'PY'
import json, statistics, sys
out, steps, every, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
walls = {}
for line in open(f"{out}/walls"):
    mode, r, w = line.split()
    walls.setdefault(mode, []).append(float(w) / 1e3)
n = steps // every
print(f"resilience: {steps} steps, a checkpoint every {every} ({n} a run), {rounds} rounds; medians")
print(f"{'mode':6} {'blocking s/ckpt':>16} {'persist s/ckpt':>15} {'wall s':>8}")
med = {}
for mode in ("sync", "async"):
    b = [json.load(open(f"{out}/{mode}-{r}/summary.json"))["checkpoint_blocking_seconds"] / n for r in range(1, rounds + 1)]
    p = [json.load(open(f"{out}/{mode}-{r}/summary.json"))["checkpoint_persist_seconds"] / n for r in range(1, rounds + 1)]
    med[mode] = statistics.median(b)
    print(f"{mode:6} {statistics.median(b):16.4f} {statistics.median(p):15.4f} {statistics.median(walls[mode]):8.2f}")
print(f"async blocking / sync blocking: {100 * med['async'] / med['sync']:.1f}%")
PY
