"""Where the device memory of the first steps goes, per mode: bench_train's LM (936M parameters by
default), three steps, and after each the caching allocator's reserved and allocated bytes (now
and peak), the device's used memory, and the reserved segments grouped by the stream they belong
to (torch.cuda.memory_snapshot: a block freed on one stream is not handed to another). Each mode
runs in a process of its own.

    python scripts/probe_first_step_memory.py --modes host,host_bwd --out /tmp/probe.json
    python scripts/probe_first_step_memory.py --smoke        # CPU: the harness only

Modes: resident (AdamW8bit), host (PagedAdamW8bit, residency="host"), host_bwd (the same with
update_in_backward=True), resident_bwd (AdamW8bit, update_in_backward=True).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.append(ROOT)  # after PYTHONPATH: PYTHONPATH=<another tree> probes that tree's pagedopt

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GiB = 1 << 30
MODES = {
    "resident": ("AdamW8bit", None, False),
    "resident_bwd": ("AdamW8bit", "device", True),
    "host": ("PagedAdamW8bit", "host", False),
    "host_bwd": ("PagedAdamW8bit", "host", True),
}


def _segments_by_stream() -> dict:
    out: dict = {}
    for seg in torch.cuda.memory_snapshot():
        s = out.setdefault(str(seg.get("stream", 0)), {"segments": 0, "reserved": 0, "allocated": 0})
        s["segments"] += 1
        s["reserved"] += seg["total_size"]
        s["allocated"] += seg["allocated_size"]
    return out


def run_one(mode: str, layers: int, batch: int, smoke: bool) -> dict:
    import bench_train as T
    import pagedopt

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    cfg = T.TINY if smoke else dataclasses.replace(T.ModelConfig(), layers=layers, batch=batch)
    torch.manual_seed(0)
    model = T.CausalLM(cfg).to(device)
    cls, residency, bwd = MODES[mode]
    opt = getattr(pagedopt, cls)(model.parameters(), **T.HYPER)
    if residency == "device":
        opt.set_pager(update_in_backward=bwd)
    elif residency is not None:
        opt.set_pager(residency=residency, update_in_backward=bwd)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    steps = []
    for step in range(3):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        rec = {"step": step}
        if cuda:
            torch.cuda.synchronize()
            rec["after_backward_reserved_gib"] = torch.cuda.memory_reserved() / GiB
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            rec.update(reserved_gib=torch.cuda.memory_reserved() / GiB,
                       max_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                       allocated_gib=torch.cuda.memory_allocated() / GiB,
                       max_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                       device_used_gib=(total - free) / GiB,
                       by_stream={k: {kk: (vv / GiB if kk != "segments" else vv) for kk, vv in v.items()}
                                  for k, v in _segments_by_stream().items()})
        rec["loss"] = float(loss)
        steps.append(rec)
    return {"mode": mode, "layers": cfg.layers, "batch": cfg.batch, "pagedopt": pagedopt.__file__, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="host,host_bwd")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.layers, args.batch, args.smoke)))
        return 0
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, "--layers", str(args.layers),
               "--batch", str(args.batch)] + (["--smoke"] if args.smoke else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            results.append({"mode": mode, "error": p.stderr[-2000:]})
        else:
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        r = results[-1]
        for s in r.get("steps", []):
            line = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "by_stream"}
            print(mode, line)
            for stream, v in s.get("by_stream", {}).items():
                print(f"    stream {stream}: " + ", ".join(f"{k} {v[k]:.2f}" if k != "segments" else f"{k} {v[k]}"
                                                        for k in v))
        if "error" in r:
            print(mode, "ERROR", r["error"][-600:])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
