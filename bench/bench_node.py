"""Several GPUs of one node: the host link per GPU with every GPU copying at once, and the optimizer
step's time per GPU at 1, 2, 4 and 8 GPUs.

    python bench/bench_node.py link --out DIR      # every GPU: each alone, then all at once
    python bench/bench_node.py step --out DIR      # 1, 2, 4, 8 GPUs (those present)
    python bench/bench_node.py step --smoke --out DIR   # the CPU (gloo), tiny shapes, seconds (CI)
    python bench/bench_node.py link --smoke --bytes 4096 --out DIR   # the CPU: the harness alone

Each measurement runs in processes started by torchrun (``python -m torch.distributed.run
--standalone``), one per GPU; this command (the parent) holds no CUDA context, gathers the ranks'
records and prints the tables.

link: pinned host <-> device copies of ``--bytes`` (1 GiB) per GPU: host -> device, device -> host,
and both at once (half the bytes each way, each on a stream of its own), first one GPU at a time
(the others idle), then every GPU at once (a barrier before each repetition, so that the copies
overlap): the rate each GPU gets when all share the host's links and memory, beside its rate
alone, and their sum over the node. Also the seconds each rank took to page-lock its buffer, all
ranks at once. Page-locked memory in all: GPUs x bytes, refused above ``--pinned-limit`` (80% of
the host's memory).

step: the optimizer step alone (random gradients, no forward or backward), timed on every rank
at once (a barrier before each step, CUDA events around it; median of ``--repeat`` after
``--warmup``; the first step, which makes the states, apart) for two sets: the TinyLlama-1.1B
parameter list sharded over the GPUs (``fixed_model``: each GPU holds 1/world of every tensor)
and one such list per GPU (``fixed_per_gpu``: the model grows with the GPUs). At 1 GPU the
parameters are plain tensors (the one-GPU kernel); beyond, DTensors sharded by rows (Shard(0)),
as FSDP2's fully_shard makes them, so that the optimizer's sharded path is what is timed. Rows:
pagedopt AdamW8bit, AdamW4bit, PagedAdamW8bit with host-resident states (the link shared by every
GPU), torch's fused AdamW. Per rank: the median, the effective GB/s at the step's floor bytes
(bench/step_specs.floor_bytes_per_param) and its share of the device copy bandwidth measured on
that GPU in the same run; the tables give the slowest rank's.

Writes node_link.json, node_step.json and node_step.md (and node_step.png with matplotlib).
GB = 1e9 bytes, GiB = 2^30 bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt

import torch  # noqa: E402

import common as C  # noqa: E402
from scale_fsdp import leave, run_graceful  # noqa: E402
from step_specs import floor_bytes_per_param  # noqa: E402

GiB = 1 << 30
WORLDS = (1, 2, 4, 8)
ROWS = {  # name: (bits of the moments, what makes the optimizer)
    "pagedopt_adamw8bit": (8, "AdamW8bit", None),
    "pagedopt_adamw4bit": (4, "AdamW4bit", None),
    "pagedopt_paged_adamw8bit_host": (8, "PagedAdamW8bit", "host"),
    "torch_adamw_fused": (32, None, None),
}
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


# --------------------------------------------------------------------------- in every rank (torchrun)
def _init(smoke: bool):
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if smoke or not torch.cuda.is_available():
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    else:
        device, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return rank, world, device


def _barrier(device) -> None:
    import torch.distributed as dist

    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    C.sync(device)


def _timed(fn, device, warmup: int, repeat: int, together: bool) -> list[float]:
    """ms of each of ``repeat`` runs of fn() after ``warmup``; ``together``: a barrier before each,
    so that every rank runs it at the same time."""
    times = []
    for i in range(warmup + repeat):
        if together:
            _barrier(device)
        C.sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return times


def _copies(host, dev, device, warmup, repeat, together) -> dict:
    n, half = host.numel(), host.numel() // 2
    both = C.duplex_copy(host, dev, device)  # on the CPU (--smoke): plain copies, the harness alone is checked
    out = {}
    for name, fn, nbytes in (("h2d", lambda: dev.copy_(host, non_blocking=True), 4 * n),
                             ("d2h", lambda: host.copy_(dev, non_blocking=True), 4 * n),
                             ("both", both, 4 * half)):
        st = C.stats(_timed(fn, device, warmup, repeat, together))
        out[name + "_ms"] = st["median_ms"]
        out[name + "_gbps"] = C.gbps(nbytes, st["median_ms"])  # "both": the rate of each direction
    return out


def link_worker(args) -> None:
    import torch.distributed as dist

    rank, world, device = _init(args.smoke)
    rec = {"rank": rank, "device": str(device), "env": C.env_info(device)}
    n = args.bytes // 4
    _barrier(device)
    t0 = time.perf_counter()
    host = torch.empty(n, dtype=torch.float32, pin_memory=device.type == "cuda")  # every rank at once
    rec["pin_s"] = time.perf_counter() - t0
    host.uniform_(-1, 1)
    dev = torch.empty(n, dtype=torch.float32, device=device)
    for r in range(world):  # one GPU at a time
        _barrier(device)
        if r == rank:
            rec["alone"] = _copies(host, dev, device, args.warmup, args.repeat, together=False)
    rec["all"] = _copies(host, dev, device, args.warmup, args.repeat, together=True)
    recs = [None] * world
    dist.all_gather_object(recs, rec)
    if rank == 0:
        C.write_json(args.child_out, {"world": world, "bytes_per_gpu": 4 * n, "ranks": recs})
    dist.destroy_process_group()
    leave()


def _shapes(smoke: bool):
    return C.tinyllama_shapes(scale=1 / 64, layers=2) if smoke else C.tinyllama_shapes()


def _params(shapes, world, rank, set_name, dtype, device, mesh):
    """Parameters (and random gradients) of this rank: plain at one rank, else DTensor shards by
    rows of ``set_name``'s global tensors."""
    g = torch.Generator(device=device).manual_seed(rank)  # drawn where they live: 2 x 1.1B values a rank
    params = []
    for _, shape in shapes:
        rows = shape[0] // world if set_name == "fixed_model" else shape[0]
        if set_name == "fixed_model" and shape[0] % world:
            raise ValueError(f"a tensor of {shape} does not split into {world} equal shards")
        local = (torch.randn((rows, *shape[1:]), generator=g, device=device) * 0.02).to(dtype)
        grad = (torch.randn((rows, *shape[1:]), generator=g, device=device) * 1e-2).to(dtype)
        if world > 1:
            from torch.distributed.tensor import DTensor, Shard
            glob = (rows * world, *shape[1:])
            stride = torch.empty(glob, device="meta").stride()
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=glob, stride=stride)
            grad = DTensor.from_local(grad, mesh, [Shard(0)], run_check=False, shape=glob, stride=stride)
        p = torch.nn.Parameter(local)
        p.grad = grad
        params.append(p)
    return params


