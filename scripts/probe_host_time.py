"""The host time of one optimizer step on the launch-bound set (n small tensors): median wall time
of opt.step() without synchronizing (what the host spends launching), the step with a synchronize,
and torch.profiler's CPU time per op and cProfile's per Python function, for the pagedopt found
first on sys.path (run with PYTHONPATH=<tree> to compare two trees).

    PYTHONPATH=$HOME/before python scripts/probe_host_time.py --cls AdamW8bit --n 2000
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH's pagedopt

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cls", default="AdamW8bit")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--side", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--min-8bit-size", type=int, default=4096)
    args = ap.parse_args()
    import pagedopt

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.side, args.side, generator=g).to(device)) for _ in range(args.n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = getattr(pagedopt, args.cls)(params, lr=1e-4, min_8bit_size=args.min_8bit_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        opt.step()
    sync()
    host, full = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
        sync()
        full.append((time.perf_counter() - t0) * 1e3)
    print(f"pagedopt {pagedopt.__file__}  {args.cls}  n={args.n}  fast={getattr(getattr(opt, 'step_plan', None), 'fast', None)}")
    print(f"host ms median {statistics.median(host):.3f}  step ms median {statistics.median(full):.3f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            opt.step()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        opt.step()
    sync()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(12)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
