PYTHON ?= python3

.PHONY: setup setup-tests demo test test-transformers-457 bench-smoke mutation build-status

# What pagedopt needs (torch, ninja, tqdm) and its build, in place; compiles only what changed.
setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# What only the tests need (pytest, hypothesis, matplotlib, transformers, accelerate).
setup-tests: setup
	PYTHON=$(PYTHON) bash scripts/setup_tests.sh

demo: setup
	$(PYTHON) -m pagedopt.demo

# The suite, with the transformers 4.57 run beside it (scripts/run_tests.sh)
test: setup-tests
	PYTHON=$(PYTHON) bash scripts/run_tests.sh

# tests/test_transformers_trainer.py again, on transformers 4.57 (.venv-transformers457/, a venv
# over the packages of $(PYTHON))
test-transformers-457: setup-tests
	PYTHON=$(PYTHON) bash scripts/test_transformers457.sh

bench-smoke: setup-tests
	$(PYTHON) -m pytest -q tests/test_bench_smoke.py tests/test_bench_quality.py

# Which units the last build compiled, and which a build would compile now
build-status:
	$(PYTHON) scripts/build_progress.py
	$(PYTHON) setup.py -q build_plan

# Mutation check (tests/mutants.toml, report for tests/MUTATION.md): make mutation ARGS="--only NAME"
# On a GPU machine: make mutation ARGS="--device"
mutation: setup-tests
	$(PYTHON) scripts/mutation.py $(ARGS)
