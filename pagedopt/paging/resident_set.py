"""The tensors a :class:`.host_resident.HostResidentPager` keeps on their device instead of on the
host: :class:`ResidentSet` (which tensors, within what budget per device) and
:func:`auto_budget` (the budget chosen from the memory a device has free).

A pager with a resident set is hybrid: tensors that fit in the budget are ordinary device memory,
made once and never moved (a pass hands them out as they are); the rest live on the host and
stream through the device buffer. So a step moves only what does not fit, and with a budget that
holds everything it moves nothing.

Part of :mod:`pagedopt.paging`; it knows nothing of what the tensors hold.
"""
from __future__ import annotations

import weakref
from typing import Optional, Union

import torch

# What "auto" leaves free on top of the peak seen so far: a twentieth of the device's memory, at
# least 1 GiB (allocator fragmentation, a longer sequence in a later batch, other libraries' work)
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN = 1 << 30


def auto_budget(free: int, total: int, reserved: int, allocated: int, peak_allocated: int, reserve: int) -> int:
    """The resident budget "auto" takes on a device, from its memory counters at the time the
    first resident tensor is asked for (the first step, after forward and backward have reached
    their peak): what the device has free (``free``, the driver's count, plus the blocks torch's
    allocator holds unused, ``reserved - allocated``), less what the peak needed beyond what is
    allocated now (``peak_allocated - allocated``: activations since freed, which the next forward
    takes again), less a margin (``AUTO_MARGIN_FRACTION`` of ``total``, at least
    ``AUTO_MARGIN_MIN``) and less ``reserve`` (the device buffer the streamed tensors need).
    Never negative."""
    margin = max(int(total * AUTO_MARGIN_FRACTION), AUTO_MARGIN_MIN)
    available = free + max(reserved - allocated, 0) - max(peak_allocated - allocated, 0)
    return max(available - margin - reserve, 0)


def measured_auto_budget(device: torch.device, reserve: int) -> Optional[int]:
    """``auto_budget`` of a CUDA ``device`` from its counters now; None for a device without such
    counters (the CPU), where "auto" keeps every tensor resident."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return auto_budget(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device),
                       torch.cuda.max_memory_allocated(device), reserve)


class ResidentSet:
    """Which tensors stay on their device, within ``budget`` bytes per device: an int, ``"auto"``
    (``measured_auto_budget`` when a device's first tensor is asked for, so after the first
    forward and backward; unbounded where there is nothing to measure) or None (none stays).

    ``place(nbytes, device)`` says whether a new tensor of that size stays; ``add(t)`` records one
    that does; ``holds(t)`` whether ``t`` (or a view of it) is one of them: every tensor on a
    device other than the CPU is, since the host tensors of a pager live on the CPU."""

    def __init__(self, budget: Union[int, str, None], reserve: int = 0):
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or isinstance(budget, bool)
                                                        or budget < 0):
            raise ValueError(f"resident_bytes must be None, 'auto' or an int >= 0, got {budget!r}")
        self.budget = budget
        self.reserve = reserve
        self._limit: dict[torch.device, Optional[int]] = {}  # device -> bytes (None: no bound)
        self._used: dict[torch.device, int] = {}
        self._tensors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor
        self._cpu_storages: dict[int, int] = {}  # data_ptr -> live tensors on it (CPU tensors that stay)

    def limit(self, device: torch.device) -> Optional[int]:
        """The budget on ``device`` in bytes (None: unbounded), fixed the first time it is asked."""
        if device not in self._limit:
            self._limit[device] = measured_auto_budget(device, self.reserve) if self.budget == "auto" else self.budget
        return self._limit[device]

    def place(self, nbytes: int, device: torch.device) -> bool:
        if self.budget is None:
            return False
        limit = self.limit(device)
        return limit is None or self._used.get(device, 0) + nbytes <= limit

    def add(self, t: torch.Tensor, nbytes: int) -> None:
        self._tensors[id(t)] = t
        self._used[t.device] = self._used.get(t.device, 0) + nbytes
        if t.device.type == "cpu":
            ptr = t.untyped_storage().data_ptr()
            self._cpu_storages[ptr] = self._cpu_storages.get(ptr, 0) + 1
            weakref.finalize(t, self._forget, t.device, ptr, nbytes)
        else:
            weakref.finalize(t, self._forget, t.device, None, nbytes)

    def _forget(self, device: torch.device, ptr: Optional[int], nbytes: int) -> None:
        self._used[device] = self._used.get(device, 0) - nbytes
        if ptr is not None:
            left = self._cpu_storages.get(ptr, 0) - 1
            if left > 0:
                self._cpu_storages[ptr] = left
            else:
                self._cpu_storages.pop(ptr, None)

    def holds(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return True
        return bool(self._cpu_storages) and t.untyped_storage().data_ptr() in self._cpu_storages

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
