"""Where an eager step's host time goes: AdamW8bit steps queued back to back (as in training) on the
TinyLlama-shaped set (fp32 or bf16) or on 2000 tensors of 256x256, with the host time of each
step() call, the same for the ordinary step (the fast step turned off), and cProfile's top entries.
torch's synchronising calls are reported (torch.cuda.set_sync_debug_mode("warn")).

    python3 scripts/profile_host.py --set small            # on a GPU
    python3 scripts/profile_host.py --set tinyllama --dtype bf16
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repo's pagedopt
import common as C  # noqa: E402

import pagedopt  # noqa: E402
from pagedopt.optim import base  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--set", default="small", choices=["small", "tinyllama"])
ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--device", default="cuda")
args = ap.parse_args()
dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
shapes = C.tinyllama_shapes() if args.set == "tinyllama" else [(f"t{i}", (256, 256)) for i in range(2000)]
if args.device == "cpu":  # a quick look here: small tensors
    shapes = [(n, (16,)) for n, _ in shapes]
params = C.make_params(shapes, dtype, args.device)
opt = pagedopt.AdamW8bit(params, lr=1e-3)


def host_ms(steps):
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        out.append((time.perf_counter() - t0) * 1e3)
    if args.device != "cpu":
        torch.cuda.synchronize()
    return out


host_ms(3)
fast = host_ms(args.steps)
real = base.fast_step
base.fast_step = lambda o, p: False
ordinary = host_ms(args.steps)
base.fast_step = real
print(f"{args.set} {args.dtype}: {len(params)} tensors, plan.fast={opt._plan.fast}")
print(f"host ms per step, back to back: fast {statistics.median(fast):.3f} (min {min(fast):.3f}), "
      f"ordinary {statistics.median(ordinary):.3f} (min {min(ordinary):.3f})")
if args.device != "cpu":
    torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof = cProfile.Profile()
    prof.enable()
    host_ms(10)
    prof.disable()
if args.device != "cpu":
    torch.cuda.set_sync_debug_mode(0)
print(f"synchronising calls seen: {len([w for w in caught if 'synchroniz' in str(w.message)])}")
for w in caught[:3]:
    print("  ", str(w.message)[:160])
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:2500])
