#!/usr/bin/env bash
# The CUDA backend's check on a machine with a GPU. Needs no network.
#
#   1. builds the CUDA backend and its tests (cmake -DMOEFLEX_CUDA=ON, in build-gpu/);
#      when this machine cannot configure the project (e.g. an image without the
#      project's dev packages) and build-gpu-bundle/ (scripts/gpu-bundle.sh, made on
#      the CPU machine and carried) is here, it uses those prebuilt binaries and says so;
#   2. runs the op harness (every CUDA op against the CPU reference, forward and
#      backward, fp32 and bf16, timed; plus training-size timings) and the runtime
#      tests (device arena, pinned pool, copy streams, NCCL on one rank);
#   3./4. trains on the GPU (`moeflex train --device cuda`, one GPU), each model in fp32
#      and in bf16 mixed precision (--bf16): the default model for 300 steps (runs
#      default, default-bf16) and the ~1.2B MoE of configs/moe-1b.toml for 20 steps
#      (moe-1b, moe-1b-bf16), and each run's config in the same precision in this
#      machine's PyTorch when it has CUDA (bench/torch_bench.py --device cuda [--bf16]:
#      torch.autocast, fp32 master weights and AdamW); the training test
#      (test_cuda_train: CUDA against CPU from one seed, every policy, the planner's
#      predicted peak) runs in step 2;
#   4b. the time model: `moeflex calibrate --device cuda`, a profiled fit run,
#      its ops added (`calibrate --from-run`) and two held-out profiled runs; prints the
#      op and step errors of each against the profile that priced it;
#   5. prints the table of per-op error and time, the card's measured bf16 GEMM rate,
#      the same ops timed in this machine's PyTorch when it has CUDA, and the training
#      table (precision, tokens/s, MFU against the measured bf16 GEMM rate, PyTorch
#      tokens/s and the ratio; bench/gpu_train_report.py).
# The table and the details go to bench/results/gpu-<date>-<card>.txt (or $OUT_DIR).
# Exit status: 0 only if everything built and every test passed; any failure is
# printed as "gpu-check: FAILED: ..." and makes the exit status non-zero (the results
# file is still written with what was measured).
#
# Environment: BUILD (build-gpu), BUNDLE (build-gpu-bundle), JOBS (nproc), OUT_DIR
# (bench/results), PYTHON (a python3 whose torch has CUDA; searched otherwise),
# PREBUILT=1 uses the bundle without trying to build (saves device time),
# MOEFLEX_GPU_CHECK_QUICK=1 skips the training-size timings, MOEFLEX_GPU_CHECK_TRAIN=0
# the training runs of steps 3-4, MOEFLEX_GPU_CHECK_BF16=0 only their bf16 runs,
# MOEFLEX_GPU_CHECK_RUNS="default-bf16 moe-1b-bf16" keeps only the named training runs,
# MOEFLEX_GPU_CHECK_PROFILE=1 adds an op-by-op profile of a moe-1b bf16 step,
# MOEFLEX_GPU_CHECK_TIME_MODEL=0 skips the time-model check (`calibrate --device cuda`
# for MOEFLEX_GPU_CHECK_CALIBRATE_SECONDS, 30, and three 6-step profiled moe-1b runs);
# TRAIN_TIMEOUT (600) caps each training run and each PyTorch run, TEST_TIMEOUT (1200)
# each test binary, in seconds.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${BUILD:-build-gpu}
BUNDLE=${BUNDLE:-build-gpu-bundle}
JOBS=${JOBS:-$(nproc)}
OUT_DIR=${OUT_DIR:-bench/results}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
FAILURES=()
START=$(date +%s)

