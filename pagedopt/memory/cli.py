"""The command line of pagedopt.memory (``pagedopt-mem``, ``python -m pagedopt.memory``): the
table of an estimate in GiB (:func:`format_estimate`) and :func:`main`."""
from __future__ import annotations

import argparse
import json
from typing import Optional

from .estimator import Estimate, estimate, gpu_capacity
from .model import model_from_config, model_from_params
from .modes import DEFAULT_MARGIN, DEVICE_BUFFER_BYTES, largest_budget, parse_size, predict_modes, recommend
from .tables import DTYPE_BYTES, GIB, GPUS, OPTIMIZERS, PRESETS

# argparse's description: the first line of the package's docstring
DESCRIPTION = "What fits: GPU memory of a training run (weights + gradients + optimizer states + activations)."


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------
def _g(nbytes: Optional[int]) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GIB:9.2f}"


def format_estimate(e: Estimate, gpu=None, compare: bool = True) -> str:
    s = e.settings
    mode = (f"LoRA r={s['lora_rank']} on q,k,v,o{',gate,up,down' if s['lora_mlp'] else ''}" if s["lora_rank"]
            else "full fine-tuning")
    label, bits, paged, _ = OPTIMIZERS[e.optimizer]
    lines = [f"model: {e.n_params:,} parameters ({e.model.source}); trainable: {e.n_trainable:,}",
             f"{mode}; weights {e.weights_dtype}; optimizer {e.optimizer} ({label}"
             + (f", min_8bit_size={s['min_8bit_size']}" if bits in (4, 8) else "") + ")"
             + f"; batch {s['batch']} x seq {s['seq']}; gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
             + f"; attention {s['attention']}", ""]
    if bits in (4, 8):
        states_note = (f"{bits}-bit for {e.params_8bit:,} of {e.n_trainable:,} trainable params"
                       + ("" if e.model.exact else " (approximate: shapes unknown)"))
    elif bits == 32:
        states_note = "fp32 m and v: 8 bytes/param"
    else:
        states_note = "exp_avg, exp_avg_sq in the params' dtype"
    rows = [("weights", e.weights, 0, ""),
            ("gradients", e.gradients, 0, "trainable params only"),
            ("optimizer states" + (" (paged)" if paged else ""), e.states_gpu, e.states_host,
             states_note + ("; on host during fwd/bwd" if paged else "")),
            ("activations (ESTIMATE)", e.activations, 0,
             "Korthikanti et al. 2022, per layer s*b*h*(34+5as/h)" + ("" if s["attention"] == "eager" else ", no 5as/h (sdpa)")),
            ("CUDA context (constant)", e.context, 0, "outside torch's allocator"),
            ]
    if e.weight_casts:
        rows.insert(4, ("16-bit weight copies", e.weight_casts, 0, "ESTIMATE: fp32 weights under autocast, the "
                        "copies saved for backward (with cache_enabled=False)"))
    width = 26
    lines.append(f"{'':{width}} {'GPU GiB':>9}  {'host GiB':>9}  note")
    for name, gpu_b, host_b, note in rows:
        lines.append(f"{name:{width}} {_g(gpu_b)}  {_g(host_b) if host_b else ' ' * 9}  {note}")
    lines.append("-" * (width + 24))
    lines.append(f"{'peak, forward/backward':{width}} {_g(e.forward_backward)}")
    lines.append(f"{'peak, optimizer step':{width}} {_g(e.optimizer_step)}  {' ' * 9}  "
                 f"incl. {e.step_temporaries / GIB:.2f} GiB step temporaries"
                 + ("; paged states stream in 64 MiB chunks" if paged else ""))
    lines.append(f"{'PEAK (estimate)':{width}} {_g(e.peak)}")
    if e.activations is None:
        lines.append("activations unknown (no architecture): the peak excludes them")
    if gpu is not None:
        name, gib = gpu_capacity(gpu)
        cap = int(gib * GIB)
        verdict = ("fits" if e.peak <= cap else "does NOT fit") + f": needs {e.peak / GIB:.1f} GiB of {gib:g} GiB"
        mb = e.max_batch(cap)
        lines += ["", f"on {name}: {verdict}"
                  + (f"; largest batch at seq {s['seq']}: {mb or 'none'}" if e.activations is not None else "")]
        if compare:
            lines.append("same run with each optimizer:")
            name_width = max(len(o) for o in OPTIMIZERS)  # the longest name keeps one space before "states"
            for opt in OPTIMIZERS:
                other = estimate(e.model, opt, e.weights_dtype, lora_rank=s["lora_rank"], lora_mlp=s["lora_mlp"],
                                 batch=s["batch"], seq=s["seq"], gradient_checkpointing=s["gradient_checkpointing"],
                                 attention=s["attention"], min_8bit_size=s["min_8bit_size"],
                                 embeddings_32bit=s["embeddings_32bit"], act_dtype=s.get("act_dtype"),
                                 context_bytes=e.context)
                lines.append(f"  {opt:{name_width}} states {other.state_bytes / GIB:8.2f} GiB  peak {other.peak / GIB:8.2f} GiB  "
                             + ("fits" if other.peak <= cap else "does not fit")
                             + (f", largest batch {other.max_batch(cap) or 'none'}" if other.activations is not None else ""))
    lines.append("Weights, gradients and optimizer states are exact for the given shapes; activations are an "
                 "estimate (measure with pagedopt.memory.memory_report).")
    return "\n".join(lines)


