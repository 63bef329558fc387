"""Unified-memory paging bandwidth, side by side with pinned copies, in one run.

A list of managed tensors shaped like the 8-bit Adam states of a 1.1B-parameter TinyLlama
(per parameter: two uint8 states and two fp32 absmax per 256 elements; small tensors keep fp32
states), about 2.08 GiB in all, scaled to --size-gib; or --layout uniform: --tensors equal ones.
Measured (median of --repeat timed runs after --warmup, CUDA events around each run, device
idle before each run; GB = 1e9 bytes):

  pinned_h2d / pinned_d2h            one pinned host buffer <-> one device buffer, copy_
  pinned_h2d_tensors / _d2h_tensors  the same bytes, one copy_ per state tensor
  uvm_page_in                        PageManager.prefetch() of every tensor after a full page-out
  uvm_page_in_stage                  PageManager.stage() over 64 MiB chunks after a full page-out
  uvm_page_out                       PageManager.page_out() (cudaMemPrefetchAsync to host)
  uvm_page_out_first                 the very first page-out (host pages not yet allocated)
  arena_*                            the same with PageManager(arena_bytes=64 MiB): one driver
                                     call per run of consecutive tensors instead of one per tensor
  copy_*                             PageManager(arena_bytes=64 MiB, host_copies=True), what the
                                     paged optimizers use: page-out = copy-engine copy into a
                                     page-locked host copy + discard, page-in = discard-and-
                                     populate on the GPU + copy back (copy_pin_ahead: the wall
                                     time from the first allocation until the host copies pinned
                                     ahead in the background are ready; copy_page_out_first
                                     comes after that)
  resident_rw                        t.add_(1) over every tensor, all resident (HBM)
  fault_rw                           the same right after a full page-out, no prefetch (faults)
  uvm_roundtrip                      prefetch + add_(1) + page_out, i.e. a paged step's traffic
  host_preferred_rw                  add_(1) over tensors advised PreferredLocation=host +
                                     AccessedBy=device: read and written in place over the bus

Bandwidth counts the bytes of the tensors moved (rw rows: bytes read + written).

    python bench/bench_paging.py --out /tmp/paging.json            # ~2 GiB, on CUDA
    python bench/bench_paging.py --size-gib 8 --repeat 5 --out ...
    python bench/bench_paging.py --smoke --out /tmp/paging.json    # tiny; on CPU: "skipped"

DEVICE SAFETY: managed memory stays under 16 GiB (--size-gib is capped at 15), never more than
the free GPU memory allows (checked with torch.cuda.mem_get_info before allocating), and is never
oversubscribed: host residency comes only from explicit page-outs.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt

import torch  # noqa: E402

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20
MANAGED_LIMIT_GIB = 15.0
CHUNK_BYTES = 64 * MiB
MARGIN = 1 * GiB  # free GPU memory left untouched


# --------------------------------------------------------------------------- layout
def tinyllama_param_shapes(layers: int = 22, hidden: int = 2048, mlp: int = 5632, kv: int = 256,
                           vocab: int = 32000) -> list[tuple[int, ...]]:
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (mlp, hidden), (mlp, hidden), (hidden, mlp), (hidden,), (hidden,)]
    return shapes + [(hidden,), (vocab, hidden)]


def state_layout(size_bytes: int, layout: str, tensors: int) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of each state tensor, in allocation order, totalling about size_bytes."""
    if layout == "uniform":
        n = max(1, size_bytes // max(1, tensors))
        return [(n, torch.uint8)] * max(1, tensors)
    full = []
    for shape in tinyllama_param_shapes():
        numel = math.prod(shape)
        if numel >= 4096:  # 8-bit states
            blocks = (numel + 255) // 256
            full += [(numel, torch.uint8), (numel, torch.uint8), (blocks, torch.float32), (blocks, torch.float32)]
        else:  # fp32 states (bitsandbytes' min_8bit_size)
            full += [(numel, torch.float32), (numel, torch.float32)]
    total = sum(n * d.itemsize for n, d in full)
    scale = size_bytes / total
    return [(max(1, int(n * scale)), d) for n, d in full]


def chunks_of(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> list[list[torch.Tensor]]:
    from pagedopt.paging import split_by_bytes

    return split_by_bytes(tensors, lambda t: t.numel() * t.element_size(), chunk_bytes)


# --------------------------------------------------------------------------- timing
def timed(fn, setup=None, warmup: int = 2, repeat: int = 10) -> dict:
    """Each run: setup() (untimed), device synchronized, then fn() between two CUDA events.
    Returns ms of every timed run, their median, the first run (warm-up included) and host ms."""
    times, host, first = [], [], None
    for k in range(warmup + repeat):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        ms = start.elapsed_time(end)
        if first is None:
            first = ms
        if k >= warmup:
            times.append(ms)
            host.append((t1 - t0) * 1e3)
    return {"ms": statistics.median(times), "first_ms": first, "times_ms": times,
            "host_issue_ms": statistics.median(host)}


def with_rate(r: dict, nbytes: int) -> dict:
    r = dict(r)
    r["bytes"] = nbytes
    r["gbps"] = nbytes / (r["ms"] * 1e-3) / GB if r["ms"] > 0 else None
    r["first_gbps"] = nbytes / (r["first_ms"] * 1e-3) / GB if r["first_ms"] else None
    return r


# --------------------------------------------------------------------------- benches
def bench_pinned(layout, device, warmup, repeat) -> dict:
    total = sum(n * d.itemsize for n, d in layout)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    offsets, off = [], 0
    for n, d in layout:
        offsets.append((off, n * d.itemsize))
        off += n * d.itemsize
    hv = [host[o:o + b] for o, b in offsets]
    dv = [dev[o:o + b] for o, b in offsets]

    def each(dst, src):
        for a, b in zip(dst, src):
            a.copy_(b, non_blocking=True)

    out = {
        "pinned_h2d": with_rate(timed(lambda: dev.copy_(host, non_blocking=True), None, warmup, repeat), total),
        "pinned_d2h": with_rate(timed(lambda: host.copy_(dev, non_blocking=True), None, warmup, repeat), total),
        "pinned_h2d_tensors": with_rate(timed(lambda: each(dv, hv), None, warmup, repeat), total),
        "pinned_d2h_tensors": with_rate(timed(lambda: each(hv, dv), None, warmup, repeat), total),
    }
    del hv, dv, host, dev
    return out


def bench_managed(layout, device, warmup, repeat, arena_bytes: int, prefix: str, extras: bool,
                  host_copies: bool = False) -> dict:
    from pagedopt.paging import PageManager, advise_preferred_location_

    m = PageManager(arena_bytes=arena_bytes, host_copies=host_copies)
    t0 = time.perf_counter()
    ts = [m.zeros((n,), d, device) for n, d in layout]
    total = sum(t.numel() * t.element_size() for t in ts)
    chunks = chunks_of(ts)
    torch.cuda.synchronize()
    out = {}
    if host_copies:
        # the host copies are pinned ahead on a background thread from the first allocation on; the
        # first page-out below takes them ready (what an optimizer's first page_out() sees after a
        # step or more): their making is timed here, apart
        m.wait_pinned()
        out[f"{prefix}_pin_ahead"] = {"ms": (time.perf_counter() - t0) * 1e3, "bytes": total}

    def all_in():
        m.prefetch()

    def all_out():
        # prefetch first: after fault_rw the manager's belief (host) is stale, and a page-out of
        # tensors believed on the host would be skipped
        m.prefetch()
        m.page_out(sync=True)

    def stage_only():
        for _ in m.stage(chunks):
            pass

    # first: page-out (its first run is the cold one, host pages not allocated yet)
    out[f"{prefix}_page_out"] = with_rate(timed(m.page_out, all_in, warmup, repeat), total)
    out[f"{prefix}_page_in"] = with_rate(timed(m.prefetch, all_out, warmup, repeat), total)
    out[f"{prefix}_page_in_stage"] = with_rate(timed(stage_only, all_out, warmup, repeat), total)
    out[f"{prefix}_page_in_stage"]["chunks"] = len(chunks)

    if extras:
        def touch():
            for t in ts:
                t.add_(1)

        def roundtrip():
            m.prefetch()
            touch()
            m.page_out()

        out["resident_rw"] = with_rate(timed(touch, all_in, warmup, repeat), 2 * total)
        out["fault_rw"] = with_rate(timed(touch, all_out, warmup, repeat), 2 * total)
        out["uvm_roundtrip"] = with_rate(timed(roundtrip, all_out, warmup, repeat), 2 * total)
        all_out()
        for t in ts:
            advise_preferred_location_(t, None)
        torch.cuda.synchronize()
        out["host_preferred_rw"] = with_rate(timed(touch, None, warmup, repeat), 2 * total)
        for t in ts:
            advise_preferred_location_(t, device)
    first = out[f"{prefix}_page_out"]
    out[f"{prefix}_page_out_first"] = {"ms": first["first_ms"], "gbps": first["first_gbps"], "bytes": total}
    out[f"{prefix}_tensors"] = {"count": len(ts), "bytes": total, "managed_allocations":
                                len({t.untyped_storage().data_ptr() for t in ts})}
    del ts, chunks, m
    gc.collect()
    torch.cuda.synchronize()
    return out


# --------------------------------------------------------------------------- main
def env_info(device) -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "host": platform.node()}
    if device is not None:
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, total_memory=p.total_memory, driver_cuda=torch.cuda.driver_version()
                    if hasattr(torch.cuda, "driver_version") else None)
        try:
            info["concurrent_managed_access"] = bool(torch.ops.pagedopt.concurrent_managed_access(device.index))
        except Exception as e:  # noqa: BLE001
            info["concurrent_managed_access"] = f"unknown: {e}"
    return info


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def print_table(results: dict) -> None:
    rows = [(k, v) for k, v in results.items() if isinstance(v, dict) and "ms" in v]
    print(f"{'measure':<24} {'MiB':>9} {'ms':>9} {'GB/s':>8} {'host ms':>8}")
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for k, v in rows:
        print(f"{k:<24} {v['bytes'] / MiB:>9.1f} {f(v['ms']):>9} {f(v.get('gbps')):>8} "
              f"{f(v.get('host_issue_ms')):>8}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=None, help="total managed state bytes (default 2.08, "
                    "the 8-bit states of TinyLlama-1.1B; --smoke: 0.0625)")
    ap.add_argument("--layout", choices=("states", "uniform"), default="states")
    ap.add_argument("--tensors", type=int, default=200, help="tensor count for --layout uniform")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-arena", action="store_true", help="skip the arena variant")
    ap.add_argument("--variants", default="uvm,arena,copy", help="managed-memory variants to run (comma list "
                    "of uvm, arena, copy)")
    ap.add_argument("--no-extras", action="store_true", help="skip the rw / fault / host-preferred rows")
    ap.add_argument("--smoke", action="store_true", help="tiny run; on a machine without CUDA, exits 0 (skipped)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)

    size_gib = args.size_gib if args.size_gib is not None else (1 / 16 if args.smoke else 2.08)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    repeat = args.repeat if args.repeat is not None else (2 if args.smoke else 10)
    doc = {"bench": "paging", "config": {"size_gib": size_gib, "layout": args.layout, "warmup": warmup,
                                         "repeat": repeat, "chunk_bytes": CHUNK_BYTES, "smoke": args.smoke}}

    def finish(rc: int) -> int:
        if args.out:
            write_json(args.out, doc)
            print(f"wrote {args.out}")
        return rc

    if not torch.cuda.is_available() or torch.device(args.device).type != "cuda":
        doc["skipped"] = "no CUDA"
        doc["env"] = env_info(None)
        print("bench_paging skipped: no CUDA")
        return finish(0)
    device = torch.device(args.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    doc["env"] = env_info(device)

    from pagedopt.paging import paging_unavailable_reason

    reason = paging_unavailable_reason(device)
    if reason is not None:
        doc["skipped"] = reason
        print(f"bench_paging skipped: {reason}")
        return finish(0)
    if not 0 < size_gib <= MANAGED_LIMIT_GIB:
        doc["error"] = f"--size-gib must be in (0, {MANAGED_LIMIT_GIB}] (device safety: managed memory < 16 GiB)"
        print(doc["error"])
        return finish(2)
    size = int(size_gib * GiB)
    layout = state_layout(size, args.layout, args.tensors)
    total = sum(n * d.itemsize for n, d in layout)
    free, cap = torch.cuda.mem_get_info(device)
    doc["config"].update(tensors=len(layout), bytes=total, gpu_free_bytes=free, gpu_total_bytes=cap)
    if total + MARGIN > free:
        doc["error"] = (f"not enough free GPU memory: need {(total + MARGIN) / GiB:.2f} GiB "
                        f"(states + 1 GiB margin), {free / GiB:.2f} GiB free; lower --size-gib")
        print(doc["error"])
        return finish(2)
    print(f"bench_paging: {len(layout)} tensors, {total / GiB:.3f} GiB on {doc['env']['device']}, "
          f"median of {repeat} after {warmup} warm-up")

    results = {}
    results.update(bench_pinned(layout, device, warmup, repeat))
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if total + MARGIN > free:
        doc["error"] = f"free GPU memory fell to {free / GiB:.2f} GiB after the pinned bench"
        doc["results"] = results
        return finish(2)
    variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    if "uvm" in variants:
        results.update(bench_managed(layout, device, warmup, repeat, 0, "uvm", not args.no_extras))
    if "arena" in variants and not args.no_arena:
        results.update(bench_managed(layout, device, warmup, repeat, 64 * MiB, "arena", False))
    if "copy" in variants:
        results.update(bench_managed(layout, device, warmup, repeat, 64 * MiB, "copy", False, host_copies=True))
    doc["results"] = results
    doc["summary_gbps"] = {k: v.get("gbps") for k, v in results.items() if isinstance(v, dict) and "gbps" in v}
    print_table(results)
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())
