PYTHON ?= python3

.PHONY: setup demo test bench-smoke

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) -m pagedopt.demo

test: setup
	$(PYTHON) -m pytest -q tests

bench-smoke: setup
	$(PYTHON) -m pytest -q tests/test_bench_smoke.py
