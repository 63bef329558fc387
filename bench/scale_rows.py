"""The rows of bench/scale.py: each optimizer and paging mode, how to make it, what the estimator
predicts for it, and what it asks of the machine (managed memory, page-locked host memory, bytes
over the host link each step).

A row's optimizer is made in the child process that trains (``Row.make``); everything else here is
computed in the parent before the child starts, from pagedopt.memory's estimate of the shape (no
GPU needed), so that a configuration the machine must not run is refused without being tried.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable, Optional

import torch

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
GiB = 1 << 30


@dataclasses.dataclass
class Row:
    name: str
    make: Callable            # (params, device, settings: dict) -> optimizer
    estimator: Optional[tuple]  # (pagedopt.memory optimizer name, mode) or None where not modelled
    managed: bool = False     # its states live in CUDA managed memory (at most 16 GiB on the device)
    # page-locked host memory: "none" | "states" (host residency, 'auto' at worst) | "beyond_budget" (hybrid) |
    # "managed_beyond_budget" (host copies of a managed-memory budget's states) | "params_and_grads"
    pinned: str = "none"
    link: str = "none"        # bytes over the host link: "none" | "pager" (its paging_stats) | "params_and_grads"
    package: Optional[str] = None
    cuda_only: bool = False
    note: str = ""


def _pagedopt(cls: str, **pager):
    def make(params, device, settings):
        import pagedopt
        opt = getattr(pagedopt, cls)(params, **HYPER)
        if pager:
            kw = dict(pager)
            if kw.get("device_budget") == "setting":
                kw["device_budget"] = settings["budget_bytes"]
            if kw.pop("managed_budget", False):  # managed memory under a budget: a PageManager of its own
                kw["pager"] = pagedopt.PageManager(settings["budget_bytes"])
            if kw.get("residency") in ("host", "auto") or "device_budget" in kw:
                kw["device_buffer"] = settings["device_buffer"]
            opt.set_pager(**kw)
        return opt
    return make


def _torch_fused(params, device, settings):
    return torch.optim.AdamW(params, fused=device.type == "cuda", **HYPER)


def _bnb(cls: str):
    def make(params, device, settings):
        import bitsandbytes as bnb
        return getattr(bnb.optim, cls)(params, **HYPER)
    return make


def _torchao(cls: str):
    def make(params, device, settings):
        import torchao.optim as ao
        return getattr(ao, cls)(params, **HYPER)
    return make


def _torchao_offload(params, device, settings):
    from torchao.optim import CPUOffloadOptimizer
    return CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **HYPER)


P8 = "paged_adamw_8bit"
P4 = "paged_adamw_4bit"
ROWS = [
    Row("torch_adamw_fused", _torch_fused, ("adamw_torch_fused", "resident"), note="32-bit AdamW, fused kernel"),
    Row("bnb_adamw8bit", _bnb("AdamW8bit"), ("adamw_8bit", "resident"), package="bitsandbytes", cuda_only=True,
        note="estimate: pagedopt's 8-bit state layout (the same bytes)"),
    Row("bnb_paged_adamw8bit", _bnb("PagedAdamW8bit"), (P8, "resident"), managed=True, package="bitsandbytes",
        cuda_only=True, note="managed states, resident"),
    Row("torchao_adamw8bit", _torchao("AdamW8bit"), None, package="torchao", cuda_only=True),
    Row("torchao_adamw4bit", _torchao("AdamW4bit"), None, package="torchao", cuda_only=True),
    Row("torchao_cpu_offload", _torchao_offload, None, pinned="params_and_grads", link="params_and_grads",
        package="torchao", cuda_only=True, note="CPUOffloadOptimizer(AdamW, fused=True): AdamW on the CPU"),
    Row("pagedopt_adamw8bit", _pagedopt("AdamW8bit"), ("adamw_8bit", "resident")),
    Row("pagedopt_adamw8bit_bwd", _pagedopt("AdamW8bit", update_in_backward=True), ("adamw_8bit", "resident_released"),
        note="resident, update_in_backward=True (gradients released)"),
    Row("pagedopt_paged_adamw8bit", _pagedopt("PagedAdamW8bit"), (P8, "resident"), managed=True, link="pager",
        note="managed states, resident"),
    Row("pagedopt_paged_adamw8bit_host", _pagedopt("PagedAdamW8bit", residency="host"), (P8, "host"),
        pinned="states", link="pager", note="residency='host'"),
    Row("pagedopt_paged_adamw8bit_host_bwd", _pagedopt("PagedAdamW8bit", residency="host", update_in_backward=True),
        (P8, "host_released"), pinned="states", link="pager",
        note="residency='host', update_in_backward=True (gradients released)"),
    Row("pagedopt_paged_adamw8bit_budget", _pagedopt("PagedAdamW8bit", device_budget="setting"), (P8, "budget"),
        pinned="beyond_budget", link="pager", note="device_budget (--budget): hybrid, the rest streamed"),
    Row("pagedopt_paged_adamw8bit_budget_bwd", _pagedopt("PagedAdamW8bit", device_budget="setting",
                                                         update_in_backward=True), (P8, "budget_released"),
        pinned="beyond_budget", link="pager", note="device_budget (--budget), update_in_backward=True"),
    Row("pagedopt_paged_adamw8bit_auto", _pagedopt("PagedAdamW8bit", residency="auto"), (P8, "auto"),
        pinned="states", link="pager", note="residency='auto': what fits stays, the rest streamed"),
    Row("pagedopt_paged_adamw8bit_auto_bwd", _pagedopt("PagedAdamW8bit", residency="auto", update_in_backward=True),
        (P8, "auto_released"), pinned="states", link="pager", note="residency='auto', update_in_backward=True"),
    Row("pagedopt_adamw4bit", _pagedopt("AdamW4bit"), ("adamw_4bit", "resident"), note="4-bit states, resident"),
    Row("pagedopt_paged_adamw4bit_host", _pagedopt("PagedAdamW4bit", residency="host"), (P4, "host"),
        pinned="states", link="pager", note="4-bit states, residency='host'"),
    Row("pagedopt_paged_adamw4bit_host_bwd", _pagedopt("PagedAdamW4bit", residency="host", update_in_backward=True),
        (P4, "host_released"), pinned="states", link="pager",
        note="4-bit states, residency='host', update_in_backward=True (gradients released)"),
    Row("pagedopt_paged_adamw8bit_managed_budget", _pagedopt("PagedAdamW8bit", managed_budget=True),
        (P8, "managed_budget"), managed=True, pinned="managed_beyond_budget", link="pager",
        note="PageManager(budget_bytes=--budget): managed memory, paged in and out around each step"),
]
BY_NAME = {r.name: r for r in ROWS}
SMOKE_ROWS = ("pagedopt_paged_adamw8bit_host", "torch_adamw_fused")


def auto_support() -> Optional[str]:
    """None when PagedAdamW8bit takes ``set_pager(residency="auto")``, else why not (its error)."""
    import warnings

    import pagedopt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = pagedopt.PagedAdamW8bit([torch.nn.Parameter(torch.ones(16))], lr=1e-3)
        try:
            opt.set_pager(residency="auto")
        except (ValueError, TypeError) as exc:
            if "auto" in str(exc) or "residency" in str(exc):
                return f"this pagedopt has no set_pager(residency='auto') ({exc})"
    return None


def unavailable(row: Row, device: torch.device) -> Optional[str]:
    """Why the row cannot run at all here (missing package, needs CUDA, no 'auto'), else None."""
    if row.cuda_only and device.type != "cuda":
        return "needs CUDA"
    if row.package and importlib.util.find_spec(row.package) is None:
        return f"{row.package} is not installed"
    if "_auto" in row.name:
        return auto_support()
    return None


def budget_bytes(states: int, budget: str) -> int:
    """The budget row's device budget: a fraction of the states ("0.5") or a size ("4GiB")."""
    from pagedopt.memory import parse_size

    try:
        frac = float(budget)
    except ValueError:
        return parse_size(budget, "--budget")
    if not 0 <= frac <= 1:
        raise ValueError(f"--budget as a fraction of the states must be in [0, 1], got {budget!r}")
    return int(states * frac)


