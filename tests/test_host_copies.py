"""PageManager(host_copies=True) on the CPU, through a fake of the CUDA calls that moves real bytes:
a page-out copies each run into the host copy and discards it (the fake overwrites discarded bytes
with garbage, as the driver may), a page-in repopulates the run and copies it back. The data must
survive every order of page-outs, page-ins, stages and budget evictions. Real managed memory:
tests/test_paging_cuda.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pagedopt import paging
from pagedopt.paging import RESIDENCY_DEVICE, RESIDENCY_HOST, PageManager
from pagedopt.paging.managed import span_bytes

GARBAGE = 0xA5  # what a discarded byte reads as in the fake


class _Stream:
    def __init__(self, name):
        self.name = name

    def wait_event(self, ev):
        pass


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _CopyingFake:
    """pagedopt.paging.backends.CudaBackend for CPU tensors: prefetch moves nothing, discard
    scrambles the bytes (and records the call), pinned_empty is a CPU tensor."""

    def __init__(self, discard_error: str | None = None):
        self.calls = []
        self.discard_error = discard_error
        self.current = _Stream("cur")

    def current_stream(self, d):
        return self.current

    def new_stream(self, d):
        return _Stream("side")

    def new_event(self):
        return _Event()

    def use_stream(self, s):
        return contextlib.nullcontext()

    def use_device(self, d):
        return contextlib.nullcontext()

    def prefetch(self, t, to):
        self.calls.append(("prefetch", span_bytes(t), None if to is None else to.index))

    def discard(self, t, to):
        if self.discard_error is not None:
            raise RuntimeError(self.discard_error)
        self.calls.append(("discard", t.numel(), None if to is None else to.index))
        t.fill_(GARBAGE)

    def pinned_empty(self, nbytes):
        self.calls.append(("pinned_empty", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)


def _manager(**kw):
    kw.setdefault("pin_ahead", False)  # copies made at the first page-out (test_pin_ahead.py: made ahead)
    m = PageManager(**kw)
    m._cuda = _CopyingFake()
    return m


def _slab_tensors(m, sizes, seed=0):
    """Random uint8 tensors suballocated in one storage at 4 KiB offsets, as an arena does."""
    g = torch.Generator().manual_seed(seed)
    total = sum((n + 4095) // 4096 * 4096 for n in sizes)
    storage = torch.zeros(total, dtype=torch.uint8).untyped_storage()
    out, off = [], 0
    for k, n in enumerate(sizes):
        v = torch.empty(0, dtype=torch.uint8).set_(storage, off, (n,))
        v.copy_(torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8))  # never GARBAGE-only
        m._register(v, True, RESIDENCY_DEVICE, ordinal=k, device=0)
        out.append(v)
        off += (n + 4095) // 4096 * 4096
    return out


def _lone(m, n, seed):
    t = torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    m._register(t, True, RESIDENCY_DEVICE, device=0)
    return t


def test_page_out_discards_and_page_in_restores_the_bytes():
    m = _manager()
    ts = _slab_tensors(m, [1000, 5000, 300]) + [_lone(m, 7000, 1)]
    before = [t.clone() for t in ts]
    # the slab's run spans offset 0 to the third tensor's end (12288 + 300); the lone tensor 7000
    assert m.page_out() == 12288 + 300 + 7000
    calls = m._cuda.calls
    # one host copy per storage, of the storage's size; one discard per run; no driver migration
    assert sorted(c[1] for c in calls if c[0] == "pinned_empty") == sorted([ts[0].untyped_storage().nbytes(), 7000])
    assert [c for c in calls if c[0] == "prefetch"] == []
    assert all(c[2] is None for c in calls if c[0] == "discard")
    # the managed bytes are gone (the fake scrambled them) and the manager knows it
    assert all(bool((t == GARBAGE).all()) for t in ts)
    s = m.stats()
    assert s.host_copied_bytes == sum(t.numel() for t in ts)
    assert s.host_copy_bytes == ts[0].untyped_storage().nbytes() + 7000
    assert all(m._entry(t).state == RESIDENCY_HOST for t in ts)
    m._cuda.calls.clear()
    m.prefetch()
    assert all(torch.equal(t, b) for t, b in zip(ts, before))
    assert all(c[2] == 0 for c in m._cuda.calls if c[0] == "discard")  # repopulated on cuda:0
    assert m.stats().host_copied_bytes == 0
    assert m.stats().host_copy_bytes == ts[0].untyped_storage().nbytes() + 7000  # kept for the next page-out
    # a second round trip reuses the host copies
    m._cuda.calls.clear()
    m.page_out()
    m.prefetch()
    assert [c for c in m._cuda.calls if c[0] == "pinned_empty"] == []
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_page_out_bytes_are_the_runs_spans():
    m = _manager()
    ts = _slab_tensors(m, [1000, 5000])
    # one run from the first tensor's start to the second's end (consecutive ordinals, small gap)
    assert m.page_out() == 4096 + 5000
    assert [c[1] for c in m._cuda.calls if c[0] == "discard"] == [4096 + 5000]


def test_stage_pages_in_a_subset_and_keeps_the_rest_copied():
    m = _manager()
    ts = _slab_tensors(m, [3000, 3000, 3000, 3000], seed=3)
    before = [t.clone() for t in ts]
    m.page_out()
    for i in m.stage([[ts[2]], [ts[0]]]):
        pass
    assert torch.equal(ts[2], before[2]) and torch.equal(ts[0], before[0])
    assert bool((ts[1] == GARBAGE).all()) and bool((ts[3] == GARBAGE).all())
    assert m.stats().host_copied_bytes == 6000
    # settle brings back exactly the copied ones
    assert m.settle() == 6000  # ordinals 1 and 3: two runs of 3000
    assert all(torch.equal(t, b) for t, b in zip(ts, before))
    assert m.stats().host_copied_bytes == 0
    assert m.settle() == 0  # nothing left: no call at all
    n = len(m._cuda.calls)
    m.settle()
    assert len(m._cuda.calls) == n


def test_runs_do_not_mix_copied_and_migrated_tensors():
    """A tensor first touched on the host (budget) is paged in by the driver; its neighbour in the
    slab, paged out into the host copy, comes back from the copy: one run each."""
    m = _manager()
    a, b = _slab_tensors(m, [4096, 4096], seed=5)
    before_a = a.clone()
    m.page_out([a])
    m._set_state(m._entry(b), RESIDENCY_HOST)  # as zeros() over budget leaves it: on the host, no copy
    m._cuda.calls.clear()
    m.prefetch()
    kinds = sorted(c[0] for c in m._cuda.calls)
    assert kinds == ["discard", "prefetch"]
    assert torch.equal(a, before_a)


def test_budget_evictions_keep_the_data():
    m = _manager(budget_bytes=8192, prefetch_depth=1)
    ts = [_lone(m, 4096, seed) for seed in range(6)]
    before = [t.clone() for t in ts]
    m.page_out()
    for step in range(3):
        m.begin_step()
        for i in m.stage([[t] for t in ts]):
            assert torch.equal(ts[i], before[i]), (step, i)
            ts[i].add_(1)  # the step's update
            before[i] = ts[i].clone()
        assert m.stats().resident_bytes <= 8192
    m.settle()
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_without_discard_page_out_falls_back_to_migration_once():
    m = PageManager()
    m._cuda = _CopyingFake(discard_error="cudaMemDiscardBatchAsync: operation not supported")
    ts = [_lone(m, 5000, 1), _lone(m, 6000, 2)]
    before = [t.clone() for t in ts]
    with pytest.warns(paging.PagingFallbackWarning, match="operation not supported"):
        m.page_out()
    assert m.host_copies is False
    assert sorted(c[1] for c in m._cuda.calls if c[0] == "prefetch") == [5000, 6000]
    assert all(torch.equal(t, b) for t, b in zip(ts, before))  # nothing was discarded
    assert m.stats().host_copied_bytes == 0


def test_host_copy_allocation_failure_migrates_that_storage():
    m = _manager()
    ts = [_lone(m, 5000, 1)]

    def refuse(nbytes):
        raise RuntimeError("pinned_empty: cudaHostAlloc of 5000 bytes failed: out of memory")

    m._cuda.pinned_empty = refuse
    with pytest.warns(paging.PagingFallbackWarning, match="could not be allocated"):
        m.page_out()
    assert [c[0] for c in m._cuda.calls] == ["prefetch"]
    assert m.stats().host_copied_bytes == 0


def test_host_copy_is_freed_with_its_storage():
    m = _manager()
    t = _lone(m, 9000, 4)
    m.page_out()
    assert m.stats().host_copy_bytes == 9000
    del t
    s = m.stats()
    assert s.host_copy_bytes == 0 and s.host_copied_bytes == 0 and s.paged_tensors == 0


def test_host_copies_setting_survives_copies_and_is_checked():
    import copy

    m = PageManager(host_copies=False)
    assert copy.deepcopy(m).host_copies is False
    assert copy.deepcopy(PageManager()).host_copies is True
    with pytest.raises(ValueError, match="host_copies"):
        PageManager(host_copies="yes")


def test_separate_runs_of_one_slab_keep_their_own_place_in_the_host_copy():
    """Two runs of one slab (ordinals 1 and 3, not consecutive) go to their own offsets of the
    slab's host copy: neither overwrites the other."""
    m = _manager()
    ts = _slab_tensors(m, [3000, 3000, 3000, 3000], seed=7)
    before = [t.clone() for t in ts]
    assert m.page_out([ts[1], ts[3]]) == 6000
    assert [c[1] for c in m._cuda.calls if c[0] == "discard"] == [3000, 3000]
    m.prefetch([ts[1], ts[3]])
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_optimizer_settle_brings_back_only_host_copied_states():
    import warnings

    import pagedopt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", paging.PagingFallbackWarning)
        opt = pagedopt.PagedAdamW8bit([torch.nn.Parameter(torch.randn(5000))], min_8bit_size=256)
    m = _manager()
    opt._pager = m
    ts = [_lone(m, 5000, 1), _lone(m, 6000, 2)]
    before = [t.clone() for t in ts]
    m.page_out([ts[0]])
    m._cuda.calls.clear()
    opt.settle()
    assert [c[0] for c in m._cuda.calls] == ["discard"] and torch.equal(ts[0], before[0])
    assert m.stats().host_copied_bytes == 0
