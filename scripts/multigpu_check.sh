#!/usr/bin/env bash
# Every multi-GPU run of issue 33 in one script (several GPUs of one host, NCCL). From the repo root:
#
#   run(command="bash scripts/multigpu_check.sh", kind="nvidia-h100-x8", timeout_s=600)  # build + a..e
#   run(command="bash scripts/multigpu_check.sh scale", timeout_s=600)                   # build (reused) + f
#   bash scripts/multigpu_check.sh nccl agree          # any subset of the stages, run in the order below
#   bash scripts/multigpu_check.sh all                 # every stage (more than one 600 s call on 8 GPUs)
#
# Fewer than 2 GPUs: prints "skipped: needs >= 2 GPUs (found N)" and exits 0. NVLink multicast stays off
# in this process and every child (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1). Device safety: no test or bench asks for more than 16 GiB of managed memory
# per GPU (bench/scale.py refuses such configurations), and page-locked host memory in all stays under
# 80% of the host's memory (bench_node.py --pinned-limit, scale.py --pinned-limit/--host-available).
#
# Stages (seconds expected on 8 x H100; each has its own cap and all share BUDGET_S, default 570: a later
# stage keeps a minimum, so a slow one shortens the rest instead of leaving them no time):
#   build    a copy of the tree in $HOME/pagedopt-multigpu (only changed files are copied, so a warm
#            machine rebuilds only what changed), PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a     150 cold, 10 warm
#   nccl     (a) every nccl test of the suite, one process per GPU, at 1/2/4/8 ranks where the GPUs
#            exist: DDP (test_distributed), FSDP2 with 8-bit/32-bit/paged classes, the family, LARS/LAMB,
#            4-bit (test_fsdp2*), DeepSpeed's one-GPU test (skipped without deepspeed)       120
#   agree    (b) tests/test_distributed_agreement.py: DDP and FSDP2 on a global batch cut per rank
#            agree with one process, 9 classes/pagers, at 2, 4, 8 GPUs                          50
#   reshard  (c) DCP saved at N ranks, loaded at M (8->4, 4->8, 2->1), bit for bit               60
#   link     (d) bench/bench_node.py link: pinned GB/s per GPU alone and with every GPU at once   30
#   step     (e) bench/bench_node.py step: the optimizer step per GPU at 1, 2, 4, 8 GPUs, a fixed
#            model and a fixed size per GPU, % of each GPU's copy bandwidth                     120
#   scale    (f) bench/scale.py --gpus N: FSDP2 across the node, bf16, 1 x 2048 tokens a GPU,
#            activation checkpointing, 5 steps, each configuration a torchrun of its own (60-120 s);
#            70b first (the goal: which rows hold it), then 30b (--no-stop: a row that ran out of
#            memory at 70b still runs 30b); no configuration starts that could not end in time  ~480
# Default stages: build nccl agree reshard link step (about 530 s cold on 8 GPUs); then `scale` alone.
#
# Knobs (env): OUT (default /tmp/out), BUDGET_S, BUILD_S NCCL_S AGREE_S RESHARD_S LINK_S STEP_S SCALE_S
# (caps), PYTEST_ARGS (added to every pytest stage, e.g. "-x"), STEP_WORLDS (1,2,4,8), STEP_ARGS,
# SCALE_SHAPES (70b,30b), SCALE_ROWS (pagedopt_paged_adamw8bit_host,pagedopt_adamw8bit,torch_adamw_fused;
# torchao_adamw8bit,torchao_adamw4bit with their wheels carried), SCALE_SEQ (2048), SCALE_STEPS (5),
# SCALE_CHILD_S (240, one configuration), SCALE_ARGS, HOST_MEM_GIB (the host's memory, where MemTotal
# grows as memory is used, as on the H200 kinds). MULTIGPU_FAKE_GPUS=N runs the script where there is no
# GPU, to check it (the cuda tests skip; give STEP_ARGS=--smoke and SCALE_ARGS="--smoke --assume-link 50,40,25").
# Carried wheels (.whl/*.whl: bitsandbytes, torchao, deepspeed) are installed into /tmp/site.
#
# What comes back in $OUT (8 files): summary.txt (printed last), results.json (stage statuses, the link
# and step benches' JSON), pytest.log, bench.log, build.log, node_step.png, scale.json, scale.png.
set -u
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
SRC=$(pwd)
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
START=$SECONDS
BUDGET="${BUDGET_S:-570}"
log() { echo "[multigpu +$((SECONDS - START))s] $*"; }

