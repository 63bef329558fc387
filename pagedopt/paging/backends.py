"""The stream, event and copy calls the pagers make, in one place: :class:`CudaBackend`, a
PageManager's (tests substitute a recording fake for it), which a HostResidentPager extends.

Part of :mod:`pagedopt.paging`.
"""
from __future__ import annotations

from typing import Optional

import torch


class CudaBackend:
    """The CUDA calls a PageManager makes, in one place (tests substitute a recording fake)."""

    @staticmethod
    def new_stream(d: int):
        return torch.cuda.Stream(device=d)

    @staticmethod
    def new_event():
        return torch.cuda.Event()

    @staticmethod
    def current_stream(d: int):
        return torch.cuda.current_stream(d)

    @staticmethod
    def use_stream(s):
        return torch.cuda.stream(s)

    @staticmethod
    def use_device(d: int):
        return torch.cuda.device(d)

    @staticmethod
    def prefetch(t: torch.Tensor, to: Optional[torch.device]) -> None:
        torch.ops.pagedopt.prefetch_(t, to)

    @staticmethod
    def discard(t: torch.Tensor, to: Optional[torch.device]) -> None:
        """Discard t's managed bytes (to=None), or discard them and populate the pages at ``to``."""
        torch.ops.pagedopt.discard_(t, to)

    @staticmethod
    def pinned_empty(nbytes: int) -> torch.Tensor:
        return torch.ops.pagedopt.pinned_empty([nbytes], torch.uint8)