step() { printf '\n=== gpu-check %s: %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { echo "gpu-check: FAILED: $*" >&2; FAILURES+=("$*"); }
die() {
  echo "gpu-check: FAILED: $*" >&2
  echo "gpu-check: stopped after $(($(date +%s) - START)) s; logs in $WORK" >&2
  exit 1
}

step "0. this machine"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
  echo "(no nvidia-smi)"
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
echo "nvcc: ${NVCC:-none}${NVCC:+ ($("$NVCC" --version | tail -n 2 | head -n 1))}"
echo "cmake: $(command -v cmake || echo none)   cores: $(nproc)"

# --------------------------------------------------------------------------------
step "1. build"
BIN=""
BUILT_FROM=""
if [[ ${PREBUILT:-0} == 1 ]]; then
  echo "gpu-check: PREBUILT=1: not building"
elif [[ -n $NVCC ]] && command -v cmake >/dev/null; then
  gen=()
  if command -v ninja >/dev/null && [[ ! -f $BUILD/CMakeCache.txt ]]; then gen=(-G Ninja); fi
  if cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMOEFLEX_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
      >"$WORK/configure.log" 2>&1; then
    if cmake --build "$BUILD" -j "$JOBS" --target test_cuda_ops test_cuda_op_cases test_cuda_bench test_cuda_runtime \
        test_backend_host test_cuda_train moeflex \
        >"$WORK/build.log" 2>&1; then
      BIN=$BUILD
      BUILT_FROM="built here in $BUILD/ ($(($(date +%s) - START)) s)"
    else
      grep -E 'error|Error' "$WORK/build.log" | head -n 30
      [[ -x $BUNDLE/bin/test_cuda_ops ]] || die "the build failed (full log: $WORK/build.log)"
      fail "the build failed here (full log: $WORK/build.log); going on with the prebuilt bundle"
    fi
  else
    echo "gpu-check: WARNING: cannot configure the project on this machine (missing dev packages?); last lines:"
    tail -n 15 "$WORK/configure.log"
  fi
else
  echo "gpu-check: no nvcc or no cmake here, so no build"
fi
if [[ -z $BIN ]]; then
  [[ -x $BUNDLE/bin/test_cuda_ops ]] ||
    die "no build, and no prebuilt bundle in $BUNDLE/ (make one with scripts/gpu-bundle.sh on the CPU machine and carry it)"
  echo "gpu-check: USING PREBUILT BINARIES from $BUNDLE/: $(head -n 1 "$BUNDLE/BUILD_INFO" 2>/dev/null)"
  BIN=$BUNDLE/bin
  BUILT_FROM="PREBUILT: $(tr '\n' ' ' <"$BUNDLE/BUILD_INFO" 2>/dev/null)"
  # The CUDA libraries come from this machine: the toolkit's, or the pip wheels'.
  libdirs=$BUNDLE/lib
  if [[ -f $BUNDLE/lib.tgz ]]; then  # packed by gpu-bundle.sh
    tar xzf "$BUNDLE/lib.tgz" -C "$WORK" || die "cannot unpack $BUNDLE/lib.tgz"
    libdirs=$WORK/lib
  fi
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=$(find /usr/local /usr/lib /opt -name "$lib" -print -quit 2>/dev/null || true)
    [[ -n $found ]] && libdirs=$libdirs:$(dirname "$found")
  done
  export LD_LIBRARY_PATH=$libdirs:${LD_LIBRARY_PATH:-}
fi
for t in test_cuda_ops test_cuda_op_cases test_cuda_bench test_cuda_runtime test_backend_host test_cuda_train moeflex; do
  missing=$(ldd "$BIN/$t" 2>&1 | grep "not found" || true)
  [[ -z $missing ]] || die "$BIN/$t cannot load: $missing"
done
echo "gpu-check: binaries: $BUILT_FROM"

# --------------------------------------------------------------------------------
step "2. op harness and runtime tests"
REPORT=$WORK/ops.tsv
: >"$REPORT"
bench=1
[[ ${MOEFLEX_GPU_CHECK_QUICK:-0} == 1 ]] && bench=0
run_test() {  # name: runs $BIN/name, keeps its log, records failures
  local name=$1 rc=0
  MOEFLEX_OP_REPORT=$REPORT MOEFLEX_OP_BENCH=$bench timeout "${TEST_TIMEOUT:-1200}" "$BIN/$name" --gtest_color=no \
    >"$WORK/$name.log" 2>&1 || rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test|^\[  FAILED  \] [A-Z]|^\[==========\] [0-9]+ tests.* ran' \
    "$WORK/$name.log" | sed "s/^/  $name: /"
  if grep -q 'skipped: no GPU' "$WORK/$name.log"; then
    die "$name sees no GPU: $(grep -m1 'skipped: no GPU' "$WORK/$name.log")"
  fi
  [[ $rc -eq 0 ]] || fail "$name exited with status $rc (failures: $(grep -c '^\[  FAILED  \] [A-Z]' "$WORK/$name.log" || true); log below)"
}
run_test test_backend_host
run_test test_cuda_runtime
run_test test_cuda_ops
run_test test_cuda_op_cases
run_test test_cuda_bench
run_test test_cuda_train
grep -q . "$REPORT" || fail "the op harness wrote no rows to its report"

# --------------------------------------------------------------------------------
step "3./4. training on the GPU"
PY=""
for cand in ${PYTHON:-} python3 /usr/bin/python3 /opt/torch/.venv/bin/python3; do
  command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    PY=$cand
    break
  fi
done
TRAIN_NOTE=""
TRAIN_RUNS=()
# The corpus: data/ here (make data), else the copy in the bundle (scripts/gpu-bundle.sh).
DATA_ARGS=()
if [[ ! -d data/brown ]]; then
  if [[ -f $BUNDLE/data.tgz ]]; then
    tar xzf "$BUNDLE/data.tgz" -C "$WORK" && DATA_ARGS=(--data "$WORK/data/brown" --data-cache "$WORK/data/tokenized")
  else
    TRAIN_NOTE="no corpus: neither data/brown (make data) nor $BUNDLE/data.tgz"
  fi
fi
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-600}
train_run() {  # name, steps, moeflex train flags...: one run into $WORK/run-name
  local name=$1 steps=$2 rc=0
  shift 2
  if [[ -n ${MOEFLEX_GPU_CHECK_RUNS:-} && " ${MOEFLEX_GPU_CHECK_RUNS//[,$'\t']/ } " != *" $name "* ]]; then
    echo "gpu-check: skipping $name (not in MOEFLEX_GPU_CHECK_RUNS)"
    return
  fi
  echo "gpu-check: training $name ($steps steps): moeflex train --device cuda $*"
  timeout "$TRAIN_TIMEOUT" "$BIN/moeflex" train --device cuda --steps "$steps" --out "$WORK/run-$name" "${DATA_ARGS[@]}" "$@" \
    >"$WORK/train-$name.log" 2>&1 || rc=$?
  tail -n 3 "$WORK/train-$name.log" | sed "s/^/  $name: /"
  if [[ $rc -ne 0 ]]; then
    fail "training $name on the GPU exited with status $rc (log: $WORK/train-$name.log)"
    return
  fi
  local torch_json=""
  if [[ -n $PY ]]; then
    torch_json=$WORK/torch-$name.json
    local cfg=configs/default.toml prev="" a torch_flags=()
    for a in "$@"; do
      [[ $prev == --config ]] && cfg=$a
      [[ $a == --bf16 ]] && torch_flags+=(--bf16)  # the same precision: autocast, fp32 weights
      prev=$a
    done
    timeout "$TRAIN_TIMEOUT" "$PY" bench/torch_bench.py "$cfg" --device cuda --steps "$(( steps < 30 ? steps : 30 ))" \
      --warmup 3 "${torch_flags[@]}" >"$torch_json" 2>"$WORK/torch-$name.err" || fail "bench/torch_bench.py on $name failed (log: $WORK/torch-$name.err)"
    tail -n 1 "$torch_json" | sed "s/^/  $name (PyTorch): /"
  fi
  TRAIN_RUNS+=(--run "$name" "$WORK/run-$name" $torch_json)
}
if [[ ${MOEFLEX_GPU_CHECK_TRAIN:-1} == 0 ]]; then
  TRAIN_NOTE="skipped (MOEFLEX_GPU_CHECK_TRAIN=0)"
