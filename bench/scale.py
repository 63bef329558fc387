"""Scale: the largest LLaMA-shaped model each optimizer and paging mode trains on this GPU, its step
time, its peak memory beside pagedopt.memory's prediction, and the host link's floor.

For each row (bench/scale_rows.py: torch's fused AdamW, bitsandbytes' and torchao's 8-bit (and
4-bit, CPU-offload) optimizers, and each pagedopt mode: resident, resident with gradients released,
paged resident, host-resident and hybrid (device budget, 'auto'), each also with updates during
backward, and a managed-memory budget)
and each parameter dtype, the shapes (bench/scale_model.py: 1b ... 30b) are tried upward, each
(row, shape, dtype) in a process of its own, training ``--steps`` steps (default 5) of a batch of
1 x 512 random tokens with gradient checkpointing (bf16 autocast on CUDA); a row stops at its first
configuration that runs out of memory (or is refused, times out or fails).

Per configuration: the step time (median of the steps after the first; the first step, which makes
the states, apart), ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (first step, and
the steps after it), the device's used memory (``cudaMemGetInfo``, which sees managed memory), the
estimator's prediction of each (pagedopt.memory.modes) and its error, and the bytes crossing the host
link each step (the pager's count for pagedopt's paged rows, else the row's arithmetic) with their
floor: the larger direction's bytes at the pinned rate measured in this run with both directions
busy (one direction alone: that direction's rate).

Device safety: a row whose states live in managed memory runs only while they are under
``--managed-limit`` (16 GiB) and, in its child, only if the GPU has them free when they are made;
no configuration may pin more than ``--pinned-limit`` (100 GiB) of host memory or need more host
memory than is free. Refused configurations are recorded as such, never run.

    python bench/scale.py --out /tmp/scale                                # every row, the whole ladder
    python bench/scale.py --rows pagedopt_paged_adamw8bit_host --shapes 13b --dtypes bf16   # one config
    python bench/scale.py --rows torch_adamw_fused,pagedopt_adamw8bit --shapes 7b:fp32,13b:bf16
    python bench/scale.py --smoke --out /tmp/s                            # tiny, CPU, seconds (CI)
    python bench/scale.py --gpus 8 --seq 2048 --dtypes bf16 --rows pagedopt_paged_adamw8bit_host   # FSDP2, the node

Writes scale.json, scale.md (the tables) and scale.png (step time against model size, per row).
GB = 1e9 bytes, GiB = 2^30 bytes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt
import common as C  # noqa: E402
import scale_model as M  # noqa: E402
import scale_report as report  # noqa: E402
import scale_fsdp as SF  # noqa: E402
import scale_rows as R  # noqa: E402

GiB = 1 << 30
OK = "ok"


class Refused(Exception):
    """The child must not go on (device safety)."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return any(s in msg for s in ("out of memory", "cudaerrormemoryallocation", "cublas_status_alloc_failed"))


