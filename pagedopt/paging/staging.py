"""The staging schedule of a PageManager: the chunked, pipelined ``stage()`` (a prefetch window of
``prefetch_depth`` chunks ahead of the one being launched, with the budget's page-outs between
chunks) and :func:`split_by_bytes`, which cuts work into such chunks.

Part of :mod:`pagedopt.paging`; :class:`_StagingMixin` is a base of
:class:`pagedopt.paging.manager.PageManager` and uses its bookkeeping and moves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import torch

from .managed import RESIDENCY_DEVICE

if TYPE_CHECKING:
    from .manager import _Entry


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


class _StagingMixin:
    """PageManager.stage() and its helpers (see PageManager for the attributes they use)."""

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
