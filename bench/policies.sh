#!/usr/bin/env bash
# Provisioning policies under routing spikes in one run on
# this machine: the default model on NP = 4 ranks with expert parallelism over all
# of them (--ep 4, 2 experts per rank), a 2.6x routing spike injected on every
# SPIKE_EVERY-th step (--inject-imbalance every=N:ratio=2.6; the most EP 4 allows
# with top-2 of 8 experts is 4x), STEPS steps each.
#
# The budget (BUDGET=auto) is measured, not guessed. `none` without a budget runs
# first; it is the speed reference, and its metrics give
#   calm  = the largest per-step peak (max over ranks) of the steps without an
#           injected spike (early training also spikes naturally: at ep 4 its
#           routing reaches over 3x on some layers, so "calm" includes those), and
#   spike = the smallest peak of the injected-spike steps.
# The budget is the midpoint, rounded down to a MiB: every calm step of `none`
# fits with (spike - calm) / 2 to spare for the budgeted arena's fragmentation,
# and no injected spike does. (Measured 2026-11-29: calm 235.2 MiB, spike 256.3 MiB,
# budget 245 MiB.) Under it every policy runs with --on-oom=restart, as a real job
# that is relaunched from its newest checkpoint (every CKPT_EVERY steps; before the
# first one, from the initial state) after a crash: the dropped step, the steps
# lost since the checkpoint and RESTART_SECONDS per restart (default 0: a real
# cold restart takes minutes, this machine's relaunch is the checkpoint reload)
# all count in its tokens/s. The spikes depend on the global step, so a redone
# step spikes again: a static policy that cannot fit the spike never gets past it
# and gives up after MAX_RESTARTS restarts at that step ("gave up" below).
#
# Prints, per policy: OOMs, restarts, lost steps, steps kept, tokens/s including
# restart losses (summary.json's tokens_per_second_effective: kept tokens / the
# time of every step run + restarts), the ratio to unbudgeted `none` and to
# `full`, the peak against the budget (and, after an OOM, the dropped step's
# demand), and activation bytes recomputed per step. Writes the device memory of
# every run against the budget to bench/results/memory-policies.png (one panel per
# policy) and bench/results/memory-<policy>.png.
#
# The 4 ranks share this machine's cores with whatever else runs, so each row also
# shows the CPU other processes took meanwhile; ROUNDS=2 runs everything twice,
# alternately, and keeps each policy's least disturbed (fastest) round.
#
# Variables: STEPS (12), SPIKE_EVERY (4), RATIO (2.6), CKPT_EVERY (5), BUDGET
# (auto, or a size such as 245MiB), RESTART_SECONDS (0), MAX_RESTARTS (3), NP (4),
# ROUNDS (1), POLICIES, BIN (build/moeflex). About 3 minutes per round on this
# 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-12}
SPIKE_EVERY=${SPIKE_EVERY:-4}
RATIO=${RATIO:-2.6}
CKPT_EVERY=${CKPT_EVERY:-5}
BUDGET=${BUDGET:-auto}
RESTART_SECONDS=${RESTART_SECONDS:-0}
MAX_RESTARTS=${MAX_RESTARTS:-3}
ROUNDS=${ROUNDS:-1}
NP=${NP:-4}
POLICIES=${POLICIES:-none full selective moe-light moe-medium moe-full threshold adaptive}
BIN=${BIN:-build/moeflex}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t_start=$(date +%s)
# CPU that other processes took while a run ran, in cores: busy time of the whole
# machine (/proc/stat) minus this script's children (bash `times`), over wall time.
hz=$(getconf CLK_TCK)
busy_seconds() { awk -v hz="$hz" '/^cpu /{print ($2+$3+$4+$7+$8+$9)/hz}' /proc/stat; }
children_cpu() {  # `times` in this shell (not in a $(...) subshell, which has no children of its own)
  times > "$tmp/times"
  awk 'NR==2{t=0; for(i=1;i<=2;i++){split($i,a,"m"); t+=a[1]*60+substr(a[2],1,length(a[2])-1)} print t}' "$tmp/times"
}
measured() {  # measured NAME CMD...: runs CMD, writes NAME.rc and NAME.others (cores used by others)
  local name=$1; shift
  local b0 c0 t0 rc=0
  children_cpu > "$tmp/c0"
  b0=$(busy_seconds); t0=$(date +%s.%N)
  "$@" > "$tmp/$name.log" 2>&1 || rc=$?
  echo "$rc" > "$tmp/$name.rc"
  children_cpu > "$tmp/c1"
  awk -v b0="$b0" -v b1="$(busy_seconds)" -v c0="$(cat "$tmp/c0")" -v c1="$(cat "$tmp/c1")" -v t0="$t0" -v t1="$(date +%s.%N)" \
    'BEGIN{o=((b1-b0)-(c1-c0))/(t1-t0); if(o<0)o=0; printf "%.2f\n", o}' > "$tmp/$name.others"
  return "$rc"
}
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$NP" -x OMP_NUM_THREADS=1)
common=(train --ep "$NP" --steps "$STEPS" --threads 1 --quiet --inject-imbalance "every=$SPIKE_EVERY:ratio=$RATIO"
        --checkpoint-every "$CKPT_EVERY")
