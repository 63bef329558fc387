"""Blockwise quantize / dequantize throughput (block 256, dynamic codebook) against the copy bandwidth.

Floor bytes for n elements and n/256 blocks (input itemsize i, output itemsize o):

    quantize:    n*i (read x)  + n (write codes) + 4*n/256 (write absmax)
    dequantize:  n (read codes) + 4*n/256 (read absmax) + n*o (write)

Peers: a plain-torch absmax pass (x.view(-1, 256).abs().amax(1), counted at n*i + 4n/256;
it does only part of the work), an eager-torch quantizer/dequantizer (bucketize on the
codebook midpoints), and bitsandbytes' quantize_blockwise/dequantize_blockwise (when
importable), each at the same floor bytes as ours. Also checks our codes against the pure-torch
reference on a slice, and against bitsandbytes' codes on the whole input.

    python bench/bench_quant.py [--numel 268435456] [--out DIR] [--only pagedopt,bnb]
    python bench/bench_quant.py --smoke --out /tmp/bq      # tiny, CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))

import torch  # noqa: E402

import common as C  # noqa: E402

BLOCK = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _torch_quantize(x, code, midpoints):
    blocks = x.view(-1, BLOCK).float()
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    idx = torch.bucketize(blocks / safe[:, None], midpoints, out_int32=True)
    return idx.to(torch.uint8).view(x.shape), absmax


def _torch_dequantize(codes, absmax, code, dtype):
    return (code[codes.view(-1, BLOCK).long()] * absmax[:, None]).to(dtype).view(codes.shape)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (seconds)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="folder for bench_quant.json and bench_quant.png")
    ap.add_argument("--numel", type=int, default=1 << 28, help="elements (1<<28 = 1 GiB of fp32)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--only", default="", help="comma list of families/prefixes: pagedopt, torch, bnb")
    ap.add_argument("--warmup", type=int, default=C.DEFAULT_WARMUP)
    ap.add_argument("--repeat", type=int, default=C.DEFAULT_REPEAT)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--check-numel", type=int, default=1 << 16, help="slice checked against the reference")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.numel = 1 << 16
        args.warmup, args.repeat = 1, 3
        args.copy_mib = 16
        args.check_numel = 1 << 12
    args.device = args.device or "cuda"
    args.numel = max(BLOCK, args.numel // BLOCK * BLOCK)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = C.bench_device(args.device)
    if device is None:
        return 2
    only = [s.strip() for s in args.only.split(",") if s.strip()]

    def want(family, name):
        return not only or any(name.startswith(o) or family == o for o in only)

    _ops = quant = bnbF = None
    notes = {}
    try:
        from pagedopt import _ops, quant  # noqa: F811
    except Exception as e:
        notes["pagedopt"] = C.short_error(e)
    if want("bnb", "bnb"):
        try:
            import bitsandbytes.functional as bnbF  # noqa: F811
        except Exception as e:
            notes["bnb"] = C.short_error(e)

    out_json = os.path.join(args.out, "bench_quant.json") if args.out else None
    res = {"bench": "quant", "env": C.env_info(device), "config": vars(args), "notes": notes, "bandwidth": {},
           "cases": [], "checks": {}}
    t_start = time.perf_counter()

    def save():
        res["wall_s"] = round(time.perf_counter() - t_start, 2)
        if out_json:
            C.write_json(out_json, res)

    try:
        res["bandwidth"]["copy"] = C.copy_bandwidth(device, args.copy_mib << 20, args.warmup, args.repeat)
    except Exception as e:
        res["bandwidth"]["copy"] = {"error": C.short_error(e)}
    copy_gbps = res["bandwidth"]["copy"].get("gbps")
    print(f"bench_quant on {res['env'].get('device_name')} ({device}); copy {C.fmt(copy_gbps, 0)} GB/s; "
          f"{args.numel / 1e6:.0f}M elements", flush=True)
    save()

    if quant is not None:
        code = quant.dynamic_codebook(signed=True, device=device)
    else:
        code = torch.linspace(-1, 1, 256, device=device)  # only used by the torch peers
    midpoints = ((code[1:] + code[:-1]) / 2).contiguous()
    n = args.numel
    nb = n // BLOCK
    broken = False

    def run(name, family, dtype_name, fn, floor_bytes, note=""):
        nonlocal broken
        case = {"name": name, "family": family, "dtype": dtype_name, "numel": n, "floor_bytes": floor_bytes,
                "note": note}
        if broken:
            case["skipped"] = "CUDA context broken by an earlier case"
        else:
            try:
                st = C.stats(C.time_ms(fn, device, args.warmup, args.repeat))
                case.update(st, gbps=C.gbps(floor_bytes, st["median_ms"]))
                case["frac_copy"] = case["gbps"] / copy_gbps if (case["gbps"] and copy_gbps) else None
            except Exception as e:
                if args.verbose:
                    traceback.print_exc()
                case["error" if family == "pagedopt" else "skipped"] = C.short_error(e)
                broken = not C.cuda_context_ok(device)
        res["cases"].append(case)
        flag = ("ERROR: " + case["error"]) if case.get("error") else (
            ("skipped: " + case["skipped"]) if case.get("skipped") else "")
        print(f"  {name:<22} {dtype_name:<4} " + (flag if flag else
              f"{C.fmt(case.get('median_ms'), 4)} ms  {C.fmt(case.get('gbps'), 0)} GB/s"), flush=True)
        save()
        return case

    for dname in [d for d in args.dtypes.split(",") if d]:
        dtype = DTYPES[dname]
        isz = torch.empty((), dtype=dtype).element_size()
        q_bytes = n * isz + n + 4 * nb
        dq_bytes = n + 4 * nb + n * isz
        g = torch.Generator(device=device)
        g.manual_seed(1)
        x = torch.empty(n, dtype=dtype, device=device).normal_(0, 1, generator=g)
        checks = res["checks"].setdefault(dname, {})

        codes = absmax = None
        if _ops is not None and want("pagedopt", "pagedopt"):
            run("pagedopt_quantize", "pagedopt", dname, lambda: _ops.quantize_blockwise(x, code, BLOCK), q_bytes)
            try:
                codes, absmax = _ops.quantize_blockwise(x, code, BLOCK)
                run("pagedopt_dequantize", "pagedopt", dname,
                    lambda: _ops.dequantize_blockwise(codes, absmax, code, BLOCK, dtype), dq_bytes)
                m = min(args.check_numel, n)
                ref_codes, ref_absmax = quant.quantize_blockwise_reference(x[:m], code, BLOCK)
                checks["pagedopt_codes_mismatch_vs_reference"] = (codes[:m] != ref_codes).float().mean().item()
                checks["pagedopt_absmax_equal_reference"] = bool(torch.equal(absmax[: m // BLOCK], ref_absmax))
                y = _ops.dequantize_blockwise(codes, absmax, code, BLOCK, torch.float32)
                checks["pagedopt_roundtrip_max_err_over_absmax"] = (
                    ((y - x.float()).view(-1, BLOCK).abs().amax(1) / absmax.clamp_min(1e-30)).max().item())
                del y
            except Exception as e:
                if args.verbose:
                    traceback.print_exc()
                checks["pagedopt_error"] = C.short_error(e)
                broken = broken or not C.cuda_context_ok(device)
        if want("torch", "torch"):
            run("torch_absmax", "torch", dname, lambda: x.view(-1, BLOCK).abs().amax(1), n * isz + 4 * nb,
                note="absmax pass only")
            run("torch_quantize_eager", "torch", dname, lambda: _torch_quantize(x, code, midpoints), q_bytes,
                note="bucketize on midpoints")
            tq_codes, tq_absmax = _torch_quantize(x, code, midpoints)
            run("torch_dequantize_eager", "torch", dname,
                lambda: _torch_dequantize(tq_codes, tq_absmax, code, dtype), dq_bytes)
            del tq_codes, tq_absmax
        if bnbF is not None and want("bnb", "bnb"):
            try:
                bcodes, bstate = bnbF.quantize_blockwise(x, code=code, blocksize=BLOCK)
            except Exception as e:
                bcodes = bstate = None
                res["cases"].append({"name": "bnb_quantize", "family": "bnb", "dtype": dname,
                                     "skipped": C.short_error(e)})
                broken = broken or not C.cuda_context_ok(device)
            if bcodes is not None:
                run("bnb_quantize", "bnb", dname, lambda: bnbF.quantize_blockwise(x, code=code, blocksize=BLOCK),
                    q_bytes)
                run("bnb_dequantize", "bnb", dname, lambda: bnbF.dequantize_blockwise(bcodes, bstate), dq_bytes)
                if codes is not None:
                    try:
                        mism = (bcodes.view(-1) != codes.view(-1)).float().mean().item()
                        checks["bnb_codes_mismatch_vs_pagedopt"] = mism
                        checks["bnb_absmax_max_rel_diff"] = ((bstate.absmax.float() - absmax).abs()
                                                             / absmax.clamp_min(1e-30)).max().item()
                    except Exception as e:
                        checks["bnb_compare_error"] = C.short_error(e)
                del bcodes, bstate
        del x, codes, absmax
        C.free_memory()
        save()

    if args.out and not args.no_plot:
        try:
            import plot
            png = os.path.join(args.out, "bench_quant.png")
            plot.plot_quant(res, png)
            print(f"wrote {png}")
        except Exception as e:
            print(f"plot skipped: {C.short_error(e)}")
    save()
    if out_json:
        print(f"wrote {out_json}")
    print()
    print(C.quant_table(res))
    print("checks:", res["checks"])
    return 1 if any(c.get("error") for c in res["cases"]) or _ops is None else 0


if __name__ == "__main__":
    sys.exit(main())
