"""The PageManager: allocation of paged tensors (own allocations or shared arena slabs), residency
bookkeeping, statistics (:class:`PagingStats`), steps, and an optional device budget.

Its moves (page-in/page-out, streams, budget evictions) are in :mod:`.migration` and its
pipelined ``stage()`` in :mod:`.staging`, as the bases ``_MigrationMixin`` and ``_StagingMixin``.

Part of :mod:`pagedopt.paging`, which re-exports the public names here.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from .managed import (RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, DeviceLike, _as_device, _span_bytes,
                      is_managed, managed_empty, paging_unavailable_reason, warn_not_paged)
from .migration import _CudaBackend, _MigrationMixin
from .staging import _StagingMixin

_PAGE = 4096  # host page size; arena suballocations are aligned to it


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


class _Entry:
    """Bookkeeping for one registered tensor (held by weakref only)."""

    __slots__ = ("ref", "key", "paged", "device", "nbytes", "storage_key", "start", "ordinal", "state",
                 "last_step", "last_seq", "host_copied")

    def __init__(self, ref, key, paged, device, nbytes, storage_key, start, ordinal, state):
        self.ref = ref
        self.key = key
        self.paged = paged
        self.device = device  # CUDA device index (or -1 for an unpaged non-CUDA tensor)
        self.nbytes = nbytes  # span of the tensor's elements
        self.storage_key = storage_key  # data_ptr of its storage (unique among live allocations)
        self.start = start  # byte offset of the span within the storage
        self.ordinal = ordinal  # allocation order within an arena (None: not in an arena)
        self.state = state
        self.last_step = -1
        self.last_seq = -1
        self.host_copied = False  # paged out into the manager's host copy; the managed bytes were discarded


class _Arena:
    __slots__ = ("anchor", "storage_key", "size", "used", "ordinal")

    def __init__(self, anchor, storage_key, size):
        self.anchor = anchor
        self.storage_key = storage_key
        self.size = size
        self.used = 0
        self.ordinal = 0


def _forget_cb(manager_ref, key):
    def cb(ref):
        m = manager_ref()
        if m is not None:
            m._forget(key, ref)
    return cb


class PageManager(_MigrationMixin, _StagingMixin):
    """Allocates paged (managed-memory) tensors and moves them between host and device.

    Args:
        budget_bytes: optional per-device budget for paged bytes resident on a GPU. None (the
            default) means no budget: tensors stay wherever they were last put. With a budget:

            * zeros() initializes a new tensor on the host (CPU first touch, no GPU memory used)
              when it would push its device's resident paged bytes over the budget;
            * stage() pages chunks in as usual, and before paging in a chunk that would exceed the
              budget it pages out victims; after the last chunk it pages out victims until the
              resident bytes fit the budget again. Page-outs run on a separate stream of the
              device, ordered after the chunks already launched, so they overlap later work.
            * Victims are, in this order: paged tensors used in neither this step nor the previous
              one, least recently used first; then tensors that this step has already used, most
              recently used first. Tensors that the current stage() has yet to use are never
              victims, nor are tensors used in the previous step but not yet in this one (LRU
              would evict exactly those under the cyclic access of an optimizer step). In steady
              state each step then pages in and out only (paged bytes - budget), the minimum.
              The budget is soft: when no victim is left (e.g. the chunks in flight alone exceed
              it), it is exceeded; device residency peaks at about budget + the prefetch window.
            * enforce_budget() applies the same rule on demand.

            For the best choices, call stage() once per step with all chunks, or call begin_step()
            once at the start of each step.
        arena_bytes: 0 (default) gives every paged tensor its own cudaMallocManaged allocation.
            A positive value suballocates paged tensors smaller than arena_bytes // 4 from shared
            managed slabs of that size (4 KiB aligned), so that the consecutive tensors of a chunk
            are paged with one driver call instead of one per tensor. A slab is freed when its
            last tensor dies. Caveat: torch.save of such a tensor saves its whole slab.
        prefetch_depth: how many chunks stage() prefetches ahead of the one being launched.
        host_copies: True (default): a page-out copies the bytes with the copy engine into a
            page-locked host copy (one per managed allocation, kept for the next page-out) and
            then discards the managed pages, so the driver may drop them without migrating them
            (cudaMemDiscardBatchAsync); the next page-in repopulates them on the GPU and copies the
            bytes back. Measured on an H200: 52 GB/s out, against the driver's 11 GB/s migration.
            Costs host memory equal to the bytes paged out. False, or a driver without discards:
            page-outs are the driver's migration (cudaMemPrefetchAsync to the host).
            While tensors are paged out this way their managed bytes are indeterminate: read
            them after ``settle()`` (state_dict(), copies and steps of pagedopt's optimizers do).
    """

    _cuda = _CudaBackend

    def __init__(self, budget_bytes: Optional[int] = None, *, arena_bytes: int = 0, prefetch_depth: int = 2,
                 host_copies: bool = True):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        if not isinstance(arena_bytes, int) or arena_bytes < 0:
            raise ValueError(f"arena_bytes must be an int >= 0, got {arena_bytes!r}")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        self.budget_bytes = budget_bytes
        self.arena_bytes = arena_bytes
        self.prefetch_depth = prefetch_depth
        if not isinstance(host_copies, bool):
            raise ValueError(f"host_copies must be True or False, got {host_copies!r}")
        self.host_copies = host_copies
        self._host_copy: dict[int, torch.Tensor] = {}  # storage data_ptr -> page-locked copy of the storage
        self._host_copy_bytes = 0
        self._host_copied_bytes = 0
        self._self_ref = weakref.ref(self)
        self._warned: set[str] = set()  # devices this manager warned about (fallback)
        self._entries: dict[int, _Entry] = {}  # id(tensor) -> entry
        self._by_storage: dict[int, list[_Entry]] = {}  # storage data_ptr -> paged entries in it
        self._arenas: dict[int, _Arena] = {}
        # O(1) counters (paged entries only, except the unpaged ones)
        self._resident: dict[int, int] = {}  # device -> bytes believed on the device
        self._host_bytes = 0
        self._unknown_bytes = 0
        self._non_resident = 0  # paged entries not believed on their device
        self._paged_count = 0
        self._unpaged_count = 0
        self._unpaged_bytes = 0
        # steps and per-step traffic
        self._step = 0
        self._seq = 0
        self._explicit_steps = False
        self._moved_in = 0
        self._moved_out = 0
        # streams and events, per device
        self._side_streams: dict = {}
        self._out_streams: dict = {}
        self._pageout_events: dict = {}  # device -> event after the last page-out issued there
        self._pagein_events: dict = {}  # device -> event of a non_blocking prefetch() in flight
        # victim bookkeeping during stage() (budget only), per device
        self._stage_stale: dict[int, list] = {}
        self._stage_done: dict[int, list] = {}

    def __getstate__(self) -> dict:
        """Pickling/deepcopy keep the configuration only: the copy tracks no tensor (copies of
        managed tensors made by torch are ordinary memory anyway)."""
        return {"budget_bytes": self.budget_bytes, "arena_bytes": self.arena_bytes,
                "prefetch_depth": self.prefetch_depth, "host_copies": self.host_copies}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["budget_bytes"], arena_bytes=state["arena_bytes"],
                      prefetch_depth=state["prefetch_depth"], host_copies=state.get("host_copies", True))

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PageManager(budget_bytes={self.budget_bytes}, arena_bytes={self.arena_bytes}, "
                f"paged_tensors={s.paged_tensors}, resident_bytes={s.resident_bytes}, host_bytes={s.host_bytes})")

    # ------------------------------------------------------------------ registration
    def _set_state(self, e: _Entry, state: int) -> None:
        old = e.state
        if old == state:
            return
        self._count(e, old, -1)
        e.state = state
        self._count(e, state, +1)

    def _count(self, e: _Entry, state: int, sign: int) -> None:
        if state == RESIDENCY_DEVICE:
            self._resident[e.device] = self._resident.get(e.device, 0) + sign * e.nbytes
        else:
            self._non_resident += sign
            if state == RESIDENCY_HOST:
                self._host_bytes += sign * e.nbytes
            else:
                self._unknown_bytes += sign * e.nbytes

    def _register(self, t: torch.Tensor, paged: bool, state: int, ordinal: Optional[int] = None,
                  device: Optional[int] = None) -> _Entry:
        key = id(t)
        old = self._entries.get(key)
        if old is not None:
            if old.ref() is t:
                return old
            self._forget(key, old.ref)
        ref = weakref.ref(t, _forget_cb(self._self_ref, key))
        if paged:
            storage_key = t.untyped_storage().data_ptr()
            e = _Entry(ref, key, True, t.device.index if device is None else device, _span_bytes(t), storage_key,
                       t.data_ptr() - storage_key, ordinal, state)
            self._entries[key] = e
            self._by_storage.setdefault(storage_key, []).append(e)
            self._paged_count += 1
            self._count(e, state, +1)
        else:
            e = _Entry(ref, key, False, t.device.index if t.is_cuda else -1, t.numel() * t.element_size(),
                       None, 0, None, RESIDENCY_UNKNOWN)
            self._entries[key] = e
            self._unpaged_count += 1
            self._unpaged_bytes += e.nbytes
        return e

    def _forget(self, key: int, ref) -> None:
        e = self._entries.get(key)
        if e is None or e.ref is not ref:
            return
        del self._entries[key]
        if not e.paged:
            self._unpaged_count -= 1
            self._unpaged_bytes -= e.nbytes
            return
        self._paged_count -= 1
        self._count(e, e.state, -1)
        self._set_host_copied(e, False)
        lst = self._by_storage.get(e.storage_key)
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self._by_storage[e.storage_key]
                copy = self._host_copy.pop(e.storage_key, None)  # the storage is gone: so is its host copy
                if copy is not None:
                    self._host_copy_bytes -= copy.numel()

    def _set_host_copied(self, e: _Entry, value: bool) -> None:
        if e.host_copied != value:
            e.host_copied = value
            self._host_copied_bytes += e.nbytes if value else -e.nbytes

    def register(self, t: torch.Tensor) -> bool:
        """Adopt a managed tensor allocated elsewhere (residency unknown until moved). Returns
        True when ``t`` is managed memory and is now tracked; False (and no tracking) otherwise."""
        e = self._entries.get(id(t))
        if e is not None and e.ref() is t:
            return e.paged
        if not is_managed(t) or _span_bytes(t) == 0:
            return False
        self._register(t, True, RESIDENCY_UNKNOWN)
        return True

    # ------------------------------------------------------------------ allocation
    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
        """A zero-filled tensor: in managed memory when paging is available on ``device``,
        otherwise ordinary ``torch.zeros`` (with a PagingFallbackWarning, once per device
        for this manager).
        Tracked by weakref for statistics and paging; the manager never keeps memory alive."""
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(s) for s in shape)
        device = _as_device(device)
        reason = paging_unavailable_reason(device)
        if reason is not None:
            warn_not_paged(device, reason, self._warned)
            t = torch.zeros(shape, dtype=dtype, device=device)
            self._register(t, False, RESIDENCY_UNKNOWN)
            return t
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        index = device.index
        t, ordinal = self._allocate(shape, dtype, index, nbytes)
        on_host = self.budget_bytes is not None and self._resident.get(index, 0) + nbytes > self.budget_bytes
        if on_host:
            # Over budget: first touch on the CPU puts the pages in host memory, using no GPU memory.
            # Nothing on the GPU references this fresh allocation, so no ordering is needed.
            ctypes.memset(t.data_ptr(), 0, nbytes)
            self._register(t, True, RESIDENCY_HOST, ordinal)
        else:
            with self._cuda.use_device(index):
                t.zero_()  # on the current stream; the pages are populated on the GPU
            self._register(t, True, RESIDENCY_DEVICE, ordinal)
        return t

    def _allocate(self, shape, dtype, index: int, nbytes: int):
        if self.arena_bytes <= 0 or nbytes > self.arena_bytes // 4:
            return managed_empty(shape, dtype, torch.device("cuda", index)), None
        ar = self._arenas.get(index)
        storage = None
        if ar is not None and ar.used + nbytes <= ar.size:
            anchor = ar.anchor()
            if anchor is not None:
                storage = anchor.untyped_storage()
        if storage is None:
            flat = managed_empty([self.arena_bytes], torch.uint8, torch.device("cuda", index))
            storage = flat.untyped_storage()
            ar = _Arena(None, storage.data_ptr(), self.arena_bytes)
            self._arenas[index] = ar
        itemsize = dtype.itemsize
        offset = ar.used  # a multiple of _PAGE, hence of itemsize
        t = torch.empty(0, dtype=dtype, device=torch.device("cuda", index)).set_(storage, offset // itemsize, shape)
        ar.used = (offset + nbytes + _PAGE - 1) // _PAGE * _PAGE
        ar.anchor = weakref.ref(t)
        ordinal = ar.ordinal
        ar.ordinal += 1
        return t, ordinal

    # ------------------------------------------------------------------ queries
    def _entry(self, t: torch.Tensor) -> Optional[_Entry]:
        e = self._entries.get(id(t))
        if e is not None and e.ref() is t:
            return e
        return None

    def _paged_entries_for(self, tensors: Iterable) -> list[_Entry]:
        """The paged entries that the given tensors cover (registered tensors, or views of them),
        without duplicates. Unregistered and unpaged tensors are ignored."""
        out: list[_Entry] = []
        seen: set[int] = set()
        for t in tensors:
            if t is None:
                continue
            e = self._entries.get(id(t))
            if e is not None and e.ref() is t:
                if e.paged and id(e) not in seen:
                    seen.add(id(e))
                    out.append(e)
                continue
            if not self._by_storage or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            lst = self._by_storage.get(t.untyped_storage().data_ptr())
            if not lst:
                continue
            start = t.data_ptr() - t.untyped_storage().data_ptr()
            end = start + _span_bytes(t)
            for e in tuple(lst):
                if e.start < end and start < e.start + e.nbytes and id(e) not in seen:
                    seen.add(id(e))
                    out.append(e)
        return out

    def is_paged(self, t: torch.Tensor) -> bool:
        """True when ``t`` (or the tensor it is a view of) is a paged tensor of this manager."""
        e = self._entry(t)
        if e is not None:
            return e.paged
        return bool(self._paged_entries_for([t]))

    def tensors(self) -> list[torch.Tensor]:
        """The live paged tensors of this manager."""
        out = []
        for e in list(self._entries.values()):
            t = e.ref()
            if e.paged and t is not None:
                out.append(t)
        return out

    def settle(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> int:
        """Make the contents of ``tensors`` (default: every paged tensor) readable by any torch op:
        those whose bytes live in the host copy (paged out with host_copies=True) are paged in on
        the current stream (ordered before later work there). Returns the bytes paged in."""
        if self._host_copied_bytes == 0:
            return 0
        return self.prefetch([t for t in (self.tensors() if tensors is None else tensors)
                              if any(e.host_copied for e in self._paged_entries_for([t]))])

    def all_resident(self) -> bool:
        """True when stage() has nothing to do: every paged tensor is believed resident, within
        the budget, with no non_blocking prefetch in flight. Then ``stage(groups)`` is exactly
        ``range(len(groups))`` (plus its begin_step when steps are implicit), so a caller may skip
        building the groups."""
        return self._non_resident == 0 and not self._pagein_events and not self._over_budget()

    def stats(self) -> PagingStats:
        return PagingStats(
            resident_bytes=sum(self._resident.values()), host_bytes=self._host_bytes,
            unknown_bytes=self._unknown_bytes, bytes_moved_last_step=self._moved_in + self._moved_out,
            page_in_bytes_last_step=self._moved_in, page_out_bytes_last_step=self._moved_out,
            paged_tensors=self._paged_count, unpaged_tensors=self._unpaged_count,
            unpaged_bytes=self._unpaged_bytes, budget_bytes=self.budget_bytes, step=self._step,
            resident_bytes_by_device={d: b for d, b in self._resident.items() if b},
            host_copy_bytes=self._host_copy_bytes, host_copied_bytes=self._host_copied_bytes)

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Start a new step: resets the per-step traffic counters and ages the LRU clock.
        stage() calls it itself until begin_step() is called explicitly once; from then on the
        caller marks steps (needed when one step runs stage() several times, e.g. per group)."""
        self._explicit_steps = True
        self._begin_step()

    def _begin_step(self) -> None:
        self._step += 1
        self._moved_in = 0
        self._moved_out = 0
