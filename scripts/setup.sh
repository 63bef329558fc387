#!/usr/bin/env bash
# Installs what pagedopt needs and builds it in place. Idempotent; used by `make demo` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  # On our machines this CUDA build of torch is served from local disk; with it the CUDA
  # sources compile and link even where there is no GPU.
  "$PY" -m pip install -q "torch==2.14.1"
fi
"$PY" -m pip install -q ninja tqdm matplotlib pytest hypothesis
# The test extra's transformers and accelerate (pyproject.toml), for the Hugging Face Trainer
# integration's tests (tests/test_transformers_trainer.py; they skip without transformers).
# transformers 5.x pins `kernels`, which our index does not serve and the Trainer does not need:
# install it with --no-deps, after its other requirements (its metadata's list, less kernels).
# PAGEDOPT_TEST_TRANSFORMERS=0 skips this (and `make test-transformers-457`).
if [ "${PAGEDOPT_TEST_TRANSFORMERS:-1}" != 0 ]; then
  TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.25.0}
  ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.16.0}
  if ! "$PY" - "$TRANSFORMERS_VERSION" "$ACCELERATE_VERSION" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
sys.exit(m.version("transformers") != sys.argv[1] or m.version("accelerate") != sys.argv[2])
PY
  then
    "$PY" -m pip install -q "huggingface-hub>=2.4,<3" numpy packaging pyyaml "regex>=2025.10.22" \
      "tokenizers>=0.23.1,<0.24" typer "safetensors>=0.8" tqdm
    "$PY" -m pip install -q --no-deps "transformers==$TRANSFORMERS_VERSION"
    "$PY" -m pip install -q "accelerate==$ACCELERATE_VERSION"
  fi
fi
# Build the extension in place (CUDA kernels too when torch is a CUDA build and nvcc exists).
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" - <<'PY'
import torch, pagedopt._ops as o
print(f"pagedopt built: torch {torch.__version__}, CUDA kernels: {'yes' if o.has_cuda_kernels() else 'no'}, "
      f"GPU present: {torch.cuda.is_available()}")
PY
