#!/usr/bin/env bash
# What only the tests need (`make test`, after scripts/setup.sh), into the environment of $PYTHON;
# what it installs is printed. Idempotent: installs only what is missing.
#
#   * pytest, pytest-xdist (the suite runs on one worker per core), hypothesis, matplotlib (the
#     benchmarks' plots, smoke-tested on the CPU);
#   * transformers 5.25.0 and accelerate 1.16.0, for tests/test_transformers_trainer.py (which
#     skips without them). transformers 5.x pins `kernels`, which our package index does not serve
#     and the Trainer does not need: it is installed with --no-deps, after its other requirements
#     (its metadata's list, less kernels: huggingface-hub, tokenizers, safetensors, ...).
#     PAGEDOPT_TEST_TRANSFORMERS=0 skips this (and the transformers 4.57 run, and peft and trl).
#   * deepspeed 0.19.8, for tests/test_deepspeed.py (which skips without it). PyPI has only its
#     source; it builds (about 20 s, its C++ ops are compiled only when used) against the torch
#     installed here (--no-build-isolation), with --no-deps after its requirements less torch, so
#     that torch stays as it is. PAGEDOPT_TEST_DEEPSPEED=0 skips this.
#   * peft 0.21.2 and trl 1.16.0, for tests/test_peft_trl.py and the README's "Use it with..."
#     snippets (tests/test_readme_integrations.py). Both require transformers, and pip would
#     resolve its pin of kernels again: they go in with --no-deps, after TRL's other requirements
#     (datasets 5.2.0, pandas, pyarrow, jinja2; peft's are transformers' and accelerate's);
#   * lightning 2.6.6, for tests/test_lightning.py and the README's Lightning snippet.
#     PAGEDOPT_TEST_LIGHTNING=0 skips it.
#   * torchao 0.18.0 (--no-deps: torch stays as it is), for the tests that read torchao's
#     AdamW8bit / AdamW4bit checkpoints (tests/test_four_bit_optim.py). PAGEDOPT_TEST_TORCHAO=0
#     skips it.
# The tests of each skip, naming the package, where it is missing.
#
# scripts/test_transformers457.sh then makes .venv-transformers457/ in the repository (a venv
# over these packages with transformers 4.57 in it) for the same tests on transformers 4.57.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "pagedopt test set-up: $*"; }
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

MISSING=$("$PY" scripts/missing_packages.py pytest pytest-xdist hypothesis matplotlib)
if [ -n "$MISSING" ]; then
  say "installing $MISSING into $SITE"
  "$PY" -m pip install -q $MISSING
fi
if [ "${PAGEDOPT_TEST_TRANSFORMERS:-1}" != 0 ]; then
  TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.25.0}
  ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.16.0}
  MISSING=$("$PY" scripts/missing_packages.py "transformers==$TRANSFORMERS_VERSION" "accelerate==$ACCELERATE_VERSION")
  if [ -n "$MISSING" ]; then
    say "installing transformers==$TRANSFORMERS_VERSION (without its pin of kernels), its requirements and accelerate==$ACCELERATE_VERSION into $SITE"
    "$PY" -m pip install -q "huggingface-hub>=2.4,<3" numpy packaging pyyaml "regex>=2025.10.22" \
      "tokenizers>=0.23.1,<0.24" typer "safetensors>=0.8" tqdm
    "$PY" -m pip install -q --no-deps "transformers==$TRANSFORMERS_VERSION"
    "$PY" -m pip install -q "accelerate==$ACCELERATE_VERSION"
  fi
fi
if [ "${PAGEDOPT_TEST_TRANSFORMERS:-1}" != 0 ]; then
  PEFT_VERSION=${PEFT_VERSION:-0.21.2}
  TRL_VERSION=${TRL_VERSION:-1.16.0}
  MISSING=$("$PY" scripts/missing_packages.py "peft==$PEFT_VERSION" "trl==$TRL_VERSION")
  if [ -n "$MISSING" ]; then
    say "installing peft==$PEFT_VERSION and trl==$TRL_VERSION (without their requirement of transformers, installed above) and TRL's requirements (datasets, pandas, pyarrow, jinja2) into $SITE"
    "$PY" -m pip install -q "datasets==5.2.0" "pandas>=2.1.1" "pyarrow>=21" jinja2 psutil
    "$PY" -m pip install -q --no-deps "peft==$PEFT_VERSION" "trl==$TRL_VERSION"
  fi
fi
if [ "${PAGEDOPT_TEST_LIGHTNING:-1}" != 0 ]; then
  LIGHTNING_VERSION=${LIGHTNING_VERSION:-2.6.6}
  MISSING=$("$PY" scripts/missing_packages.py "lightning==$LIGHTNING_VERSION")
  if [ -n "$MISSING" ]; then
    say "installing lightning==$LIGHTNING_VERSION into $SITE"
    "$PY" -m pip install -q "lightning==$LIGHTNING_VERSION"
  fi
fi
if [ "${PAGEDOPT_TEST_TORCHAO:-1}" != 0 ]; then
  TORCHAO_VERSION=${TORCHAO_VERSION:-0.18.0}
  MISSING=$("$PY" scripts/missing_packages.py "torchao==$TORCHAO_VERSION")
  if [ -n "$MISSING" ]; then
    say "installing torchao==$TORCHAO_VERSION (without requirements: torch stays as it is) into $SITE"
    "$PY" -m pip install -q --no-deps "torchao==$TORCHAO_VERSION"
  fi
fi
if [ "${PAGEDOPT_TEST_DEEPSPEED:-1}" != 0 ]; then
  DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
  MISSING=$("$PY" scripts/missing_packages.py "deepspeed==$DEEPSPEED_VERSION")
  if [ -n "$MISSING" ]; then
    say "installing deepspeed==$DEEPSPEED_VERSION (built against the installed torch, without changing it) and its requirements into $SITE"
    "$PY" -m pip install -q einops hjson msgpack ninja numpy packaging psutil py-cpuinfo "pydantic>=2" tqdm
    "$PY" -m pip install -q --no-build-isolation --no-deps "deepspeed==$DEEPSPEED_VERSION"
  fi
fi
