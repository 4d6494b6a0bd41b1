#!/usr/bin/env bash
# --on-oom=restart through the command line on 2 ranks with expert parallelism: a
# 2x routing spike on step 4 makes one rank run out of memory under a budget that
# the calm steps fit (64 KiB under the unbudgeted spike step's peak). Both ranks
# must drop the step together (no deadlock: the ctest timeout and the comm
# watchdog would catch one), go back to the step-2 checkpoint twice, then give up
# with exit code 3 naming step 4; rank 0's summary.json holds the counts.
set -euo pipefail
bin=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd "$src"
cat > "$out/tiny.toml" <<'EOF'
[model]
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_experts = 8
num_experts_per_tok = 2
moe_intermediate_size = 128
[train]
micro_batch_size = 8
seq_len = 32
eval_every = 0
eval_batches = 2
trace_steps = 0
EOF
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
args=(train --config "$out/tiny.toml" --ep 2 --steps 6 --threads 1 --inject-imbalance every=4:ratio=2.0 --quiet)
"${mpi[@]}" "$bin" "${args[@]}" --out "$out/free" > /dev/null
budget=$(/usr/bin/python3 -c "
import json
lines = [json.loads(l) for l in open('$out/free/metrics.jsonl')]
calm = max(l['peak_device_bytes'] for l in lines if not l['injected_imbalance'])
spike = max(l['peak_device_bytes'] for l in lines if l['injected_imbalance'])
assert spike - calm > 512 * 1024, (calm, spike)
print(spike - 64 * 1024)")
set +e
# With --profile-ops (a hand-made profile): the op times of the steps that completed
# are written even though the run gives up.
/usr/bin/python3 -c "
import json
json.dump({'format': 'moeflex-hardware-profile', 'version': 2, 'name': 'test', 'threads': 1,
           'gemm': [{'M': 64, 'N': 64, 'K': 64, 'flops_per_s': 1e10, 'layout': 'nt'}],
           'memory_bandwidth_Bps': 1e10, 'launch_overhead_s': 1e-6, 'h2d_bandwidth_Bps': 1e10,
           'd2h_bandwidth_Bps': 1e10, 'copy_latency_s': 1e-5, 'all_to_all_bandwidth_Bps': 0,
           'all_to_all_latency_s': 0, 'op_tables': {}}, open('$out/hw.json', 'w'))"
"${mpi[@]}" "$bin" "${args[@]}" --device-memory "${budget}B" --policy none --on-oom restart --checkpoint-every 2 \
  --max-restarts 2 --restart-seconds 60 --profile-ops --hardware-profile "$out/hw.json" --out "$out/restart" \
  > "$out/restart.log" 2>&1
rc=$?
set -e
[[ $rc -eq 3 ]] || { cat "$out/restart.log"; echo "expected exit code 3 after the restarts, got $rc"; exit 1; }
grep -q "step 4 ran out of device memory 3 times" "$out/restart.log" || { cat "$out/restart.log"; exit 1; }
/usr/bin/python3 - "$out" "$budget" <<'PY'
import json, sys
out, budget = sys.argv[1], int(sys.argv[2])
s = json.load(open(f"{out}/restart/summary.json"))
free = [json.loads(l) for l in open(f"{out}/free/metrics.jsonl")]
m = [json.loads(l) for l in open(f"{out}/restart/metrics.jsonl")]
# 3 OOMs of step 4; 2 restarts from the step-2 checkpoint, each losing step 3.
assert s["oom_count"] == 3 and s["restarts"] == 2 and s["lost_steps"] == 2, s
assert s["steps_run"] == 3 + 3 + 2 and s["steps"] == 3, s
assert s["restart_seconds"] >= 120, s["restart_seconds"]
assert s["tokens_per_second_effective"] < s["tokens_per_second"], s
assert s["peak_device_bytes"] <= budget < s["oom_peak_demand_bytes"], s
assert s["oom_peak_demand_bytes"] == free[3]["peak_device_bytes"], (s["oom_peak_demand_bytes"], free[3])
assert [l["step"] for l in m] == [1, 2, 3, 4, 3, 4, 3, 4], [l["step"] for l in m]
assert sum(l["oom"] for l in m) == 3 and all(l["oom"] == (l["step"] == 4) for l in m)
assert {l["loss"] for l in m if l["step"] == 3} == {free[2]["loss"]}, "a redone step repeats its loss"
ops = json.load(open(f"{out}/restart/op_times.json"))
assert 0 < s["time_model_op_error"] == ops["op_error"], (s.get("time_model_op_error"), ops["op_error"])
assert s["time_model_step_error"] > 0, s
print("on-oom=restart under MPI: ok, budget", budget, "B, restart_seconds", s["restart_seconds"],
      "tokens/s", round(s["tokens_per_second"]), "effective", round(s["tokens_per_second_effective"]))
PY