def format_modes(e: Estimate, gpu=None, margin: float = DEFAULT_MARGIN, budget=None,
                 device_buffer=DEVICE_BUFFER_BYTES, release_ok: bool = True) -> str:
    """The table of each paging mode's peak (pagedopt.memory.modes) and, for a GPU, the mode to pick."""
    cap = None if gpu is None else int(gpu_capacity(gpu)[1] * GIB)
    if budget is None and cap is not None:
        budget = largest_budget(e, cap, margin) or None
    preds = predict_modes(e, device_buffer, budget, capacity=cap)
    width = max(len(p.mode) for p in preds)
    lines = ["", "each mode (GiB; peak: what the GPU holds, first step included; torch: torch.cuda.max_memory_allocated"
             " after the first step; link: bytes each way per step):",
             f"  {'mode':{width}} {'peak':>8} {'1st step':>8} {'torch':>8} {'states':>8} {'grads':>8} {'pinned':>8}"
             f" {'link':>8}" + ("  fits" if cap is not None else "")]
    for p in preds:
        lines.append(f"  {p.mode:{width}} {p.peak / GIB:8.2f} {p.first_step_peak / GIB:8.2f} {p.allocator_peak / GIB:8.2f}"
                     f" {p.states_on_gpu / GIB:8.2f} {p.gradients / GIB:8.2f} {p.pinned / GIB:8.2f} {p.link_h2d / GIB:8.2f}"
                     + (("  yes" if p.fits(cap, margin) else "  no") if cap is not None else ""))
    for p in preds:
        lines.append(f"  {p.mode}: {p.how}" + (f"  ({p.note})" if p.note else ""))
    if cap is not None:
        r = recommend(e, cap, margin, release_ok, device_buffer)
        lines += ["", f"recommended: {r.how or 'none'}", f"  {r.reason}"]
        if r.alternatives:
            lines.append(f"  also fit (slower): {', '.join(r.alternatives)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pagedopt-mem", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (optimizer states then approximate)")
    src.add_argument("--config", help=f"config.json (or its directory) of a transformers model, or a preset: "
                                       f"{', '.join(PRESETS)}")
    p.add_argument("--no-transformers", action="store_true", help="count with the Llama formula, not a meta model")
    p.add_argument("--weights", choices=list(DTYPE_BYTES), default="bf16", help="dtype of the weights (and gradients)")
    p.add_argument("--activations", choices=list(DTYPE_BYTES), default=None, dest="act_dtype",
                   help="dtype of activations (default: that of the weights; bf16 for fp32 weights under autocast)")
    p.add_argument("--optimizer", default="paged_adamw_8bit",
                   help=f"{', '.join(OPTIMIZERS)} (Trainer names such as pagedopt_adamw_8bit work too)")
    p.add_argument("--min-8bit-size", type=int, default=4096)
    p.add_argument("--embeddings-32bit", action="store_true",
                   help="embeddings keep 32-bit states (what the pagedopt Trainer names do by default)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora-mlp", action="store_true", help="LoRA on the MLP projections too")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--gpu", help="GPU memory in GiB or a name: " + ", ".join(GPUS))
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes)")
    p.add_argument("--modes", action="store_true", help="each paging mode's peak (resident, budget, host, with "
                   "gradients released) and, with --gpu, the mode to pick")
    p.add_argument("--device-buffer", default="256MiB", help="the device buffer of host-resident states (--modes)")
    p.add_argument("--budget", default=None, help="the budget mode's device budget, e.g. 4GiB (--modes; default: "
                   "the largest that fits the --gpu, else half the states)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="the share of the GPU left free when "
                   "deciding what fits (--modes; default %(default)s)")
    p.add_argument("--no-release", action="store_true", help="the run clips gradients, uses GradScaler, DDP or "
                   "gradient accumulation: no mode that releases gradients during backward (--modes)")
    a = p.parse_args(argv)
    try:
        model = (model_from_params(a.params) if a.params is not None
                 else model_from_config(a.config, use_transformers=not a.no_transformers))
        e = estimate(model, a.optimizer, a.weights, lora_rank=a.lora, lora_mlp=a.lora_mlp, batch=a.batch, seq=a.seq,
                     gradient_checkpointing=a.gradient_checkpointing, attention=a.attention,
                     min_8bit_size=a.min_8bit_size, embeddings_32bit=a.embeddings_32bit, act_dtype=a.act_dtype)
        if a.gpu is not None:
            gpu_capacity(a.gpu)
        buffer = parse_size(a.device_buffer, "--device-buffer")
        budget = None if a.budget is None else parse_size(a.budget, "--budget")
        if not 0 <= a.margin < 1:
            raise ValueError(f"--margin must be in [0, 1), got {a.margin}")
    except (ValueError, FileNotFoundError, KeyError) as err:
        p.error(str(err))
    if a.json:
        out = {k: getattr(e, k) for k in ("n_params", "n_trainable", "weights", "gradients", "state_bytes", "states_gpu",
                                          "states_host", "activations", "step_temporaries", "context")}
        out.update(forward_backward=e.forward_backward, optimizer_step=e.optimizer_step, peak=e.peak,
                   source=e.model.source, optimizer=e.optimizer)
        cap = None if a.gpu is None else int(gpu_capacity(a.gpu)[1] * GIB)
        if cap is not None:
            out["max_batch"] = e.max_batch(cap)
        if a.modes:
            if budget is None and cap is not None:
                budget = largest_budget(e, cap, a.margin) or None
            out["modes"] = [m.as_dict() for m in predict_modes(e, buffer, budget, capacity=cap)]
            if cap is not None:
                r = recommend(e, cap, a.margin, not a.no_release, buffer)
                out["recommendation"] = {"mode": r.mode, "how": r.how, "reason": r.reason,
                                         "alternatives": r.alternatives}
        print(json.dumps(out, indent=1))
    else:
        print(format_estimate(e, a.gpu))
        if a.modes:
            print(format_modes(e, a.gpu, a.margin, budget, buffer, not a.no_release))
    return 0

