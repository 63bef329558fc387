"""Where a training step of bench/bench_train.py's model spends its time, per optimizer mode: one
step under torch.profiler (after warm-ups), summarised as a GPU timeline relative to the step's
start: forward and backward (their CPU spans), the span and busy time of host-to-device and
device-to-host copies, and of the optimizer's kernels. For the host-resident modes this shows
whether the link is busy or waiting (for gradients, for regions of the device buffer).

    python scripts/profile_train_step.py --modes pagedopt_paged_adamw8bit_host_bwd,pagedopt_paged_adamw8bit
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_train as BT  # noqa: E402


def _busy(intervals):
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _print_copies(t0, copies: list, updates: dict) -> None:
    """Each chunk's copy in, update (gradients ready, start, end) and copy back, ms from the step's
    start (negative: during the step before), and how busy each direction was."""
    at = {(k, what): (t0.elapsed_time(s), t0.elapsed_time(e)) for k, what, s, e in copies}
    print("   chunk   in start   in end   grads   upd start  upd end  back start  back end")
    for k in sorted({k for k, _ in at}):
        cin, cback = at.get((k, "in"), (None, None)), at.get((k, "back"), (None, None))
        upd = [t0.elapsed_time(e) for e in updates[k]] if k in updates else [None] * 3
        cells = [*cin, *upd, *cback]
        print(f"   {k:5d}" + "".join(f"  {x:8.2f}" if x is not None else "         -" for x in cells))
    for what in ("in", "back"):
        ivs = [v for (k, w), v in at.items() if w == what]
        if ivs:
            first, last = min(s for s, _ in ivs), max(e for _, e in ivs)
            print(f"   copies {what}: {first:.2f} to {last:.2f} ms, busy {_busy(ivs):.2f} ms "
                  f"({_busy(ivs) / max(last - first, 1e-9) * 100:.0f}%)")


def _time_host_calls(steps, step) -> None:
    """Host time of the calls updates during backward make (wall clock on the thread that runs
    them, the autograd engine's), per step and per chunk, over ``steps`` back-to-back steps."""
    from pagedopt import _ops
    from pagedopt.optim import backward_updates as bu
    from pagedopt.optim import kernels
    from pagedopt.paging.stream_pass import StreamPass

    totals, counts = {}, {}
    targets = [(bu.BackwardUpdates, "_on_grad"), (bu.BackwardUpdates, "_update_chunk"),
               (bu.BackwardUpdates, "_update_part"), (bu.BackwardUpdates, "finish_step"),
               (bu.BackwardUpdates, "end_step"), (StreamPass, "take"), (StreamPass, "give_back"),
               (kernels, "step_chunk"), (_ops, "check_grads"), (_ops, "quantized_step_")]
    saved = []
    for owner, attr in targets:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))
        key = f"{getattr(owner, '__name__', owner)}.{attr}"

        def timed(*a, _fn=fn, _key=key, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_key] = totals.get(_key, 0.0) + time.perf_counter() - t0
                counts[_key] = counts.get(_key, 0) + 1
        setattr(owner, attr, timed)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    print(f"   host time per step of the calls (wall clock, inclusive), {steps} steps of {wall:.2f} ms:")
    for key in sorted(totals, key=totals.get, reverse=True):
        print(f"     {key:40s} {totals[key] * 1e3 / steps:7.2f} ms/step  {counts[key] // steps:4d} calls/step  "
              f"{totals[key] * 1e6 / counts[key]:7.1f} us/call")