ALL="build nccl agree reshard link step scale"
REQ="${*:-build nccl agree reshard link step}"
[[ " $REQ " == *" all "* ]] && REQ="$ALL"
has() { [[ " $REQ " == *" $1 "* ]]; }

# ---------------------------------------------------------------------------- GPUs, host memory
if [ -n "${MULTIGPU_FAKE_GPUS:-}" ]; then  # checking this script where there is no GPU: cuda tests skip
  NGPU=$MULTIGPU_FAKE_GPUS
  GPU_NAME="no GPU (MULTIGPU_FAKE_GPUS)"
elif command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
else
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  GPU_NAME=""
fi
if [ "${NGPU:-0}" -lt 2 ]; then
  echo "skipped: needs >= 2 GPUs (found ${NGPU:-0})" | tee "$OUT/summary.txt"
  exit 0
fi
MEM_GIB=$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo)
if [ -n "${HOST_MEM_GIB:-}" ]; then
  MEM_GIB=$HOST_MEM_GIB
elif [[ "$GPU_NAME" == *H200* ]]; then  # these kinds' MemTotal starts small and grows as memory is used
  case $NGPU in 2) NOMINAL=256 ;; 4) NOMINAL=512 ;; 8) NOMINAL=560 ;; *) NOMINAL=$MEM_GIB ;; esac
  if [ "$MEM_GIB" -lt $((NOMINAL / 2)) ]; then
    log "MemTotal says ${MEM_GIB} GiB; this kind has ${NOMINAL} GiB (HOST_MEM_GIB overrides)"
    MEM_GIB=$NOMINAL
  fi
fi
PIN_GIB=$((MEM_GIB * 8 / 10))
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null
log "$NGPU GPUs ($GPU_NAME); host memory ${MEM_GIB} GiB, page-locked at most ${PIN_GIB} GiB in all; stages: $REQ"

# ---------------------------------------------------------------------------- bookkeeping
WORK=$(mktemp -d /tmp/multigpu.XXXXXX)
declare -A STATUS=()
ORDER=()
FINAL_RC=0
set_status() { STATUS[$1]="$2"; ORDER+=("$1"); }
declare -A MIN_S=([nccl]=60 [agree]=40 [reshard]=40 [link]=25 [step]=60 [scale]=150)
reserve_after() {  # the minimum seconds of the requested stages after $1
  local seen=0 sum=0 s
  for s in $ALL; do
    if ((seen)) && has "$s"; then sum=$((sum + ${MIN_S[$s]:-0})); fi
    [[ $s == "$1" ]] && seen=1
  done
  echo "$sum"
}
stage_timeout() {  # cap stage -> seconds it may run
  local cap=$1 left
  left=$((BUDGET - (SECONDS - START) - $(reserve_after "$2") - 15))
  ((left < cap)) && cap=$left
  echo "$cap"
}

finish() {
  local rc=$?
  trap - EXIT
  {
    printf '{"gpus": %s, "gpu_name": "%s", "host_mem_gib": %s, "elapsed_s": %s, "stages": "%s"' \
      "$NGPU" "$GPU_NAME" "$MEM_GIB" "$((SECONDS - START))" "$REQ"
    for s in ${ORDER[@]+"${ORDER[@]}"}; do printf ', "%s": "%s"' "$s" "${STATUS[$s]//\"/\'}"; done
    printf '}\n'
  } > "$WORK/status.json"
  parts=("multigpu_check=$WORK/status.json")
  [ -f "$WORK/link/node_link.json" ] && parts+=("node_link=$WORK/link/node_link.json")
  [ -f "$WORK/step/node_step.json" ] && parts+=("node_step=$WORK/step/node_step.json")
  "$PY" "$SRC/bench/common.py" merge "$OUT/results.json" "${parts[@]}" >/dev/null 2>&1 || log "WARNING: merging JSON failed"
  left=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null)
  {
    echo
    echo "================ multigpu_check summary: $NGPU x ${GPU_NAME:-GPU}, $((SECONDS - START)) s of $BUDGET ================"
    for f in "$WORK/link.txt" "$WORK/step/node_step.md" "$WORK/scale/scale.md"; do
      [ -f "$f" ] && { cat "$f"; echo; }
    done
    grep -h -E "^(FAILED|ERROR) " "$OUT/pytest.log" 2>/dev/null | head -n 40
    grep -h -E "^E +[A-Za-z.]*(Error|Exception):" "$OUT/pytest.log" 2>/dev/null | sort | uniq -c | head -n 20
    [ -n "$left" ] && echo "WARNING: processes still on the GPUs: $left"
    for s in ${ORDER[@]+"${ORDER[@]}"}; do printf '  %-8s %s\n' "$s" "${STATUS[$s]}"; done
  } | tee "$OUT/summary.txt"
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT

