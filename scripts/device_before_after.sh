#!/usr/bin/env bash
# Before/after figures of a change, from one device machine: the baseline tree and this one are
# each built in $HOME (reused while the machine stays warm and their sources are unchanged), then
# the benches run alternately, baseline first, each configuration in a process of its own.
#
#   git archive <baseline commit> | (rm -rf .before && mkdir .before && tar -x -C .before)
#   run(command="bash scripts/device_before_after.sh build test step", carry=[".before"])
#   run(command="bash scripts/device_before_after.sh train")          # the next call, still warm
#
# Stages: build (both trees), test (pytest -m cuda on this tree), step (bench_step: the 1.1B set
# in fp32 and bf16, eager and captured, and the 2000-small-tensor set, for pagedopt's 8-bit and
# 32-bit AdamW), train (bench_train: the 936M LM in every pagedopt residency mode), probe (both
# trees: scripts/probe_host_time.py on 2000 small tensors, scripts/probe_first_step_memory.py on
# host residency with and without updates in backward). Env knobs:
# ROUNDS (alternations of before/after per bench, default 2), STEP_ONLY, STEP_ARGS (more bench_step
# arguments, e.g. "--sets small"), TRAIN_MODES, TRAIN_STEPS, PYTEST_ARGS; for the probes PROBE_CLS
# (default AdamW8bit), PROBE_SIDE (256), PROBE_STEPS (30), PROBE_ROUNDS (1) and PROBE_MEMORY (0: the
# host time only). Everything lands in $OUT: pytest_cuda.log, summary.txt (the table, also printed
# last) and before_after.tgz (build logs, step_{before,after}_N.json, train_{before,after}_N.json,
# the probes' output: a call brings back at most 8 files).
set -u
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
SRC=$(pwd)
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES="${*:-build test step train}"
ROUNDS="${ROUNDS:-2}"
STEP_ONLY="${STEP_ONLY:-pagedopt_adamw8bit,pagedopt_adamw32,pagedopt_paged_adamw8bit}"
TRAIN_MODES="${TRAIN_MODES:-pagedopt_adamw8bit,pagedopt_paged_adamw8bit,pagedopt_paged_adamw8bit_pageout,pagedopt_paged_adamw8bit_host,pagedopt_paged_adamw8bit_host_bwd}"
log() { echo "[before_after +${SECONDS}s] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

build() {  # $1: source tree, $2: name (before|after); builds a copy in $HOME/$2 unless its sources are unchanged
  local dst="$HOME/$2" stamp
  stamp=$(cd "$1" && tar c csrc setup.py 2>/dev/null | md5sum | cut -d' ' -f1)
  if [[ -f "$dst/.stamp" && "$(cat "$dst/.stamp")" == "$stamp" ]] && ls "$dst"/pagedopt/_C*.so >/dev/null 2>&1; then
    rsync -a --exclude '_C*.so' --exclude build "$1"/ "$dst"/ 2>/dev/null || cp -r "$1"/. "$dst"/
    log "$2: build reused"; return 0
  fi
  rm -rf "$dst"; mkdir -p "$dst"; cp -r "$1"/. "$dst"/
  (cd "$dst" && PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 timeout "${BUILD_S:-300}" python3 setup.py build_ext --inplace \
     > "$OUT/build_$2.log" 2>&1) || { log "$2: BUILD FAILED"; tail -20 "$OUT/build_$2.log"; return 1; }
  echo "$stamp" > "$dst/.stamp"; log "$2: built"
}

if has build; then
  [[ -d .before ]] || { log "no .before tree carried"; exit 2; }
  build "$SRC/.before" before & b1=$!
  build "$SRC" after & b2=$!
  wait $b1 || exit 1; wait $b2 || exit 1
fi
# this tree's sources as they are now (a warm machine's copy is refreshed without rebuilding)
if [[ -d "$HOME/after" ]]; then
  rsync -a --exclude '_C*.so' --exclude build --exclude .before "$SRC"/ "$HOME/after"/ 2>/dev/null || true
fi

if has test; then
  log "pytest -m cuda (after)"
  (cd "$HOME/after" && timeout "${TEST_S:-420}" python3 -m pytest ${PYTEST_ARGS:--m cuda -q -x -p no:cacheprovider tests} \
     2>&1 | tee "$OUT/pytest_cuda.log" | tail -5)
fi

if has step; then
  for r in $(seq 1 "$ROUNDS"); do
    for which in before after; do
      log "bench_step $which round $r"
      (cd "$HOME/$which" && timeout "${STEP_S:-240}" python3 bench/bench_step.py --only "$STEP_ONLY" --no-torchao \
         --no-plot --no-pageout ${STEP_ARGS:-} --out "$OUT/step_${which}_$r" > "$OUT/step_${which}_$r.log" 2>&1)
      cp "$OUT/step_${which}_$r/bench_step.json" "$OUT/step_${which}_$r.json" 2>/dev/null
      rm -rf "$OUT/step_${which}_$r"
    done
  done
fi

if has train; then
  for r in $(seq 1 "$ROUNDS"); do
    for which in before after; do
      log "bench_train $which round $r"
      (cd "$HOME/$which" && timeout "${TRAIN_S:-300}" python3 bench/bench_train.py --modes "$TRAIN_MODES" \
         --steps "${TRAIN_STEPS:-10}" --out "$OUT/train_${which}_$r" > "$OUT/train_${which}_$r.log" 2>&1)
      cp "$OUT/train_${which}_$r/train.json" "$OUT/train_${which}_$r.json" 2>/dev/null
      rm -rf "$OUT/train_${which}_$r"
    done
  done
fi

if has probe; then  # where a step's host time and the first steps' device memory go, in both trees
  for r in $(seq 1 "${PROBE_ROUNDS:-1}"); do
    for which in before after; do
      log "probes $which round $r"
      PYTHONPATH="$HOME/$which" timeout "${PROBE_S:-90}" python3 "$HOME/after/scripts/probe_host_time.py" --n 2000 \
        --cls "${PROBE_CLS:-AdamW8bit}" --side "${PROBE_SIDE:-256}" --steps "${PROBE_STEPS:-30}" \
        > "$OUT/probe_host_${which}_$r.txt" 2>&1
      head -2 "$OUT/probe_host_${which}_$r.txt"
      [[ "${PROBE_MEMORY:-1}" == 1 && $r == 1 ]] || continue
      PYTHONPATH="$HOME/$which" timeout "${PROBE_S:-90}" python3 "$HOME/after/scripts/probe_first_step_memory.py" \
        --modes host,host_bwd --layers 8 --out "$OUT/probe_memory_$which.json" > "$OUT/probe_memory_$which.txt" 2>&1
      grep -v "^    stream" "$OUT/probe_memory_$which.txt" | tail -6
    done
  done
fi

python3 "$SRC/scripts/before_after_table.py" "$OUT" | tee "$OUT/summary.txt" || true
# a call brings back at most 8 files: everything but the summary and the test log goes in one archive
(cd "$OUT" && mapfile -t rest < <(ls | grep -v -x -e summary.txt -e pytest_cuda.log -e before_after.tgz) \
   && (( ${#rest[@]} )) && tar czf before_after.tgz "${rest[@]}" && rm -rf "${rest[@]}") || true
