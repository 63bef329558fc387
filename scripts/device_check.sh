#!/usr/bin/env bash
# Build, test and benchmark pagedopt on the device machine (H200), in one call, from the repo root:
#
#   bash scripts/device_check.sh                        # info wheels build test bench
#   STAGES="build bench" bash scripts/device_check.sh   # or: bash scripts/device_check.sh build step
#
# Stages: info wheels build test bench (= step quant paging), or step / quant / paging alone.
# Env knobs: OUT (default /tmp/out), BUDGET_S (whole-script budget, default 540 s),
#   BUILD_TIMEOUT TEST_TIMEOUT STEP_TIMEOUT QUANT_TIMEOUT PAGING_TIMEOUT (caps, seconds),
#   STEP_ARGS QUANT_ARGS PAGING_ARGS (extra bench arguments, e.g. STEP_ARGS="--no-torchao"),
#   PYTEST_ARGS (default "-m cuda -q -x tests"; no quoted words), PYTHON (default python3),
#   FORCE_BUILD=1 (build even where nvidia-smi is missing).
# Carry the wheels: run(carry=[".whl"]). The wheels stage installs .whl/*.whl into /tmp/site.
#
# What comes back under $OUT (at most 8 files): results.json (every bench's JSON merged, plus the
# stage statuses), summary.txt, build.log, pytest_cuda.log, bench.log, bench_step.png,
# bench_quant.png and, if bench_paging wrote one, paging.png. The summary table prints last.
set -u
set -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$(pwd)
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/devcheck.XXXXXX)
export PYTHONUNBUFFERED=1
# multicast stays off on the multi-GPU kinds (harmless elsewhere)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
BUDGET="${BUDGET_S:-540}"
START=$SECONDS
FINAL_RC=0   # 1 when the build is incomplete or pytest fails; the benches still run

STAGES_REQ="${*:-${STAGES:-info wheels build test bench}}"
has_stage() { [[ " $STAGES_REQ " == *" $1 "* ]]; }
BENCHES=""
for b in step quant paging; do
  if has_stage bench || has_stage "$b"; then BENCHES="$BENCHES $b"; fi
done

declare -A STATUS=()
ORDER=()
set_status() { STATUS[$1]="$2"; [[ " ${ORDER[*]-} " == *" $1 "* ]] || ORDER+=("$1"); }
log() { echo "[device_check +$((SECONDS - START))s] $*"; }
elapsed() { echo $((SECONDS - START)); }

# The least useful time of each later stage is kept back for it: a slow build shortens the
# tests and benches instead of leaving them no time at all.
declare -A MIN_S=([test]=45 [step]=100 [quant]=30 [paging]=45)
reserve_after() {  # sum of MIN_S over the requested stages after $1
  local seen=0 sum=0 s
  for s in build test $BENCHES; do
    if ((seen)); then
      if [[ $s == test ]] && ! has_stage test; then continue; fi
      if [[ $s == paging && ! -f bench/bench_paging.py ]]; then continue; fi
      sum=$((sum + ${MIN_S[$s]:-0}))
    fi
    [[ $s == "$1" ]] && seen=1
  done
  echo "$sum"
}
# seconds a stage may run: min(cap, budget left - reserve for later stages - 20 for the summary)
stage_timeout() {
  local cap=$1 reserve
  reserve=$(reserve_after "$2")
  local left=$((BUDGET - (SECONDS - START) - reserve - 20))
  if ((left < cap)); then cap=$left; fi
  echo "$cap"
}

