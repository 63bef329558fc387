#!/usr/bin/env bash
# The set-up of `make demo`, and the first half of `make test`'s: what pagedopt itself needs, and
# its build. Everything goes into the environment of $PYTHON (python3 by default); what it does is
# printed. Idempotent: a second run with nothing changed installs nothing and compiles nothing.
#
#   1. torch==2.14.1 if no torch is importable; ninja and tqdm if missing (pip); for step 3,
#      setuptools>=64, and wheel where setuptools is older than 70.1 (as in a fresh venv).
#   2. The extension, built in place: `python setup.py build_ext --inplace`, objects and ninja's
#      log kept in ./build, so only what changed is compiled (scripts/build_progress.py prints
#      which units, the progress and the elapsed time).
#   3. pagedopt as an editable package of this checkout (`pip install --no-build-isolation
#      --no-deps -e .`, which reuses the build of step 2), unless it is installed from here already.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "pagedopt set-up: $*"; }
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
  # On our machines this CUDA build of torch is served from local disk; with it the CUDA
  # sources compile and link even where there is no GPU.
  say "installing torch==2.14.1 into $SITE"
  "$PY" -m pip install -q "torch==2.14.1"
fi
read -r -a MISSING <<<"$("$PY" scripts/missing_packages.py --editable-build ninja tqdm)"
if [ "${#MISSING[@]}" != 0 ]; then
  say "installing ${MISSING[*]} into $SITE"
  "$PY" -m pip install -q "${MISSING[@]}"
fi

# Build the extension in place (CUDA kernels too when torch is a CUDA build and nvcc exists).
"$PY" setup.py -q build_ext --inplace
COMPILED=$("$PY" -c "import json; r = json.load(open('build/pagedopt-build.json')); print(f\"{len(r['compiled'])} of {len(r['units'])}\")")

if ! "$PY" scripts/missing_packages.py --installed-here pagedopt >/dev/null; then
  WAS=$("$PY" scripts/missing_packages.py --where pagedopt)
  say "installing pagedopt from $PWD into $SITE as an editable package${WAS:+ (in place of the one from $WAS)}"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
"$PY" - "$COMPILED" <<'PY'
import sys, torch, pagedopt._ops as o
print(f"pagedopt set-up: done; torch {torch.__version__}, CUDA kernels: {'yes' if o.has_cuda_kernels() else 'no'}, "
      f"GPU present: {torch.cuda.is_available()}; this set-up compiled {sys.argv[1]} units")
PY
