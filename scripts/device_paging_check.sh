#!/usr/bin/env bash
# One device call for the paging work: reuse a carried build of pagedopt._C (built elsewhere for the
# device's python and torch) or build it, run the CUDA paging/optimizer tests, then the benches that
# measure the paging targets. Every stage has its own time cap; results land in $OUT.
#
#   run(command="bash scripts/device_paging_check.sh", carry=[".devbuild", ".whl"])
#
# .devbuild/_C.*.so: an extension built for the device's python3 and torch (optional).
# .whl/*.whl: the peers' wheels (bitsandbytes, torchao), installed into /tmp/site (optional).
# PROBE_S (default 0: off): run scripts/probe_page_in.cu first, for at most that many seconds.
# STRESS_S (default 0: off): run scripts/stress_host_residency.py for that many seconds.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SRC=$(pwd); W="$HOME/po"; mkdir -p "$W"
cp -r "$SRC"/. "$W"/ && cd "$W" || exit 2
T0=$SECONDS
log() { echo "[paging_check +$((SECONDS - T0))s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
ok() { python3 -c "import sys, torch, pagedopt._ops as o; torch.ops.pagedopt.discard_; sys.exit(0 if o.has_cuda_kernels() else 1)" 2>/dev/null; }
if ls .devbuild/_C.*.so >/dev/null 2>&1; then cp .devbuild/_C.*.so pagedopt/; fi
if ok; then log "carried build imports"; else
  log "building"; PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout "${BUILD_S:-330}" \
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; ok || { log "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
fi
if compgen -G ".whl/*.whl" >/dev/null; then  # peers (bitsandbytes, torchao): carry .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site && log "wheels installed: $(ls .whl | tr '\n' ' ')"
fi
if [ "${PROBE_S:-0}" != 0 ]; then
  log "probe_page_in"; nvcc -O2 -arch=sm_90 -o /tmp/probe_in scripts/probe_page_in.cu && timeout "$PROBE_S" /tmp/probe_in | tee "$OUT/probe_page_in.txt"
fi
if [ "${STRESS_S:-0}" != 0 ]; then  # the intermittent host-residency NaN hunt (scripts/stress_host_residency.py)
  log "stress_host_residency"; timeout $((STRESS_S + 60)) python3 scripts/stress_host_residency.py --seconds "$STRESS_S" \
    2>&1 | tee "$OUT/stress.txt" | tail -n 12
fi
if [ "${TEST_S:-170}" != 0 ]; then
log "pytest -m cuda"
timeout "${TEST_S:-170}" python3 -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests/test_host_paging_cuda.py \
  tests/test_paging_cuda.py tests/test_optim_cuda.py tests/test_checkpoint_cuda.py tests/test_backward_updates.py} \
  > "$OUT/pytest_cuda.log" 2>&1
log "pytest rc=$?: $(tail -n 1 "$OUT/pytest_cuda.log")"; grep -E "passed|failed" "$OUT/pytest_cuda.log" | tail -n 2; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_cuda.log" | head -"${FAIL_LINES:-20}"
fi
if [ "${STEP_S:-150}" != 0 ]; then
  log "bench_step (TinyLlama-1.1B set, page-out rows)"
  # STEP_ARGS replaces the default selection (sets, dtypes, --only) as a whole
  timeout "${STEP_S:-150}" python3 bench/bench_step.py --no-torchao --no-plot --out "$OUT" ${STEP_ARGS:---sets tinyllama \
    --dtypes fp32 --only ${STEP_ONLY:-pagedopt_paged,pagedopt_adamw8bit,torch_adamw_fused}} > "$OUT/bench_step.log" 2>&1
  log "bench_step rc=$?"; tail -n "${STEP_LINES:-14}" "$OUT/bench_step.log"
fi
if [ "${TRAIN_S:-200}" != 0 ]; then
  log "bench_train"
  timeout "${TRAIN_S:-200}" python3 bench/bench_train.py --warmup 2 --steps "${TRAIN_STEPS:-6}" --rounds "${TRAIN_ROUNDS:-1}" --out /tmp/train_out --modes \
    "${TRAIN_MODES:-pagedopt_adamw8bit,pagedopt_paged_adamw8bit,pagedopt_paged_adamw8bit_pageout,pagedopt_paged_adamw8bit_host,pagedopt_paged_adamw8bit_host_bwd,torch_adamw_fused}" \
    > "$OUT/bench_train.log" 2>&1
  log "bench_train rc=$?"; tail -n 12 "$OUT/bench_train.log"; cp /tmp/train_out/train.json /tmp/train_out/train.png "$OUT"/ 2>/dev/null
fi
if [ -n "${PROFILE_MODES:-}" ]; then  # one step per mode under torch.profiler (scripts/profile_train_step.py)
  log "profile_train_step"; timeout "${PROFILE_S:-120}" python3 scripts/profile_train_step.py --modes "$PROFILE_MODES" ${PROFILE_ARGS:-} \
    > "$OUT/profile.txt" 2>&1; log "profile rc=$?"; grep -v -e Warning -e _warn_once "$OUT/profile.txt" | tail -n 60
fi
if [ "${PAGING_S:-70}" != 0 ]; then
  log "bench_paging"
  timeout "${PAGING_S:-70}" python3 bench/bench_paging.py --no-extras --repeat 5 --variants "${PAGING_VARIANTS:-arena,copy}" \
    --out "$OUT/paging.json" \
    > "$OUT/bench_paging.log" 2>&1
  log "bench_paging rc=$?"; tail -n 16 "$OUT/bench_paging.log"
fi
log "done"
