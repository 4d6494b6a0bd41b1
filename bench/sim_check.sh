#!/usr/bin/env bash
# The simulator against reality on this machine: each config trains a few steps
# under mpirun (measured: median step time after the first steps, peak device
# bytes over ranks, tokens/s per rank), then `moeflex simulate` predicts the same
# run on the this-machine cluster preset (the calibrated profile in
# data/hardware/this-machine.json; run `mpirun -np 2 moeflex calibrate --threads 1` first),
# replaying the run's own expert loads, every rank's, from its loads.jsonl (older
# runs: the summed ones of metrics.jsonl). Prints predicted vs measured and the
# Spearman rank correlation of TGS. Targets: step time within 5%, peak
# within 1%, Spearman >= 0.8.
# SIM_ONLY=1 OUT=DIR re-simulates the runs already in DIR (a model change, same runs).
# CLUSTER=FILE.json simulates on another cluster description (e.g. one whose
# "profile" is a fresh calibration elsewhere) instead of the this-machine preset.
# Calibrate with `mpirun -np 2 moeflex calibrate --threads 1`: only then does the
# profile hold the measured link between ranks (else the preset's assumed one).
# The "cpu" column is the median over steps of the busiest rank's CPU seconds per
# step (loads.jsonl): far below "step meas" means the machine was busy with others.
# REPEAT=N runs all configs N times, one round after the other (OUT/round1..N; with
# CALIBRATE=1 each round calibrates its own profile first), and compares medians over
# the rounds, listing each round's errors: see the comment at run_round.
# With REPEAT, IN_SITU=1 fits each round separately, just before its runs.
# IN_SITU=1 first trains a separate fit run (OUT/in-situ-fit: dp 2, EP 1, policy none,
# seed 7, 6 steps, --profile-ops; a layout and seed none of the checked runs has), adds
# its ops to the profile (`moeflex calibrate --from-run`, OUT/in-situ.json) and
# simulates on the this-machine cluster with that profile.
# Every run trains with --profile-ops on the profile it is simulated with (no step-time
# cost measurable here: three alternating pairs within the noise), and the table's
# "ops/prof" column is the run's measured op time over its predicted op time (op_times.json,
# warm-up step left out): the machine's drift since its profile was measured, and the
# cost model's own per-op error. "err@ops" is the median over rounds of each round's step
# error with its prediction scaled by its own run's ops/prof: a diagnostic of what the
# simulator puts around the ops (the target is the raw error). PROFILE_OPS=0 trains
# without the flag.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moeflex}
STEPS=${STEPS:-8}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
CFG=bench/sim_check.toml
# SIM_ONLY=1 re-simulates what OUT holds: REPEAT defaults to its round1..N folders.
if [[ -z "${REPEAT:-}" && "${SIM_ONLY:-0}" == 1 && -d "$OUT/round1" ]]; then
  REPEAT=0
  while [[ -d "$OUT/round$((REPEAT + 1))" ]]; do REPEAT=$((REPEAT + 1)); done
fi
REPEAT=${REPEAT:-1}
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || { echo "sim_check: REPEAT='$REPEAT' must be a positive integer" >&2; exit 2; }
# CALIBRATE=1 measures the profile first (as the header says, with 2 ranks); without
# it an existing profile is used as it is, and its age is printed: this shared
# machine's speed drifts from day to day (on 2026-11-30 a profile of the evening
# before predicted every config 9-17% fast; recalibrated, 4 of 8 were within 5%).
if [[ ( "${CALIBRATE:-0}" == 1 && "$REPEAT" -le 1 && "${SIM_ONLY:-0}" != 1 ) || ! -f data/hardware/this-machine.json ]]; then
  mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$BIN" calibrate --threads 1 > "$OUT/calibrate.log"
fi
prof_age=$(( ($(date +%s) - $(stat -c %Y data/hardware/this-machine.json)) / 60 ))
echo "sim_check: $STEPS steps per config, $CFG, results in $OUT (load: $(cut -d' ' -f1-3 /proc/loadavg))"
if [[ -n "${CLUSTER:-}" ]]; then
  echo "cluster: $CLUSTER$([[ "${CALIBRATE:-0}" == 1 && "$REPEAT" -gt 1 ]] && echo ' (CALIBRATE=1 ignored: CLUSTER names the profile)')"
elif [[ "$REPEAT" -gt 1 && ( "${CALIBRATE:-0}" == 1 || "${SIM_ONLY:-0}" == 1 ) ]]; then
  echo "profiles: each round's own where it has one (OUT/roundK/this-machine.json$([[ "${CALIBRATE:-0}" == 1 && "${SIM_ONLY:-0}" != 1 ]] && echo ', calibrated first'))"