# --------------------------------------------------------------------------- one configuration (child)
def device_used(device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def managed_on_gpu(row: R.Row, opt, settings: dict) -> int:
    """Managed bytes of states the GPU will hold once they are made; raises Refused where they may
    exceed the managed limit ('auto' is checked here, once its pager is known)."""
    states, limit = settings["states_bytes"], settings["managed_limit"]
    if "_auto" in row.name:
        from pagedopt.paging import HostResidentPager
        if isinstance(getattr(opt, "pager", None), HostResidentPager):
            return 0
        if states >= limit:
            raise Refused(f"residency='auto' chose {type(getattr(opt, 'pager', None)).__name__}, not host residency, "
                          f"for {states / GiB:.1f} GiB of states (>= {limit / GiB:g} GiB of managed memory)")
        return states
    if not row.managed:
        return 0
    return min(states, settings["budget_bytes"]) if row.pinned == "managed_beyond_budget" else states


def check_free(device, managed: int) -> None:
    """Before the first step makes managed states: the GPU must have them free, and 1 GiB more."""
    if device.type != "cuda" or managed <= 0:
        return
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if free < managed + GiB:
        raise Refused(f"{free / GiB:.1f} GiB free on the GPU for {managed / GiB:.1f} GiB of managed states (+1 GiB): "
                      "never oversubscribe managed memory")


def host_state_bytes(opt) -> int:
    """The bytes of the optimizer's states under bitsandbytes' keys (state1/2, absmax1/2), counted
    from opt.state: what host residency streams in and back each step."""
    return sum(t.numel() * t.element_size() for st in getattr(opt, "state", {}).values()
               for k, t in st.items() if k in ("state1", "state2", "absmax1", "absmax2") and isinstance(t, torch.Tensor))


def run_config(row: R.Row, shape: M.Shape, dtype: str, device: torch.device, settings: dict, build=None) -> dict:
    """Train ``settings['steps']`` steps; the record (status ok, oom, refused or error). ``build``:
    what makes the model (scale_model.build; scale_fsdp.build shards it)."""
    cuda = device.type == "cuda"
    rec = {"row": row.name, "shape": shape.name, "dtype": dtype, "params": M.param_count(shape)}
    inject = settings.get("inject_oom")
    phase, k = "build", 0
    used = {"first": 0, "steady": 0}
    base = device_used(device)

    def at(where: str) -> None:
        nonlocal phase
        phase = where
        if inject and inject == f"{shape.name}:{where}":
            raise torch.OutOfMemoryError(f"injected out of memory at {where} (--inject-oom)")

    def sample() -> None:
        key = "first" if k <= 1 else "steady"
        used[key] = max(used[key], device_used(device) - base)

    times, losses, link = [], [], []
    try:
        at("build")
        model = (build or M.build)(shape, M.DTYPES[dtype], device, checkpointing=settings["checkpointing"])
        at("optimizer")
        opt = row.make(list(model.parameters()), device, settings)
        managed = managed_on_gpu(row, opt, settings)
        g = torch.Generator(device="cpu").manual_seed(1)
        tokens = torch.randint(shape.vocab, (settings["batch"], settings["seq"] + 1), generator=g).to(device)
        inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        for k in range(1, settings["steps"] + 1):
            if k == 2:
                if cuda:
                    torch.cuda.synchronize(device)
                    rec["max_allocated_first"] = torch.cuda.max_memory_allocated(device)
                    rec["max_reserved_first"] = torch.cuda.max_memory_reserved(device)
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
            C.sync(device)
            t0 = time.perf_counter()
            at("forward")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda, cache_enabled=False):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab), tgt)
            del logits
            at("backward")
            loss.backward()
            sample()
            if k == 1:
                check_free(device, managed)
            at("step")
            opt.step()
            opt.zero_grad(set_to_none=True)
            C.sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            sample()
            losses.append(float(loss.detach()))
            del loss
            stats = opt.paging_stats() if row.link == "pager" and hasattr(opt, "paging_stats") else None
            if stats is not None:
                link.append((stats.page_in_bytes_last_step, stats.page_out_bytes_last_step))
        steady = times[1:] or times
        rec.update(status=OK, step_ms=statistics.median(steady), step_ms_all=times, first_step_ms=times[0],
                   losses=losses, state_bytes=_state_bytes(opt), host_state_bytes=host_state_bytes(opt))
        if link:
            rec["link_h2d"], rec["link_d2h"] = link[-1]
            rec["link_source"] = "pager"
            rec["link_all"] = link
        if stats is not None:
            rec["paging_stats"] = {k2: v for k2, v in stats.as_dict().items() if not isinstance(v, dict)}
        if "_auto" in row.name and stats is not None:  # what 'auto' kept on the GPU
            rec["auto_resident_bytes"] = stats.resident_bytes
    except Refused as exc:
        rec.update(status="refused", phase=phase, reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded, with the phase it happened in
        rec.update(status="oom" if is_oom(exc) else "error", phase=phase, step=k, error=C.short_error(exc))
    if cuda and C.cuda_context_ok(device):  # an illegal access (say) leaves no figures to read
        if "max_allocated_first" not in rec:  # it never reached a second step
            rec["max_allocated_first"] = torch.cuda.max_memory_allocated(device)
            rec["max_reserved_first"] = torch.cuda.max_memory_reserved(device)
        elif rec["status"] == OK:
            rec["max_allocated"] = torch.cuda.max_memory_allocated(device)
            rec["max_reserved"] = torch.cuda.max_memory_reserved(device)
        rec["device_used_first"], rec["device_used"] = used["first"], used["steady"] or None
    return rec


def _state_bytes(opt) -> Optional[int]:
    try:
        return C.state_bytes(opt, views=True)
    except Exception:  # noqa: BLE001 - torchao's CPUOffloadOptimizer keeps no readable .state
        return None


# --------------------------------------------------------------------------- the parent
def host_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def parse_configs(shapes: str, dtypes: str, smoke: bool, node: bool = False) -> list[tuple[str, str]]:
    """(shape, dtype) in the order given: ``7b:fp32`` alone, or a shape with every --dtypes."""
    names = [s for s in shapes.split(",") if s] or list(M.SMOKE_LADDER if smoke else M.NODE_LADDER if node else M.LADDER)
    dts = [d for d in dtypes.split(",") if d]
    out = []
    for dt in dts:
        if dt not in M.DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {dt!r}; known: {', '.join(M.DTYPES)}")
    for n in names:
        shape, _, dt = n.partition(":")
        if shape not in M.SHAPES:
            raise ValueError(f"--shapes: unknown shape {shape!r}; known: {', '.join(M.SHAPES)}")
        if dt and dt not in M.DTYPES:
            raise ValueError(f"--shapes: unknown dtype {dt!r} in {n!r}; known: {', '.join(M.DTYPES)}")
        out += [(shape, dt)] if dt else [(shape, d) for d in dts]
    return out


def run_child(argv_base: list[str], row: str, shape: str, dtype: str, out_path: str, timeout_s: float) -> dict:
    cmd = [sys.executable, *SF.launcher(SF.nproc_of(argv_base)), os.path.abspath(__file__), *argv_base, "--child",
           f"{row}:{shape}:{dtype}", "--child-out", out_path]
    base = {"row": row, "shape": shape, "dtype": dtype}
    try:
        proc = SF.run_graceful(cmd, timeout_s, stdout=None, stderr=subprocess.PIPE)  # torchrun ends its workers
    except subprocess.TimeoutExpired:  # FSDP2: ranks that failed alone left their records
        return dict(base, **(SF.salvage(out_path) or dict(status="timeout", reason=f"timed out after {timeout_s:.0f} s")))
    if proc.returncode != 0 or not os.path.exists(out_path):
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return dict(base, **(SF.salvage(out_path) or dict(status="error", error=f"exit {proc.returncode}: "
                                                          + " | ".join(tail)[-300:])))
    import json
    with open(out_path) as f:
        return json.load(f)


def measure_link(device, nproc: int = 1) -> dict:
    """Pinned copies of 1 GiB each way and both ways at once (bench/common.py pinned_bandwidth), in a
    process of its own: this one keeps no CUDA context, which would take GPU memory from the children.
    On several GPUs, each GPU's rates with all copying at once (scale_fsdp.measure_link)."""
    import json
    if nproc > 1:
        return SF.measure_link(nproc)
    folder = tempfile.mkdtemp(prefix="scale_link_")
    path = os.path.join(folder, "link.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--device", str(device), "--child-link", path]
    try:
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=300)
        if proc.returncode != 0 or not os.path.exists(path):
            return {"skipped": f"exit {proc.returncode}: {(proc.stderr or '')[-300:]}"}
        with open(path) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"skipped": "the link measurement timed out (300 s)"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plan_config(row: R.Row, shape: M.Shape, dtype: str, args, limits: dict) -> tuple[dict, Optional[str]]:
    """The settings a child gets, with the estimator's prediction and the row's demands; and why it
    must not run (device safety), or None."""
    ckpt, autocast = not args.no_checkpointing, getattr(args, "autocast", True)
    e8 = M.estimate(shape, "paged_adamw_8bit", dtype, args.batch, args.seq, ckpt, autocast)
    from pagedopt.memory import predict_modes, streamed_bytes
    settings = {"states_bytes": e8.state_bytes, "budget_bytes": R.budget_bytes(streamed_bytes(e8), args.budget)}
    need = R.demands(row, e8, settings)
    pred, nproc = None, getattr(args, "nproc", 1)
    if row.estimator is not None and nproc == 1:
        opt_name, mode = row.estimator
        e = e8 if opt_name == "paged_adamw_8bit" else M.estimate(shape, opt_name, dtype, args.batch, args.seq, ckpt,
                                                                   autocast)
        preds = predict_modes(e, args.device_buffer_bytes, settings["budget_bytes"],
                              capacity=getattr(args, "device_total", None))  # 'auto' needs the GPU's size
        pred = next((p for p in preds if p.mode == mode), None)
    settings.update(need=need, prediction=None if pred is None else pred.as_dict())
    if nproc > 1:  # per GPU, FSDP2 across the node
        SF.plan_node(settings, nproc)
    return settings, R.refusal(row, need, limits)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated rows (default: all; --smoke: "
                    + ",".join(R.SMOKE_ROWS) + "); known: " + ", ".join(R.BY_NAME))
    ap.add_argument("--shapes", default="", help="comma-separated shapes, upward (default: " + ",".join(M.LADDER)
                    + "); NAME:DTYPE for one dtype only, e.g. 7b:fp32,13b:bf16")
    ap.add_argument("--dtypes", default="bf16,fp32", help="parameter dtypes (default %(default)s; --smoke: fp32)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 512; --smoke: 32)")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--budget", default="0.5", help="the budget row's device budget: a fraction of the states "
                    "(default %(default)s) or a size such as 4GiB")
    ap.add_argument("--device-buffer", default="256MiB", help="host residency's device buffer")
    ap.add_argument("--no-stop", action="store_true", help="go on up a row after an OOM")
    ap.add_argument("--managed-limit", default="16GiB", help="largest managed-memory states run (device safety)")
    ap.add_argument("--pinned-limit", default="100GiB", help="most page-locked host memory a config may need")
    ap.add_argument("--host-available", default=None, help="host memory a config may use (default: MemAvailable; "
                    "for a machine whose MemAvailable grows as memory is used)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration's process")
    ap.add_argument("--time-budget", type=float, default=None, help="start no configuration after this many seconds")
    ap.add_argument("--assume-link", default=None, metavar="H2D,D2H,BOTH",
                    help="GB/s of the host link where it is not measured (no CUDA): one way, the other, each way "
                    "with both busy")
    ap.add_argument("--inject-oom", default=None, metavar="SHAPE:PHASE", help="raise an OOM at PHASE (build, "
                    "optimizer, forward, backward, step) of SHAPE's configs (tests)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--gpus", dest="nproc", type=int, default=1, help="FSDP2 across this many GPUs, one process each (torchrun; "
                    "bench/scale_fsdp.py); default shapes then " + ",".join(M.NODE_LADDER))
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="folder for scale.json, scale.md and scale.png")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-settings", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-link", default=None, help=argparse.SUPPRESS)  # child: measure the link into this file
    args = ap.parse_args(argv)
    from pagedopt.memory import parse_size

    try:
        args.device_buffer_bytes = parse_size(args.device_buffer, "--device-buffer")
        R.budget_bytes(1, args.budget)  # a bad --budget is refused here, not in the middle of the grid
        limits = {"managed": parse_size(args.managed_limit, "--managed-limit"),
                  "pinned": parse_size(args.pinned_limit, "--pinned-limit"),
                  "host_available": parse_size(args.host_available, "--host-available") if args.host_available
                  else host_available()}
        configs = parse_configs(args.shapes, args.dtypes if not args.smoke or args.dtypes != "bf16,fp32" else "fp32",
                                args.smoke, args.nproc > 1)
        rates = report.parse_rates(args.assume_link)
    except ValueError as exc:
        ap.error(str(exc))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    args.autocast = device.type == "cuda"  # bf16 autocast on CUDA (run_config), what the estimate assumes
    if args.seq is None:
        args.seq = 32 if args.smoke else 512
    names = [n for n in args.rows.split(",") if n] or list(R.SMOKE_ROWS if args.smoke else R.BY_NAME)
    unknown = [n for n in names if n not in R.BY_NAME]
    if unknown:
        ap.error(f"--rows: unknown row(s) {unknown}; known: {', '.join(R.BY_NAME)}")
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")

    if args.child_link is not None:  # the host link's rates, in a process of its own
        C.write_json(args.child_link, dict(C.pinned_bandwidth(device, GiB), env=C.env_info(device)))
        return 0
    if args.child is not None:  # one configuration, in this process
        import json
        row, shape, dtype = args.child.split(":")
        settings = json.loads(args.child_settings)
        settings.update(steps=args.steps, batch=args.batch, seq=args.seq, checkpointing=not args.no_checkpointing,
                        device_buffer=args.device_buffer_bytes, inject_oom=args.inject_oom,
                        managed_limit=limits["managed"], device=device.type)
        if args.nproc > 1:  # this process is one rank of the configuration (torchrun); it ends there
            SF.child(run_config, R.BY_NAME[row], M.SHAPES[shape], dtype, settings, args.child_out, args.timeout)
        rec = run_config(R.BY_NAME[row], M.SHAPES[shape], dtype, device, settings)
        C.write_json(args.child_out, rec)
        return 0
    return run_parent(args, names, configs, device, limits, rates)


