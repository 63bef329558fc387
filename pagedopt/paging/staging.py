"""The staging schedule of a PageManager: :class:`Staging`, the chunked, pipelined ``stage()`` (a
prefetch window of ``prefetch_depth`` chunks ahead of the one being launched, with the budget's
page-outs between chunks), and :func:`split_by_bytes`, which cuts work into such chunks.

Part of :mod:`pagedopt.paging`; a PageManager holds one, over its :class:`.ledger.Ledger` and its
:class:`.migration.Migration`.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from .ledger import Entry, Ledger, by_device
from .managed import RESIDENCY_DEVICE
from .migration import Migration


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


class Staging:
    """PageManager.stage() and its helpers: the schedule of one manager's page-ins (and, with a
    budget, page-outs) around the chunks its caller launches."""

    def __init__(self, ledger: Ledger, migration: Migration):
        self.ledger = ledger
        self.migration = migration
        # victim bookkeeping during stage() (budget only), per device
        self._stale: dict[int, list] = {}
        self._done: dict[int, list] = {}

    # ------------------------------------------------------------------ pipeline
    def stage(self, groups: Sequence[Iterable[torch.Tensor]], prefetch_depth: int) -> Iterator[int]:
        """PageManager.stage, with its prefetch_depth."""
        ledger = self.ledger
        if not ledger.explicit_steps:
            ledger.new_step()
        if not isinstance(groups, (list, tuple)):
            groups = list(groups)
        n = len(groups)
        self.migration.wait_pagein_events()
        if ledger.non_resident == 0 and not ledger.over_budget():
            yield from range(n)
            return
        yield from self._stage_slow(groups, n, prefetch_depth)

    def _stage_slow(self, groups, n: int, prefetch_depth: int) -> Iterator[int]:
        ledger = self.ledger
        chunk_entries = [ledger.paged_entries_for(g) for g in groups]
        last_use: dict[int, int] = {}
        for i, ents in enumerate(chunk_entries):
            for e in ents:
                last_use[id(e)] = i
        budget = ledger.budget_bytes is not None
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
                            self._done.setdefault(e.device, []).append(e)
                while issued < n and issued <= i + prefetch_depth:
                    waits[issued] = self._page_in_chunk(chunk_entries[issued], side_ready)
                    issued += 1
                if waits[i]:
                    for d, ev in waits[i]:
                        self.migration.cuda.current_stream(d).wait_event(ev)
                    waits[i] = None
                for e in chunk_entries[i]:
                    ledger.mark_used(e)
                yield i
            completed = True
        finally:
            self._stale = {}
            self._done = {}
            if completed and ledger.over_budget():
                self.migration.enforce_budget()

    def _init_stage_victims(self, in_stage: dict) -> None:
        """Victims for page-ins during a stage: stale entries (LRU first) and entries done in an
        earlier stage of this step (a stack, most recent on top); entries of this stage are pushed
        onto the stack as their last chunk is launched."""
        step = self.ledger.step
        stale: dict[int, list] = {}
        done: dict[int, list] = {}
        for e in list(self.ledger.entries.values()):
            if not e.paged or e.state != RESIDENCY_DEVICE or id(e) in in_stage:
                continue
            if e.last_step == step:
                done.setdefault(e.device, []).append(e)
            elif e.last_step < step - 1:
                stale.setdefault(e.device, []).append(e)
        for lst in stale.values():
            lst.sort(key=lambda e: e.last_seq, reverse=True)  # popped from the end: LRU first
        for lst in done.values():
            lst.sort(key=lambda e: e.last_seq)  # popped from the end: MRU first
        self._stale = stale
        self._done = done

    def _stage_victims(self, d: int) -> Iterator[Entry]:
        stale = self._stale.get(d)
        while stale:
            yield stale.pop()
        done = self._done.get(d)
        while done:
            yield done.pop()

    def _page_in_chunk(self, entries: list[Entry], side_ready: set) -> list:
        need = [e for e in entries if e.state != RESIDENCY_DEVICE and e.ref() is not None]
        if not need:
            return []
        ledger, migration = self.ledger, self.migration
        cuda = migration.cuda
        waits = []
        for d, ents in by_device(need).items():
            side = migration.side_stream(d)
            if d not in side_ready:
                side_ready.add(d)
                ev = migration.take_pageout_event(d)
                if ev is not None:
                    side.wait_event(ev)  # page-outs issued before this stage finish first
            if ledger.budget_bytes is not None:
                incoming = sum(e.nbytes for e in ents)
                if ledger.resident.get(d, 0) + incoming > ledger.budget_bytes:
                    migration.evict(d, max(ledger.budget_bytes - incoming, 0), self._stage_victims(d))
            with cuda.use_stream(side):
                migration.issue(ents, to_host=False)
            ready = cuda.new_event()
            ready.record(side)
            waits.append((d, ready))
        return waits