# ---------------------------------------------------------------------------- the copy, wheels, build
W="$HOME/pagedopt-multigpu"
mkdir -p "$W"
# mirror the tree into $W, copying only files whose bytes differ (their old times are kept, so that the
# build recompiles only what changed); $W's own build/, extension and caches stay
"$PY" - "$SRC" "$W" <<'EOF' || { log "copying the tree failed"; exit 1; }
import filecmp, os, shutil, sys
src, dst = sys.argv[1:3]
skip = {".git", "build", "__pycache__", ".whl", ".pytest_cache", ".hypothesis"}
seen = set()
for root, dirs, files in os.walk(src):
    dirs[:] = [d for d in dirs if d not in skip]
    rel = os.path.relpath(root, src)
    os.makedirs(os.path.join(dst, rel), exist_ok=True)
    for f in files:
        if f.startswith("_C.") and f.endswith(".so"):
            continue
        a, b = os.path.join(root, f), os.path.join(dst, rel, f)
        seen.add(os.path.normpath(os.path.join(rel, f)))
        if not os.path.exists(b) or not filecmp.cmp(a, b, shallow=False):
            shutil.copy2(a, b)
for root, dirs, files in os.walk(dst):
    dirs[:] = [d for d in dirs if d not in skip]
    rel = os.path.relpath(root, dst)
    for f in files:
        p = os.path.normpath(os.path.join(rel, f))
        if p not in seen and not (f.startswith("_C.") and f.endswith(".so")):
            os.remove(os.path.join(root, f))
EOF
cd "$W" || exit 2
export PYTHONPATH="$W"
if compgen -G "$SRC/.whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$SRC"/.whl/*.whl > "$WORK/wheels.log" 2>&1; then
    export PYTHONPATH="$W:/tmp/site"
    log "wheels: $(cd "$SRC/.whl" && ls *.whl | sed 's/-py3.*\|-cp3.*//' | tr '\n' ' ')"
  else
    log "WARNING: installing the carried wheels failed (their rows and tests skip)"; tail -n 5 "$WORK/wheels.log"
  fi
fi
if has build; then
  t=$(stage_timeout "${BUILD_S:-330}" build)
  log "build (at most ${t}s) -> build.log"
  b0=$SECONDS
  PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16} timeout --kill-after=10 "$t" \
    "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  rc=$?
  chk=$("$PY" -c "import pagedopt, pagedopt._ops as o; print(pagedopt.__file__, 'cuda kernels:', o.has_cuda_kernels())" 2>&1 | tail -n 1)
  if ((rc == 0)) && [[ $chk == "$W/"*"cuda kernels: True" ]]; then
    set_status build "ok in $((SECONDS - b0)) s"
  else
    log "BUILD FAILED (rc=$rc): $chk"; grep -E "error" "$OUT/build.log" | head -n 20; tail -n 30 "$OUT/build.log"
    set_status build "FAILED rc=$rc after $((SECONDS - b0)) s: $chk"
    exit 1
  fi
fi

# ---------------------------------------------------------------------------- the stages
run_pytest() {  # name cap -- pytest arguments
  local name=$1 cap=$2 t rc counts st
  shift 3
  t=$(stage_timeout "$cap" "$name")
  if ((t < 20)); then set_status "$name" "SKIPPED (no time left)"; return; fi
  log "$name: pytest $* (at most ${t}s) -> pytest.log"
  echo "===== $name: pytest -m cuda $*" >> "$OUT/pytest.log"
  local s0=$SECONDS
  # shellcheck disable=SC2086
  timeout --kill-after=30 "$t" "$PY" -m pytest -m cuda -p no:cacheprovider -q -rs ${PYTEST_ARGS:-} "$@" \
    >> "$OUT/pytest.log" 2>&1
  rc=$?
  counts=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$OUT/pytest.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
  case $rc in
    0) st="PASS" ;; 5) st="NO TESTS" ;; 124|137) st="TIMEOUT after ${t}s" ;; *) st="FAIL rc=$rc" ;;
  esac
  ((rc != 0)) && FINAL_RC=1
  set_status "$name" "$st in $((SECONDS - s0)) s: ${counts:-no counts}"
  log "$name: ${STATUS[$name]}"
}

