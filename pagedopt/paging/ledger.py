"""The bookkeeping of a PageManager: :class:`Ledger`, what it believes of every tensor it tracks.

* one :class:`Entry` per registered tensor (held by weakref only: a dead tensor's entry is
  forgotten by a weakref callback), by tensor and by storage;
* O(1) counters of where the paged bytes are believed to be (on a device, on the host, unknown),
  of the unpaged tensors, and of the bytes whose contents live in a page-locked host copy (with
  those copies, one per storage, dropped when the storage's last tensor dies);
* the step clock (steps, the order of uses within them, the bytes moved this step), and the
  device budget with the order in which resident tensors are evicted under it.

It moves nothing: page-ins and page-outs are :mod:`.migration`'s, the staging schedule is
:mod:`.staging`'s. Part of :mod:`pagedopt.paging`.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from .managed import RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, span_bytes


class Entry:
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


def _forget_cb(ledger_ref, key):
    def cb(ref):
        ledger = ledger_ref()
        if ledger is not None:
            ledger.forget(key, ref)
    return cb


def by_device(entries: Iterable[Entry]) -> dict[int, list[Entry]]:
    """The entries grouped by their device, in their order."""
    out: dict[int, list[Entry]] = {}
    for e in entries:
        out.setdefault(e.device, []).append(e)
    return out


class Ledger:
    """The entries, counters, host copies, step clock and budget of one PageManager (see the
    module docstring). Its attributes are read by the manager and its moves; the counters change
    only through the methods here."""

    def __init__(self, budget_bytes: Optional[int] = None):
        self.budget_bytes = budget_bytes
        self._self_ref = weakref.ref(self)
        self.entries: dict[int, Entry] = {}  # id(tensor) -> entry
        self.by_storage: dict[int, list[Entry]] = {}  # storage data_ptr -> paged entries in it
        # O(1) counters (paged entries only, except the unpaged ones)
        self.resident: dict[int, int] = {}  # device -> bytes believed on the device
        self.host_bytes = 0
        self.unknown_bytes = 0
        self.non_resident = 0  # paged entries not believed on their device
        self.paged_count = 0
        self.unpaged_count = 0
        self.unpaged_bytes = 0
        # page-locked host copies of storages (PageManager(host_copies=True))
        self.host_copy: dict[int, torch.Tensor] = {}  # storage data_ptr -> page-locked copy of the storage
        self.host_copy_bytes = 0
        self.host_copied_bytes = 0
        self.on_storage_gone = None  # called with a storage's key when its last tracked tensor dies
        # steps and per-step traffic
        self.step = 0
        self.seq = 0
        self.explicit_steps = False
        self.moved_in = 0
        self.moved_out = 0

    # ------------------------------------------------------------------ residency
    def set_state(self, e: Entry, state: int) -> None:
        old = e.state
        if old == state:
            return
        self._count(e, old, -1)
        e.state = state
        self._count(e, state, +1)

    def _count(self, e: Entry, state: int, sign: int) -> None:
        if state == RESIDENCY_DEVICE:
            self.resident[e.device] = self.resident.get(e.device, 0) + sign * e.nbytes
        else:
            self.non_resident += sign
            if state == RESIDENCY_HOST:
                self.host_bytes += sign * e.nbytes
            else:
                self.unknown_bytes += sign * e.nbytes

    def set_host_copied(self, e: Entry, value: bool) -> None:
        if e.host_copied != value:
            e.host_copied = value
            self.host_copied_bytes += e.nbytes if value else -e.nbytes

    def add_host_copy(self, storage_key: int, copy: torch.Tensor, nbytes: int) -> None:
        """Keep ``copy`` (``nbytes``) as the page-locked host copy of the storage at ``storage_key``
        (until the storage's last tracked tensor dies)."""
        self.host_copy[storage_key] = copy
        self.host_copy_bytes += nbytes

    # ------------------------------------------------------------------ registration
    def register(self, t: torch.Tensor, paged: bool, state: int, ordinal: Optional[int] = None,
                 device: Optional[int] = None) -> Entry:
        key = id(t)
        old = self.entries.get(key)
        if old is not None:
            if old.ref() is t:
                return old
            self.forget(key, old.ref)
        ref = weakref.ref(t, _forget_cb(self._self_ref, key))
        if paged:
            storage_key = t.untyped_storage().data_ptr()
            e = Entry(ref, key, True, t.device.index if device is None else device, span_bytes(t), storage_key,
                      t.data_ptr() - storage_key, ordinal, state)
            self.entries[key] = e
            self.by_storage.setdefault(storage_key, []).append(e)
            self.paged_count += 1
            self._count(e, state, +1)
        else:
            e = Entry(ref, key, False, t.device.index if t.is_cuda else -1, t.numel() * t.element_size(),
                      None, 0, None, RESIDENCY_UNKNOWN)
            self.entries[key] = e
            self.unpaged_count += 1
            self.unpaged_bytes += e.nbytes
        return e

    def forget(self, key: int, ref) -> None:
        e = self.entries.get(key)
        if e is None or e.ref is not ref:
            return
        del self.entries[key]
        if not e.paged:
            self.unpaged_count -= 1
            self.unpaged_bytes -= e.nbytes
            return
        self.paged_count -= 1
        self._count(e, e.state, -1)
        self.set_host_copied(e, False)
        lst = self.by_storage.get(e.storage_key)
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self.by_storage[e.storage_key]
                copy = self.host_copy.pop(e.storage_key, None)  # the storage is gone: so is its host copy
                if copy is not None:
                    self.host_copy_bytes -= copy.numel()
                if self.on_storage_gone is not None:
                    self.on_storage_gone(e.storage_key)

    # ------------------------------------------------------------------ queries
    def entry(self, t: torch.Tensor) -> Optional[Entry]:
        e = self.entries.get(id(t))
        if e is not None and e.ref() is t:
            return e
        return None

    def paged_entries_for(self, tensors: Iterable) -> list[Entry]:
        """The paged entries that the given tensors cover (registered tensors, or views of them),
        without duplicates. Unregistered and unpaged tensors are ignored."""
        out: list[Entry] = []
        seen: set[int] = set()
        for t in tensors:
            if t is None:
                continue
            e = self.entries.get(id(t))
            if e is not None and e.ref() is t:
                if e.paged and id(e) not in seen:
                    seen.add(id(e))
                    out.append(e)
                continue
            if not self.by_storage or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            lst = self.by_storage.get(t.untyped_storage().data_ptr())
            if not lst:
                continue
            start = t.data_ptr() - t.untyped_storage().data_ptr()
            end = start + span_bytes(t)
            for e in tuple(lst):
                if e.start < end and start < e.start + e.nbytes and id(e) not in seen:
                    seen.add(id(e))
                    out.append(e)
        return out

    def live_paged_entries(self) -> list[Entry]:
        """The entries of the paged tensors still alive."""
        return [e for e in list(self.entries.values()) if e.paged and e.ref() is not None]

    # ------------------------------------------------------------------ steps
    def new_step(self) -> None:
        """Age the clock by one step and reset the step's traffic counters."""
        self.step += 1
        self.moved_in = 0
        self.moved_out = 0

    def mark_used(self, e: Entry) -> None:
        """``e`` is used now (by the chunk being launched): the recency that picks victims."""
        e.last_step = self.step
        e.last_seq = self.seq
        self.seq += 1

    def count_moved(self, nbytes: int, to_host: bool) -> None:
        if to_host:
            self.moved_out += nbytes
        else:
            self.moved_in += nbytes

    # ------------------------------------------------------------------ budget
    def over_budget(self) -> bool:
        b = self.budget_bytes
        return b is not None and any(v > b for v in self.resident.values())

    def victims(self, d: int) -> list[Entry]:
        """Resident paged entries of device d in eviction order (see PageManager's docstring), for
        use outside stage()."""
        stale, done = [], []
        for e in list(self.entries.values()):
            if not e.paged or e.device != d or e.state != RESIDENCY_DEVICE:
                continue
            if e.last_step == self.step:
                done.append(e)
            elif e.last_step < self.step - 1:
                stale.append(e)
        stale.sort(key=lambda e: e.last_seq)
        done.sort(key=lambda e: e.last_seq, reverse=True)
        return stale + done
