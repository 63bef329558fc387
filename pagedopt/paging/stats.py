"""What a pager reports: :class:`PagingStats`, a snapshot of a PageManager or a HostResidentPager.

Part of :mod:`pagedopt.paging`, which re-exports it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class PagingStats:
    """A snapshot of a PageManager. Byte counts of paged tensors are the manager's belief (what it
    last prefetched or paged out itself); the driver may have moved pages since.

    resident_bytes / host_bytes / unknown_bytes: paged bytes believed on a GPU / on the host /
        not known (registered from elsewhere and not yet moved).
    bytes_moved_last_step: page_in_bytes + page_out_bytes requested since the last begin_step().
    paged_tensors: live paged tensors; unpaged_tensors / unpaged_bytes: live tensors that zeros()
        returned as ordinary memory (paging unavailable on their device).
    resident_bytes_by_device: {device index: resident bytes}.
    host_copy_bytes: page-locked host memory held for the host copies of paged-out tensors
        (PageManager(host_copies=True)); host_copied_bytes: paged bytes whose contents live in
        such a copy now (their managed pages were discarded).
    device_buffer_bytes: the device buffer that host-resident states stream through
        (HostResidentPager; 0 for a PageManager).
    transfer_ms_last_step: GPU time from the first to the last copy of the last step's streaming
        (HostResidentPager), None while unknown (not finished, no CUDA, or a PageManager).
    """

    resident_bytes: int = 0
    host_bytes: int = 0
    unknown_bytes: int = 0
    bytes_moved_last_step: int = 0
    page_in_bytes_last_step: int = 0
    page_out_bytes_last_step: int = 0
    paged_tensors: int = 0
    unpaged_tensors: int = 0
    unpaged_bytes: int = 0
    budget_bytes: Optional[int] = None
    step: int = 0
    resident_bytes_by_device: dict = field(default_factory=dict)
    host_copy_bytes: int = 0
    host_copied_bytes: int = 0
    device_buffer_bytes: int = 0
    transfer_ms_last_step: Optional[float] = None

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return asdict(self)