echo "policies: $NP ranks, --ep $NP, $STEPS steps, ${RATIO}x spike every ${SPIKE_EVERY}th step, checkpoint every" \
     "$CKPT_EVERY, restart penalty ${RESTART_SECONDS}s (load: $(cut -d' ' -f1-3 /proc/loadavg))"

reference() {  # reference ROUND: the unbudgeted speed reference
  mkdir -p "$tmp/r$1"
  measured "r$1/none-unbudgeted" "${mpi[@]}" "$BIN" "${common[@]}" --policy none --out "$tmp/r$1/none-unbudgeted" \
    || { cat "$tmp/r$1/none-unbudgeted.log"; echo "policies: the unbudgeted reference run failed"; exit 1; }
}
reference 1

if [[ $BUDGET == auto ]]; then
  BUDGET=$(/usr/bin/python3 - "$tmp/r1/none-unbudgeted" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
calm = [l for l in lines if not l["injected_imbalance"]]
spikes = [l for l in lines if l["injected_imbalance"]]
if not calm or not spikes:
    sys.exit("policies: the reference run needs calm and spike steps (raise STEPS or lower SPIKE_EVERY)")
c = max(calm, key=lambda l: l["peak_device_bytes"])
s = min(spikes, key=lambda l: l["peak_device_bytes"])
mib = 2**20
if s["peak_device_bytes"] <= c["peak_device_bytes"]:
    sys.exit(f"policies: no budget separates calm steps ({c['peak_device_bytes'] / mib:.1f} MiB at step "
             f"{c['step']}) from the injected spikes ({s['peak_device_bytes'] / mib:.1f} MiB); raise RATIO or set BUDGET")
budget = (c["peak_device_bytes"] + s["peak_device_bytes"]) // 2 // mib
print(f"budget: calm-step peak {c['peak_device_bytes'] / mib:.1f} MiB (step {c['step']}, natural imbalance "
      f"{c.get('ep_imbalance', c['max_expert_imbalance']):.2f}), spike peak {s['peak_device_bytes'] / mib:.1f} MiB "
      f"(step {s['step']}) -> {budget} MiB, the midpoint", file=sys.stderr)
print(f"{budget}MiB")
PY
)
fi
echo "budget $BUDGET per rank"

for round in $(seq 1 "$ROUNDS"); do
  (( round == 1 )) || reference "$round"
  for p in $POLICIES; do
    rc=0
    measured "r$round/$p" "${mpi[@]}" "$BIN" "${common[@]}" --policy "$p" --device-memory "$BUDGET" --on-oom restart \
      --max-restarts "$MAX_RESTARTS" --restart-seconds "$RESTART_SECONDS" --out "$tmp/r$round/$p" || rc=$?
    if [[ ! -f $tmp/r$round/$p/summary.json ]]; then
      tail -5 "$tmp/r$round/$p.log"; echo "policies: $p wrote no summary (exit $rc)"
    fi
  done
done

/usr/bin/python3 - "$tmp" "$STEPS" "$ROUNDS" $POLICIES <<'PY'
import json, os, re, statistics, sys
tmp, steps, rounds, policies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
mib = 2**20