def profile_mode(name: str, layers: int, warmup: int, profiler: bool = True, host_times: int = 0) -> None:
    mode = {m.name: m for m in BT.MODES}[name]
    cfg = BT.ModelConfig() if layers is None else BT.ModelConfig(layers=layers)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = BT.CausalLM(cfg).to(device)
    opt = mode.make(list(model.parameters()), device)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), device=device)
    marks = {}

    def step(mark=False):
        ev = lambda k: (marks.setdefault(k, torch.cuda.Event(enable_timing=True)).record() if mark else None)  # noqa: E731
        ev("start")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        ev("forward")
        loss.backward()
        ev("backward")
        opt.step()
        ev("step")
        opt.zero_grad(set_to_none=True)
        if mode.page_out:
            opt.page_out()

    for _ in range(warmup):
        step()
    # a few steps without the profiler (which slows the host, and so the hooks' work, several times):
    # the GPU times of forward, backward and step() marks, and the chunks' updates during backward
    bwd = getattr(opt, "_backward_updates", None)
    rows = []
    copy_traces = []  # per step: the copies of the pass opened at its end (the next step's)
    for _ in range(3):
        if bwd is not None:
            bwd.trace = []
            bwd.copy_trace = []
            copy_traces.append(bwd.copy_trace)
        step(mark=True)
        torch.cuda.synchronize()
        rows.append({k: marks["start"].elapsed_time(e) for k, e in marks.items()})
    med = {k: sorted(r[k] for r in rows)[1] for k in rows[0]}
    stats = opt.paging_stats() if getattr(opt, "is_paged", False) else None
    print(f"\n== {name}, no profiler (median of 3, ms from the step's start): forward {med['forward']:.1f}, "
          f"backward {med['backward']:.1f}, step {med['step']:.1f}; transfers "
          f"{getattr(stats, 'transfer_ms_last_step', None)}")
    if bwd is not None and bwd.trace:
        t0 = marks["start"]
        bwd_trace_all = list(bwd.trace)  # the last marked step's updates
        print("   chunk  grads ready  update start  update end   (last step)")
        trace = bwd.trace if profiler else bwd.trace[-3:]
        for k, ready, start, end in trace:
            print(f"   {k:5d}  {t0.elapsed_time(ready):11.2f}  {t0.elapsed_time(start):12.2f}  {t0.elapsed_time(end):10.2f}")
        bwd.trace = None
        if len(copy_traces) >= 2 and copy_traces[-2]:  # the last marked step's copies (its pass opened a step before)
            _print_copies(t0, copy_traces[-2], {k: (ready, start, end) for k, ready, start, end in bwd_trace_all})
        bwd.copy_trace = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):  # back to back, as in a training loop
        step()
    torch.cuda.synchronize()
    print(f"   loop: {(time.perf_counter() - start) * 200:.2f} ms per step (5 steps back to back)")
    if host_times and bwd is not None:
        _time_host_calls(host_times, step)
    if not profiler:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(mark=True)
        torch.cuda.synchronize()
    ms = {k: marks["start"].elapsed_time(e) for k, e in marks.items()}
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not evs:
        print(name, "no CUDA events recorded")
        return
    t0 = min(e.time_range.start for e in evs)
    kinds = {"HtoD": [], "DtoH": [], "opt kernels": [], "all kernels": []}
    for e in evs:
        iv = ((e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3)
        n = e.name
        if "Memcpy HtoD" in n:
            kinds["HtoD"].append(iv)
        elif "Memcpy DtoH" in n:
            kinds["DtoH"].append(iv)
        else:
            kinds["all kernels"].append(iv)
            if "step" in n.lower() and ("pagedopt" in n.lower() or "eight_bit" in n.lower() or "adam" in n.lower()):
                kinds["opt kernels"].append(iv)
    print(f"\n== {name}: events (ms from the step's start, GPU): forward {ms['forward']:.1f}, backward "
          f"{ms['backward']:.1f}, step {ms['step']:.1f}")
    for k, ivs in kinds.items():
        if ivs:
            print(f"   {k:12s} n={len(ivs):5d} first {min(s for s, _ in ivs):7.2f}  last end {max(e for _, e in ivs):7.2f}"
                  f"  busy {_busy(ivs):7.2f} ms")
    # the copies' busy time in 5 ms windows: where the link waits
    for k in ("HtoD", "DtoH"):
        ivs = kinds[k]
        if not ivs:
            continue
        end = max(e for _, e in ivs)
        row = []
        w = 0.0
        while w < end:
            clipped = [(max(s, w), min(e, w + 5)) for s, e in ivs if e > w and s < w + 5]
            row.append(f"{_busy(clipped) / 5 * 100:3.0f}")
            w += 5
        print(f"   {k} % busy per 5 ms: {' '.join(row)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modes", default="pagedopt_paged_adamw8bit_host_bwd,pagedopt_paged_adamw8bit_host")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-profiler", action="store_true", help="only the unprofiled steps' marks")
    ap.add_argument("--host-times", type=int, default=0, metavar="STEPS",
                    help="updates during backward: host time of their calls over STEPS steps")
    ap.add_argument("--variants", default="", help="updates during backward: comma-separated "
                    "PRIORITY/CHUNKS_PER_BUFFER pairs to compare, e.g. -1/3,0/3,-1/4")
    args = ap.parse_args()
    from pagedopt.optim.backward_updates import BackwardUpdates

    variants = [tuple(int(x) for x in v.split("/")) for v in args.variants.split(",") if v] or [(None, None)]
    for name in args.modes.split(","):
        for priority, chunks in variants:
            if priority is not None:
                BackwardUpdates.stream_priority, BackwardUpdates.chunks_per_buffer = priority, chunks
                print(f"\n-- update stream priority {priority}, {chunks} chunks per device buffer")
            profile_mode(name, args.layers, args.warmup, profiler=not args.no_profiler, host_times=args.host_times)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
