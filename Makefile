PYTHON ?= python3

.PHONY: setup demo test test-transformers-457 bench-smoke mutation

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) -m pagedopt.demo

test: setup
	$(PYTHON) -m pytest -q tests
	PYTHON=$(PYTHON) bash scripts/test_transformers457.sh

# tests/test_transformers_trainer.py again, on transformers 4.57 (a venv over the system packages)
test-transformers-457: setup
	PYTHON=$(PYTHON) bash scripts/test_transformers457.sh

bench-smoke: setup
	$(PYTHON) -m pytest -q tests/test_bench_smoke.py

# Mutation check (tests/mutants.toml, report for tests/MUTATION.md): make mutation ARGS="--only NAME"
# On a GPU machine: make mutation ARGS="--device"
mutation: setup
	$(PYTHON) scripts/mutation.py $(ARGS)
