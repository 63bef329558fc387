"""Shared helpers for the pagedopt benchmarks.

* timing: CUDA events around each repeat (host clock + sync on CPU), median over
  `repeat` runs after `warmup` runs (defaults 3 and 10, like the peer figures);
* ceilings measured in the same run: device copy bandwidth (bytes read + written)
  and pinned host<->device bandwidth;
* parameter sets: a TinyLlama-shaped list (22 layers, hidden 2048, MLP 5632, k/v
  2048x256, vocab 32000 embed + lm_head, RMSNorm weights: ~1.1B params, 201 tensors)
  with a `scale` knob for tiny CPU runs, and a "many small tensors" set;
* random params and grads (never zeros);
* a JSON writer stamped with date, device and versions, plus `merge` / `summary`
  subcommands used by scripts/device_check.sh:

    python bench/common.py merge OUT.json A.json B.json ...
    python bench/common.py summary OUT.json

GB here means 1e9 bytes.
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterable, Sequence

import torch

DEFAULT_WARMUP = 3
DEFAULT_REPEAT = 10
GB = 1e9
GiB = float(1 << 30)


# --------------------------------------------------------------------------- devices, timing
def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def bench_device(name: str):
    """The device to bench on, or None (with a message) when it asks for CUDA and there is none."""
    device = torch.device(name)
    if is_cuda(device) and not torch.cuda.is_available():
        print("CUDA is not available; use --smoke or --device cpu", file=sys.stderr)
        return None
    return device


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory() -> None:
    """Drop garbage and give cached blocks back, between peers."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_ms(fn: Callable[[], object], device, warmup: int = DEFAULT_WARMUP, repeat: int = DEFAULT_REPEAT,
            sync_each: bool = True) -> list[float]:
    """Run fn() `warmup` times, then time `repeat` runs one by one; returns each run's ms.

    On CUDA each run sits between two events, and (sync_each) the device is idle before
    each run, so host-side launch overhead and syncs inside fn count, as in a real step.
    On CPU the host clock is used."""
    for _ in range(max(0, warmup)):
        fn()
    sync(device)
    times = []
    if is_cuda(device):
        for _ in range(repeat):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            if sync_each:
                end.synchronize()
            times.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in times]
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def host_time_ms(fn: Callable[[], object], device) -> float:
    """One run of fn(), host clock, device synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def stats(times_ms: Sequence[float]) -> dict:
    xs = [float(t) for t in times_ms]
    if not xs:
        return {"median_ms": None, "min_ms": None, "max_ms": None, "n": 0, "all_ms": []}
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "n": len(xs),
            "all_ms": [round(x, 5) for x in xs]}


def gbps(nbytes: float, ms: float | None) -> float | None:
    if not ms or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / GB


# --------------------------------------------------------------------------- ceilings
def copy_bandwidth(device, nbytes: int = 2 << 30, warmup: int = DEFAULT_WARMUP,
                   repeat: int = DEFAULT_REPEAT) -> dict:
    """Device-to-device `copy_` of an `nbytes` buffer; bandwidth counts bytes read + written."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), device, warmup, repeat)
    st = stats(times)
    moved = 2 * n * 4
    del src, dst
    free_memory()
    return {"buffer_bytes": n * 4, "bytes_moved": moved, **st, "gbps": gbps(moved, st["median_ms"])}


