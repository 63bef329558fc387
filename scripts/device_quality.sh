#!/usr/bin/env bash
# One device call for bench/quality.py: reuse a warm machine's build of this tree (left by
# scripts/device_before_after.sh in $HOME/after) or build in place, install the carried peers'
# wheels (.whl/*.whl: bitsandbytes, torchao) into /tmp/site, then the quality bench with its own
# per-row cap (never an outer timeout: the report is written after the last row). Results in $OUT:
# quality.log and quality.tgz (quality.json, row_*.json, quality.png).
#
#   run(command="bash scripts/device_quality.sh", carry=[".whl"])
#   run(command="QUALITY_ARGS='--seeds 8 --rows fp32,pagedopt_4bit,torchao_4bit' bash scripts/device_quality.sh", ...)
DEVICE_SCRIPT=device_quality
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_extension
device_wheels
python3 bench/quality.py --jobs "${QUALITY_JOBS:-8}" --timeout "${QUALITY_ROW_S:-520}" --out "$OUT/quality" \
  ${QUALITY_ARGS:-} > "$OUT/quality.log" 2>&1
log "quality rc=$?"
grep -v -e "Warning" -e "warnings.warn" "$OUT/quality.log" | tail -70
(cd "$OUT" && tar czf quality.tgz quality && rm -rf quality)
