#!/usr/bin/env bash
# The intermittent host-residency NaN, under diagnostic variants (each its own process, S seconds):
# the mixed loop as first seen, the failing case alone, CUDA_LAUNCH_BLOCKING=1, copies on one stream.
S=${S:-25}
run() { echo "--- $*"; timeout $((S + 60)) "$@" 2>&1 | grep -E "rounds|STRESS|Error" ; }
run python3 scripts/stress_host_residency.py --seconds "$S"
run python3 scripts/stress_host_residency.py --seconds "$S" --names PagedAdam --dtypes bf16 --variants sync
run env CUDA_LAUNCH_BLOCKING=1 python3 scripts/stress_host_residency.py --seconds "$S"
run python3 scripts/stress_host_residency.py --seconds "$S" --one-stream