run_bench() {  # name cap -- command
  local name=$1 cap=$2 t rc
  shift 3
  t=$(stage_timeout "$cap" "$name")
  if ((t < 20)); then set_status "$name" "SKIPPED (no time left)"; return; fi
  log "$name: $* (at most ${t}s) -> bench.log"
  echo "===== $name: $*" >> "$OUT/bench.log"
  local s0=$SECONDS
  timeout --kill-after=70 "$t" "$@" >> "$OUT/bench.log" 2>&1
  rc=$?
  case $rc in
    0) set_status "$name" "ok in $((SECONDS - s0)) s" ;;
    124|137) set_status "$name" "TIMEOUT after ${t}s (partial results kept)"; FINAL_RC=1 ;;
    *) set_status "$name" "rc=$rc after $((SECONDS - s0)) s (see bench.log)"; FINAL_RC=1 ;;
  esac
  log "$name: ${STATUS[$name]}"
}

if has nccl; then
  run_pytest nccl "${NCCL_S:-240}" -- -k "nccl or deepspeed_one_gpu" tests/test_distributed.py tests/test_fsdp2.py \
    tests/test_fsdp2_four_bit.py tests/test_deepspeed.py
fi
if has agree; then
  run_pytest agree "${AGREE_S:-150}" -- tests/test_distributed_agreement.py
fi
if has reshard; then
  run_pytest reshard "${RESHARD_S:-150}" -- -k reshard_nccl tests/test_fsdp2_checkpoint.py
fi
if has link; then
  mkdir -p "$WORK/link"
  run_bench link "${LINK_S:-120}" -- "$PY" bench/bench_node.py link --nproc "$NGPU" \
    --pinned-limit $((PIN_GIB << 30)) --out "$WORK/link"
  [ -f "$WORK/link/node_link.json" ] && "$PY" - "$WORK/link/node_link.json" > "$WORK/link.txt" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
import bench_node
print(bench_node.link_table(json.load(open(sys.argv[1]))))
EOF
fi
if has step; then
  mkdir -p "$WORK/step"
  t=$(stage_timeout "${STEP_S:-240}" step)
  # shellcheck disable=SC2086
  run_bench step "${STEP_S:-240}" -- "$PY" bench/bench_node.py step --nproc "$NGPU" --worlds "${STEP_WORLDS:-1,2,4,8}" \
    --timeout $((t > 80 ? t / 2 : 40)) --out "$WORK/step" ${STEP_ARGS:-}
  [ -f "$WORK/step/node_step.png" ] && cp -f "$WORK/step/node_step.png" "$OUT/"
fi
if has scale; then
  mkdir -p "$WORK/scale"
  t=$(stage_timeout "${SCALE_S:-540}" scale)
  child=${SCALE_CHILD_S:-240}
  # no configuration starts unless a whole one still fits (and the tables are written)
  grid=$((t - child - 40 > 30 ? t - child - 40 : 30))
  # shellcheck disable=SC2086
  run_bench scale "${SCALE_S:-540}" -- "$PY" bench/scale.py --gpus "$NGPU" --seq "${SCALE_SEQ:-2048}" --dtypes bf16 \
    --shapes "${SCALE_SHAPES:-70b,30b}" --no-stop --steps "${SCALE_STEPS:-5}" --timeout "$child" --time-budget "$grid" \
    --rows "${SCALE_ROWS:-pagedopt_paged_adamw8bit_host,pagedopt_adamw8bit,torch_adamw_fused}" \
    --pinned-limit "${PIN_GIB}GiB" --host-available "${PIN_GIB}GiB" --out "$WORK/scale" ${SCALE_ARGS:-}
  for f in scale.json scale.png; do [ -f "$WORK/scale/$f" ] && cp -f "$WORK/scale/$f" "$OUT/"; done
fi
exit "$FINAL_RC"
