"""bench/*.py as modules for the tests of the benches: ``load_bench("scale")`` executes
bench/scale.py as the module ``pagedopt_bench_scale`` (registered in sys.modules, which dataclasses
look their module up in), with bench/ on sys.path while it imports its siblings (common.py, ...)."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def load_bench(name: str):
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(f"pagedopt_bench_{name}", os.path.join(BENCH, f"{name}.py"))
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH)
    return mod
