"""CUDA unified (managed) memory: the ``torch.ops.pagedopt`` operators and whether they can be used.

* thin wrappers over the ``torch.ops.pagedopt`` managed-memory operators (``managed_empty``,
  ``prefetch_``, ``advise_preferred_location_``, ``is_managed``, ``residency``) and the
  ``RESIDENCY_*`` values that ``residency`` returns;
* :func:`paging_available` / :func:`paging_unavailable_reason` and a one-time fallback warning;
* :func:`as_device` and :func:`span_bytes`, the device and byte span of a tensor, for the modules
  of the package.

Part of :mod:`pagedopt.paging`, which re-exports its public names (those of the first two items).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from .. import _callsite
from .. import _ops  # noqa: F401  (loads pagedopt._C, which registers the ops, and their fakes)

DeviceLike = Union[torch.device, str, int]

# Values of residency() (and of the manager's belief about a tensor): where its bytes were last
# explicitly sent. 0 also means "never prefetched as a whole" or "pages in different places".
RESIDENCY_UNKNOWN = 0
RESIDENCY_DEVICE = 1
RESIDENCY_HOST = 2


class PagingFallbackWarning(UserWarning):
    """Paged tensors were requested where paging is not possible; they live in ordinary memory."""


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------
def paging_built() -> bool:
    """True when this build of pagedopt carries the CUDA paging operators (csrc/paging)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has("pagedopt::prefetch_", "CUDA") and has("pagedopt::managed_empty", "CompositeExplicitAutograd")


_concurrent_cache: dict[int, bool] = {}


def _concurrent_managed_access(index: int) -> bool:
    if index not in _concurrent_cache:
        _concurrent_cache[index] = bool(torch.ops.pagedopt.concurrent_managed_access(index))
    return _concurrent_cache[index]


def as_device(device: DeviceLike) -> torch.device:
    """torch.device with the current CUDA device filled in for a bare 'cuda'."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def paging_unavailable_reason(device: DeviceLike) -> Optional[str]:
    """Why tensors on ``device`` cannot be paged, or None when they can."""
    flag = os.environ.get("PAGEDOPT_DISABLE_PAGING", "").strip().lower()
    if flag not in ("", "0", "false", "no"):
        return "paging is disabled by PAGEDOPT_DISABLE_PAGING"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return f"'{device.type}' is not a CUDA device"
    if not paging_built():
        return "this build of pagedopt has no CUDA paging support (it was built without CUDA)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)"
    if not _concurrent_managed_access(index):
        return ("the GPU does not support concurrent managed access (cudaDevAttrConcurrentManagedAccess=0, "
                "as on Windows, WSL and some virtual machines)")
    return None


def paging_available(device: DeviceLike) -> bool:
    """True when tensors on ``device`` can live in managed memory and be paged: a CUDA device,
    pagedopt built with CUDA, a GPU with concurrent managed access, paging not disabled."""
    return paging_unavailable_reason(device) is None


_warned: set[str] = set()


def warn_not_paged(device: DeviceLike, reason: Optional[str] = None, registry: Optional[set] = None) -> bool:
    """Warn once that paged tensors on ``device`` are ordinary ones: once per device per process,
    or, with ``registry`` (a set the caller keeps), once per device per registry; a PageManager
    passes its own, so each manager (each of its users) says it once (and Python's default warning filter
    shows a given call site once per process anyway). Returns True when it warned now."""
    key = str(device)
    seen = _warned if registry is None else registry
    if key in seen:
        return False
    seen.add(key)
    if reason is None:
        reason = paging_unavailable_reason(device) or "paging is not available"
    # at the user's line (opt.step(), trainer.train()), not at the optimizer's code that made the state
    _callsite.warn(f"paged optimizer states are not paged on {key}: {reason}; they live in ordinary memory",
                   PagingFallbackWarning)
    return True


def _reset_fallback_warnings() -> None:
    """For tests: forget which devices were warned about."""
    _warned.clear()


# ---------------------------------------------------------------------------------------------
# operator wrappers
# ---------------------------------------------------------------------------------------------
def managed_empty(shape: Sequence[int], dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
    """An uninitialized CUDA tensor in managed memory (freed with cudaFree when its storage dies)."""
    if isinstance(shape, int):
        shape = (shape,)
    return torch.ops.pagedopt.managed_empty([int(s) for s in shape], dtype, as_device(device))


def is_managed(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are CUDA managed memory (False for CPU tensors or CPU-only builds)."""
    if not t.is_cuda or not paging_built():
        return False
    return bool(torch.ops.pagedopt.is_managed(t))


def residency(t: torch.Tensor) -> int:
    """Where ``t``'s bytes were last explicitly prefetched: RESIDENCY_DEVICE (1), RESIDENCY_HOST
    (2) or RESIDENCY_UNKNOWN (0: never prefetched as a whole, or split). It is the last *request*
    (as reported by the driver), not a guarantee that the migration has finished; synchronize
    first. Raises for tensors that are not managed memory."""
    return int(torch.ops.pagedopt.residency(t))


def prefetch_(t: torch.Tensor, to: Optional[DeviceLike] = None) -> None:
    """Start migrating ``t``'s bytes to ``to`` (None/'cpu': host; else t's own CUDA device),
    asynchronously on the current stream of t's device."""
    torch.ops.pagedopt.prefetch_(t, None if to is None else torch.device(to))


def advise_preferred_location_(t: torch.Tensor, to: Optional[DeviceLike] = None) -> None:
    """cudaMemAdvise: None/'cpu' keeps pages on the host with the GPU mapping them (PreferredLocation
    host + AccessedBy device: kernels read/write over the interconnect, no migration); t's device
    restores migrate-to-GPU behaviour (PreferredLocation device, AccessedBy unset)."""
    torch.ops.pagedopt.advise_preferred_location_(t, None if to is None else torch.device(to))


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first to its last element (the range a prefetch of t covers)."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()
