"""Paging of tensors through CUDA unified (managed) memory.

This module knows nothing about optimizers. It offers

* thin wrappers over the ``torch.ops.pagedopt`` managed-memory operators (``managed_empty``,
  ``prefetch_``, ``advise_preferred_location_``, ``is_managed``, ``residency``);
* :func:`paging_available` / :func:`paging_unavailable_reason` and a one-time fallback warning;
* :class:`PageManager`: allocation of paged tensors, residency bookkeeping, page-in/page-out,
  a pipelined :meth:`PageManager.stage` for chunked kernels, an optional device budget and
  statistics.

Paged tensors are real CUDA tensors whose bytes live in ``cudaMallocManaged`` memory, so every
torch op works on them and the driver migrates pages on demand. Explicit prefetches only make the
migration early and bulk; **correctness never depends on them** (a kernel touching a page that is
on the host faults it in). Every event and stream below is therefore about speed, not safety.

Where paging is not possible (CPU tensors, a build without CUDA, a GPU without concurrent managed
access, or ``PAGEDOPT_DISABLE_PAGING=1``), :meth:`PageManager.zeros` returns ordinary tensors,
warns once (per device, per manager), and every other method is a cheap no-op for them.

A PageManager is not thread-safe; use it from the thread that launches the work.
"""
from __future__ import annotations

import ctypes
import os
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch

from . import _ops  # noqa: F401  (loads pagedopt._C, which registers the ops, and their fakes)

__all__ = [
    "RESIDENCY_UNKNOWN", "RESIDENCY_DEVICE", "RESIDENCY_HOST", "PagingFallbackWarning", "PagingStats",
    "PageManager", "paging_built", "paging_available", "paging_unavailable_reason", "warn_not_paged",
    "managed_empty", "is_managed", "residency", "prefetch_", "advise_preferred_location_",
]

DeviceLike = Union[torch.device, str, int]

# Values of residency() (and of the manager's belief about a tensor): where its bytes were last
# explicitly sent. 0 also means "never prefetched as a whole" or "pages in different places".
RESIDENCY_UNKNOWN = 0
RESIDENCY_DEVICE = 1
RESIDENCY_HOST = 2

_PAGE = 4096  # host page size; arena suballocations are aligned to it
_MERGE_GAP = 64 << 10  # adjacent arena tensors separated by at most this many bytes share one prefetch


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


