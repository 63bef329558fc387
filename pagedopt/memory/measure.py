"""Measuring a run's memory: what the process holds now (CUDA allocator, resident set, a paged
optimizer's residency): :func:`memory_report`, :func:`report_gib`, and :func:`log_memory` for a
plain loop; the Trainer callback (pagedopt.integrations.callbacks) uses them too. The estimator is
pagedopt.memory.estimator."""
from __future__ import annotations

from typing import Any, Callable, Optional

from .tables import GIB

# ------------------------------------------------------------------------------------------------
# measuring a run
# ------------------------------------------------------------------------------------------------
def _unwrap(optimizer):
    """The pagedopt (or torch) optimizer inside wrappers such as accelerate's AcceleratedOptimizer."""
    seen = 0
    while optimizer is not None and not hasattr(optimizer, "paging_stats") and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def memory_report(optimizer=None, device=None) -> dict:
    """What the process holds now, in bytes:

    * ``allocated_bytes``, ``reserved_bytes``, ``max_allocated_bytes``: torch.cuda.memory_allocated /
      memory_reserved / max_memory_allocated of ``device`` (the current CUDA device); 0 without CUDA;
    * ``rss_bytes``: the process's resident memory (psutil; absent without psutil);
    * with ``optimizer``: ``optimizer_state_bytes`` (pagedopt.optim.base.optimizer_state_bytes), and for a
      paged pagedopt optimizer ``paged_resident_bytes`` / ``paged_host_bytes`` (its paging_stats():
      paged state bytes on a GPU / on the host) and ``unpaged_bytes`` (states that could not be paged,
      e.g. on the CPU).
    """
    import torch

    out: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        out.update(allocated_bytes=int(torch.cuda.memory_allocated(dev)), reserved_bytes=int(torch.cuda.memory_reserved(dev)),
                   max_allocated_bytes=int(torch.cuda.max_memory_allocated(dev)))
    else:
        out.update(allocated_bytes=0, reserved_bytes=0, max_allocated_bytes=0)
    try:
        import psutil

        out["rss_bytes"] = int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    opt = _unwrap(optimizer)
    if opt is not None:
        from ..optim.base import optimizer_state_bytes

        out["optimizer_state_bytes"] = int(optimizer_state_bytes(opt))
        stats = opt.paging_stats() if hasattr(opt, "paging_stats") else None
        if stats is not None:
            out.update(paged_resident_bytes=int(stats.resident_bytes), paged_host_bytes=int(stats.host_bytes),
                       unpaged_bytes=int(stats.unpaged_bytes))
    return out


def report_gib(report: dict, prefix: str = "mem/") -> dict:
    """``memory_report()`` with ``*_bytes`` keys turned into ``{prefix}*_gib`` floats (for logs)."""
    return {f"{prefix}{k[:-len('_bytes')]}_gib" if k.endswith("_bytes") else f"{prefix}{k}":
            v / GIB if k.endswith("_bytes") else v for k, v in report.items()}


def log_memory(step: int, every: int = 100, optimizer=None, log: Optional[Callable[[str], Any]] = print) -> Optional[dict]:
    """In a plain loop: every ``every`` steps (when ``step % every == 0``), call ``log`` with one line
    of :func:`memory_report` in GiB, and return the report (bytes, with ``step``); else None."""
    if every <= 0 or step % every:
        return None
    rep = memory_report(optimizer)
    if log is not None:
        log(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in report_gib(rep, "").items()))
    return {"step": step, **rep}


