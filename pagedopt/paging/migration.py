"""Page-in and page-out of a PageManager's tensors: the CUDA streams and events, the driver
prefetches (consecutive arena tensors merged into one call), the explicit ``prefetch()`` /
``page_out()`` / ``synchronize()``, and the budget's evictions.

Part of :mod:`pagedopt.paging`; :class:`_MigrationMixin` is a base of
:class:`pagedopt.paging.manager.PageManager` and uses its bookkeeping.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import warnings

import torch

from .managed import RESIDENCY_DEVICE, RESIDENCY_HOST, DeviceLike, PagingFallbackWarning, _as_device

if TYPE_CHECKING:
    from .manager import _Entry

_MERGE_GAP = 64 << 10  # adjacent arena tensors separated by at most this many bytes share one prefetch


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

    @staticmethod
    def discard(t: torch.Tensor, to: Optional[torch.device]) -> None:
        """Discard t's managed bytes (to=None), or discard them and populate the pages at ``to``."""
        torch.ops.pagedopt.discard_(t, to)

    @staticmethod
    def pinned_empty(nbytes: int) -> torch.Tensor:
        return torch.ops.pagedopt.pinned_empty([nbytes], torch.uint8)


def _byte_view(anchor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """The bytes [start, start + nbytes) of anchor's storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(anchor.untyped_storage(), start, (nbytes,))


class _MigrationMixin:
    """PageManager's streams, moves and budget (see PageManager for the attributes they use)."""

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
                    self._cuda.prefetch(view, target)
                    copied = False
                moved += end - first.start
                for e in run:
                    self._set_state(e, RESIDENCY_HOST if to_host else RESIDENCY_DEVICE)
                    self._set_host_copied(e, copied)
            i = j
        if to_host:
            self._moved_out += moved
        else:
            self._moved_in += moved
        return moved

    def _host_copy_of(self, anchor: torch.Tensor, storage_key: int) -> Optional[torch.Tensor]:
        """The page-locked host copy of anchor's storage, allocated at its first page-out."""
        copy = self._host_copy.get(storage_key)
        if copy is None:
            nbytes = anchor.untyped_storage().nbytes()
            try:
                copy = self._cuda.pinned_empty(nbytes)
            except RuntimeError as exc:  # page-locked memory exhausted: this storage migrates instead
                self._warn_no_host_copy(f"page-locked host memory of {nbytes} bytes could not be allocated ({exc})")
                return None
            self._host_copy[storage_key] = copy
            self._host_copy_bytes += nbytes
        return copy

    def _warn_no_host_copy(self, why: str) -> None:
        if "host_copies" not in self._warned:
            self._warned.add("host_copies")
            warnings.warn(f"paged-out states go through the driver's migration instead of a host copy: {why}",
                          PagingFallbackWarning, stacklevel=4)

    def _copy_out(self, anchor: torch.Tensor, storage_key: int, start: int, nbytes: int) -> bool:
        """Copy bytes [start, start + nbytes) of the storage into its host copy, then discard them.
        False when it fell back to the driver's migration (no host copy, or no discard)."""
        view = _byte_view(anchor, start, nbytes)
        copy = self._host_copy_of(anchor, storage_key)
        if copy is None:
            self._cuda.prefetch(view, None)
            return False
        copy[start:start + nbytes].copy_(view, non_blocking=True)
        try:
            self._cuda.discard(view, None)
        except RuntimeError as exc:  # the runtime or driver offers no discards: migrate from now on
            self.host_copies = False
            self._warn_no_host_copy(str(exc).splitlines()[0])
            self._cuda.prefetch(view, None)  # the bytes are intact: the copy only read them
            return False
        return True

    def _copy_in(self, anchor: torch.Tensor, storage_key: int, start: int, nbytes: int, target) -> None:
        """Populate the discarded pages on the GPU and copy the bytes back from the host copy."""
        view = _byte_view(anchor, start, nbytes)
        self._cuda.discard(view, target)
        view.copy_(self._host_copy[storage_key][start:start + nbytes], non_blocking=True)

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