def _as_device(device: DeviceLike) -> torch.device:
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
    passes its own, so each paged optimizer says it once (and Python's default warning filter
    shows a given call site once per process anyway). Returns True when it warned now."""
    key = str(device)
    seen = _warned if registry is None else registry
    if key in seen:
        return False
    seen.add(key)
    if reason is None:
        reason = paging_unavailable_reason(device) or "paging is not available"
    warnings.warn(f"paged optimizer states are not paged on {key}: {reason}; they live in ordinary memory",
                  PagingFallbackWarning, stacklevel=3)
    return True


def _reset_fallback_warnings() -> None:
    """For tests: forget which devices were warned about."""
    _warned.clear()


# ---------------------------------------------------------------------------------------------
# operator wrappers
# ---------------------------------------------------------------------------------------------
def split_by_bytes(items: Sequence, nbytes_of, chunk_bytes: int) -> list[list]:
    """Consecutive runs of ``items``, each closed once its bytes (``nbytes_of(item)``) reach
    ``chunk_bytes``: the chunks that PageManager.stage() pipelines."""
    chunks, current, size = [], [], 0
    for item in items:
        current.append(item)
        size += nbytes_of(item)
        if size >= chunk_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def managed_empty(shape: Sequence[int], dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
    """An uninitialized CUDA tensor in managed memory (freed with cudaFree when its storage dies)."""
    if isinstance(shape, int):
        shape = (shape,)
    return torch.ops.pagedopt.managed_empty([int(s) for s in shape], dtype, _as_device(device))


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


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first to its last element (the range a prefetch of t covers)."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


# ---------------------------------------------------------------------------------------------
# PageManager
# ---------------------------------------------------------------------------------------------
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

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return asdict(self)


class _Entry:
    """Bookkeeping for one registered tensor (held by weakref only)."""

    __slots__ = ("ref", "key", "paged", "device", "nbytes", "storage_key", "start", "ordinal", "state",
                 "last_step", "last_seq")

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


class _CudaBackend:
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
    """

    _cuda = _CudaBackend

    def __init__(self, budget_bytes: Optional[int] = None, *, arena_bytes: int = 0, prefetch_depth: int = 2):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        if not isinstance(arena_bytes, int) or arena_bytes < 0:
            raise ValueError(f"arena_bytes must be an int >= 0, got {arena_bytes!r}")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        self.budget_bytes = budget_bytes
        self.arena_bytes = arena_bytes
        self.prefetch_depth = prefetch_depth
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
                "prefetch_depth": self.prefetch_depth}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["budget_bytes"], arena_bytes=state["arena_bytes"],
                      prefetch_depth=state["prefetch_depth"])

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
        lst = self._by_storage.get(e.storage_key)
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self._by_storage[e.storage_key]

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
            resident_bytes_by_device={d: b for d, b in self._resident.items() if b})

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

    # ------------------------------------------------------------------ streams
    def _side_stream(self, d: int):
        s = self._side_streams.get(d)
        if s is None:
            s = self._side_streams[d] = self._cuda.new_stream(d)
        return s

    def _out_stream(self, d: int):
        s = self._out_streams.get(d)
        if s is None:
            s = self._out_streams[d] = self._cuda.new_stream(d)
        return s

    def _wait_pagein_events(self) -> None:
        """The current streams wait for non_blocking prefetches still in flight."""
        if self._pagein_events:
            for d, ev in self._pagein_events.items():
                self._cuda.current_stream(d).wait_event(ev)
            self._pagein_events.clear()

    def _issue(self, entries: list[_Entry], to_host: bool) -> int:
        """Prefetch the entries (all on one device) on the *current* stream, merging runs of
        consecutive arena tensors into one call. Updates beliefs and traffic; returns bytes."""
        if not entries:
            return 0
        entries = sorted(entries, key=lambda e: (e.storage_key, e.start))
        target = None if to_host else torch.device("cuda", entries[0].device)
        moved = 0
        i, n = 0, len(entries)
        while i < n:
            first = entries[i]
            j = i + 1
            end = first.start + first.nbytes
            if first.ordinal is not None:
                while (j < n and entries[j].storage_key == first.storage_key and entries[j].ordinal is not None
                       and entries[j].ordinal == entries[j - 1].ordinal + 1 and entries[j].start - end <= _MERGE_GAP):
                    end = entries[j].start + entries[j].nbytes
                    j += 1
            run = entries[i:j]
            anchor = None
            for e in run:
                anchor = e.ref()
                if anchor is not None:
                    break
            if anchor is not None:
                if j - i == 1:
                    view = anchor
                else:
                    view = torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(
                        anchor.untyped_storage(), first.start, (end - first.start,))
                self._cuda.prefetch(view, target)
                moved += end - first.start
                for e in run:
                    self._set_state(e, RESIDENCY_HOST if to_host else RESIDENCY_DEVICE)
            i = j
        if to_host:
            self._moved_out += moved
        else:
            self._moved_in += moved
        return moved

    @staticmethod
    def _by_device(entries: Iterable[_Entry]) -> dict[int, list[_Entry]]:
        out: dict[int, list[_Entry]] = {}
        for e in entries:
            out.setdefault(e.device, []).append(e)
        return out

    def _select(self, tensors, device) -> list[_Entry]:
        if tensors is None:
            entries = [e for e in list(self._entries.values()) if e.paged and e.ref() is not None]
        else:
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            entries = self._paged_entries_for(tensors)
        if device is not None:
            d = _as_device(device)
            if d.type != "cuda":
                return []
            entries = [e for e in entries if e.device == d.index]
        return entries

    # ------------------------------------------------------------------ explicit moves
    def prefetch(self, tensors: Optional[Iterable[torch.Tensor]] = None, device: Optional[DeviceLike] = None,
                 *, non_blocking: bool = False) -> int:
        """Page tensors (default: all registered; with ``device``: only those on it) in to their
        own device. Tensors believed resident are skipped without a driver call.

        non_blocking=False: issued on the current stream, so later work on it sees them resident.
        non_blocking=True: issued on a side stream (e.g. from a backward hook, to overlap compute);
        the current streams wait for it at the next stage()/page_out()/synchronize().
        Returns the bytes requested. Never synchronizes the host."""
        total = 0
        for d, ents in self._by_device(self._select(tensors, device)).items():
            ents = [e for e in ents if e.state != RESIDENCY_DEVICE]
            if not ents:
                continue
            ev = self._pageout_events.pop(d, None)
            if non_blocking:
                side = self._side_stream(d)
                if ev is not None:
                    side.wait_event(ev)
                with self._cuda.use_stream(side):
                    total += self._issue(ents, to_host=False)
                done = self._cuda.new_event()
                done.record(side)
                self._pagein_events[d] = done
            else:
                cur = self._cuda.current_stream(d)
                if ev is not None:
                    cur.wait_event(ev)
                with self._cuda.use_device(d):
                    total += self._issue(ents, to_host=False)
        return total

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
        self._wait_pagein_events()
        total = 0
        events = []
        for d, ents in self._by_device(self._select(tensors, None)).items():
            ents = [e for e in ents if e.state != RESIDENCY_HOST]
            if not ents:
                continue
            total += self._page_out_on(d, ents, overlap)
            events.append(self._pageout_events[d])
        if sync:
            for ev in events:
                ev.synchronize()
        return total

    def _page_out_on(self, d: int, ents: list[_Entry], overlap: bool) -> int:
        cur = self._cuda.current_stream(d)
        if overlap:
            out = self._out_stream(d)
            after = self._cuda.new_event()
            after.record(cur)
            out.wait_event(after)
            stream = out
        else:
            stream = cur
        with self._cuda.use_stream(stream):
            moved = self._issue(ents, to_host=True)
        ev = self._cuda.new_event()
        ev.record(stream)
        self._pageout_events[d] = ev
        return moved

    def synchronize(self) -> None:
        """Host-wait for every page-in/page-out this manager issued (event waits, not a
        device-wide sync)."""
        for ev in list(self._pageout_events.values()) + list(self._pagein_events.values()):
            ev.synchronize()

    # ------------------------------------------------------------------ budget
    def _over_budget(self) -> bool:
        b = self.budget_bytes
        return b is not None and any(v > b for v in self._resident.values())

    def _victims(self, d: int) -> list[_Entry]:
        """Resident paged entries of device d in eviction order (see the class docstring), for
        use outside stage()."""
        stale, done = [], []
        for e in list(self._entries.values()):
            if not e.paged or e.device != d or e.state != RESIDENCY_DEVICE:
                continue
            if e.last_step == self._step:
                done.append(e)
            elif e.last_step < self._step - 1:
                stale.append(e)
        stale.sort(key=lambda e: e.last_seq)
        done.sort(key=lambda e: e.last_seq, reverse=True)
        return stale + done

    def _evict(self, d: int, target: int, victims: Iterable[_Entry]) -> int:
        """Page out entries taken from ``victims`` (an iterator, consumed as far as needed) on
        device d, overlapping later work, until its resident bytes are at most ``target``."""
        excess = self._resident.get(d, 0) - target
        chosen = []
        victims = iter(victims)
        while excess > 0:
            e = next(victims, None)  # consumed only while needed: the stage stacks keep the rest
            if e is None:
                break
            if e.state != RESIDENCY_DEVICE or e.ref() is None:
                continue
            chosen.append(e)
            excess -= e.nbytes
        if not chosen:
            return 0
        return self._page_out_on(d, chosen, overlap=True)

    def enforce_budget(self) -> int:
        """Page out victims until every device's resident paged bytes fit the budget (a no-op
        without a budget). Asynchronous, overlapping later work. Returns the bytes requested."""
        if not self._over_budget():
            return 0
        total = 0
        for d in list(self._resident):
            if self._resident[d] > self.budget_bytes:
                total += self._evict(d, self.budget_bytes, iter(self._victims(d)))
        return total

    # ------------------------------------------------------------------ pipeline
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
        if not self._explicit_steps:
            self._begin_step()
        if not isinstance(groups, (list, tuple)):
            groups = list(groups)
        n = len(groups)
        self._wait_pagein_events()
        if self._non_resident == 0 and not self._over_budget():
            yield from range(n)
            return
        yield from self._stage_slow(groups, n)

    def _stage_slow(self, groups, n: int) -> Iterator[int]:
        chunk_entries = [self._paged_entries_for(g) for g in groups]
        last_use: dict[int, int] = {}
        for i, ents in enumerate(chunk_entries):
            for e in ents:
                last_use[id(e)] = i
        budget = self.budget_bytes is not None
        if budget:
            self._init_stage_victims(last_use)
        waits: list = [None] * n
        side_ready: set[int] = set()
        issued = 0
        completed = False
        try:
            for i in range(n):
                if budget and i > 0:
                    # chunk i-1 was launched: its tensors that no later chunk uses become victims,
                    # the most recently used on top
                    for e in chunk_entries[i - 1]:
                        if last_use[id(e)] == i - 1:
                            self._stage_done.setdefault(e.device, []).append(e)
                while issued < n and issued <= i + self.prefetch_depth:
                    waits[issued] = self._page_in_chunk(chunk_entries[issued], side_ready)
                    issued += 1
                if waits[i]:
                    for d, ev in waits[i]:
                        self._cuda.current_stream(d).wait_event(ev)
                    waits[i] = None
                for e in chunk_entries[i]:
                    e.last_step = self._step
                    e.last_seq = self._seq
                    self._seq += 1
                yield i
            completed = True
        finally:
            self._stage_stale = {}
            self._stage_done = {}
            if completed and self._over_budget():
                self.enforce_budget()

    def _init_stage_victims(self, in_stage: dict) -> None:
        """Victims for page-ins during a stage: stale entries (LRU first) and entries done in an
        earlier stage of this step (a stack, most recent on top); entries of this stage are pushed
        onto the stack as their last chunk is launched."""
        stale: dict[int, list] = {}
        done: dict[int, list] = {}
        for e in list(self._entries.values()):
            if not e.paged or e.state != RESIDENCY_DEVICE or id(e) in in_stage:
                continue
            if e.last_step == self._step:
                done.setdefault(e.device, []).append(e)
            elif e.last_step < self._step - 1:
                stale.setdefault(e.device, []).append(e)
        for lst in stale.values():
            lst.sort(key=lambda e: e.last_seq, reverse=True)  # popped from the end: LRU first
        for lst in done.values():
            lst.sort(key=lambda e: e.last_seq)  # popped from the end: MRU first
        self._stage_stale = stale
        self._stage_done = done

    def _stage_victims(self, d: int) -> Iterator[_Entry]:
        stale = self._stage_stale.get(d)
        while stale:
            yield stale.pop()
        done = self._stage_done.get(d)
        while done:
            yield done.pop()

    def _page_in_chunk(self, entries: list[_Entry], side_ready: set) -> list:
        need = [e for e in entries if e.state != RESIDENCY_DEVICE and e.ref() is not None]
        if not need:
            return []
        waits = []
        for d, ents in self._by_device(need).items():
            side = self._side_stream(d)
            if d not in side_ready:
                side_ready.add(d)
                ev = self._pageout_events.pop(d, None)
                if ev is not None:
                    side.wait_event(ev)  # page-outs issued before this stage finish first
            if self.budget_bytes is not None:
                incoming = sum(e.nbytes for e in ents)
                if self._resident.get(d, 0) + incoming > self.budget_bytes:
                    self._evict(d, max(self.budget_bytes - incoming, 0), self._stage_victims(d))
            with self._cuda.use_stream(side):
                self._issue(ents, to_host=False)
            ready = self._cuda.new_event()
            ready.record(side)
            waits.append((d, ready))
        return waits
