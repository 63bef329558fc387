"""Page-in and page-out of a PageManager's tensors: :class:`Migration`, with the CUDA streams and
events, the driver prefetches (consecutive arena tensors merged into one call), the copies into
and out of page-locked host copies, the explicit ``prefetch()`` / ``page_out()`` /
``synchronize()``, and the budget's evictions.

Part of :mod:`pagedopt.paging`; a PageManager holds one, over its :class:`.ledger.Ledger`, whose
beliefs every move updates.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .. import _callsite
from .backends import CudaBackend
from .ledger import Entry, Ledger, by_device
from .managed import RESIDENCY_DEVICE, RESIDENCY_HOST, DeviceLike, PagingFallbackWarning, as_device
from .pin_ahead import PinAhead

_MERGE_GAP = 64 << 10  # adjacent arena tensors separated by at most this many bytes share one prefetch


def _byte_view(anchor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """The bytes [start, start + nbytes) of anchor's storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(anchor.untyped_storage(), start, (nbytes,))


class Migration:
    """The moves of one PageManager's tensors (see PageManager for what they do).

    ``ledger``: the manager's bookkeeping; ``host_copies``: page out through page-locked host copies
    (turned off here for good when the driver offers no discards); ``warned``: the manager's set of
    fallback warnings already given; ``cuda``: the CUDA calls (:class:`.backends.CudaBackend`, or a
    fake in tests); ``pin_ahead``: make each storage's host copy when it is tracked
    (:mod:`.pin_ahead`), not at its first page-out."""

    def __init__(self, ledger: Ledger, host_copies: bool, warned: set, cuda=CudaBackend, pin_ahead: bool = True):
        self.ledger = ledger
        self.host_copies = host_copies
        self.pin_ahead = pin_ahead
        self._pinner = PinAhead(cuda)
        ledger.on_storage_gone = self._pinner.drop
        self._cuda = cuda
        self._warned = warned
        # streams and events, per device
        self._side_streams: dict = {}
        self._out_streams: dict = {}
        self._pageout_events: dict = {}  # device -> event after the last page-out issued there
        self._pagein_events: dict = {}  # device -> event of a non_blocking prefetch() in flight

    @property
    def cuda(self):
        return self._cuda

    @cuda.setter
    def cuda(self, backend) -> None:
        self._cuda = backend
        self._pinner.drop_all()
        self._pinner.cuda = backend

    # ------------------------------------------------------------------ host copies made ahead
    def storage_tracked(self, storage_key: int, nbytes: int, device: int) -> None:
        """A storage is tracked from now on: its host copy is made ahead (see :mod:`.pin_ahead`)."""
        if self.host_copies and self.pin_ahead and storage_key not in self.ledger.host_copy:
            self._pinner.request(storage_key, nbytes, device)

    def forget_pinned(self) -> None:
        """Drop the host copies made ahead and not used (page-outs no longer use host copies)."""
        self._pinner.drop_all()

    def wait_pinned(self) -> None:
        """Wait until the host copies being made ahead are made."""
        self._pinner.wait()

    @property
    def pinning_bytes(self) -> int:
        """Bytes of host copies asked for ahead and not yet used by a page-out."""
        return self._pinner.pending_bytes

    # ------------------------------------------------------------------ streams
    def side_stream(self, d: int):
        """The stream of device d that page-ins run on beside the caller's work."""
        s = self._side_streams.get(d)
        if s is None:
            s = self._side_streams[d] = self.cuda.new_stream(d)
        return s

    def _out_stream(self, d: int):
        s = self._out_streams.get(d)
        if s is None:
            s = self._out_streams[d] = self.cuda.new_stream(d)
        return s

    def wait_pagein_events(self) -> None:
        """The current streams wait for non_blocking prefetches still in flight."""
        if self._pagein_events:
            for d, ev in self._pagein_events.items():
                self.cuda.current_stream(d).wait_event(ev)
            self._pagein_events.clear()

    def pagein_in_flight(self) -> bool:
        """True while a non_blocking prefetch() has not been waited for."""
        return bool(self._pagein_events)

    def take_pageout_event(self, d: int):
        """The event after the last page-out issued on device d (None if none is pending); the
        caller orders its page-ins after it, and it is not handed out again."""
        return self._pageout_events.pop(d, None)

    def issue(self, entries: list[Entry], to_host: bool) -> int:
        """Move the entries (all on one device) on the *current* stream, merging runs of
        consecutive arena tensors into one call: a driver prefetch, or with host copies a
        copy-engine copy to/from the host copy plus a discard (see PageManager's host_copies).
        Updates beliefs and traffic; returns bytes."""
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
                       and entries[j].ordinal == entries[j - 1].ordinal + 1 and entries[j].start - end <= _MERGE_GAP
                       and entries[j].host_copied == first.host_copied):
                    end = entries[j].start + entries[j].nbytes
                    j += 1
            run = entries[i:j]
            anchor = None
            for e in run:
                anchor = e.ref()
                if anchor is not None:
                    break
            if anchor is not None:
                if to_host and self.host_copies:
                    copied = self._copy_out(anchor, first.storage_key, first.start, end - first.start)
                elif not to_host and first.host_copied:
                    self._copy_in(anchor, first.storage_key, first.start, end - first.start, target)
                    copied = False
                else:
                    view = anchor if j - i == 1 else _byte_view(anchor, first.start, end - first.start)
                    self.cuda.prefetch(view, target)
                    copied = False
                moved += end - first.start
                for e in run:
                    self.ledger.set_state(e, RESIDENCY_HOST if to_host else RESIDENCY_DEVICE)
                    self.ledger.set_host_copied(e, copied)
            i = j
        self.ledger.count_moved(moved, to_host)
        return moved

    def _host_copy_of(self, anchor: torch.Tensor, storage_key: int) -> Optional[torch.Tensor]:
        """The page-locked host copy of anchor's storage, allocated at its first page-out."""
        copy = self.ledger.host_copy.get(storage_key)
        if copy is None:
            nbytes = anchor.untyped_storage().nbytes()
            try:
                copy = self._pinner.take(storage_key, nbytes)
                if copy is None:
                    copy = self.cuda.pinned_empty(nbytes)
            except RuntimeError as exc:  # page-locked memory exhausted: this storage migrates instead
                self._warn_no_host_copy(f"page-locked host memory of {nbytes} bytes could not be allocated ({exc})")
                return None
            self.ledger.add_host_copy(storage_key, copy, nbytes)
        return copy

    def _warn_no_host_copy(self, why: str) -> None:
        if "host_copies" not in self._warned:
            self._warned.add("host_copies")
            _callsite.warn(f"paged-out states go through the driver's migration instead of a host copy: {why}",
                           PagingFallbackWarning)

    def _copy_out(self, anchor: torch.Tensor, storage_key: int, start: int, nbytes: int) -> bool:
        """Copy bytes [start, start + nbytes) of the storage into its host copy, then discard them.
        False when it fell back to the driver's migration (no host copy, or no discard)."""
        view = _byte_view(anchor, start, nbytes)
        copy = self._host_copy_of(anchor, storage_key)
        if copy is None:
            self.cuda.prefetch(view, None)
            return False
        copy[start:start + nbytes].copy_(view, non_blocking=True)
        try:
            self.cuda.discard(view, None)
        except RuntimeError as exc:  # the runtime or driver offers no discards: migrate from now on
            self.host_copies = False
            self.forget_pinned()
            self._warn_no_host_copy(str(exc).splitlines()[0])
            self.cuda.prefetch(view, None)  # the bytes are intact: the copy only read them
            return False
        return True

    def _copy_in(self, anchor: torch.Tensor, storage_key: int, start: int, nbytes: int, target) -> None:
        """Populate the discarded pages on the GPU and copy the bytes back from the host copy."""
        view = _byte_view(anchor, start, nbytes)
        self.cuda.discard(view, target)
        view.copy_(self.ledger.host_copy[storage_key][start:start + nbytes], non_blocking=True)

    def _select(self, tensors, device) -> list[Entry]:
        if tensors is None:
            entries = self.ledger.live_paged_entries()
        else:
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            entries = self.ledger.paged_entries_for(tensors)
        if device is not None:
            d = as_device(device)
            if d.type != "cuda":
                return []
            entries = [e for e in entries if e.device == d.index]
        return entries

    # ------------------------------------------------------------------ explicit moves
    def prefetch(self, tensors: Optional[Iterable[torch.Tensor]] = None, device: Optional[DeviceLike] = None,
                 *, non_blocking: bool = False) -> int:
        """PageManager.prefetch."""
        total = 0
        for d, ents in by_device(self._select(tensors, device)).items():
            ents = [e for e in ents if e.state != RESIDENCY_DEVICE]
            if not ents:
                continue
            ev = self._pageout_events.pop(d, None)
            if non_blocking:
                side = self.side_stream(d)
                if ev is not None:
                    side.wait_event(ev)
                with self.cuda.use_stream(side):
                    total += self.issue(ents, to_host=False)
                done = self.cuda.new_event()
                done.record(side)
                self._pagein_events[d] = done
            else:
                cur = self.cuda.current_stream(d)
                if ev is not None:
                    cur.wait_event(ev)
                with self.cuda.use_device(d):
                    total += self.issue(ents, to_host=False)
        return total

    def page_out(self, tensors: Optional[Iterable[torch.Tensor]] = None, *, sync: bool = False,
                 overlap: bool = False) -> int:
        """PageManager.page_out."""
        self.wait_pagein_events()
        total = 0
        events = []
        for d, ents in by_device(self._select(tensors, None)).items():
            ents = [e for e in ents if e.state != RESIDENCY_HOST]
            if not ents:
                continue
            total += self._page_out_on(d, ents, overlap)
            events.append(self._pageout_events[d])
        if sync:
            for ev in events:
                ev.synchronize()
        return total

    def _page_out_on(self, d: int, ents: list[Entry], overlap: bool) -> int:
        cur = self.cuda.current_stream(d)
        if overlap:
            out = self._out_stream(d)
            after = self.cuda.new_event()
            after.record(cur)
            out.wait_event(after)
            stream = out
        else:
            stream = cur
        with self.cuda.use_stream(stream):
            moved = self.issue(ents, to_host=True)
        ev = self.cuda.new_event()
        ev.record(stream)
        self._pageout_events[d] = ev
        return moved

    def synchronize(self) -> None:
        """PageManager.synchronize."""
        for ev in list(self._pageout_events.values()) + list(self._pagein_events.values()):
            ev.synchronize()

    # ------------------------------------------------------------------ budget
    def evict(self, d: int, target: int, victims: Iterable[Entry]) -> int:
        """Page out entries taken from ``victims`` (an iterator, consumed as far as needed) on
        device d, overlapping later work, until its resident bytes are at most ``target``."""
        excess = self.ledger.resident.get(d, 0) - target
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
        """PageManager.enforce_budget."""
        ledger = self.ledger
        if not ledger.over_budget():
            return 0
        total = 0
        for d in list(ledger.resident):
            if ledger.resident[d] > ledger.budget_bytes:
                total += self.evict(d, ledger.budget_bytes, iter(ledger.victims(d)))
        return total