else
  echo "profile: data/hardware/this-machine.json, written $(date -u -r data/hardware/this-machine.json +%Y-%m-%dT%H:%MZ)" \
    "($prof_age min ago$( ((prof_age > 180)) && echo '; CALIBRATE=1 measures it again'))"
fi
# The in-situ profile of DIR: BASE plus the ops of a fit run trained into DIR/in-situ-fit
# (kept under SIM_ONLY); writes DIR/in-situ.json.
in_situ() {
  local dir=$1 base=$2
  if [[ "${SIM_ONLY:-0}" == 1 && ! -f "$dir/in-situ-fit/op_times.json" ]]; then
    echo "sim_check: SIM_ONLY=1 IN_SITU=1 but $dir holds no fit run (in-situ-fit; run without SIM_ONLY)" >&2
    exit 2
  fi
  if [[ "${SIM_ONLY:-0}" != 1 ]]; then
    rm -rf "${dir:?}/in-situ-fit"
    mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$BIN" train --config "$CFG" --steps 6 \
      --threads 1 --dp 2 --seed 7 --profile-ops --hardware-profile "$base" --out "$dir/in-situ-fit" --quiet \
      > "$dir/in-situ-fit.train.log" 2>&1
  fi
  "$BIN" calibrate --from-run "$dir/in-situ-fit" --base "$base" --out "$dir/in-situ.json" > /dev/null
}
if [[ "${IN_SITU:-0}" == 1 && -n "${CLUSTER:-}" ]]; then
  echo "sim_check: IN_SITU=1 prices with its own profile (this machine's plus a fit run); unset CLUSTER (or IN_SITU)" >&2
  exit 2
fi
# HP: the profile that prices the runs (simulate --hardware-profile; "" = the cluster's own).
HP=""
if [[ "${IN_SITU:-0}" == 1 && "$REPEAT" -le 1 ]]; then
  in_situ "$OUT" "${HARDWARE_PROFILE:-data/hardware/this-machine.json}"
  HP="$OUT/in-situ.json"
  echo "in situ: the profile plus the ops of $OUT/in-situ-fit ($HP)"
fi
# The profile a cluster prices with (for train --profile-ops): HP, else the cluster
# file's "profile" (relative to the repository), else none (a data-sheet cluster).
profile_of() {
  local cl=$1 hp=$2
  if [[ -n "$hp" ]]; then echo "$hp"; return; fi
  [[ -f "$cl" ]] || cl="configs/clusters/$cl.json"
  [[ -f "$cl" ]] || return 0  # simulate names the cluster it cannot find
  /usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("profile", ""))' "$cl"
}
# name | ranks | train flags | simulate --parallel | schedule | policy
CONFIGS=(
  "dp2-ep2-none|2|--ep 2|pp=1,dp=2,ep=2|1f1b|none"
  "dp2-ep2-full|2|--ep 2 --policy full|pp=1,dp=2,ep=2|1f1b|full"
  "dp2-ep1-moefull|2|--policy moe-full|pp=1,dp=2,ep=1|1f1b|moe-full"
  "pp2-1f1b|2|--pp 2|pp=2,dp=1|1f1b|none"
  "pp2-gpipe|2|--pp 2 --schedule gpipe|pp=2,dp=1|gpipe|none"
  "pp2-zbh1-selective|2|--pp 2 --schedule zb-h1 --policy selective|pp=2,dp=1|zb-h1|selective"
  "pp2-interleaved|2|--pp 2 --vpp 2 --schedule interleaved|pp=2,vpp=2,dp=1|interleaved|none"
  "pp2-dualpipev|2|--pp 2 --vpp 2 --schedule dualpipev|pp=2,dp=1|dualpipev|none"
  "pp2-1f1b-overlap|2|--pp 2 --vpp 2 --schedule 1f1b-overlap|pp=2,vpp=2,dp=1|1f1b-overlap|none"
  "pp2-dp2-ep2|4|--pp 2 --ep 2|pp=2,dp=2,ep=2|1f1b|none"
  "dp4-ep4-none|4|--ep 4|pp=1,dp=4,ep=4|1f1b|none"
)
# One round: every config trained into DIR and simulated on cluster CL, priced by
# profile HP ("" = the cluster's own).
run_round() {
  local dir=$1 cl=$2 hp=$3
  local prof ops_flags=()
  prof=$(profile_of "$cl" "$hp")
  [[ "${PROFILE_OPS:-1}" == 0 || -z "$prof" ]] || ops_flags=(--profile-ops --hardware-profile "$prof")
  mkdir -p "$dir"
  for c in "${CONFIGS[@]}"; do
    IFS='|' read -r name np flags par sched pol <<< "$c"
    if [[ "${SIM_ONLY:-0}" == 1 && ! -f "$dir/$name/metrics.jsonl" ]]; then
      echo "sim_check: SIM_ONLY=1 but $dir/$name holds no run (train it first: run without SIM_ONLY)" >&2
      exit 2
    fi
    if [[ "${SIM_ONLY:-0}" != 1 ]]; then
      rm -rf "${dir:?}/$name"
      # shellcheck disable=SC2086
      mpirun --allow-run-as-root --oversubscribe -np "$np" -x OMP_NUM_THREADS=1 "$BIN" train --config "$CFG" \
        --steps "$STEPS" --threads 1 $flags "${ops_flags[@]}" --out "$dir/$name" --quiet > "$dir/$name.train.log" 2>&1 ||
        { echo "sim_check: training $name failed ($dir/$name.train.log):" >&2; tail -3 "$dir/$name.train.log" >&2; exit 1; }
    fi
    loads="$dir/$name/loads.jsonl"
    [[ -f "$loads" ]] || loads="$dir/$name/metrics.jsonl"
    iters=$(wc -l < "$dir/$name/metrics.jsonl")
    dp=$(sed 's/.*dp=\([0-9]*\).*/\1/' <<< "$par")
    "$BIN" simulate --model "$CFG" --cluster "$cl" ${hp:+--hardware-profile "$hp"} --parallel "$par" \
      --schedule "$sched" --policy "$pol" \
      --global-batch $((4 * 4 * dp)) --loads "$loads" --iterations "$iters" \
      --out "$dir/$name/sim" > "$dir/$name.sim.log" 2>&1 ||
      { echo "sim_check: simulating $name failed ($dir/$name.sim.log):" >&2; tail -3 "$dir/$name.sim.log" >&2; exit 1; }
  done
}
# REPEAT=N (N > 1): N rounds of all 11 configs, one after the other, in OUT/round1..N;
# with CALIBRATE=1 each round first calibrates its own profile (OUT/roundK/this-
# machine.json, data/hardware/ untouched). The table compares, per config, the median
# over rounds of the measured step with the median of the predicted one, and lists
# each round's error: this shared machine's speed moves by 5-8% within minutes (on
# 2026-11-30 a profile calibrated at 04:57 predicted the runs of 04:59 3-12% fast,
# where one of 04:21 had put runs of 04:56 within -5% to +5%), so one round decides
# "within 5%" by the noise as much as by the model.
ROUNDS=()
if ((REPEAT <= 1)); then
  run_round "$OUT" "${CLUSTER:-this-machine}" "$HP"
  ROUNDS=("$OUT")