def duplex_copy(host: torch.Tensor, dev: torch.Tensor, device):
    """A function that copies the first half of ``host`` into ``dev`` and the second half of ``dev``
    back into ``host`` at once, each on a stream of its own after the current stream's work, the
    current stream waiting for both (what streaming host-resident states does: copies in and back
    overlap). On the CPU: the same two copies, one after the other."""
    half = host.numel() // 2
    if not is_cuda(device):
        def both_cpu():
            dev[:half].copy_(host[:half])
            host[half:2 * half].copy_(dev[half:2 * half])
        return both_cpu
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def both():
        cur = torch.cuda.current_stream(device)
        for s in streams:
            s.wait_stream(cur)
        with torch.cuda.stream(streams[0]):
            dev[:half].copy_(host[:half], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host[half:2 * half].copy_(dev[half:2 * half], non_blocking=True)
        for s in streams:
            cur.wait_stream(s)
    return both


def pinned_bandwidth(device, nbytes: int = 1 << 30, warmup: int = 2, repeat: int = 5) -> dict:
    """Pinned host -> device and device -> host `copy_` bandwidth (bytes copied / time), one
    direction at a time and both at once (half the bytes each way; the rate of each direction)."""
    if not is_cuda(device):
        return {"skipped": "not a CUDA device"}
    n = nbytes // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.uniform_(-1, 1)
    dev = torch.empty(n, dtype=torch.float32, device=device)
    h2d = stats(time_ms(lambda: dev.copy_(host, non_blocking=True), device, warmup, repeat))
    d2h = stats(time_ms(lambda: host.copy_(dev, non_blocking=True), device, warmup, repeat))
    # both directions at once (what streaming host-resident states does: copies in and back
    # overlap), each on a stream of its own, between two halves of the buffers
    half = n // 2
    duplex = stats(time_ms(duplex_copy(host, dev, device), device, warmup, repeat))
    del host, dev
    free_memory()
    return {"bytes": n * 4, "h2d": h2d, "d2h": d2h, "h2d_gbps": gbps(n * 4, h2d["median_ms"]),
            "d2h_gbps": gbps(n * 4, d2h["median_ms"]), "both": duplex,
            "both_gbps_each_way": gbps(half * 4, duplex["median_ms"])}


# --------------------------------------------------------------------------- parameter sets
def _scaled(x: int, scale: float, multiple: int = 8) -> int:
    if scale == 1.0:
        return x
    return max(multiple, int(round(x * scale / multiple)) * multiple)


def tinyllama_shapes(scale: float = 1.0, layers: int = 22) -> list[tuple[str, tuple[int, ...]]]:
    """TinyLlama-1.1B's parameter list (names, shapes), in model order.

    hidden 2048, MLP 5632, 32 heads with 4 k/v heads (k/v projections 2048 -> 256),
    vocab 32000 with an untied lm_head. scale multiplies every width (rounded to 8)."""
    hidden = _scaled(2048, scale)
    mlp = _scaled(5632, scale)
    kv = _scaled(256, scale)
    vocab = _scaled(32000, scale)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed_tokens", (vocab, hidden))]
    for i in range(layers):
        pre = f"layers.{i}."
        shapes += [
            (pre + "q_proj", (hidden, hidden)),
            (pre + "k_proj", (kv, hidden)),
            (pre + "v_proj", (kv, hidden)),
            (pre + "o_proj", (hidden, hidden)),
            (pre + "gate_proj", (mlp, hidden)),
            (pre + "up_proj", (mlp, hidden)),
            (pre + "down_proj", (hidden, mlp)),
            (pre + "input_layernorm", (hidden,)),
            (pre + "post_attention_layernorm", (hidden,)),
        ]
    shapes += [("norm", (hidden,)), ("lm_head", (vocab, hidden))]
    return shapes


def small_shapes(n: int = 2000, side: int = 256) -> list[tuple[str, tuple[int, ...]]]:
    """The launch-bound set: n tensors of side x side."""
    return [(f"w{i}", (side, side)) for i in range(n)]


def numel_of(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


def make_params(shapes, dtype: torch.dtype, device, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters ~ N(0, 0.02) with .grad ~ N(0, 1e-2) (random, never zero)."""
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        p.grad = torch.empty(shape, dtype=dtype, device=device)
        params.append(p)
    reinit_params(params, seed)
    return params


@torch.no_grad()
def reinit_params(params, seed: int = 0) -> None:
    """Refill params and grads with the same random values (so every peer starts equal)."""
    if not params:
        return
    device = params[0].device
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    for p in params:
        p.normal_(0.0, 0.02, generator=g)
        p.grad.normal_(0.0, 1e-2, generator=g)
        # N(0, s) can return an exact 0 only with negligible probability; grads are never all-zero.


@torch.no_grad()
def all_finite(params) -> bool:
    if not params:
        return True
    flags = [torch.isfinite(p).all() for p in params]
    return bool(torch.stack(flags).all().item())


# --------------------------------------------------------------------------- memory accounting
def _storage_key_and_bytes(t: torch.Tensor, views: bool = False):
    try:
        if views:  # the tensor's own bytes (tensors carved from one storage count apart)
            return (str(t.device), t.data_ptr()), t.numel() * t.element_size()
        st = t.untyped_storage()
        return (str(t.device), st.data_ptr()), st.nbytes()
    except Exception:  # tensor subclasses without storage, etc.
        return (str(t.device), id(t)), t.numel() * t.element_size()


def _walk_tensors(obj, out: dict, views: bool = False) -> None:
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) not in (torch.Tensor, torch.nn.Parameter):
            try:  # wrapper subclasses (torchao's OptimState8bit): count the inner tensors
                names, _ = obj.__tensor_flatten__()
                for name in names:
                    _walk_tensors(getattr(obj, name), out, views)
                return
            except Exception:
                pass
        key, nbytes = _storage_key_and_bytes(obj, views)
        out[key] = max(out.get(key, 0), nbytes)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk_tensors(v, out, views)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk_tensors(v, out, views)


def state_bytes(optimizer, views: bool = False) -> int:
    """Bytes of every distinct storage reachable from optimizer.state (shared codebooks once);
    ``views``: of every distinct tensor instead (states carved from shared slabs count their own
    bytes, not their slab's)."""
    found: dict = {}
    _walk_tensors(dict(optimizer.state), found, views)
    return int(sum(found.values()))


def cuda_allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if is_cuda(device) else 0


# --------------------------------------------------------------------------- environment, JSON
def env_info(device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, sm_count=props.multi_processor_count,
                    device_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    else:
        info["device_name"] = platform.processor() or "cpu"
    for mod in ("pagedopt", "bitsandbytes", "torchao"):
        m = sys.modules.get(mod)
        if m is not None:
            info[f"{mod}_version"] = getattr(m, "__version__", "?")
    return info


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return repr(obj)


def write_json(path: str, obj) -> None:
    """Write atomically (a bench killed by a timeout leaves the last complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(obj), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def short_error(exc: BaseException, limit: int = 300) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
    return msg[:limit]


def cuda_context_ok(device) -> bool:
    """False when an earlier error (illegal address, ...) poisoned the CUDA context."""
    if not is_cuda(device):
        return True
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


def fmt(x, nd: int = 2, width: int = 0) -> str:
    if x is None:
        s = "-"
    elif isinstance(x, float):
        s = f"{x:.{nd}f}"
    else:
        s = str(x)
    return s.rjust(width) if width else s


def table(rows: list[list], headers: list[str]) -> str:
    """Plain-text table: numbers (and '-' for None) right-aligned, text left-aligned."""
    cells = [[fmt(c) for c in r] for r in rows]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) if num else h.ljust(w) for h, w, num in zip(headers, widths, numeric)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for r in cells:
        out.append("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip())
    return "\n".join(out)


# --------------------------------------------------------------------------- merge / summary (device_check.sh)
def _summary_lines(doc: dict) -> list[str]:
    lines = []
    step = doc.get("step")
    if step:
        bw = step.get("bandwidth", {})
        copy = (bw.get("copy") or {}).get("gbps")
        lines.append(f"device: {step.get('env', {}).get('device_name')}  copy {fmt(copy, 0)}"
                     f" GB/s  pinned h2d/d2h {fmt((bw.get('pinned') or {}).get('h2d_gbps'), 1)}"
                     f"/{fmt((bw.get('pinned') or {}).get('d2h_gbps'), 1)} GB/s")
        lines.append(step_table(step))
    quant = doc.get("quant")
    if quant:
        lines.append(quant_table(quant))
    paging = doc.get("paging")
    if paging:
        lines.append("bench_paging: " + json.dumps(paging)[:1500])
    for key in sorted(k for k in doc if k not in ("step", "quant", "paging")):
        lines.append(f"{key}: {json.dumps(doc[key])[:500]}")
    return lines


def step_table(step: dict) -> str:
    rows = []
    for c in step.get("cases", []):
        note = c.get("skipped") or c.get("error") or ""
        if not note and c.get("mode") == "after_pageout":
            note = (f"{(c.get('paged_bytes') or 0) / GiB:.2f} GiB paged; page-out {fmt(c.get('page_out_ms'), 1)} ms;"
                    f" page-in ~{fmt(c.get('pagein_gbps_est'), 1)} GB/s")
        elif not note and (c.get("first_step_ms") or 0) > 1000:
            note = f"first step {c['first_step_ms'] / 1e3:.1f} s"
        if c.get("finite") is False:
            note = "NON-FINITE PARAMS " + note
        sb = c.get("state_bytes")
        rows.append([c.get("name"), c.get("set"), c.get("dtype"), c.get("mode"), c.get("median_ms"),
                     c.get("gbps"), None if c.get("frac_copy") is None else 100 * c["frac_copy"],
                     c.get("back_to_back_ms"), c.get("host_ms"), None if not sb else sb / GiB, note[:60]])
    return table(rows, ["optimizer", "set", "dtype", "mode", "ms", "GB/s", "%copy", "b2b ms", "host ms", "state GiB",
                        "note"])


def quant_table(quant: dict) -> str:
    rows = []
    for c in quant.get("cases", []):
        note = c.get("skipped") or c.get("error") or c.get("note") or ""
        rows.append([c.get("name"), c.get("dtype"), c.get("median_ms"), c.get("gbps"),
                     None if c.get("frac_copy") is None else 100 * c["frac_copy"], note[:60]])
    return table(rows, ["op", "dtype", "ms", "GB/s", "%copy", "note"])


def _main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "merge":
        out, parts = argv[1], argv[2:]
        doc: dict = {}
        if os.path.exists(out):
            try:
                with open(out) as f:
                    doc = json.load(f)
            except Exception:
                doc = {}
        for p in parts:
            key, _, path = p.partition("=") if "=" in p else (os.path.splitext(os.path.basename(p))[0], "", p)
            key = key.replace("bench_", "")
            try:
                with open(path) as f:
                    doc[key] = json.load(f)
            except Exception as e:  # missing or partial: note it, keep going
                doc[key] = {"missing": short_error(e)}
        write_json(out, doc)
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        with open(argv[1]) as f:
            doc = json.load(f)
        print("\n".join(_summary_lines(doc)))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