elif [[ -n $TRAIN_NOTE ]]; then  # no corpus: the training half of the check cannot run
  fail "steps 3-4 did not run: $TRAIN_NOTE (or MOEFLEX_GPU_CHECK_TRAIN=0 to skip them)"
else
  # bf16 next to fp32 at the same step count, so their loss columns compare directly; the
  # default model (12M parameters, 1k tokens a step) should take seconds on the GPU.
  bf16=${MOEFLEX_GPU_CHECK_BF16:-1}
  train_run default 300
  [[ $bf16 == 0 ]] || train_run default-bf16 300 --bf16
  train_run moe-1b 20 --config configs/moe-1b.toml
  [[ $bf16 == 0 ]] || train_run moe-1b-bf16 20 --config configs/moe-1b.toml --bf16
  [[ -n $PY ]] || echo "gpu-check: no python3 with a CUDA-enabled torch: the PyTorch training comparison is skipped"
  if [[ -n ${MOEFLEX_GPU_CHECK_RUNS:-} && ${#TRAIN_RUNS[@]} -eq 0 ]]; then
    fail "MOEFLEX_GPU_CHECK_RUNS='$MOEFLEX_GPU_CHECK_RUNS' names none of the training runs (default default-bf16 moe-1b moe-1b-bf16)"
    TRAIN_NOTE="none ran (MOEFLEX_GPU_CHECK_RUNS named none of them)"
  fi
fi
[[ -z $TRAIN_NOTE ]] || echo "gpu-check: steps 3 and 4 (training on the GPU): $TRAIN_NOTE"
# Optional: where the ~1B MoE's bf16 step goes, op by op (--profile-ops synchronises
# around each op on the GPU; bench/gpu_op_profile.py). --profile-ops prices ops with a
# hardware profile: this machine's, or the one the bundle carries (a CPU's: only the
# measured times are read here).
PROFILE_TABLE=$WORK/op-profile.txt
: >"$PROFILE_TABLE"
if [[ ${MOEFLEX_GPU_CHECK_PROFILE:-0} == 1 ]]; then
  hw=data/hardware/this-machine.json
  [[ -f $hw ]] || hw=$BUNDLE/hw.json
  if [[ ! -d data/brown && ${#DATA_ARGS[@]} -eq 0 ]]; then
    fail "MOEFLEX_GPU_CHECK_PROFILE=1 needs the corpus: neither data/brown (make data) nor $BUNDLE/data.tgz"
  elif [[ ! -f $hw ]]; then
    fail "MOEFLEX_GPU_CHECK_PROFILE=1 needs a hardware profile (data/hardware/this-machine.json or $BUNDLE/hw.json)"
  else
    echo "gpu-check: profiling moe-1b-bf16 (4 steps, --profile-ops)"
    if timeout "$TRAIN_TIMEOUT" "$BIN/moeflex" train --device cuda --config configs/moe-1b.toml --bf16 --steps 4 \
        --profile-ops --hardware-profile "$hw" --out "$WORK/run-profile" "${DATA_ARGS[@]}" >"$WORK/train-profile.log" 2>&1 &&
        "${PY:-python3}" bench/gpu_op_profile.py "$WORK/run-profile/op_times.json" >"$PROFILE_TABLE" 2>&1; then
      head -n 25 "$PROFILE_TABLE"
    else
      fail "the profiled run failed (log: $WORK/train-profile.log)"
      tail -n 5 "$WORK/train-profile.log"
    fi
  fi
fi

# Issue 4's time model on the GPU: `moeflex calibrate --device cuda` at moe-1b's
# shapes, then three fp32 runs with --profile-ops (each op timed against the cost
# model; summary.json's time_model_* errors): the fit run priced by the calibrated
# profile alone; its ops added to that profile (`calibrate --from-run`); a run of
# another seed (same shapes, other routings) and one of micro-batch 2 (dense shapes
# the fit never ran) priced by the result. Goal: mean op error <= 1.5%.
TIME_TABLE=$WORK/time-model.txt
: >"$TIME_TABLE"
if [[ ${MOEFLEX_GPU_CHECK_TIME_MODEL:-1} == 1 && ${MOEFLEX_GPU_CHECK_TRAIN:-1} != 0 && -z $TRAIN_NOTE ]]; then
  tm_cfg=configs/moe-1b.toml
  tm_prof=$WORK/cuda-profile.json
  tm_mb2=$WORK/moe-1b-mb2.toml
  sed 's/^micro_batch_size = .*/micro_batch_size = 2/' "$tm_cfg" >"$tm_mb2"
  tm_run() {  # name, profile, moeflex train flags...
    local name=$1 prof=$2
    shift 2
    timeout "$TRAIN_TIMEOUT" "$BIN/moeflex" train --device cuda --steps 6 --profile-ops --hardware-profile "$prof" \
      --out "$WORK/run-$name" "${DATA_ARGS[@]}" "$@" >"$WORK/train-$name.log" 2>&1 ||
      { fail "time model: training $name exited with an error (log: $WORK/train-$name.log)"; return 1; }
  }
  echo "gpu-check: time model: moeflex calibrate --device cuda --config $tm_cfg"
  if timeout "$TRAIN_TIMEOUT" "$BIN/moeflex" calibrate --device cuda --config "$tm_cfg" \
      --seconds "${MOEFLEX_GPU_CHECK_CALIBRATE_SECONDS:-30}" --out "$tm_prof" >"$WORK/calibrate-cuda.log" 2>&1; then
    tail -n 3 "$WORK/calibrate-cuda.log"
    if tm_run tm-fit "$tm_prof" --config "$tm_cfg" --seed 7 &&
        "$BIN/moeflex" calibrate --from-run "$WORK/run-tm-fit" --base "$tm_prof" --out "$WORK/cuda-in-situ.json" \
          >"$WORK/calibrate-in-situ.log" 2>&1; then
      tm_run tm-seed "$WORK/cuda-in-situ.json" --config "$tm_cfg" --seed 11
      tm_run tm-mb2 "$WORK/cuda-in-situ.json" --config "$tm_mb2" --seed 11
    else
      fail "time model: the fit run or calibrate --from-run failed (logs: $WORK/train-tm-fit.log, $WORK/calibrate-in-situ.log)"
    fi
    "${REPORT_PY:-python3}" - "$WORK" >"$TIME_TABLE" <<'PY'
import json, os, sys
w = sys.argv[1]
print("--- time model on the GPU (moe-1b fp32, 6 steps, --profile-ops; goal: op error <= 1.5%)")
print(f"{'run':<10} {'profile':<26} {'op error':>9} {'median err':>11} {'noise floor':>12} {'step error':>11}")
for name, prof in (("tm-fit", "calibrated"), ("tm-seed", "+ in situ (other seed)"), ("tm-mb2", "+ in situ (micro-batch 2)")):
    f = os.path.join(w, "run-" + name, "summary.json")
    if not os.path.exists(f):
        print(f"{name:<10} {prof:<26} (no summary)")
        continue
    s = json.load(open(f))
    g = lambda k: 100 * s.get(k, float("nan"))
    print(f"{name:<10} {prof:<26} {g('time_model_op_error'):8.2f}% {g('time_model_op_median_error'):10.2f}% "
          f"{g('time_model_op_noise_floor'):11.2f}% {g('time_model_step_error'):10.2f}%")
PY
    cat "$TIME_TABLE"
  else
    fail "moeflex calibrate --device cuda failed (log: $WORK/calibrate-cuda.log)"
    tail -n 5 "$WORK/calibrate-cuda.log"
  fi
fi

# --------------------------------------------------------------------------------
step "5. results"
TORCH_NOTE=""  # PY: the python3 with a CUDA-enabled torch found in step 3
TORCH_TSV=$WORK/torch.tsv
if [[ -n $PY ]]; then
  if ! "$PY" bench/gpu_torch_ops.py --report "$REPORT" --out "$TORCH_TSV" 2>"$WORK/torch.err"; then
    tail -n 20 "$WORK/torch.err"
    fail "bench/gpu_torch_ops.py failed (PyTorch timings missing)"
  fi
else
  TORCH_NOTE="no python3 with a CUDA-enabled torch on this machine: PyTorch timings skipped"
  echo "gpu-check: $TORCH_NOTE"
fi
REPORT_PY=$(command -v python3 || command -v "$PY" || true)
[[ -n $REPORT_PY ]] || die "no python3 to format the table (raw rows: $REPORT)"

card=$(awk -F'\t' '$1 == "#device" {split($2, a, ","); print a[1]; exit}' "$REPORT")
[[ -n $card ]] || card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
card=$(echo "${card:-unknown-gpu}" | tr -c 'A-Za-z0-9._-' '-' | sed 's/-\+/-/g; s/^-//; s/-$//')
mkdir -p "$OUT_DIR"
RESULT=$OUT_DIR/gpu-$(date +%Y-%m-%d)-$card.txt
TABLE=$WORK/table.txt
"$REPORT_PY" bench/gpu_report.py --report "$REPORT" --torch "$TORCH_TSV" --torch-note "$TORCH_NOTE" >"$TABLE" ||
  fail "rows above their tolerance in the table (see 'FAIL' in the check column)"
TRAIN_TABLE=$WORK/train-table.txt
: >"$TRAIN_TABLE"
if [[ ${#TRAIN_RUNS[@]} -gt 0 ]]; then
  "$REPORT_PY" bench/gpu_train_report.py --report "$REPORT" "${TRAIN_RUNS[@]}" >"$TRAIN_TABLE" ||
    fail "the training table is incomplete (see $TRAIN_TABLE)"
fi
{
  echo "moeflex GPU check (scripts/gpu-check.sh), $(date -u +%Y-%m-%dT%H:%MZ)"
  if [[ $BUILT_FROM == PREBUILT* ]]; then  # this checkout's git metadata need not be the bundle's commit
    echo "commit: the bundle's (next line); this checkout's git says $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git status --porcelain 2>/dev/null | grep -q . && echo ' (with uncommitted changes)')"
  fi
  echo "binaries: $BUILT_FROM"
  echo "nvcc: ${NVCC:-none}; driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  echo
  echo "steps 1-2 (build, op harness and runtime tests): $([[ ${#FAILURES[@]} -eq 0 ]] && echo 'all passed' || echo 'FAILURES (below)')"
  echo "steps 3-4 (training on the GPU): ${TRAIN_NOTE:-ran (table below)}"
  echo
  cat "$TABLE"
  if [[ -s $TRAIN_TABLE ]]; then
    echo
    cat "$TRAIN_TABLE"
  fi
  if [[ -s $TIME_TABLE ]]; then
    echo
    cat "$TIME_TABLE"
  fi
  if [[ -s $PROFILE_TABLE ]]; then
    echo
    echo "--- where a moe-1b bf16 step goes (moeflex train --profile-ops; bench/gpu_op_profile.py)"
    cat "$PROFILE_TABLE"
  fi
  if [[ ${#FAILURES[@]} -gt 0 ]]; then
    echo
    echo "FAILURES:"
    printf '  %s\n' "${FAILURES[@]}"
    for t in test_backend_host test_cuda_runtime test_cuda_ops test_cuda_bench test_cuda_train; do
      [[ -f $WORK/$t.log ]] || continue
      if grep -q '^\[  FAILED  \]' "$WORK/$t.log"; then
        echo
        echo "--- $t: failure messages"
        grep -B2 -A8 -E 'Failure$|error:|what\(\)' "$WORK/$t.log" | head -n 300
      fi
    done
  fi
  echo
  echo "--- raw harness rows (op, dtype, shape, err, tol, ms, TFLOP/s, GB/s, note)"
  cat "$REPORT"
  if [[ -s $TORCH_TSV ]]; then
    echo
    echo "--- raw PyTorch rows (op, dtype, shape, ms, note)"
    cat "$TORCH_TSV"
  fi
} >"$RESULT"
cat "$TABLE"
[[ -s $TRAIN_TABLE ]] && { echo; cat "$TRAIN_TABLE"; }
echo
echo "gpu-check: results in $RESULT (logs in $WORK); $(($(date +%s) - START)) s in all"
if [[ ${#FAILURES[@]} -gt 0 ]]; then
  echo
  echo "gpu-check: FAILED (${#FAILURES[@]}):" >&2
  printf '  %s\n' "${FAILURES[@]}" >&2
  exit 1
fi
echo "gpu-check: PASSED"
