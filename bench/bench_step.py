"""Optimizer step time: pagedopt against torch, bitsandbytes and torchao, side by side in one run.

Sets: the TinyLlama-1.1B parameter list (fp32 and bf16 params) and 2000 tensors of 256x256
(fp32, launch-bound). Each figure is the median of --repeat steps after --warmup steps
(3 and 10 by default; the first step, which creates the states, counts as a warm-up and is
also reported on its own), with random gradients. Effective GB/s is taken at the floor bytes
per parameter:

    8-bit states:            3 x param width + 2 B per moment (Adam: 16 B fp32, 10 B bf16;
                             Lion, SGD, RMSprop, Adagrad, LARS: 14 / 8 B; AdEMAMix: 18 / 12 B)
    32-bit AdamW (torch):    28 B (fp32 params + states)  14 B (bf16 params + states)

and compared with the device copy bandwidth measured in the same run. "b2b ms" is the median
device time of a step when steps are queued back to back (as in training, where the host
prepares the next step while the GPU works), so host overhead is hidden there; "ms" has the
device idle before each step, so it includes the host's time to launch; "host ms" is the host
time of one step() call (the Python and C++ work before the kernels run). Paged optimizers are
also timed on the first step after a full page-out of their states.

    python bench/bench_step.py                      # everything, on CUDA
    python bench/bench_step.py --only pagedopt,torch --sets tinyllama
    python bench/bench_step.py --no-torchao --out /tmp/out
    python bench/bench_step.py --smoke --out /tmp/bs   # tiny, CPU, pagedopt only, seconds

On CUDA each library's rows of a (set, dtype) run in a child process of their own (--isolate
library; --isolate case gives every row its own), so that one library's leaked or cached memory,
or a broken CUDA context, cannot touch another's figure; the parent measures the copy bandwidth
once and merges the children's records. A child costs a few seconds (imports, CUDA context,
parameters).

Peers that cannot be imported or fail are recorded as skipped, with the reason.
Keep the total managed memory under 16 GiB (device safety rule): paged optimizers are
counted conservatively (bitsandbytes never frees its paged buffers).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt

import torch  # noqa: E402

import common as C  # noqa: E402

from step_specs import DTYPES, HYPER, MANAGED_LIMIT, Spec, build_specs, floor_bytes_per_param, selected  # noqa: E402,F401


def _plain(obj):
    if obj is None or isinstance(obj, (int, float, str, bool, dict, list)):
        return obj
    if callable(getattr(obj, "as_dict", None)):
        return obj.as_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)


# --------------------------------------------------------------------------- one case
class Runner:
    def __init__(self, args, device, res, out_json):
        self.args, self.device, self.res, self.out_json = args, device, res, out_json
        self.copy_gbps = None
        self.t_start = time.perf_counter()
        self.managed_reserved = 0
        self.broken = False

    def budget_left(self) -> float:
        if not self.args.time_budget:
            return float("inf")
        return self.args.time_budget - (time.perf_counter() - self.t_start)

    def save(self):
        self.res["wall_s"] = round(time.perf_counter() - self.t_start, 2)
        if self.out_json:
            C.write_json(self.out_json, self.res)

    def add(self, case: dict, echo: bool = True):
        self.res["cases"].append(case)
        if not echo:  # a child process printed it already
            self.save()
            return
        flag = ("ERROR: " + case["error"]) if case.get("error") else (
            ("skipped: " + case["skipped"]) if case.get("skipped") else "")
        msg = f"  {case['name']:<26} {case['set']:<9} {case['dtype']:<4} {case['mode']:<13} "
        msg += flag if flag else (f"{C.fmt(case.get('median_ms'), 3)} ms  "
                                                 f"{C.fmt(case.get('gbps'), 0)} GB/s")
        print(msg, flush=True)
        self.save()

    def run(self, spec: Spec, params, set_name: str, dtype: str):
        args, device = self.args, self.device
        n = sum(p.numel() for p in params)
        base = {"name": spec.name, "family": spec.family, "set": set_name, "dtype": dtype, "mode": "resident",
                "n_params": n, "n_tensors": len(params), "bits": spec.bits,
                "floor_bytes_per_param": floor_bytes_per_param(spec.bits, dtype, spec.moments), "note": spec.note}
        if self.broken:
            self.add({**base, "skipped": "CUDA context broken by an earlier case"})
            return
        if self.budget_left() < max(spec.min_budget_s, 5.0):
            self.add({**base, "skipped": f"time budget ({args.time_budget} s) nearly spent"})
            return
        est_managed = int(n * 2.1) + (1 << 20)
        if spec.page_out is not None and C.is_cuda(device):
            free, _ = torch.cuda.mem_get_info(device)
            if self.managed_reserved + est_managed > MANAGED_LIMIT or est_managed * 2 > free:
                self.add({**base, "skipped": f"managed memory guard (reserved {self.managed_reserved / C.GiB:.1f} GiB"
                          f" + {est_managed / C.GiB:.1f} GiB, free {free / C.GiB:.1f} GiB)"})
                return
            self.managed_reserved += est_managed
        warmup = args.warmup if spec.warmup is None else spec.warmup
        repeat = args.repeat if spec.repeat is None else spec.repeat
        opt = None
        try:
            C.reinit_params(params, args.seed)
            C.free_memory()
            alloc0 = C.cuda_allocated(device)
            if spec.graph and not C.is_cuda(device):
                self.add({**base, "skipped": "a CUDA graph needs CUDA"})
                return
            opt = spec.make(params)
            first_ms = C.host_time_ms(opt.step, device)      # creates the states (torchao: compiles)
            step = captured_step(opt, device) if spec.graph else opt.step
            times = C.time_ms(step, device, max(0, warmup - 1), repeat)
            st = C.stats(times)
            # Back to back: steps queued without waiting, as in training, where the host prepares the
            # next step while the GPU works: the device time of a step, with host overhead hidden.
            host_ms: list[float] = []

            def timed_step():
                t0 = time.perf_counter()
                step()
                host_ms.append((time.perf_counter() - t0) * 1e3)

            b2b = C.time_ms(timed_step, device, 0, repeat, sync_each=False) if C.is_cuda(device) else times
            floor = base["floor_bytes_per_param"] * n
            case = {**base, **st, "first_step_ms": first_ms, "warmup": warmup,
                    "back_to_back_ms": statistics.median(b2b),
                    "host_ms": statistics.median(host_ms) if host_ms else None,
                    "gbps": C.gbps(floor, st["median_ms"]),
                    "floor_ms": None if not self.copy_gbps else floor / (self.copy_gbps * C.GB) * 1e3,
                    "state_bytes": C.state_bytes(opt),
                    "alloc_delta_bytes": C.cuda_allocated(device) - alloc0 if C.is_cuda(device) else None,
                    "finite": C.all_finite(params)}
            case["frac_copy"] = (case["gbps"] / self.copy_gbps) if (case["gbps"] and self.copy_gbps) else None
            if hasattr(opt, "state_bytes") and callable(opt.state_bytes):
                try:
                    case["own_state_bytes"] = int(opt.state_bytes())
                except Exception as e:
                    case["own_state_bytes"] = C.short_error(e)
            if spec.paged_bytes is not None:
                case["paged_bytes"] = spec.paged_bytes(opt)
            if hasattr(opt, "paging_stats"):
                try:
                    case["paging_stats"] = _plain(opt.paging_stats())
                except Exception as e:
                    case["paging_stats"] = C.short_error(e)
            self.add(case)
            if spec.page_out is not None and not args.no_pageout:
                self.add(self.after_page_out(spec, opt, case))
        except Exception as e:
            err = C.short_error(e)
            if args.verbose:
                traceback.print_exc()
            self.add({**base, "error" if spec.family == "pagedopt" else "skipped": err})
            if not C.cuda_context_ok(device):
                self.broken = True
                print("  CUDA context is broken; the remaining cases are skipped", flush=True)
        finally:
            del opt
            C.free_memory()

    def after_page_out(self, spec: Spec, opt, resident: dict) -> dict:
        device = self.device
        case = {**{k: resident[k] for k in ("name", "family", "set", "dtype", "n_params", "n_tensors", "bits",
                                            "floor_bytes_per_param", "note")}, "mode": "after_pageout"}
        try:
            out_ms, step_ms, nbytes = [], [], 0
            for i in range(self.args.pageout_repeat):
                C.sync(device)
                t0 = time.perf_counter()
                nbytes = spec.page_out(opt)
                C.sync(device)
                out_ms.append((time.perf_counter() - t0) * 1e3)
                if i == 0 and hasattr(opt, "paging_stats"):
                    try:
                        case["paging_stats_after_page_out"] = _plain(opt.paging_stats())
                    except Exception as e:
                        case["paging_stats_after_page_out"] = C.short_error(e)
                step_ms.append(C.time_ms(opt.step, device, warmup=0, repeat=1)[0])
            if not nbytes and isinstance(case.get("paging_stats_after_page_out"), dict):
                nbytes = int(case["paging_stats_after_page_out"].get("host_bytes") or 0)
            st = C.stats(step_ms)
            extra = st["median_ms"] - resident["median_ms"]
            case.update(st)
            case.update(paged_bytes=nbytes, page_out_ms=statistics.median(out_ms), page_out_all_ms=out_ms,
                        page_out_gbps=C.gbps(nbytes, statistics.median(out_ms)),
                        extra_ms_vs_resident=extra,
                        pagein_gbps_est=C.gbps(nbytes, extra) if extra > 0 and nbytes else None,
                        gbps=None, frac_copy=None, finite=C.all_finite(opt.param_groups[0]["params"]))
            if hasattr(opt, "paging_stats"):
                try:
                    case["paging_stats"] = _plain(opt.paging_stats())
                except Exception as e:
                    case["paging_stats"] = C.short_error(e)
        except Exception as e:
            if self.args.verbose:
                traceback.print_exc()
            case["error" if spec.family == "pagedopt" else "skipped"] = C.short_error(e)
        return case


def captured_step(opt, device):
    """opt.step() captured in a CUDA graph (after the eager first step made the states): the
    graph's replay, which reruns the step's kernels with no host work but the launch."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize(device)
    return graph.replay