else
  for ((k = 1; k <= REPEAT; k++)); do
    dir="$OUT/round$k"
    if [[ "${SIM_ONLY:-0}" == 1 && ! -d "$dir" ]]; then
      echo "sim_check: SIM_ONLY=1 REPEAT=$REPEAT but $dir does not exist" >&2
      exit 2
    fi
    mkdir -p "$dir"
    # A round's own profile: calibrated now, or (SIM_ONLY) the one it was run with.
    [[ "${CALIBRATE:-0}" == 1 || "${SIM_ONLY:-0}" == 1 ]] || rm -f "$dir/this-machine.json"
    cl=${CLUSTER:-this-machine}
    hp=""
    if [[ "${CALIBRATE:-0}" == 1 && -z "${CLUSTER:-}" && "${SIM_ONLY:-0}" != 1 ]]; then
      mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 "$BIN" calibrate --threads 1 \
        --out "$dir/this-machine.json" > "$dir/calibrate.log"
    fi
    [[ -f "$dir/this-machine.json" && -z "${CLUSTER:-}" ]] && hp="$dir/this-machine.json"
    if [[ "${IN_SITU:-0}" == 1 && -z "${CLUSTER:-}" ]]; then  # this round's own fit, on its profile
      base=${HARDWARE_PROFILE:-data/hardware/this-machine.json}
      [[ -f "$dir/this-machine.json" ]] && base="$dir/this-machine.json"
      in_situ "$dir" "$base"
      hp="$dir/in-situ.json"
    fi
    echo "round $k of $REPEAT: $dir (cluster $cl${hp:+, profile $hp}; load $(cut -d' ' -f1-3 /proc/loadavg))"
    run_round "$dir" "$cl" "$hp"
    ROUNDS+=("$dir")
  done
