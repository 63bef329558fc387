"""The stream, event and copy calls the pagers make, in one place:

* :class:`CudaBackend`: a PageManager's (tests substitute a recording fake for it);
* :class:`TimedCudaBackend`: a HostResidentPager's on a CUDA device (timing events too);
* :class:`HostBackend`: a HostResidentPager's on the CPU, where every copy has finished when it
  returns, so no stream or event is needed (:class:`NoStream` stands in for both).

Part of :mod:`pagedopt.paging`.
"""
from __future__ import annotations

import contextlib
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


class TimedCudaBackend(CudaBackend):
    @staticmethod
    def new_timing_event():
        return torch.cuda.Event(enable_timing=True)


class NoStream:
    """A stream or event on the CPU, where every copy has finished when it returns."""

    def wait_event(self, ev) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostBackend:
    """The stream calls of a pass over CPU tensors: none is needed."""

    @staticmethod
    def new_stream(d):
        return NoStream()

    @staticmethod
    def new_event():
        return NoStream()

    @staticmethod
    def current_stream(d):
        return NoStream()

    @staticmethod
    def use_stream(s):
        return contextlib.nullcontext()