def demands(row: Row, e, settings: dict) -> dict:
    """What the row asks of the machine for the estimate ``e`` (pagedopt.memory.Estimate of the
    shape with this row's optimizer, or of an 8-bit one where the row is not modelled): managed
    bytes, page-locked host bytes, pageable host bytes, and the bytes over the link each way."""
    from pagedopt.memory.modes import HOST_SLAB_BYTES, streamed_bytes

    states, moved = e.state_bytes, streamed_bytes(e)  # host residency leaves the step counters on the GPU
    budget = settings.get("budget_bytes") or 0
    rest = max(moved - budget, 0)
    pinned = {"none": 0, "states": moved + HOST_SLAB_BYTES, "beyond_budget": rest + HOST_SLAB_BYTES if rest else 0,
              "managed_beyond_budget": max(states - budget, 0), "params_and_grads": e.weights + e.gradients}[row.pinned]
    # torchao's CPUOffloadOptimizer runs torch's AdamW on the host: two moments like the params
    pageable = 2 * e.weights if row.pinned == "params_and_grads" else 0
    if row.link == "params_and_grads":
        link = (e.weights, e.gradients)  # params come back, gradients go out
    elif row.pinned == "states":
        link = (moved, moved)
    elif row.pinned == "beyond_budget":
        link = (rest, rest)
    elif row.pinned == "managed_beyond_budget":
        link = (pinned, pinned)
    else:
        link = (0, 0)
    return {"states": states, "managed": states if row.managed else 0, "pinned": pinned, "pageable": pageable,
            "link_h2d": link[0], "link_d2h": link[1]}


def refusal(row: Row, need: dict, limits: dict) -> Optional[str]:
    """Why the machine must not run this configuration (device safety), else None. (The 'auto'
    row is checked again in its child, once its pager is known: see scale.py ``managed_guard``.)"""
    if need["managed"] and need["managed"] >= limits["managed"]:
        return (f"managed states {need['managed'] / GiB:.1f} GiB >= {limits['managed'] / GiB:g} GiB: never "
                "oversubscribe managed memory (device safety)")
    if need["pinned"] > limits["pinned"]:
        return (f"needs {need['pinned'] / GiB:.1f} GiB of page-locked host memory, more than the "
                f"{limits['pinned'] / GiB:g} GiB allowed (device safety)")
    host = limits.get("host_available")
    if host is not None and need["pinned"] + need["pageable"] > host:
        return (f"needs {(need['pinned'] + need['pageable']) / GiB:.1f} GiB of host memory, more than the "
                f"{host / GiB:.1f} GiB free (device safety)")
    return None