# --------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, pagedopt only (seconds)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--out", default=None, help="folder for bench_step.json and bench_step.png")
    ap.add_argument("--only", default="", help="comma list of names, prefixes or families "
                    "(pagedopt, torch, bnb, torchao; e.g. pagedopt_adamw8bit,bnb)")
    ap.add_argument("--sets", default="tinyllama,small")
    ap.add_argument("--dtypes", default="fp32,bf16", help="for the TinyLlama set")
    ap.add_argument("--small-dtypes", default="fp32", help="for the many-small-tensors set")
    ap.add_argument("--warmup", type=int, default=C.DEFAULT_WARMUP)
    ap.add_argument("--repeat", type=int, default=C.DEFAULT_REPEAT)
    ap.add_argument("--scale", type=float, default=1.0, help="width multiplier for the TinyLlama set")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--small-n", type=int, default=2000)
    ap.add_argument("--small-side", type=int, default=256)
    ap.add_argument("--copy-mib", type=int, default=2048, help="buffer size of the copy-bandwidth probe")
    ap.add_argument("--pinned-mib", type=int, default=1024)
    ap.add_argument("--pageout-repeat", type=int, default=3)
    ap.add_argument("--no-pageout", action="store_true")
    ap.add_argument("--bnb-pageout", action="store_true", help="also time bitsandbytes after its page-out "
                    "(exits the whole process on CUDA 13)")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--torchao-bf16", action="store_true", help="also bf16 params (a second compile)")
    ap.add_argument("--torchao-small", action="store_true", help="also the small set (about 0.9 s/step)")
    ap.add_argument("--torchao-warmup", type=int, default=2)
    ap.add_argument("--torchao-repeat", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; later cases are skipped past it")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failed cases")
    ap.add_argument("--isolate", choices=("auto", "library", "case", "no"), default="auto",
                    help="child processes: one per library and (set, dtype), or one per case, so that one "
                    "library's leaked memory or broken CUDA context cannot touch another's figure (auto: library "
                    "on CUDA, no on the CPU)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)        # SET/DTYPE/NAME,...: these cases only
    ap.add_argument("--case-out", default=None, help=argparse.SUPPRESS)    # where the case's JSON goes
    ap.add_argument("--copy-gbps", type=float, default=None, help=argparse.SUPPRESS)  # the parent's probe
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.scale, args.layers = 1 / 32, 2
        args.small_n, args.small_side = 16, 64
        args.warmup, args.repeat = 2, 3
        args.copy_mib, args.pinned_mib = 16, 16
        args.pageout_repeat = 1
        args.no_torchao = True
        args.only = args.only or "pagedopt"
    args.device = args.device or "cuda"
    return args


def run_isolated(argv: list[str], keys: list[str], runner: "Runner") -> list[dict]:
    """Cases of the plan (each key set/dtype/name) in one child process of this script; the cases
    as it recorded them, or an error case for each if it died without a record."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "case.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--case", ",".join(keys), "--case-out", out,
               "--isolate", "no"]
        if runner.copy_gbps:
            cmd += ["--copy-gbps", repr(runner.copy_gbps)]
        left = runner.budget_left()
        if left != float("inf"):
            cmd += ["--time-budget", repr(max(left, 1.0))]
        try:
            proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True,
                                  timeout=None if left == float("inf") else left + 60)
            err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            err = "timed out"
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    died = []
    for key in keys:
        set_name, dtype, name = key.split("/")
        died.append({"name": name, "family": name.split("_")[0], "set": set_name, "dtype": dtype, "mode": "resident",
                     "error" if name.startswith("pagedopt") else "skipped": f"its process died: {err}"})
    return died


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = C.bench_device(args.device)
    if device is None:
        return 2
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    out_json = os.path.join(args.out, "bench_step.json") if args.out else None
    try:  # import the optional peers first, so their versions land in env
        import pagedopt  # noqa: F401
    except Exception as e:
        print(f"pagedopt import failed: {C.short_error(e)}", flush=True)
    for mod, fam in (("bitsandbytes", "bnb"), ("torchao", "torchao")):
        if not only or any(o.startswith(fam) for o in only):
            if fam == "torchao" and args.no_torchao:
                continue
            try:
                __import__(mod)
            except Exception as e:
                print(f"{mod} not importable: {C.short_error(e)}", flush=True)

    res = {"bench": "step", "env": C.env_info(device), "config": {k: v for k, v in vars(args).items()},
           "hyper": HYPER, "bandwidth": {}, "cases": []}
    runner = Runner(args, device, res, out_json)
    if args.case:  # a child of an isolated run: this case only, no probes, its cases to --case-out
        runner.copy_gbps = args.copy_gbps
        runner.out_json = None
    else:
        print(f"bench_step on {res['env'].get('device_name')} ({device}), torch {torch.__version__}", flush=True)
    isolate = args.isolate if args.isolate != "auto" else ("library" if C.is_cuda(device) else "no")

    if not args.case:
        try:
            res["bandwidth"]["copy"] = C.copy_bandwidth(device, args.copy_mib << 20)
        except Exception as e:
            res["bandwidth"]["copy"] = {"error": C.short_error(e)}
        runner.copy_gbps = res["bandwidth"]["copy"].get("gbps")
        try:
            res["bandwidth"]["pinned"] = C.pinned_bandwidth(device, args.pinned_mib << 20)
        except Exception as e:
            res["bandwidth"]["pinned"] = {"error": C.short_error(e)}
        pin = res["bandwidth"]["pinned"]
        print(f"copy bandwidth {C.fmt(runner.copy_gbps, 0)} GB/s (read+write); pinned h2d/d2h "
              f"{C.fmt(pin.get('h2d_gbps'), 1)}/{C.fmt(pin.get('d2h_gbps'), 1)} GB/s", flush=True)
        runner.save()

    sets = {
        "tinyllama": (C.tinyllama_shapes(args.scale, args.layers), [d for d in args.dtypes.split(",") if d]),
        "small": (C.small_shapes(args.small_n, args.small_side), [d for d in args.small_dtypes.split(",") if d]),
    }
    specs = [s for s in build_specs(args) if selected(s, only)]
    # plan: (set, dtype, spec) groups; slow compiled peers (torchao) go last so a time limit costs only them
    plan = []
    for late in (False, True):
        for set_name in [s for s in args.sets.split(",") if s]:
            if set_name not in sets:
                print(f"unknown set {set_name!r}", file=sys.stderr)
                return 2
            shapes, dtypes = sets[set_name]
            for dtype in dtypes:
                if dtype not in DTYPES:
                    print(f"unknown dtype {dtype!r}", file=sys.stderr)
                    return 2
                for spec in specs:
                    if (spec.min_budget_s > 0) == late and set_name in spec.sets and dtype in spec.dtypes:
                        plan.append((set_name, dtype, spec))
    if args.case:
        keys = args.case.split(",")
        plan = [(s, d, sp) for s, d, sp in plan if f"{s}/{d}/{sp.name}" in keys]
    res["plan"] = [f"{s}/{d}/{sp.name}" for s, d, sp in plan]
    res["isolated"] = isolate

    if isolate != "no":  # the rows of one (set, dtype) and library, or each row, per child
        groups: dict[tuple, list[str]] = {}
        for set_name, dtype, spec in plan:
            group_key = (set_name, dtype, spec.family if isolate == "library" else spec.name)
            groups.setdefault(group_key, []).append(f"{set_name}/{dtype}/{spec.name}")
        current = None
        for (set_name, dtype, _), keys in groups.items():
            if current != (set_name, dtype):
                current = (set_name, dtype)
                shapes = sets[set_name][0]
                print(f"set {set_name} {dtype}: {len(shapes)} tensors, {C.numel_of(shapes) / 1e6:.1f}M params "
                      f"(a process per {isolate})", flush=True)
            for case in run_isolated(argv, keys, runner):
                runner.add(case, echo=False)
        res["children"] = len(groups)
        plan = []

    params, current = None, None
    for set_name, dtype, spec in plan:
        if current != (set_name, dtype):
            params = None
            C.free_memory()
            shapes = sets[set_name][0]
            if not args.case:
                print(f"set {set_name} {dtype}: {len(shapes)} tensors, {C.numel_of(shapes) / 1e6:.1f}M params",
                      flush=True)
            try:
                params = C.make_params(shapes, DTYPES[dtype], device, args.seed)
            except Exception as e:
                runner.add({"name": spec.name, "family": spec.family, "set": set_name, "dtype": dtype,
                            "mode": "resident", "error": "making params: " + C.short_error(e)})
                current = None
                continue
            current = (set_name, dtype)
        runner.run(spec, params, set_name, dtype)
    params = None
    C.free_memory()

    if args.case:
        C.write_json(args.case_out, res["cases"])
        return 0
    runner.save()
    if args.out and not args.no_plot:
        try:
            import plot
            png = os.path.join(args.out, "bench_step.png")
            plot.plot_step(res, png)
            print(f"wrote {png}")
        except Exception as e:
            print(f"plot skipped: {C.short_error(e)}")
    if out_json:
        print(f"wrote {out_json}")
    print()
    print(C.step_table(res))
    failed = [c for c in res["cases"] if c.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