fi
/usr/bin/python3 - "${#ROUNDS[@]}" "${ROUNDS[@]}" "${CONFIGS[@]}" <<'PY'
import json, statistics, sys
n_rounds = int(sys.argv[1])
rounds, configs = sys.argv[2:2 + n_rounds], sys.argv[2 + n_rounds:]
def one(out, name, np_):
    L = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    steady = L[2:] if len(L) > 3 else L
    t_meas = statistics.median(x["step_seconds"] for x in steady)
    peak_meas = max(x["peak_device_bytes"] for x in L)
    tgs_meas = statistics.median(x["tokens_per_second"] for x in steady) / np_
    s = json.load(open(f"{out}/{name}/sim/summary.json"))
    cpu = float("nan")
    try:
        C = [json.loads(l) for l in open(f"{out}/{name}/loads.jsonl")]
        C = C[2:] if len(C) > 3 else C
        cpu = statistics.median(max(x["step_cpu_seconds"]) for x in C)
    except (OSError, KeyError, ValueError):
        pass
    speed = float("nan")  # the run's measured op time over its predicted (--profile-ops)
    try:
        o = json.load(open(f"{out}/{name}/op_times.json"))["ops"]
        speed = o["measured_total_s"] / o["predicted_total_s"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        pass
    return (t_meas, s["step_time_s"], peak_meas, s["peak_bytes"], tgs_meas, s["tgs"], cpu, speed)
rows, per_round, per_round_ops = [], [], []
for c in configs:
    name, np_ = c.split("|")[0], int(c.split("|")[1])
    rs = [one(out, name, np_) for out in rounds]
    per_round.append([100 * (r[1] - r[0]) / r[0] for r in rs])
    med = [statistics.median(r[i] for r in rs) for i in range(8)]
    per_round_ops.append([100 * (r[1] * r[7] - r[0]) / r[0] for r in rs])
    med[2] = max(r[2] for r in rs)  # peaks: the largest measured, the largest predicted
    med[3] = max(r[3] for r in rs)
    rows.append((name, *med))
def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]: j += 1
        for k in range(i, j + 1): r[order[k]] = (i + j) / 2
        i = j + 1
    return r
def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 0.0
if n_rounds > 1:
    print(f"medians over {n_rounds} rounds (measured and predicted each); the last column lists each round's step error")
print(f"{'config':<20} {'step meas':>10} {'step pred':>10} {'err':>7} {'cpu':>7} {'peak MiB meas':>14} {'pred':>9} {'err':>7} {'TGS meas':>9} {'pred':>9} {'ops/prof':>8} {'err@ops':>8}"
      + ("  rounds" if n_rounds > 1 else ""))
te, pe, te_ops = [], [], []
for (n, tm, tp, pm, pp, gm, gp, cpu, speed), pr, pro in zip(rows, per_round, per_round_ops):
    te.append(abs(tp - tm) / tm); pe.append(abs(pp - pm) / pm)
    # err@ops: the median over rounds of each round's error at that run's own op speed
    e_ops = statistics.median(pro)
    te_ops.append(abs(e_ops) / 100)
    extra = "  " + " ".join(f"{e:+.1f}%" for e in pr) if n_rounds > 1 else ""
    print(f"{n:<20} {tm:>10.4f} {tp:>10.4f} {100*(tp-tm)/tm:>+6.1f}% {cpu:>7.3f} {pm/2**20:>14.2f} {pp/2**20:>9.2f} {100*(pp-pm)/pm:>+6.2f}% {gm:>9.0f} {gp:>9.0f} {speed:>8.3f} {e_ops:>+7.1f}%{extra}")
rho = spearman([r[5] for r in rows], [r[6] for r in rows])
print(f"\nmean |step error| {100*statistics.mean(te):.1f}% (max {100*max(te):.1f}%; target 5%), "
      f"within 5%: {sum(e <= 0.05 for e in te)}/{len(te)}")
print(f"mean |peak error| {100*statistics.mean(pe):.2f}% (max {100*max(pe):.2f}%; target 1%), "
      f"within 1%: {sum(e <= 0.01 for e in pe)}/{len(pe)}")
print(f"Spearman(predicted TGS, measured TGS) = {rho:.3f} (target >= 0.8)")
# A diagnostic, not the target: each config's error against the set's median error.
# The profile's offset (the machine's speed when it was calibrated against now) moves
# every prediction alike; what remains is how well the simulator spaces the configs.
signed = [(tp - tm) / tm for (n, tm, tp, *_r) in rows]
mid = statistics.median(signed)
rel = [e - mid for e in signed]
print(f"relative to the set's median error ({100*mid:+.1f}%): within 5% {sum(abs(e) <= 0.05 for e in rel)}/{len(rel)}, "
      f"mean |error| {100*statistics.mean(abs(e) for e in rel):.1f}% (diagnostic; the target is absolute)")
if not any(x != x for x in te_ops):
    print(f"at each run's own op speed (ops/prof; a diagnostic of the simulator without the machine's drift): "
          f"within 5% {sum(e <= 0.05 for e in te_ops)}/{len(te_ops)}, mean |error| {100*statistics.mean(te_ops):.1f}%")
if n_rounds > 1:
    within = [sum(abs(pr[i]) <= 5 for pr in per_round) for i in range(n_rounds)]
    print("within 5% per round: " + ", ".join(f"{w}/{len(per_round)}" for w in within))
PY
