"""The PageManager: allocation of paged tensors (own allocations or shared arena slabs) and the
calls of its users, over three parts it holds:

* a :class:`.ledger.Ledger`: residency bookkeeping, host copies, steps and the budget;
* a :class:`.migration.Migration`: page-in and page-out (streams, events, driver prefetches,
  host copies, the budget's evictions);
* a :class:`.staging.Staging`: the pipelined ``stage()``.

Part of :mod:`pagedopt.paging`, which re-exports :class:`PageManager`.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Iterable, Iterator, Optional, Sequence

import torch

from .ledger import Entry, Ledger
from .managed import (RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, DeviceLike, as_device, is_managed,
                      managed_empty, paging_unavailable_reason, span_bytes, warn_not_paged)
from .migration import Migration
from .staging import Staging
from .stats import PagingStats

_PAGE = 4096  # host page size; arena suballocations are aligned to it


class _Arena:
    __slots__ = ("anchor", "storage_key", "size", "used", "ordinal")

    def __init__(self, anchor, storage_key, size):
        self.anchor = anchor
        self.storage_key = storage_key
        self.size = size
        self.used = 0
        self.ordinal = 0


class PageManager:
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
              would evict exactly those under the cyclic access of a step that visits every tensor). In steady
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
            them after ``settle()``.
        pin_ahead: True (default): with host copies, each storage's host copy is allocated when
            the manager starts tracking the storage, on a background thread
            (:mod:`pagedopt.paging.pin_ahead`), so that the first page-out does not wait for
            ``cudaHostAlloc`` (about 1.4 s for 2 GiB, against 44 ms for the copy). Up to half of
            the host memory available then is pinned ahead; the rest at the first page-out.
            ``wait_pinned()`` waits for them. False: each copy is made at its first page-out.
    """

    def __init__(self, budget_bytes: Optional[int] = None, *, arena_bytes: int = 0, prefetch_depth: int = 2,
                 host_copies: bool = True, pin_ahead: bool = True):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        if not isinstance(arena_bytes, int) or arena_bytes < 0:
            raise ValueError(f"arena_bytes must be an int >= 0, got {arena_bytes!r}")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        if not isinstance(host_copies, bool):
            raise ValueError(f"host_copies must be True or False, got {host_copies!r}")
        if not isinstance(pin_ahead, bool):
            raise ValueError(f"pin_ahead must be True or False, got {pin_ahead!r}")
        self.arena_bytes = arena_bytes
        self.prefetch_depth = prefetch_depth
        self._warned: set[str] = set()  # devices this manager warned about (fallback), and "host_copies"
        self._ledger = Ledger(budget_bytes)
        self._migration = Migration(self._ledger, host_copies, self._warned, pin_ahead=pin_ahead)
        self._staging = Staging(self._ledger, self._migration)
        self._arenas: dict[int, _Arena] = {}

    # ------------------------------------------------------------------ configuration
    @property
    def budget_bytes(self) -> Optional[int]:
        """The per-device budget of resident paged bytes (None: none); may be changed at any time."""
        return self._ledger.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: Optional[int]) -> None:
        self._ledger.budget_bytes = value

    @property
    def host_copies(self) -> bool:
        """Whether page-outs go through page-locked host copies (see the class docstring); turns
        False by itself where the driver offers no discards."""
        return self._migration.host_copies

    @host_copies.setter
    def host_copies(self, value: bool) -> None:
        self._migration.host_copies = value
        if not value:
            self._migration.forget_pinned()

    @property
    def pin_ahead(self) -> bool:
        """Whether host copies are made when storages are tracked (see the class docstring)."""
        return self._migration.pin_ahead

    def wait_pinned(self) -> None:
        """Wait until the host copies being made ahead (``pin_ahead``) are made; a page-out
        waits for the ones it needs by itself."""
        self._migration.wait_pinned()

    @property
    def _cuda(self):
        """The CUDA calls of this manager (pagedopt.paging.backends.CudaBackend); tests set a fake."""
        return self._migration.cuda

    @_cuda.setter
    def _cuda(self, backend) -> None:
        self._migration.cuda = backend

    def __getstate__(self) -> dict:
        """Pickling/deepcopy keep the configuration only: the copy tracks no tensor (copies of
        managed tensors made by torch are ordinary memory anyway)."""
        return {"budget_bytes": self.budget_bytes, "arena_bytes": self.arena_bytes,
                "prefetch_depth": self.prefetch_depth, "host_copies": self.host_copies, "pin_ahead": self.pin_ahead}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["budget_bytes"], arena_bytes=state["arena_bytes"],
                      prefetch_depth=state["prefetch_depth"], host_copies=state.get("host_copies", True),
                      pin_ahead=state.get("pin_ahead", True))

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PageManager(budget_bytes={self.budget_bytes}, arena_bytes={self.arena_bytes}, "
                f"paged_tensors={s.paged_tensors}, resident_bytes={s.resident_bytes}, host_bytes={s.host_bytes})")

    # ------------------------------------------------------------------ the ledger's, for tests
    def _register(self, t: torch.Tensor, paged: bool, state: int, ordinal: Optional[int] = None,
                  device: Optional[int] = None) -> Entry:
        return self._track(t, paged, state, ordinal, device)

    def _entry(self, t: torch.Tensor) -> Optional[Entry]:
        return self._ledger.entry(t)

    def _set_state(self, e: Entry, state: int) -> None:
        self._ledger.set_state(e, state)

    @property
    def _entries(self) -> dict:
        return self._ledger.entries

    @property
    def _by_storage(self) -> dict:
        return self._ledger.by_storage

    @property
    def _non_resident(self) -> int:
        return self._ledger.non_resident

    # ------------------------------------------------------------------ registration
    def _track(self, t: torch.Tensor, paged: bool, state: int, ordinal: Optional[int] = None,
               device: Optional[int] = None) -> Entry:
        """The ledger's entry of ``t``; the first tracked tensor of a managed storage has its host
        copy made ahead (pin_ahead)."""
        new_storage = paged and t.untyped_storage().data_ptr() not in self._ledger.by_storage
        e = self._ledger.register(t, paged, state, ordinal, device)
        if new_storage and e.paged:
            self._migration.storage_tracked(e.storage_key, t.untyped_storage().nbytes(), e.device)
        return e

    def register(self, t: torch.Tensor) -> bool:
        """Adopt a managed tensor allocated elsewhere (residency unknown until moved). Returns
        True when ``t`` is managed memory and is now tracked; False (and no tracking) otherwise."""
        e = self._ledger.entry(t)
        if e is not None:
            return e.paged
        if not is_managed(t) or span_bytes(t) == 0:
            return False
        self._track(t, True, RESIDENCY_UNKNOWN)
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
        device = as_device(device)
        reason = paging_unavailable_reason(device)
        if reason is not None:
            warn_not_paged(device, reason, self._warned)
            t = torch.zeros(shape, dtype=dtype, device=device)
            self._ledger.register(t, False, RESIDENCY_UNKNOWN)
            return t
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        index = device.index
        t, ordinal = self._allocate(shape, dtype, index, nbytes)
        on_host = self.budget_bytes is not None and self._ledger.resident.get(index, 0) + nbytes > self.budget_bytes
        if on_host:
            # Over budget: first touch on the CPU puts the pages in host memory, using no GPU memory.
            # Nothing on the GPU references this fresh allocation, so no ordering is needed.
            ctypes.memset(t.data_ptr(), 0, nbytes)
            self._track(t, True, RESIDENCY_HOST, ordinal)
        else:
            with self._migration.cuda.use_device(index):
                t.zero_()  # on the current stream; the pages are populated on the GPU
            self._track(t, True, RESIDENCY_DEVICE, ordinal)
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
    def is_paged(self, t: torch.Tensor) -> bool:
        """True when ``t`` (or the tensor it is a view of) is a paged tensor of this manager."""
        e = self._ledger.entry(t)
        if e is not None:
            return e.paged
        return bool(self._ledger.paged_entries_for([t]))

    def tensors(self) -> list[torch.Tensor]:
        """The live paged tensors of this manager."""
        out = []
        for e in list(self._ledger.entries.values()):
            t = e.ref()
            if e.paged and t is not None:
                out.append(t)
        return out

    def settle(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> int:
        """Make the contents of ``tensors`` (default: every paged tensor) readable by any torch op:
        those whose bytes live in the host copy (paged out with host_copies=True) are paged in on
        the current stream (ordered before later work there). Returns the bytes paged in."""
        if self._ledger.host_copied_bytes == 0:
            return 0
        return self.prefetch([t for t in (self.tensors() if tensors is None else tensors)
                              if any(e.host_copied for e in self._ledger.paged_entries_for([t]))])

    def all_resident(self) -> bool:
        """True when stage() has nothing to do: every paged tensor is believed resident, within
        the budget, with no non_blocking prefetch in flight. Then ``stage(groups)`` is exactly
        ``range(len(groups))`` (plus its begin_step when steps are implicit), so a caller may skip
        building the groups."""
        return (self._ledger.non_resident == 0 and not self._migration.pagein_in_flight()
                and not self._ledger.over_budget())

    def stats(self) -> PagingStats:
        led = self._ledger
        return PagingStats(
            resident_bytes=sum(led.resident.values()), host_bytes=led.host_bytes,
            unknown_bytes=led.unknown_bytes, bytes_moved_last_step=led.moved_in + led.moved_out,
            page_in_bytes_last_step=led.moved_in, page_out_bytes_last_step=led.moved_out,
            paged_tensors=led.paged_count, unpaged_tensors=led.unpaged_count,
            unpaged_bytes=led.unpaged_bytes, budget_bytes=led.budget_bytes, step=led.step,
            resident_bytes_by_device={d: b for d, b in led.resident.items() if b},
            host_copy_bytes=led.host_copy_bytes, host_copied_bytes=led.host_copied_bytes)

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Start a new step: resets the per-step traffic counters and ages the LRU clock.
        stage() calls it itself until begin_step() is called explicitly once; from then on the
        caller marks steps (needed when one step runs stage() several times, e.g. per group)."""
        self._ledger.explicit_steps = True
        self._ledger.new_step()

    # ------------------------------------------------------------------ moves (Migration)
    def prefetch(self, tensors: Optional[Iterable[torch.Tensor]] = None, device: Optional[DeviceLike] = None,
                 *, non_blocking: bool = False) -> int:
        """Page tensors (default: all registered; with ``device``: only those on it) in to their
        own device. Tensors believed resident are skipped without a driver call.

        non_blocking=False: issued on the current stream, so later work on it sees them resident.
        non_blocking=True: issued on a side stream (e.g. from a backward hook, to overlap compute);
        the current streams wait for it at the next stage()/page_out()/synchronize().
        Returns the bytes requested. Never synchronizes the host."""
        return self._migration.prefetch(tensors, device, non_blocking=non_blocking)

    def page_out(self, tensors: Optional[Iterable[torch.Tensor]] = None, *, sync: bool = False,
                 overlap: bool = False) -> int:
        """Send tensors (default: all registered) to host memory. Tensors believed on the host
        are skipped without a driver call.

        overlap=False (default): issued on the current stream of each device, after the work
            already queued there; later work on that stream waits for the migration.
        overlap=True: issued on a separate page-out stream that first waits for the current
            stream (so the tensors' pending users finish first); later work on the current stream
            runs concurrently with the migration.
        sync=False (default): returns at once (asynchronous). sync=True: the host waits for these
            page-outs only (an event synchronize, not a device-wide one).
        The next page-in of these tensors (stage/prefetch) is ordered after this page-out.
        Returns the bytes requested."""
        return self._migration.page_out(tensors, sync=sync, overlap=overlap)

    def synchronize(self) -> None:
        """Host-wait for every page-in/page-out this manager issued (event waits, not a
        device-wide sync)."""
        self._migration.synchronize()

    def enforce_budget(self) -> int:
        """Page out victims until every device's resident paged bytes fit the budget (a no-op
        without a budget). Asynchronous, overlapping later work. Returns the bytes requested."""
        return self._migration.enforce_budget()

    # ------------------------------------------------------------------ pipeline (Staging)
    def stage(self, groups: Sequence[Iterable[torch.Tensor]]) -> Iterator[int]:
        """The step pipeline: ``for i in manager.stage(chunks): launch chunk i``.

        ``groups[i]`` lists the tensors that chunk i's launch touches. Before yielding i, the
        current stream of each device involved waits (an event, not a host sync) until chunk i's
        paged tensors were prefetched; chunks i+1 .. i+prefetch_depth are meanwhile prefetched on
        a side stream per device, each tensor to its own device. Paged tensors believed resident
        cost no driver call, and when every paged tensor is believed resident (and within budget)
        this is a plain ``range(len(groups))``. Tensors that are not paged by this manager are
        ignored. With a budget, see the class docstring for the page-outs done here.

        Starts a new step (begin_step) itself unless the caller has ever called begin_step().
        """
        return self._staging.stage(groups, self.prefetch_depth)
