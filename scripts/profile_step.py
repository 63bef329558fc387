"""A few AdamW8bit steps on the TinyLlama-shaped set, for ncu:

    ncu --clock-control none -k regex:adam8bit_kernel -c 1 --section SpeedOfLight ... \
        python3 scripts/profile_step.py [--dtype bf16]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import common as C  # noqa: E402

import pagedopt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()
dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
params = C.make_params(C.tinyllama_shapes(), dtype, "cuda")
opt = pagedopt.AdamW8bit(params, lr=1e-3)
for _ in range(args.steps):
    opt.step()
torch.cuda.synchronize()
print("ok", sum(p.numel() for p in params))