def _optimizer(row: str, params, device):
    import warnings

    bits, cls, residency = ROWS[row]
    if cls is None:
        return torch.optim.AdamW(params, fused=device.type == "cuda", **HYPER)
    import pagedopt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a Paged* class on the CPU: unpaged
        opt = getattr(pagedopt, cls)(params, **HYPER)
    if residency:
        opt.set_pager(residency=residency)
    return opt


def step_worker(args) -> None:
    import torch.distributed as dist

    rank, world, device = _init(args.smoke)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    copy = C.copy_bandwidth(device, 64 << 20 if args.smoke else GiB) if device.type == "cuda" else {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    records = []
    for set_name in args.sets.split(","):
        params = _params(_shapes(args.smoke), world, rank, set_name, dtype, device, mesh)  # every row steps these
        local = sum((p._local_tensor if world > 1 else p).numel() for p in params)
        for row in args.rows.split(","):
            rec = {"set": set_name, "row": row, "world": world, "rank": rank, "local_params": local}
            opt = None
            try:
                opt = _optimizer(row, params, device)
                _barrier(device)
                t0 = time.perf_counter()
                opt.step()
                C.sync(device)
                rec["first_step_ms"] = (time.perf_counter() - t0) * 1e3
                times = _timed(opt.step, device, args.warmup, args.repeat, together=True)
                rec.update(step_ms=statistics.median(times), step_ms_all=times)
                floor = floor_bytes_per_param(ROWS[row][0], args.dtype) * local
                rec["floor_gbps"] = C.gbps(floor, rec["step_ms"])
                if copy.get("gbps"):
                    rec["copy_share"] = rec["floor_gbps"] / copy["gbps"]
                stats = opt.paging_stats() if hasattr(opt, "paging_stats") else None
                if stats is not None:
                    rec["link_h2d"], rec["link_d2h"] = stats.page_in_bytes_last_step, stats.page_out_bytes_last_step
                if device.type == "cuda":
                    rec["max_allocated"] = torch.cuda.max_memory_allocated(device)
            except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
                rec["error"] = C.short_error(exc)
            opt = None  # its states go before the next row's are made
            C.free_memory()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            records.append(rec)
        del params
        C.free_memory()
    gathered = [None] * world
    dist.all_gather_object(gathered, {"records": records, "copy_gbps": copy.get("gbps"), "env": C.env_info(device)})
    if rank == 0:
        C.write_json(args.child_out, {"world": world, "ranks": gathered})
    dist.destroy_process_group()
    leave()


# --------------------------------------------------------------------------- the parent
def torchrun(nproc: int, argv: list[str], timeout: float) -> Optional[str]:
    """Run this file under torchrun on ``nproc`` processes; None, or what went wrong."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), *argv]
    try:
        proc = run_graceful(cmd, timeout, stderr=subprocess.PIPE)  # torchrun, terminated, ends its workers
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode:
        lines = [x for x in (proc.stderr or "").splitlines() if "Error" in x or "error" in x] or \
            (proc.stderr or "").splitlines()
        return f"exit {proc.returncode}: " + " | ".join(lines[-3:])[-400:]
    return None


def host_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_link(args) -> dict:
    gpus = 2 if args.smoke else (args.nproc or torch.cuda.device_count())
    if gpus < 1:
        return {"skipped": "no CUDA GPU"}
    limit = args.pinned_limit if args.pinned_limit is not None else int(0.8 * (host_memory() or 0))
    if gpus * args.bytes > limit:
        return {"skipped": f"{gpus} x {args.bytes / GiB:g} GiB page-locked is over the limit of {limit / GiB:.1f} GiB"}
    path = os.path.join(tempfile.mkdtemp(prefix="node_link_"), "link.json")
    err = torchrun(gpus, ["_link", "--bytes", str(args.bytes), "--warmup", str(args.warmup), "--repeat",
                          str(args.repeat), "--child-out", path] + (["--smoke"] if args.smoke else []), args.timeout)
    if err:
        return {"error": err}
    with open(path) as f:
        doc = json.load(f)
    ranks = doc["ranks"]
    doc["summary"] = {
        f"{mode}_{k}": [r[mode][k + "_gbps"] for r in ranks] for mode in ("alone", "all") for k in ("h2d", "d2h", "both")}
    doc["summary"].update({f"node_{k}_gbps": sum(r["all"][k + "_gbps"] for r in ranks) for k in ("h2d", "d2h", "both")})
    doc["summary"]["pin_s"] = [r["pin_s"] for r in ranks]
    return doc


def link_table(doc: dict) -> str:
    if "ranks" not in doc:
        return f"link: {doc.get('skipped') or doc.get('error')}"
    rows = [[r["rank"], C.fmt(r["alone"]["h2d_gbps"], 1), C.fmt(r["all"]["h2d_gbps"], 1), C.fmt(r["alone"]["d2h_gbps"], 1),
             C.fmt(r["all"]["d2h_gbps"], 1), C.fmt(r["alone"]["both_gbps"], 1), C.fmt(r["all"]["both_gbps"], 1),
             C.fmt(r["pin_s"], 2)] for r in doc["ranks"]]
    s = doc["summary"]
    rows.append(["node", "", C.fmt(s["node_h2d_gbps"], 1), "", C.fmt(s["node_d2h_gbps"], 1), "",
                 C.fmt(s["node_both_gbps"], 1), ""])
    return (f"pinned copies of {doc['bytes_per_gpu'] / GiB:g} GiB per GPU, GB/s (both: each way), alone / all GPUs at once\n"
            + C.table(rows, ["GPU", "h2d alone", "h2d all", "d2h alone", "d2h all", "both alone", "both all",
                             "pin s (all)"]))


def run_step(args) -> dict:
    gpus = 2 if args.smoke else (args.nproc or torch.cuda.device_count())
    worlds = [w for w in (int(x) for x in args.worlds.split(",")) if w <= gpus]
    doc = {"command": " ".join(["bench/bench_node.py", *sys.argv[1:]]), "dtype": args.dtype, "worlds": {}}
    for w in worlds:
        path = os.path.join(tempfile.mkdtemp(prefix="node_step_"), "step.json")
        argv = ["_step", "--rows", args.rows, "--sets", args.sets, "--dtype", args.dtype, "--warmup", str(args.warmup),
                "--repeat", str(args.repeat), "--child-out", path] + (["--smoke"] if args.smoke else [])
        print(f"[bench_node] step at {w} GPU(s) ...", flush=True)
        err = torchrun(w, argv, args.timeout)
        if err:
            doc["worlds"][str(w)] = {"error": err}
            print(f"    {err}", flush=True)
            continue
        with open(path) as f:
            doc["worlds"][str(w)] = json.load(f)
    return doc


def slowest(doc: dict, set_name: str, row: str, world: int) -> Optional[dict]:
    """The record of the slowest rank of (set, row) at ``world`` GPUs, or None."""
    w = doc["worlds"].get(str(world)) or {}
    recs = [r for rank in w.get("ranks", []) for r in rank["records"] if r["set"] == set_name and r["row"] == row]
    ok = [r for r in recs if r.get("step_ms") is not None]
    if not ok or len(ok) < len(recs):
        return None
    return max(ok, key=lambda r: r["step_ms"])


def step_tables(doc: dict) -> str:
    out = []
    worlds = sorted(int(w) for w in doc["worlds"])
    rows = sorted({r["row"] for w in doc["worlds"].values() for rk in w.get("ranks", []) for r in rk["records"]})
    sets = sorted({r["set"] for w in doc["worlds"].values() for rk in w.get("ranks", []) for r in rk["records"]})
    for set_name in sets:
        table = []
        for row in rows:
            cells = [row]
            for w in worlds:
                r = slowest(doc, set_name, row, w)
                share = "" if r is None or r.get("copy_share") is None else f" ({100 * r['copy_share']:.0f}%)"
                cells.append("-" if r is None else f"{r['step_ms']:.2f}{share}")
            table.append(cells)
        out.append(f"### {set_name}: ms per step of the slowest GPU (share of its copy bandwidth at the floor bytes)\n\n"
                   + C.table(table, ["row"] + [f"{w} GPU" for w in worlds]))
    errors = [f"{w} GPUs: {v['error']}" for w, v in doc["worlds"].items() if "error" in v]
    errors += [f"{r['row']} {r['set']} {r['world']} GPUs rank {r['rank']}: {r['error']}" for w in doc["worlds"].values()
               for rk in w.get("ranks", []) for r in rk["records"] if "error" in r]
    return "\n\n".join(out + (["errors:\n" + "\n".join(errors)] if errors else []))


def plot(doc: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    worlds = sorted(int(w) for w in doc["worlds"])
    sets = ("fixed_model", "fixed_per_gpu")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, set_name in zip(axes, sets):
        for row in ROWS:
            pts = [(w, r["step_ms"]) for w in worlds if (r := slowest(doc, set_name, row, w)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=row)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("optimizer step, ms (slowest GPU)")
        ax.set_title(set_name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["link", "step", "_link", "_step"])
    ap.add_argument("--out", default=None, help="folder for node_link.json / node_step.json, .md, .png")
    ap.add_argument("--nproc", type=int, default=None, help="GPUs to use (default: every one)")
    ap.add_argument("--bytes", type=int, default=GiB, help="link: pinned bytes per GPU (default 1 GiB)")
    ap.add_argument("--pinned-limit", type=int, default=None, help="link: most page-locked bytes in all "
                    "(default: 80%% of the host's memory)")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="step: GPU counts (default %(default)s)")
    ap.add_argument("--rows", default=",".join(ROWS), help="step: rows (default: all: %(default)s)")
    ap.add_argument("--sets", default="fixed_model,fixed_per_gpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per torchrun")
    ap.add_argument("--smoke", action="store_true", help="the CPU (gloo), 2 ranks (step: tiny shapes, 1 and 2 "
                    "ranks; link: plain copies, the harness only)")
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; known: {', '.join(ROWS)}")
    if args.what == "_link":
        link_worker(args)
        return 0
    if args.what == "_step":
        step_worker(args)
        return 0
    out = args.out or os.path.join(os.getcwd(), "node_out")
    os.makedirs(out, exist_ok=True)
    if args.what == "link":
        doc = run_link(args)
        C.write_json(os.path.join(out, "node_link.json"), doc)
        print(link_table(doc))
        return 0 if "ranks" in doc or "skipped" in doc else 1
    doc = run_step(args)
    C.write_json(os.path.join(out, "node_step.json"), doc)
    text = step_tables(doc)
    with open(os.path.join(out, "node_step.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    png = plot(doc, os.path.join(out, "node_step.png"))
    if png:
        print(f"chart: {png}")
    return 0 if doc["worlds"] and all("error" not in w for w in doc["worlds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
