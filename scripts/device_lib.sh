# What the one-call device scripts share (sourced by scripts/device_scale.sh and
# scripts/device_quality.sh; DEVICE_SCRIPT names the caller in the log): NVLink multicast kept
# off, $OUT, the repository root as the working directory, log(), the extension (a carried
# .devbuild/_C.*.so, a warm machine's build of the same sources left in $HOME/after by
# scripts/device_before_after.sh, or a build here) and the carried peers' wheels.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
T0=$SECONDS
log() { echo "[${DEVICE_SCRIPT:-device} +$((SECONDS - T0))s] $*"; }

# The extension with CUDA kernels, in place, for these sources (csrc and setup.py as a stamp, kept
# in pagedopt/.device_stamp beside an in-place build, so that a warm machine's stale build of other
# sources is never taken); exits 1 if it cannot be had.
device_extension() {
  local ok='import sys, pagedopt._ops as o; sys.exit(0 if o.has_cuda_kernels() else 1)' stamp
  stamp=$(tar c csrc setup.py 2>/dev/null | md5sum | cut -d' ' -f1)
  if ls .devbuild/_C.*.so >/dev/null 2>&1; then  # carried: built for these sources
    cp .devbuild/_C.*.so pagedopt/ && echo "$stamp" > pagedopt/.device_stamp
  elif [[ -f "$HOME/after/.stamp" && "$(cat "$HOME/after/.stamp")" == "$stamp" ]]; then
    cp "$HOME"/after/pagedopt/_C*.so pagedopt/ && echo "$stamp" > pagedopt/.device_stamp
  fi
  if [[ "$(cat pagedopt/.device_stamp 2>/dev/null)" == "$stamp" ]] && python3 -c "$ok" 2>/dev/null; then
    log "build reused"; return 0
  fi
  log "building"
  rm -f pagedopt/.device_stamp
  PAGEDOPT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout "${BUILD_S:-330}" python3 setup.py build_ext --inplace \
    > "$OUT/build.log" 2>&1
  python3 -c "$ok" 2>/dev/null || { log "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
  echo "$stamp" > pagedopt/.device_stamp
  log "built"
}

# The carried wheels (.whl/*.whl: bitsandbytes, torchao) into /tmp/site, on PYTHONPATH.
device_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site && log "wheels installed: $(ls .whl | tr '\n' ' ')"
  fi
}