merge_results() {
  local parts=()
  [[ -f "$WORK/step/bench_step.json" ]] && parts+=("step=$WORK/step/bench_step.json")
  [[ -f "$WORK/quant/bench_quant.json" ]] && parts+=("quant=$WORK/quant/bench_quant.json")
  if [[ -d "$WORK/paging" ]]; then
    local js=("$WORK"/paging/*.json)
    if [[ -f "${js[0]}" ]]; then
      if ((${#js[@]} == 1)); then parts+=("paging=${js[0]}")
      else for j in "${js[@]}"; do parts+=("paging_$(basename "${j%.json}")=$j"); done; fi
    fi
  fi
  # stage statuses as JSON
  {
    printf '{"budget_s": %s, "elapsed_s": %s, "stages_requested": "%s"' "$BUDGET" "$(elapsed)" "$STAGES_REQ"
    for s in ${ORDER[@]+"${ORDER[@]}"}; do printf ', "%s": "%s"' "$s" "${STATUS[$s]//\"/\'}"; done
    printf '}\n'
  } > "$WORK/device_check.json"
  parts+=("device_check=$WORK/device_check.json")
  "$PY" "$ROOT/bench/common.py" merge "$OUT/results.json" "${parts[@]}" >/dev/null 2>&1 ||
    log "WARNING: merging the JSON files failed"
  [[ -f "$WORK/step/bench_step.png" ]] && cp -f "$WORK/step/bench_step.png" "$OUT/bench_step.png"
  [[ -f "$WORK/quant/bench_quant.png" ]] && cp -f "$WORK/quant/bench_quant.png" "$OUT/bench_quant.png"
  if [[ -d "$WORK/paging" ]]; then
    local png
    png=$(ls "$WORK"/paging/*.png 2>/dev/null | head -n 1)
    [[ -n "$png" ]] && cp -f "$png" "$OUT/paging.png"
  fi
  return 0
}

finish() {
  local rc=$?
  trap - EXIT
  merge_results
  {
    echo
    echo "================ device_check summary ($(elapsed) s of ${BUDGET} s) ================"
    if [[ -f "$OUT/results.json" ]]; then
      "$PY" "$ROOT/bench/common.py" summary "$OUT/results.json" 2>&1 | grep -v '^device_check:' || true
    fi
    echo
    for s in ${ORDER[@]+"${ORDER[@]}"}; do printf '  %-8s %s\n' "$s" "${STATUS[$s]}"; done
  } | tee "$OUT/summary.txt"
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT

# ---------------------------------------------------------------------------- info
if has_stage info; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,clocks.sm,clocks.mem \
      --format=csv,noheader 2>&1 | head -n 4
  else
    log "WARNING: nvidia-smi not found"
  fi
  info=$(timeout 60 "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA DEVICE')" 2>&1 | tail -n 1)
  echo "$info"
  set_status info "$info"
fi

# ---------------------------------------------------------------------------- wheels
if has_stage wheels; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$WORK/wheels.log" 2>&1; then
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      set_status wheels "ok: $(cd .whl && ls *.whl | sed 's/-py3.*\|-cp3.*//' | tr '\n' ' ')"
    else
      log "WARNING: installing the carried wheels failed (peers will be skipped):"
      tail -n 15 "$WORK/wheels.log"
      set_status wheels "FAILED (peers skipped)"
    fi
  else
    log "WARNING: no .whl/*.whl here (carry .whl); bitsandbytes/torchao peers will be skipped"
    set_status wheels "none carried"
  fi
fi

# ---------------------------------------------------------------------------- build
if has_stage build; then
  t=$(stage_timeout "${BUILD_TIMEOUT:-330}" build)
  log "build (timeout ${t}s) -> \$OUT/build.log"
  if ((t < 30)); then
    set_status build "SKIPPED (no time left)"
    exit 1
  fi
  if ! command -v nvidia-smi >/dev/null 2>&1 && [[ "${FORCE_BUILD:-0}" != 1 ]]; then
    # an editable install re-points the machine's pagedopt at this checkout: only where meant
    set_status build "SKIPPED (no nvidia-smi: not the device; FORCE_BUILD=1 to build anyway)"
    exit 1
  fi
  bstart=$SECONDS
  ( export TORCH_CUDA_ARCH_LIST="9.0a" MAX_JOBS=16 PAGEDOPT_CUDA=1
    timeout --kill-after=10 "$t" "$PY" -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
  rc=$?
  if ((rc == 0)); then
    chk=$(timeout 60 "$PY" -c "import pagedopt, pagedopt._ops as o; print('pagedopt', pagedopt.__version__,
'cuda kernels:', o.has_cuda_kernels())" 2>&1 | tail -n 1)
    echo "$chk" | tee -a "$OUT/build.log"
    if [[ $chk == *"cuda kernels: True"* ]]; then
      set_status build "ok in $((SECONDS - bstart)) s; $chk"
    else
      log "WARNING: the build finished but pagedopt has no CUDA kernels or does not import: $chk"
      set_status build "WARNING built in $((SECONDS - bstart)) s but: $chk"
      FINAL_RC=1
    fi
  else
    log "BUILD FAILED (rc=$rc, 124 = timeout); last lines of build.log:"
    grep -n -E "error|Error" "$OUT/build.log" | head -n 30
    tail -n 60 "$OUT/build.log"
    set_status build "FAILED rc=$rc after $((SECONDS - bstart)) s"
    exit 1
  fi
fi

# ---------------------------------------------------------------------------- tests
if has_stage test; then
  t=$(stage_timeout "${TEST_TIMEOUT:-150}" test)
  log "pytest ${PYTEST_ARGS:--m cuda -q -x tests} (timeout ${t}s) -> \$OUT/pytest_cuda.log"
  if ((t < 20)); then
    set_status pytest "SKIPPED (no time left)"
  else
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$t" "$PY" -m pytest -p no:cacheprovider ${PYTEST_ARGS:--m cuda -q -x tests} \
      > "$OUT/pytest_cuda.log" 2>&1
    rc=$?
    counts=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$OUT/pytest_cuda.log" | tail -n 1 |
      sed 's/=//g; s/^ *//; s/ *$//')
    case $rc in
      0) st="PASS" ;;
      5) st="NO TESTS COLLECTED" ;;
      124|137) st="TIMEOUT after ${t}s" ;;
      *) st="FAIL rc=$rc" ;;
    esac
    set_status pytest "$st: ${counts:-no counts}"
    if ((rc != 0)); then
      FINAL_RC=1
      grep -E "^(FAILED|ERROR)|Error|error:" "$OUT/pytest_cuda.log" | head -n 20
    fi
    log "pytest: $st: ${counts:-}"
  fi
