"""End-to-end training step: a ~1B-parameter causal LM (plain torch, bf16 autocast) trained for a
few steps with each optimizer mode, every mode in a process of its own, side by side in one run.

Per mode: the median time of a whole training step (forward, backward, optimizer step, zero_grad
and, for the "paged out" modes, a page-out of every optimizer state after the step), and the peak
GPU memory two ways: ``torch.cuda.max_memory_allocated`` (torch's caching allocator only: it does
not see managed memory, so paged states do not show there) and the device-level used memory
(``cudaMemGetInfo``: total - free, sampled after backward and after the optimizer step, minus what
was used before the model existed), which counts managed pages resident on the GPU.

The default model (d_model 2048, 16 layers, MLP 4x, vocabulary 32000, untied head: 936M
parameters, fp32 master weights) is trained on random tokens, batch 8 x 512.

    python bench/bench_train.py --out /tmp/train                  # every mode, on CUDA
    python bench/bench_train.py --modes torch_adamw_fused,pagedopt_paged_adamw8bit_pageout
    python bench/bench_train.py --smoke --out /tmp/bt             # tiny model, CPU, seconds (CI)

Modes whose library is missing or that fail are recorded as skipped, with the reason. Each mode
runs in a child process (``--mode``), so one library's leaked or cached memory, or a broken CUDA
context, cannot touch another's figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt
import common as C  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 2048
    layers: int = 16
    heads: int = 16
    mlp_ratio: int = 4
    vocab: int = 32000
    seq: int = 512
    batch: int = 8


TINY = ModelConfig(d_model=64, layers=2, heads=4, vocab=256, seq=32, batch=2)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, cfg.mlp_ratio * d, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def param_count(cfg: ModelConfig) -> int:
    d = cfg.d_model
    per_layer = 4 * d * d + 2 * cfg.mlp_ratio * d * d + 2 * d
    return cfg.layers * per_layer + 2 * cfg.vocab * d + d


# --------------------------------------------------------------------------- the modes
@dataclasses.dataclass
class Mode:
    name: str
    make: Callable  # (params, device) -> optimizer
    page_out: bool = False  # page out every state after each step (opt.page_out())
    cuda_only: bool = False
    note: str = ""


def _pagedopt(cls: str, residency: Optional[str] = None, update_in_backward: bool = False,
              device_budget: Optional[str] = None):
    def make(params, device):
        import pagedopt
        opt = getattr(pagedopt, cls)(params, **HYPER)
        if device_budget is not None:  # hybrid: that many bytes of states stay, the rest stream
            opt.set_pager(device_budget=device_budget, update_in_backward=update_in_backward)
        elif residency is not None:  # the default device buffer (256 MiB)
            opt.set_pager(residency=residency, update_in_backward=update_in_backward)
        return opt
    return make


def _bnb(cls: str):
    def make(params, device):
        import bitsandbytes as bnb
        return getattr(bnb.optim, cls)(params, **HYPER)
    return make


def _torch_adamw(params, device):
    return torch.optim.AdamW(params, fused=C.is_cuda(device), **HYPER)


def _torchao_offload(params, device):
    from torchao.optim import CPUOffloadOptimizer
    return CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **HYPER)


MODES = [
    Mode("torch_adamw_fused", _torch_adamw, note="32-bit states, never paged"),
    Mode("pagedopt_adamw8bit", _pagedopt("AdamW8bit")),
    Mode("pagedopt_paged_adamw8bit", _pagedopt("PagedAdamW8bit"), note="paged, resident"),
    Mode("pagedopt_paged_adamw8bit_pageout", _pagedopt("PagedAdamW8bit"), page_out=True,
         note="page_out() after every step (copy engine into host copies)"),
    Mode("pagedopt_paged_adamw8bit_host", _pagedopt("PagedAdamW8bit", "host"),
         note="residency='host': states on the host, streamed through a 256 MiB device buffer"),
    Mode("pagedopt_paged_adamw8bit_host_bwd", _pagedopt("PagedAdamW8bit", "host", update_in_backward=True),
         note="residency='host', update_in_backward=True: states stream in and back during backward"),
    Mode("pagedopt_paged_adamw8bit_auto", _pagedopt("PagedAdamW8bit", "auto"),
         note="residency='auto': the states that fit in the free memory stay, the rest stream"),
    Mode("pagedopt_paged_adamw8bit_budget512", _pagedopt("PagedAdamW8bit", device_budget="512MiB"),
         note="device_budget='512MiB': 512 MiB of states stay, the rest stream from the host"),
    Mode("pagedopt_paged_adamw8bit_budget512_bwd", _pagedopt("PagedAdamW8bit", update_in_backward=True,
                                                             device_budget="512MiB"),
         note="device_budget='512MiB', update_in_backward=True"),
    Mode("bnb_adamw8bit", _bnb("AdamW8bit"), cuda_only=True),
    Mode("bnb_paged_adamw8bit", _bnb("PagedAdamW8bit"), cuda_only=True, note="paged, resident"),
    Mode("torchao_cpu_offload", _torchao_offload, cuda_only=True,
         note="CPUOffloadOptimizer(AdamW, fused=True): AdamW on the CPU, states on the host"),
]
LINK_BYTES = 1 << 30  # pinned copies that measure the host link (bench/common.py pinned_bandwidth)
VARIANT_HELP = ("a mode name of updates during backward may end in @cN (N chunks per device buffer), pN "
                "(update stream priority N) and/or w (the updates on a worker thread), e.g. "
                "pagedopt_paged_adamw8bit_host_bwd@c4p0w")


def resolve_mode(name: str, by_name: dict) -> Optional[Mode]:
    """The mode of ``name``: a plain mode name, or one of updates during backward with a variant of
    its tuning (``@c6``, ``@p0``, ``@w``, ``@c6p-1w``: chunks per device buffer, update stream
    priority, updates on a worker thread),
    each run in its own process like every mode. None for an unknown name or variant."""
    base, at, variant = name.partition("@")
    mode = by_name.get(base)
    if mode is None or not at:
        return mode
    m = re.fullmatch(r"(?:c(\d+))?(?:p(-?\d+))?(w)?", variant)
    if m is None or not any(m.groups()) or "update_in_backward" not in mode.note:
        return None
    chunks, priority = (int(x) if x is not None else None for x in m.groups()[:2])
    thread = m.group(3) is not None
    if chunks is not None and chunks < 1:
        return None

    def make(params, device):
        from pagedopt.optim.backward_updates import BackwardUpdates
        if chunks is not None:
            BackwardUpdates.chunks_per_buffer = chunks
        if priority is not None:
            BackwardUpdates.stream_priority = priority
        if thread:
            BackwardUpdates.update_thread = True
        return mode.make(params, device)
    return dataclasses.replace(mode, name=name, make=make, note=f"{mode.note} ({variant})")


SMOKE_MODES = ("torch_adamw_fused", "pagedopt_adamw8bit", "pagedopt_paged_adamw8bit_pageout",
               "pagedopt_paged_adamw8bit_host", "pagedopt_paged_adamw8bit_host_bwd")


# --------------------------------------------------------------------------- one mode (child)
def device_used(device) -> int:
    """Bytes in use on the whole device (every allocator, managed pages, the context)."""
    if not C.is_cuda(device):
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def run_mode(mode: Mode, cfg: ModelConfig, device, warmup: int, steps: int, seed: int = 0) -> dict:
    """Train `warmup + steps` steps; the record of the timed ones."""
    if mode.cuda_only and not C.is_cuda(device):
        return {"mode": mode.name, "skipped": "needs CUDA"}
    C.free_memory()
    base_used = device_used(device)
    torch.manual_seed(seed)
    model = CausalLM(cfg).to(device)
    params = [p for p in model.parameters()]
    opt = mode.make(params, device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
    autocast_dtype = torch.bfloat16
    peaks = {"after_backward": 0, "after_step": 0}

    def train_step() -> float:
        with torch.autocast(device_type=device.type, dtype=autocast_dtype):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        peaks["after_backward"] = max(peaks["after_backward"], device_used(device) - base_used)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode.page_out:
            opt.page_out()
        peaks["after_step"] = max(peaks["after_step"], device_used(device) - base_used)
        return loss.detach()

    losses = []
    for _ in range(warmup):
        losses.append(float(train_step()))
    if C.is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    peaks = {k: 0 for k in peaks}
    times = []
    transfer_ms = []  # host-resident states: the GPU time of each timed step's copies in and back
    for _ in range(steps):
        C.sync(device)
        t0 = time.perf_counter()
        loss = train_step()
        C.sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
        if getattr(opt, "is_paged", False) and hasattr(opt, "paging_stats"):  # pagedopt's, not a peer's
            transfer_ms.append(opt.paging_stats().transfer_ms_last_step)
    # the same number of steps back to back, synchronised only before and after: the time per step
    # of a training loop, where what a step leaves in flight (copies back) overlaps the next forward
    C.sync(device)
    t0 = time.perf_counter()
    loop_losses = [train_step() for _ in range(steps)]  # tensors: reading them would wait for each step
    C.sync(device)
    loop_ms = (time.perf_counter() - t0) * 1e3 / steps
    rec = {
        "mode": mode.name,
        "loop_step_ms": loop_ms,
        "note": mode.note,
        "params": sum(p.numel() for p in params),
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        "state_bytes": _state_bytes_or_none(opt),  # what streaming moves each way
        "transfer_ms": statistics.median(transfer_ms) if transfer_ms and None not in transfer_ms else None,
        "losses": losses,
        "loop_losses": [float(x) for x in loop_losses],
        "max_memory_allocated": torch.cuda.max_memory_allocated(device) if C.is_cuda(device) else None,
        "device_used_peak": max(peaks.values()) if C.is_cuda(device) else None,
        "device_used_after_backward": peaks["after_backward"] if C.is_cuda(device) else None,
        "device_used_after_step": peaks["after_step"] if C.is_cuda(device) else None,
    }
    if hasattr(opt, "paging_stats") and getattr(opt, "is_paged", False):
        try:
            rec["paging_stats"] = dict(opt.paging_stats().as_dict())
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            rec["paging_stats"] = C.short_error(exc)
    return rec


def _state_bytes_or_none(opt) -> Optional[int]:
    """The optimizer's state bytes, per tensor; None for an optimizer without a readable ``state``
    (torchao's CPUOffloadOptimizer keeps its own)."""
    try:
        return C.state_bytes(opt, views=True)
    except Exception:  # noqa: BLE001 - a report, not a check
        return None


# --------------------------------------------------------------------------- the parent
def run_child(argv_base: list[str], name: str, out_path: str, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv_base, "--mode", name, "--mode-out", out_path]
    try:
        proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"mode": name, "skipped": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out_path):
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return {"mode": name, "skipped": f"exit {proc.returncode}: " + " | ".join(tail)[-300:]}
    with open(out_path) as f:
        return json.load(f)


