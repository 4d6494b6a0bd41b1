#!/usr/bin/env bash
# Goodput under supervised restart: the default model (CONFIG to change it) on 2
# ranks with expert parallelism trains STEPS steps with a checkpoint every CKPT_EVERY,
# once uninterrupted and once under `moeflex run` with one rank killed (kill -9) once
# step KILL_AT is in metrics.jsonl. Prints both runs' wall seconds, the supervised
# run's restarts, lost steps and seconds and goodput (kept step seconds / wall
# seconds, supervisor.json), the uninterrupted run's goodput (its step seconds /
# wall), and whether the final losses are equal bit for bit.
#   bash bench/goodput.sh          # STEPS=40 CKPT_EVERY=10 KILL_AT=25
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${BIN:-build/moeflex}")
steps=${STEPS:-40}
every=${CKPT_EVERY:-10}
kill_at=${KILL_AT:-25}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
config=()
[[ -n ${CONFIG:-} ]] && config=(--config "$CONFIG")
cmd=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$bin" train "${config[@]}" --ep 2
     --steps "$steps" --checkpoint-every "$every" --quiet)
t0=$(date +%s%N)
"${cmd[@]}" --out "$out/whole" > "$out/whole.log" 2>&1 || { cat "$out/whole.log"; exit 1; }
t1=$(date +%s%N)
"$bin" run --max-restarts 2 -- "${cmd[@]}" --out "$out/killed" > "$out/killed.log" 2>&1 &
sup=$!
while ! [[ -f "$out/killed/metrics.jsonl" ]] || ! grep -q "\"step\":$kill_at," "$out/killed/metrics.jsonl"; do
  sleep 0.2
  kill -0 "$sup" 2> /dev/null || { cat "$out/killed.log"; exit 1; }
done
victim=$(pgrep -f -- "train.*--out $out/killed" | tail -1)
kill -9 "$victim"
wait "$sup" || { cat "$out/killed.log"; exit 1; }
/usr/bin/python3 - "$out" "$(( (t1 - t0) / 1000000 ))" "$kill_at" "$every" <<'PY'
import json, sys
out, whole_ms, kill_at, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sup = json.load(open(f"{out}/killed/supervisor.json"))
t = sup
whole = [json.loads(l) for l in open(f"{out}/whole/metrics.jsonl")]
killed = {}
for l in open(f"{out}/killed/metrics.jsonl"):
    x = json.loads(l)
    killed[x["step"]] = x
same = [x["loss"] for x in whole] == [killed[s]["loss"] for s in sorted(killed)]
whole_steps = sum(x["step_seconds"] for x in whole)
print(f"goodput: 2 ranks, {len(whole)} steps, a checkpoint every {every}; rank 1 killed after step {kill_at}")
print(f"uninterrupted: wall {whole_ms / 1e3:.2f} s, goodput {whole_steps / (whole_ms / 1e3):.3f}")
print(f"supervised:    wall {t['wall_seconds']:.2f} s, restarts {t['restarts']}, lost steps {t['lost_steps']}, "
      f"lost seconds {t['lost_seconds']:.2f}, goodput {t['goodput']:.3f}")
print(f"losses equal bit for bit: {same}")
PY