def run_parent(args, names, configs, device, limits, rates) -> int:
    out_dir = args.out or os.path.join(os.getcwd(), "scale_out")
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    link = {"before": measure_link(device, args.nproc)} if device.type == "cuda" else None
    env = link["before"].pop("env", None) if link else C.env_info(device)  # CUDA's: from the child
    args.device_total = (env or {}).get("device_memory_bytes")  # what residency='auto' is predicted on
    child_argv = ["--device", str(device), "--steps", str(args.steps), "--batch", str(args.batch), "--seq",
                  str(args.seq), "--device-buffer", args.device_buffer, "--managed-limit", args.managed_limit,
                  "--gpus", str(args.nproc), "--timeout", str(args.timeout)]
    child_argv += ["--no-checkpointing"] if args.no_checkpointing else []
    child_argv += ["--inject-oom", args.inject_oom] if args.inject_oom else []
    children = tempfile.mkdtemp(prefix="scale_children_")  # the children's records, gathered into scale.json
    rows = [R.BY_NAME[n] for n in names]
    records = []
    gone = {r.name: R.unavailable(r, device) for r in rows}
    for r in rows:
        if gone[r.name]:
            records.append({"row": r.name, "shape": None, "dtype": None, "status": "skipped", "reason": gone[r.name]})
    doc = {"env": env or {"device": str(device)}, "command": " ".join(["bench/scale.py", *sys.argv[1:]]), "link": link,
           "settings": {"steps": args.steps, "batch": args.batch, "seq": args.seq, "nproc": args.nproc,
                        "checkpointing": not args.no_checkpointing, "budget": args.budget,
                        "device_buffer": args.device_buffer_bytes, "limits": limits}, "records": records}
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `timeout` ends the grid: the tables are still written
    try:
        run_grid(args, configs, rows, gone, limits, child_argv, children, out_dir, doc, t_start)
    except Interrupted as exc:
        doc["interrupted"] = str(exc)
        print(f"[scale] interrupted ({exc}): writing what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(children, ignore_errors=True)
    if link is not None:
        if "interrupted" not in doc and args.nproc == 1:  # (on a node the measure takes a torchrun: once)
            link["after"] = measure_link(device, args.nproc)
            link["after"].pop("env", None)
        rates = report.rates_from(link)
    doc["rates"] = rates
    # the parent should hold no CUDA context (its GPU memory would be missing from the children's)
    doc["parent_cuda_initialized"] = torch.cuda.is_initialized()
    for rec in doc["records"]:
        report.add_figures(rec, rates)
    C.write_json(os.path.join(out_dir, "scale.json"), doc)
    text = report.markdown(doc)
    with open(os.path.join(out_dir, "scale.md"), "w") as f:
        f.write(text)
    print(text)
    png = report.plot(doc["records"], os.path.join(out_dir, "scale.png"))
    if png:
        print(f"chart: {png}")
    return 0


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(f"signal {signum}")


def run_grid(args, configs, rows, gone, limits, child_argv, children, out_dir, doc, t_start) -> None:
    """Every configuration upward, a row stopping at its first failure; records into doc."""
    import json
    records, stopped = doc["records"], {}
    for shape_name, dtype in configs:
        shape = M.SHAPES[shape_name]
        for r in rows:
            if gone[r.name]:
                continue
            key = (r.name, dtype)
            base = {"row": r.name, "shape": shape_name, "dtype": dtype, "params": M.param_count(shape)}
            settings, refused = plan_config(r, shape, dtype, args, limits)
            if key in stopped:
                rec = dict(base, status="not_run", reason=f"the row stopped at {stopped[key]}")
            elif args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
                rec = dict(base, status="not_run", reason=f"time budget ({args.time_budget:.0f} s) spent")
            elif refused:
                rec = dict(base, status="refused", reason=refused)
            else:
                print(f"[scale] {r.name} {shape_name} {dtype} ...", flush=True)
                path = os.path.join(children, f"{r.name}_{shape_name}_{dtype}.json")
                rec = run_child(child_argv + ["--child-settings", json.dumps(settings)], r.name, shape_name, dtype,
                                path, args.timeout)
                rec = dict(base, **rec)
            rec["prediction"], rec["need"] = settings["prediction"], settings["need"]
            if rec["status"] not in (OK, "not_run") and not args.no_stop:
                stopped.setdefault(key, f"{shape_name} ({rec['status']})")
            records.append(rec)
            if rec["status"] not in ("not_run",):
                print("   ", report.one_line(rec), flush=True)
            C.write_json(os.path.join(out_dir, "scale.json"), doc)  # a killed run leaves what it had


if __name__ == "__main__":
    sys.exit(main())