def merge_rounds(recs: list[dict]) -> dict:
    """One record of a mode run in several rounds (each its own process): the median over rounds of
    the step and loop times, every round's pair kept (``rounds``), memory peaks the largest seen."""
    done = [r for r in recs if "step_ms" in r]
    if not done:
        return recs[0]
    out = dict(done[0])
    out["rounds"] = [{"step_ms": r["step_ms"], "loop_step_ms": r.get("loop_step_ms")} for r in done]
    out["step_ms"] = statistics.median(r["step_ms"] for r in done)
    loops = [r["loop_step_ms"] for r in done if r.get("loop_step_ms") is not None]
    out["loop_step_ms"] = statistics.median(loops) if loops else None
    for k in ("max_memory_allocated", "device_used_peak", "device_used_after_backward", "device_used_after_step"):
        seen = [r[k] for r in done if r.get(k) is not None]
        out[k] = max(seen) if seen else None
    if len(done) < len(recs):
        out["skipped_rounds"] = [r.get("skipped") for r in recs if "step_ms" not in r]
    return out


def loop_range(r: dict) -> Optional[str]:
    loops = [x["loop_step_ms"] for x in r.get("rounds", []) if x.get("loop_step_ms") is not None]
    return f"{min(loops):.1f}-{max(loops):.1f}" if len(loops) > 1 else None