def load_one(run):
    path = f"{tmp}/{run}/summary.json"
    if not os.path.exists(path):
        return None
    s = json.load(open(path))
    lines = [json.loads(l) for l in open(f"{tmp}/{run}/metrics.jsonl")] if os.path.exists(f"{tmp}/{run}/metrics.jsonl") else []
    kept = [l for l in lines if not l.get("oom")]
    s["_recomputed"] = statistics.mean(l["bytes_recomputed"] for l in kept) / mib if kept else 0.0
    s["_offloaded"] = statistics.mean(l["bytes_offloaded"] for l in kept) / mib if kept else 0.0
    rc = int(open(f"{tmp}/{run}.rc").read()) if os.path.exists(f"{tmp}/{run}.rc") else 0
    s["_gave_up"] = None
    s["_others"] = open(f"{tmp}/{run}.others").read().strip() if os.path.exists(f"{tmp}/{run}.others") else "-"
    if rc != 0:
        log = open(f"{tmp}/{run}.log").read()
        m = re.search(r"step (\d+) ran out of device memory", log)
        s["_gave_up"] = f"gave up @ step {m.group(1)}" if m else f"failed (exit {rc})"
        s["_others"] = "-"  # ranks ended by MPI_Abort do not return their CPU time to this shell
    s["_dir"] = f"{tmp}/{run}"
    return s

def load(name):
    """The round of `name` with the highest tokens/s: the one least disturbed by other processes."""
    runs = [s for s in (load_one(f"r{r}/{name}") for r in range(1, rounds + 1)) if s]
    return max(runs, key=lambda s: s.get("tokens_per_second_effective", 0)) if runs else None

ref = load("none-unbudgeted")
full = load("full")
rows = [("none, no budget", ref)] + [(p, load(p)) for p in policies]
budget = next((s["device_budget_bytes"] for _, s in rows[1:] if s and s.get("device_budget_bytes")), None)
hdr = (f"{'policy':<16} {'OOMs':>4} {'restarts':>8} {'lost':>4} {'steps kept':>16} {'tokens/s':>9} "
       f"{'vs none':>8} {'vs full':>8} {'peak MiB / budget':>22} {'recomp MiB/step':>15} {'offl MiB/step':>13} {'others':>6}")
print(hdr)
for name, s in rows:
    if s is None:
        print(f"{name:<16} (no summary)")
        continue
    tps = s.get("tokens_per_second_effective", s["tokens_per_second"])
    kept = f"{s['steps']}/{steps}" + (f" {s['_gave_up']}" if s["_gave_up"] else "")
    vs_ref = f"{tps / ref['tokens_per_second_effective']:.2f}x" if ref else "-"
    vs_full = f"{tps / full['tokens_per_second_effective']:.2f}x" if full and full["tokens_per_second_effective"] else "-"
    b = s.get("device_budget_bytes")
    peak = f"{s['peak_device_bytes'] / mib:.1f}" + (f" / {b / mib:.0f}" if b else " / -")
    if s.get("oom_peak_demand_bytes"):
        peak += f" (OOM needed {s['oom_peak_demand_bytes'] / mib:.1f})"
    print(f"{name:<16} {s['oom_count']:>4} {s.get('restarts', 0):>8} {s.get('lost_steps', 0):>4} {kept:>16} {tps:>9.0f} "
          f"{vs_ref:>8} {vs_full:>8} {peak:>22} {s['_recomputed']:>15.1f} {s['_offloaded']:>13.1f} {s['_others']:>6}")
with open(f"{tmp}/chosen", "w") as f:
    f.write("\n".join(s["_dir"] for _, s in rows if s) + "\n")
if rounds > 1:
    print(f"each row: the best of {rounds} rounds (policies run alternately), by tokens/s")
print("tokens/s: kept tokens / (time of every step run, dropped and lost ones included, + restart time); "
      "checkpoint writes and evaluations are not counted for any policy.\nothers: cores' worth of CPU that other "
      "processes took during the run (the ranks share this machine's cores with them; rows with more are slower "
      "for that reason alone; not measured for a run that gave up)")
PY

mkdir -p bench/results
mapfile -t runs < "$tmp/chosen"
/usr/bin/python3 bench/plot_memory.py "${runs[@]}" --grid --each bench/results --out bench/results/memory-policies.png \
  --title "Device memory per step: ep $NP, ${RATIO}x spikes every ${SPIKE_EVERY}th step, budget $BUDGET, on-oom=restart" \
  > "$tmp/plot.log" 2>&1 && grep '^wrote' "$tmp/plot.log" | sed 's/^wrote /plot: /' || { cat "$tmp/plot.log"; echo "policies: plot failed"; }
echo "policies: $(( $(date +%s) - t_start )) s"
