#!/usr/bin/env bash
# Runs tests/test_transformers_trainer.py on transformers 4.57, the oldest version that
# pagedopt.integrations.transformers supports, in a venv over the system packages (torch,
# pagedopt as built in place by scripts/setup.sh, and pytest, hypothesis, accelerate from
# scripts/setup_tests.sh), so only
# transformers 4.57 and its huggingface-hub/tokenizers (and, where the system has datasets 5.x, a
# datasets 4.x) are installed there. Idempotent; used by
# `make test` and `make test-transformers-457`. PAGEDOPT_TEST_TRANSFORMERS=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV457:-.venv-transformers457}

if [ "${PAGEDOPT_TEST_TRANSFORMERS:-1}" = 0 ]; then
  echo "transformers 4.57 tests skipped (PAGEDOPT_TEST_TRANSFORMERS=0)"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "pagedopt test set-up: creating $VENV/ in $PWD (a venv over the packages of $PY, for transformers 4.57)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import sys, transformers; sys.exit(not transformers.__version__.startswith('4.57.'))" 2>/dev/null; then
  echo "pagedopt test set-up: installing transformers==4.57.* (and the huggingface-hub and tokenizers it needs) into $VENV/"
  "$VENV/bin/python" -m pip install -q "transformers==4.57.*"
fi
# transformers' Trainer imports datasets whenever it is installed. The datasets 5.x that
# scripts/setup_tests.sh installs for TRL needs a huggingface-hub (>= 1.31) that transformers 4.57
# does not take, so the venv gets a datasets 4.x of its own, over its own huggingface-hub.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('datasets') is None)" \
   && ! "$VENV/bin/python" -c "import datasets" 2>/dev/null; then
  echo "pagedopt test set-up: installing datasets 4.x (for the huggingface-hub of transformers 4.57) into $VENV/"
  "$VENV/bin/python" -m pip install -q "datasets>=4.7,<5"
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, pagedopt
print(f"transformers {transformers.__version__} (venv), torch {torch.__version__}, pagedopt from {pagedopt.__file__}")
PY
"$VENV/bin/python" -m pytest -q tests/test_transformers_trainer.py "$@"