def result_table(records: list[dict]) -> str:
    gib = float(1 << 30)
    ref = next((r["step_ms"] for r in records if r.get("mode") == "pagedopt_adamw8bit" and "step_ms" in r), None)
    rows = []
    for r in records:
        if "skipped" in r:
            rows.append([r["mode"], None, None, None, None, None, None, None, None, "skipped: " + r["skipped"]])
            continue
        in_gib = [r.get(k) / gib if r.get(k) is not None else None
                  for k in ("max_memory_allocated", "device_used_peak", "device_used_after_backward", "device_used_after_step")]
        rows.append([r["mode"], r["step_ms"], r["step_ms"] / ref if ref else None, r.get("loop_step_ms"),
                     loop_range(r), *in_gib, r.get("note", "")])
    return C.table(rows, ["mode", "step ms", "x adamw8bit", "loop ms", "loop ms, rounds", "max alloc GiB",
                          "device used GiB", "after bwd GiB", "after step GiB", "note"])


def link_summary(link: dict, records: list[dict]) -> str:
    """The link's rates and the floor they set for streaming the states in and back each step."""
    lines = []
    for when, r in link.items():
        lines.append(f"link {when}: host->device {C.fmt(r['h2d_gbps'], 1)} GB/s, device->host "
                     f"{C.fmt(r['d2h_gbps'], 1)} GB/s, both at once {C.fmt(r['both_gbps_each_way'], 1)} GB/s each way")
    each_way = [r["both_gbps_each_way"] for r in link.values() if r.get("both_gbps_each_way")]
    streamed = next((r for r in records if "_host" in r.get("mode", "") and r.get("state_bytes")), None)
    if each_way and streamed:
        floor = streamed["state_bytes"] / (min(each_way) * C.GB) * 1e3
        lines.append(f"host-resident states: {streamed['state_bytes'] / C.GB:.2f} GB each way per step, "
                     f"{floor:.1f} ms of link time at the slower rate measured both ways at once")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = [r for r in records if "step_ms" in r]
    if not done:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.5 * len(done) + 1.5))
    names = [r["mode"] for r in done]
    ys = range(len(done))
    a.barh([y - 0.2 for y in ys], [r["step_ms"] for r in done], height=0.4, label="one step, synchronised")
    a.barh([y + 0.2 for y in ys], [r.get("loop_step_ms") or 0 for r in done], height=0.4,
           label="steps back to back (loop)")
    a.set_yticks(list(ys), names)
    a.set_xlabel("median training step (ms)")
    a.legend(loc="upper right", fontsize="small")
    a.invert_yaxis()
    used = [(r.get("device_used_peak") or 0) / (1 << 30) for r in done]
    b.barh(names, used)
    b.set_xlabel("peak device memory used (GiB)")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="", help="comma-separated mode names (default: all; --smoke: "
                    + ",".join(SMOKE_MODES) + "); " + VARIANT_HELP)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few steps (CI)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mode's process")
    ap.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved (each "
                    "run its own process); each mode's figures are the medians over rounds, with the range")
    ap.add_argument("--out", default=None, help="folder for train.json (and train.png)")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)      # child: run this mode only
    ap.add_argument("--mode-out", default=None, help=argparse.SUPPRESS)  # child: its record
    args = ap.parse_args(argv)

    cfg = TINY if args.smoke else ModelConfig()
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    if args.smoke:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    by_name = {m.name: m for m in MODES}
    names = [n for n in args.modes.split(",") if n] or (list(SMOKE_MODES) if args.smoke else list(by_name))
    unknown = [n for n in names if resolve_mode(n, by_name) is None]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; known: {', '.join(by_name)}; {VARIANT_HELP}")

    if args.mode is not None:  # a child
        try:
            rec = run_mode(resolve_mode(args.mode, by_name), cfg, device, args.warmup, args.steps)
        except Exception as exc:  # noqa: BLE001 - recorded as skipped, with the reason
            rec = {"mode": args.mode, "skipped": C.short_error(exc)}
        C.write_json(args.mode_out, rec)
        return 0

    out_dir = args.out or os.path.join(os.getcwd(), "bench_train_out")
    os.makedirs(out_dir, exist_ok=True)
    child_argv = ["--device", str(device), "--warmup", str(args.warmup), "--steps", str(args.steps),
                  "--layers", str(cfg.layers), "--batch", str(cfg.batch)] + (["--smoke"] if args.smoke else [])
    # the host link, before and after the modes (the host-resident modes' floor moves with it, and
    # it differs from one machine to the next): pinned copies, each way and both ways at once
    link = {"before": C.pinned_bandwidth(device, LINK_BYTES)} if C.is_cuda(device) else None
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    by_round = {name: [] for name in names}
    for k in range(args.rounds):  # interleaved: a machine's drift during the run touches every mode alike
        for name in names:
            print(f"[bench_train] {name}" + (f" (round {k + 1})" if args.rounds > 1 else "") + " ...", flush=True)
            suffix = f"_r{k + 1}" if args.rounds > 1 else ""
            rec = run_child(child_argv, name, os.path.join(out_dir, f"mode_{name}{suffix}.json"), args.timeout)
            by_round[name].append(rec)
            print("   ", rec.get("skipped") or f"{rec['step_ms']:.1f} ms, loop {rec['loop_step_ms']:.1f} ms", flush=True)
    records = [by_round[name][0] if args.rounds == 1 else merge_rounds(by_round[name]) for name in names]
    if link is not None:
        link["after"] = C.pinned_bandwidth(device, LINK_BYTES)
    doc = {"env": C.env_info(device), "config": dataclasses.asdict(cfg), "params": param_count(cfg),
           "command": " ".join([os.path.basename(sys.executable), "bench/bench_train.py", *(argv or sys.argv[1:])]),
           "link": link, "records": records}
    C.write_json(os.path.join(out_dir, "train.json"), doc)
    print(result_table(records))
    if link is not None:
        print(link_summary(link, records))
    png = plot(records, os.path.join(out_dir, "train.png"))
    if png:
        print(f"chart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
