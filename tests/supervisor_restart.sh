#!/usr/bin/env bash
# moeflex run: a 2-rank expert-parallel run under the supervisor loses one rank to
# kill -9 after step 5; the supervisor relaunches it once with --resume, records the
# attempt in supervisor.json (restarts 1, lost steps >= 0, goodput in (0, 1]), and the
# run ends with an uninterrupted run's losses, bit for bit (the JSON number strings).
# An exit code 2 (a bad flag value), a command without --out and a SIGTERM are not
# restarted. The model is small but not tiny: a step takes ~0.1 s on 2 cores, so the
# run is still going when the kill comes after step 5.
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
sup=
cleanup() {
  [[ -n $sup ]] && kill "$sup" 2>/dev/null && wait "$sup" 2>/dev/null
  rm -rf "$out"
}
trap cleanup EXIT
cd "$src"
cat > "$out/cfg.toml" <<'TOML'
[model]
hidden_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 256
[train]
micro_batch_size = 8
seq_len = 128
eval_every = 0
eval_batches = 1
checkpoint_every = 2
keep_checkpoints = 2
trace_steps = 0
TOML
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
args=(train --config "$out/cfg.toml" --ep 2 --steps 12 --threads 1 --quiet)
export MOEFLEX_COMM_TIMEOUT=${MOEFLEX_COMM_TIMEOUT:-60}
"${mpi[@]}" "$bin" "${args[@]}" --out "$out/whole" > /dev/null

# The supervised run, killed once: one rank process (not mpirun, not the supervisor).
"$bin" run --max-restarts 2 --restart-delay 0.2 -- "${mpi[@]}" "$bin" "${args[@]}" --out "$out/run2" \
  > "$out/run.log" 2>&1 &
sup=$!
last_step() { grep -o '"step":[0-9]*' "$out/run2/metrics.jsonl" 2>/dev/null | tail -n 1 | cut -d: -f2; }
while (($(last_step || echo 0) < 5)); do
  kill -0 "$sup" 2>/dev/null || { cat "$out/run.log"; echo "the supervised run ended before step 5"; exit 1; }
  sleep 0.02
done
rank=$(pgrep -o -f "^$bin train .*--out $out/run2") || { echo "no rank process of run2 found"; exit 1; }
kill -9 "$rank"
rc=0
wait "$sup" || rc=$?
sup=
[[ $rc -eq 0 ]] || { cat "$out/run.log"; echo "moeflex run exited $rc, expected 0 after one restart"; exit 1; }
grep "^moeflex run:" "$out/run.log"
grep -q "^moeflex run: attempt 1 ended .* at step [0-9]*; restart 1 of 2 from the checkpoint of step [0-9]*" \
  "$out/run.log" || { cat "$out/run.log"; echo "no restart line"; exit 1; }

/usr/bin/python3 - "$out/whole" "$out/run2" <<'PY'
import json, os, re, sys
whole, run2 = sys.argv[1:]
def loss_strings(run):  # the JSON text of every step's loss, as written
    lines = [l for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
    return [re.search(r'"loss":([^,}]+)', l).group(1) for l in lines]
a, b = loss_strings(whole), loss_strings(run2)
assert len(a) == 12 and len(b) == 12, (len(a), len(b))
assert a[-1] == b[-1], ("final loss", a[-1], b[-1])
assert a == b, [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y][:5]
s = json.load(open(os.path.join(run2, "supervisor.json")))
assert s["restarts"] == 1 and len(s["attempts"]) == 2, s
first, second = s["attempts"]
assert first["exit_code"] not in (0, 2, 3) or first["signal"], first
assert first["resumed_from_step"] is None and first["last_step"] >= 5, first
assert 0 <= first["lost_steps"] == first["last_step"] - second["resumed_from_step"], (first, second)
assert second["resumed_from_step"] >= 2 and second["resumed_from_step"] % 2 == 0, second
assert "--resume" in second["command"] and "--out" not in second["command"], second["command"]
assert second["exit_code"] == 0 and second["last_step"] == 12, second
assert s["lost_steps"] == first["lost_steps"] and s["lost_seconds"] > 0, s
assert 0 < s["goodput"] <= 1 and s["kept_step_seconds"] > 0, s
assert abs(s["goodput"] - s["kept_step_seconds"] / s["wall_seconds"]) < 1e-12, s
assert s["outcome"] == "done", s["outcome"]
print("supervisor_restart: ok, final loss", b[-1], "; resumed from step", second["resumed_from_step"],
      "after step", first["last_step"], "; goodput %.3f" % s["goodput"])
PY

# Exit code 2 (a bad flag value, refused on every rank with MPI_Abort) is not restarted.
rc=0
"$bin" run --max-restarts 2 --restart-delay 0 -- "${mpi[@]}" "$bin" "${args[@]}" --steps 0 --out "$out/bad" \
  > "$out/bad.log" 2>&1 || rc=$?
[[ $rc -eq 2 ]] || { cat "$out/bad.log"; echo "expected exit code 2, got $rc"; exit 1; }
grep -q "exit code 2 is bad input .*: a restart would fail the same way, not restarted" "$out/bad.log" \
  || { cat "$out/bad.log"; exit 1; }
/usr/bin/python3 -c "
import json, sys
s = json.load(open('$out/bad/supervisor.json'))
assert s['restarts'] == 0 and len(s['attempts']) == 1 and s['attempts'][0]['exit_code'] == 2, s"
# A command without a run folder is refused before anything runs.
rc=0
"$bin" run -- "$bin" train --steps 3 > "$out/none.log" 2>&1 || rc=$?
[[ $rc -eq 2 ]] && grep -q "neither --out DIR nor --resume DIR" "$out/none.log" \
  || { cat "$out/none.log"; echo "expected a refusal naming --out, exit code 2 (got $rc)"; exit 1; }
echo "supervisor_restart: exit code 2 and a command without --out are not restarted"

# SIGTERM to the supervisor is forwarded to the train run (one process here), which
# stops after its step with a checkpoint of it; the supervisor exits with the run's
# code (0) and does not restart it.
"$bin" run -- "$bin" train --config "$out/cfg.toml" --steps 100 --threads 1 --quiet --out "$out/term" \
  > "$out/term.log" 2>&1 &
sup=$!
until grep -q '"step":3,' "$out/term/metrics.jsonl" 2>/dev/null; do
  kill -0 "$sup" 2>/dev/null || { cat "$out/term.log"; echo "the run to stop ended before step 3"; exit 1; }
  sleep 0.02
done
kill -TERM "$sup"
rc=0
wait "$sup" || rc=$?
sup=
[[ $rc -eq 0 ]] || { cat "$out/term.log"; echo "expected exit code 0 after SIGTERM, got $rc"; exit 1; }
/usr/bin/python3 - "$out/term" <<'PY'
import json, os, sys
run = sys.argv[1]
s = json.load(open(os.path.join(run, "supervisor.json")))
assert len(s["attempts"]) == 1 and s["restarts"] == 0, s
last = s["attempts"][0]["last_step"]
assert 3 <= last < 100 and "stopped by signal 15" in s["outcome"], s
assert os.path.isdir(os.path.join(run, "checkpoints", "step_%08d" % last)), os.listdir(os.path.join(run, "checkpoints"))
print("supervisor_restart: SIGTERM forwarded, the run stopped at step", last, "with its checkpoint, not restarted")
PY
