"""Hunt for the intermittent NaNs once seen in host-resident PagedAdam with 32-bit states on bf16
parameters (bench/RESULTS.md, sixth session, call B): repeat that test's scenario many times, each
time with new optimizers, and report which side (managed-memory reference or host-resident) went
wrong, if any. Variants: optimizers dropped right after the last step with their copies back still
in flight (``drop``), or after a synchronize (``sync``); updates during backward (``bwd``).

    python scripts/stress_host_residency.py --seconds 60          # on a GPU
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pagedopt  # noqa: E402

MiB = 1 << 20


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(512, 300), (4096,), (7,), (1024, 257), (33, 65)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", dtype)) for s in shapes]


def _train(opt, params, steps, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype)
        opt.step()


def one_round(name: str, dtype, variant: str, it: int) -> dict:
    ref_params, host_params = _params(dtype, it), _params(dtype, it)
    ref = getattr(pagedopt, name)(ref_params, lr=1e-2, min_8bit_size=256)
    host = getattr(pagedopt, name)(host_params, lr=1e-2, min_8bit_size=256)
    host.set_pager(residency="host", device_buffer=8 * MiB if "8bit" not in name else 4 * MiB)
    _train(ref, ref_params, 3, it)
    _train(host, host_params, 3, it)
    torch.cuda.synchronize()
    host.settle()
    out = {"ref_nan": any(bool(torch.isnan(p).any()) for p in ref_params),
           "host_nan": any(bool(torch.isnan(p).any()) for p in host_params),
           "differ": any(not torch.equal(a, b) for a, b in zip(ref_params, host_params))}
    if variant == "drop":  # one more step each, then drop everything with the copies back in flight
        _train(host, host_params, 1, it + 1)
    del ref, host
    if variant == "sync":
        torch.cuda.synchronize()
    gc.collect()
    return out


def _one_stream() -> None:
    """Diagnostic variant: the pager's copies run on the caller's stream (no cross-stream ordering)."""
    from pagedopt.paging import host_resident as hr

    def streams_of(self, device, be):
        s = be.current_stream(device.index)
        return (s, s)
    hr.HostResidentPager._streams_of = streams_of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--names", default="PagedAdam,PagedAdamW8bit")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--variants", default="drop,sync")
    ap.add_argument("--one-stream", action="store_true", help="copies on the caller's stream (diagnostic)")
    args = ap.parse_args()
    if args.one_stream:
        _one_stream()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    cases = [(n, dtypes[d], v) for n in args.names.split(",") for d in args.dtypes.split(",")
             for v in args.variants.split(",")]
    tally = {c: {"rounds": 0, "ref_nan": 0, "host_nan": 0, "differ": 0} for c in cases}
    end = time.time() + args.seconds
    it = 0
    while time.time() < end:
        for c in cases:
            r = one_round(*c, it)
            t = tally[c]
            t["rounds"] += 1
            for k in ("ref_nan", "host_nan", "differ"):
                t[k] += int(r[k])
        it += 1
    for (n, d, v), t in tally.items():
        print(f"{n:16s} {str(d):15s} {v:5s} rounds {t['rounds']:4d}  ref NaN {t['ref_nan']}  host NaN "
              f"{t['host_nan']}  differ {t['differ']}")
    bad = sum(t["ref_nan"] + t["host_nan"] + t["differ"] for t in tally.values())
    print("STRESS", "FAILURES" if bad else "clean", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