fi

# ---------------------------------------------------------------------------- benches
run_bench() {  # name cap command...
  local name=$1 cap=$2
  shift 2
  local t
  t=$(stage_timeout "$cap" "$name")
  if ((t < 20)); then
    set_status "$name" "SKIPPED (no time left)"
    return
  fi
  log "bench $name (timeout ${t}s)"
  echo "===== bench $name: $*" >> "$OUT/bench.log"
  local bstart=$SECONDS
  timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep --line-buffered -v "^  \|^wrote "
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) set_status "$name" "ok in $((SECONDS - bstart)) s" ;;
    124|137) set_status "$name" "TIMEOUT after ${t}s (partial JSON kept)" ;;
    *) set_status "$name" "rc=$rc after $((SECONDS - bstart)) s (see bench.log)" ;;
  esac
  merge_results
}

for b in $BENCHES; do
  case $b in
    step)
      mkdir -p "$WORK/step"
      t=$(stage_timeout "${STEP_TIMEOUT:-220}" step)
      # shellcheck disable=SC2086
      run_bench step "${STEP_TIMEOUT:-220}" "$PY" bench/bench_step.py -v --out "$WORK/step" \
        --time-budget $((t > 40 ? t - 25 : 15)) ${STEP_ARGS:-} ;;
    quant)
      mkdir -p "$WORK/quant"
      # shellcheck disable=SC2086
      run_bench quant "${QUANT_TIMEOUT:-90}" "$PY" bench/bench_quant.py -v --out "$WORK/quant" ${QUANT_ARGS:-} ;;
    paging)
      if [[ -f bench/bench_paging.py ]]; then
        mkdir -p "$WORK/paging"
        phelp=$(timeout 60 "$PY" bench/bench_paging.py --help 2>&1)
        if [[ $phelp == *"--out"* ]]; then  # its --out takes the JSON file's path
          # shellcheck disable=SC2086
          run_bench paging "${PAGING_TIMEOUT:-150}" "$PY" bench/bench_paging.py \
            --out "$WORK/paging/bench_paging.json" ${PAGING_ARGS:-}
        else
          log "bench_paging.py has no --out in its --help: running it in $WORK/paging, merging any *.json it writes there"
          cd "$WORK/paging" || exit 1
          # shellcheck disable=SC2086
          run_bench paging "${PAGING_TIMEOUT:-150}" "$PY" "$ROOT/bench/bench_paging.py" ${PAGING_ARGS:-}
          cd "$ROOT" || exit 1
        fi
      else
        set_status paging "absent (bench/bench_paging.py not in the tree)"
      fi ;;
  esac
done

exit "$FINAL_RC"
