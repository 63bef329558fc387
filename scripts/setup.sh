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
# Build the extension in place (CUDA kernels too when torch is a CUDA build and nvcc exists).
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" - <<'PY'
import torch, pagedopt._ops as o
print(f"pagedopt built: torch {torch.__version__}, CUDA kernels: {'yes' if o.has_cuda_kernels() else 'no'}, "
      f"GPU present: {torch.cuda.is_available()}")
PY
