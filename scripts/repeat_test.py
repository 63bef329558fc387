"""Run one parametrized test function many times in one process and count failures: for faults
seen once in several runs (an intermittent result is a bug until explained).

    python scripts/repeat_test.py tests/test_optim_cuda.py test_cuda_step_equals_cpu_step \
        "cls=pagedopt.AdamW8bit,dtype=torch.float32" --times 200
"""
import argparse
import importlib.util
import os
import sys
import time
import traceback

import torch  # noqa: F401  (used by the evaluated arguments)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import pagedopt  # noqa: E402,F401


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file")
    ap.add_argument("function")
    ap.add_argument("kwargs", help="name=python expression, comma-separated")
    ap.add_argument("--times", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("under_test", os.path.join(ROOT, args.file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, args.function)
    kwargs = {k: eval(v) for k, v in (kv.split("=", 1) for kv in args.kwargs.split(",") if kv)}
    fails, t0, n = 0, time.time(), 0
    for n in range(1, args.times + 1):
        try:
            fn(**kwargs)
        except Exception:  # noqa: BLE001  (counted and shown)
            fails += 1
            if fails <= 3:
                print(f"run {n} failed:\n{traceback.format_exc(limit=3)}", flush=True)
        if time.time() - t0 > args.seconds:
            break
    print(f"{args.function}({args.kwargs}): {fails} failed of {n} runs in {time.time() - t0:.0f} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
