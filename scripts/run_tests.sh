#!/usr/bin/env bash
# `make test` after its set-up: the test suite, and beside it (at a lower priority, on the core
# the suite mostly leaves idle) tests/test_transformers_trainer.py again on transformers 4.57
# (scripts/test_transformers457.sh), whose output is shown when the suite has finished.
# Exits non-zero when either fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=build/test-transformers457.log
mkdir -p build
if [ "${PAGEDOPT_TEST_TRANSFORMERS:-1}" != 0 ]; then
  echo "pagedopt tests: the transformers 4.57 run goes on beside the suite; its output ($LOG) follows the suite's"
  # at a lower priority and on one thread, so that it takes the core the suite leaves idle
  # rather than time from the suite's own threads
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHON="$PY" nice -n 10 bash scripts/test_transformers457.sh >"$LOG" 2>&1 &
  OTHER=$!
fi
# the suite on one pytest worker per core (pytest-xdist, at most 4), a test file to a worker
WORKERS=${PAGEDOPT_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
[ "$WORKERS" -gt 4 ] && WORKERS=4
XDIST=()
if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  XDIST=(-n "$WORKERS" --dist loadfile)
fi
# the set-up has just built the extension: tests/test_build.py then expects it up to date
PAGEDOPT_EXPECT_UP_TO_DATE=1 "$PY" -m pytest -q "${XDIST[@]}" tests
SUITE=$?
OTHER_RC=0
if [ -n "${OTHER:-}" ]; then
  wait "$OTHER"
  OTHER_RC=$?
  echo
  echo "=== transformers 4.57 (scripts/test_transformers457.sh) ==="
  cat "$LOG"
fi
if [ "$SUITE" != 0 ] || [ "$OTHER_RC" != 0 ]; then
  echo "pagedopt tests: FAILED (suite: exit $SUITE, transformers 4.57 run: exit $OTHER_RC)"
  exit 1
fi
