"""Does freeing page-locked host memory (pagedopt's pinned_empty: cudaFreeHost) wait for a copy
into it that is still queued? Queue ~0.2 s of GPU sleep then a device-to-host copy into the block on
a side stream, drop the block, and time the drop. A drop that returns at once means the copy may
land in freed (and maybe reused) host memory.

    python scripts/probe_free_host.py        # on a GPU
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pagedopt  # noqa: E402,F401


def one(kind: str) -> float:
    src = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    host = (torch.ops.pagedopt.pinned_empty([64 << 20], torch.uint8) if kind == "pinned_empty"
            else torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True))
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(400_000_000)  # a few hundred ms of GPU time on the side stream
        host.copy_(src, non_blocking=True)
    t0 = time.perf_counter()
    del host
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    rest = time.perf_counter() - t1
    print(f"{kind}: drop took {dt * 1e3:.1f} ms, the queued work then took {rest * 1e3:.1f} ms more", flush=True)
    return dt


if __name__ == "__main__":
    for kind in ("pinned_empty", "torch_pinned"):
        for _ in range(2):
            one(kind)
