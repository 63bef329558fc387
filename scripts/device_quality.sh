#!/usr/bin/env bash
# One device call for bench/quality.py: reuse a warm machine's build of this tree (left by
# scripts/device_before_after.sh in $HOME/after) or build in place, install the carried peers'
# wheels (.whl/*.whl: bitsandbytes, torchao) into /tmp/site, then the quality bench with its own
# per-row cap (never an outer timeout: the report is written after the last row). Results in $OUT:
# quality.log and quality.tgz (quality.json, row_*.json, quality.png).
#
#   run(command="bash scripts/device_quality.sh", carry=[".whl"])
#   run(command="QUALITY_ARGS='--seeds 8 --rows fp32,pagedopt_4bit,torchao_4bit' bash scripts/device_quality.sh", ...)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
T0=$SECONDS
log() { echo "[device_quality +$((SECONDS - T0))s] $*"; }
stamp=$(tar c csrc setup.py 2>/dev/null | md5sum | cut -d' ' -f1)
if [[ -f "$HOME/after/.stamp" && "$(cat "$HOME/after/.stamp")" == "$stamp" ]]; then
  cp "$HOME"/after/pagedopt/_C*.so pagedopt/ && log "build reused"
else
  log "building"
  PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout "${BUILD_S:-330}" python3 setup.py build_ext --inplace \
    > "$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
  log "built"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site && log "wheels installed: $(ls .whl | tr '\n' ' ')"
fi
python3 bench/quality.py --jobs "${QUALITY_JOBS:-8}" --timeout "${QUALITY_ROW_S:-520}" --out "$OUT/quality" \
  ${QUALITY_ARGS:-} > "$OUT/quality.log" 2>&1
log "quality rc=$?"
grep -v -e "Warning" -e "warnings.warn" "$OUT/quality.log" | tail -70
(cd "$OUT" && tar czf quality.tgz quality && rm -rf quality)
