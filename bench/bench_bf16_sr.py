"""What bf16_stochastic_round costs on the GPU: the engine's step (quantized_step_) on bf16 parameters
with and without stochastic rounding, 8-bit and 32-bit states, in one process on one set of
tensors. The step is memory-bound; rounding adds integer work (two 64-bit hashes per 8 elements in
the vector path) and reads one 8-byte stream per tensor, no memory traffic per element.

    python bench/bench_bf16_sr.py [--numel 268435456] [--tensors 1] [--iters 30]

Prints one line per case: median ms per step, GB/s of the bytes a step must move, and the ratio
with / without rounding."""
from __future__ import annotations

import argparse
import statistics

import torch

from pagedopt import _ops
from pagedopt.quant import dynamic_codebook

ADAMW = [1e-4, 0.9, 0.999, 1e-8, 0.01, 1.0]  # lr, beta1, beta2, eps, weight_decay, decoupled


def case(numel: int, tensors: int, eight_bit: bool):
    n = numel // tensors
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=g).bfloat16() for _ in range(tensors)]
    grads = [torch.randn(n, device="cuda", generator=g).bfloat16() * 1e-3 for _ in range(tensors)]
    if eight_bit:
        states = [[torch.zeros(n, dtype=torch.uint8, device="cuda") for _ in params] for _ in range(2)]
        absmax = [[torch.zeros((n + 255) // 256, device="cuda") for _ in params] for _ in range(2)]
        qmaps = [dynamic_codebook(True, "cuda"), dynamic_codebook(False, "cuda")]
    else:
        states = [[torch.zeros(n, device="cuda") for _ in params] for _ in range(2)]
        absmax, qmaps = [], []
    steps = [torch.tensor(1.0, device="cuda") for _ in params]
    bytes_moved = numel * (2 + 2 + 2 + (2 * 2 if eight_bit else 2 * 8))  # p r/w, g, states r/w
    return params, grads, states, absmax, steps, qmaps, bytes_moved


def time_step(args, sr: bool, iters: int) -> float:
    params, grads, states, absmax, steps, qmaps, _ = args
    kw = dict(sr_ids=list(range(len(params))), sr_seed=1) if sr else {}

    def step():
        _ops.quantized_step_("adam", params, grads, states, absmax, steps, qmaps, ADAMW, **kw)

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 28)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--iters", type=int, default=30)
    a = parser.parse_args()
    print(torch.cuda.get_device_name(), f"numel={a.numel} tensors={a.tensors}")
    for eight_bit in (True, False):
        args = case(a.numel, a.tensors, eight_bit)
        base = time_step(args, False, a.iters)
        rounded = time_step(args, True, a.iters)
        label = "8-bit" if eight_bit else "32-bit"
        for name, ms in (("nearest", base), ("stochastic", rounded)):
            print(f"adamw {label} states, bf16 params, {name:10s}: {ms:8.3f} ms  {args[-1] / ms / 1e6:7.1f} GB/s")
        print(f"adamw {label}: stochastic / nearest = {rounded / base:.3f}")
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
