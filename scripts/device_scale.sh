#!/usr/bin/env bash
# One device call for bench/scale.py: build pagedopt._C (or reuse a carried/earlier build), then the
# scale grid, each configuration in a process of its own; results land in $OUT (scale.json,
# scale.md, scale.png, scale.log, build.log: five files, inside the eight a call brings back).
#
#   run(command="bash scripts/device_scale.sh", timeout_s=600)                       # the quick grid
#   run(command="SCALE_ROWS=... SCALE_SHAPES=1b,3b,7b SCALE_DTYPES=bf16 bash scripts/device_scale.sh")
#   run(command="bash scripts/device_scale.sh", carry=[".whl"])                      # with the peers' wheels
#
# The default quick grid (meant to fit 8 minutes on an H100, the build included; not yet timed): 7B-shaped fp32 and
# 13B-shaped bf16 parameters, for pagedopt's resident AdamW8bit, host residency with and without
# updates during backward, residency='auto' with updates during backward, and torch's fused AdamW.
# Knobs (env):
#   SCALE_ROWS     comma-separated rows of bench/scale_rows.py (python3 bench/scale.py --help lists them)
#   SCALE_SHAPES   shapes upward, NAME or NAME:DTYPE (default 7b:fp32,13b:bf16; the whole ladder:
#                  1b,3b,7b,10b,13b,20b,30b with SCALE_DTYPES)
#   SCALE_DTYPES   bf16,fp32 (for shapes given without a dtype)
#   SCALE_STEPS    training steps per configuration (default 5; the first one timed apart)
#   SCALE_ARGS     more bench/scale.py arguments (e.g. "--budget 4GiB --no-stop")
#   SCALE_PASSES   "ROWS@SHAPES;ROWS@SHAPES": one bench run per pass (see below)
#   SCALE_S        the bench's time cap in seconds (default 600 - the build - 20 s); no configuration
#                  starts in its last 60 s (--time-budget), so the tables are always written
#   SCALE_CHILD_S  one configuration's cap in seconds (default 180)
#   BUILD_S        the build's cap (default 330)
# .devbuild/_C.*.so (carried): an extension built for the device's python3 and torch, used if it imports.
# .whl/*.whl (carried): bitsandbytes and torchao for their rows, installed into /tmp/site.
DEVICE_SCRIPT=device_scale
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
free -g | head -2
device_extension
device_wheels
END=$(( T0 + ${SCALE_S:-$(( 600 - (SECONDS - T0) - 20 ))} + (SECONDS - T0) ))
# SCALE_PASSES: "ROWS@SHAPES;ROWS@SHAPES;..." runs bench/scale.py once per pass (each row's shapes
# its own), one after the other in the time left, each into $OUT/scale_N (tarred into scale.tgz).
# Without it: one pass of SCALE_ROWS over SCALE_SHAPES into $OUT.
DEFAULT_ROWS=pagedopt_adamw8bit,pagedopt_paged_adamw8bit_host,pagedopt_paged_adamw8bit_host_bwd,pagedopt_paged_adamw8bit_auto_bwd,torch_adamw_fused
IFS=';' read -r -a PASSES <<< "${SCALE_PASSES:-${SCALE_ROWS:-$DEFAULT_ROWS}@${SCALE_SHAPES:-7b:fp32,13b:bf16}}"
n=0
for pass in "${PASSES[@]}"; do
  n=$((n + 1))
  LEFT=$(( END - SECONDS ))
  if [ "$LEFT" -lt 90 ]; then log "only ${LEFT} s left: pass $n ($pass) not run"; continue; fi
  dir="$OUT"; [[ -n "${SCALE_PASSES:-}" ]] && dir="$OUT/scale_$n"
  mkdir -p "$dir"
  log "scale pass $n (${pass}): ${LEFT} s"
  timeout "$LEFT" python3 bench/scale.py --out "$dir" --time-budget $(( LEFT - 60 )) --timeout "${SCALE_CHILD_S:-180}" \
    --rows "${pass%%@*}" --shapes "${pass#*@}" --dtypes "${SCALE_DTYPES:-bf16,fp32}" --steps "${SCALE_STEPS:-5}" \
    ${SCALE_ARGS:-} 2>&1 | tee "$dir/scale.log" | grep -v -e "Warning" -e "warnings.warn"
  log "scale pass $n rc=${PIPESTATUS[0]}"
done
if [[ -n "${SCALE_PASSES:-}" ]]; then (cd "$OUT" && tar czf scale.tgz scale_* && rm -rf scale_*); fi
