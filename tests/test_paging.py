"""Tests of pagedopt.paging.

* CPU tests: the fallback path (ordinary tensors, one warning), and the PageManager's pipeline,
  budget and statistics logic driven through a recording fake of its CUDA calls.
* ``@pytest.mark.cuda`` tests: real managed memory. DEVICE SAFETY: every test keeps its managed
  memory to a few tens of MiB, never oversubscribes the GPU, and simulates pressure only with
  explicit page-outs and small budgets.
"""
from __future__ import annotations

import contextlib
import gc
import os
import warnings

import pytest
import torch

from pagedopt import paging
from pagedopt.paging import (RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, PageManager,
                             PagingFallbackWarning)

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# CPU: fallback
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_warnings():
    paging._reset_fallback_warnings()
    yield
    paging._reset_fallback_warnings()


def test_cpu_is_not_pageable():
    assert not paging.paging_available("cpu")
    assert "not a CUDA device" in paging.paging_unavailable_reason(torch.device("cpu"))
    assert not paging.is_managed(torch.zeros(4))


def test_disable_env(monkeypatch):
    monkeypatch.setenv("PAGEDOPT_DISABLE_PAGING", "1")
    assert "PAGEDOPT_DISABLE_PAGING" in paging.paging_unavailable_reason("cuda:0")
    assert not paging.paging_available("cuda:0")


def test_fallback_zeros_and_warning_once(fresh_warnings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = PageManager()
        a = m.zeros((3, 5), torch.float32, "cpu")
        b = m.zeros(7, torch.uint8, torch.device("cpu"))
    ours = [w for w in caught if issubclass(w.category, PagingFallbackWarning)]
    assert len(ours) == 1  # once per manager and device
    msg = str(ours[0].message)
    assert "not paged on cpu" in msg and "ordinary memory" in msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = PageManager().zeros([2], torch.bfloat16, "cpu")  # another manager (optimizer) says it once too
        m.zeros(1, torch.float32, "cpu")
    assert len([w for w in caught if issubclass(w.category, PagingFallbackWarning)]) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert paging.warn_not_paged("cpu", "test") is True
        assert paging.warn_not_paged("cpu", "test") is False  # the helper alone: once per process
    assert len([w for w in caught if issubclass(w.category, PagingFallbackWarning)]) == 1
    for t, shape, dtype in ((a, (3, 5), torch.float32), (b, (7,), torch.uint8), (c, (2,), torch.bfloat16)):
        assert t.device.type == "cpu" and t.shape == shape and t.dtype == dtype
        assert torch.count_nonzero(t) == 0
        assert not m.is_paged(t)
    s = m.stats()
    assert s.paged_tensors == 0 and s.resident_bytes == 0 and s.host_bytes == 0
    assert s.unpaged_tensors == 2 and s.unpaged_bytes == 3 * 5 * 4 + 7  # the dropped one is forgotten
    assert s["unpaged_tensors"] == 2 and s.as_dict()["unpaged_bytes"] == 67
    del a
    gc.collect()
    assert m.stats().unpaged_tensors == 1 and m.stats().unpaged_bytes == 7


def test_fallback_stage_and_moves_are_noops(fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = PageManager(budget_bytes=0)
        ts = [m.zeros((4,), torch.float32, "cpu") for _ in range(5)]
    chunks = [ts[0:2], ts[2:3], [], ts[3:5], [torch.ones(3)]]
    assert list(m.stage(chunks)) == [0, 1, 2, 3, 4]
    assert list(m.stage([])) == []
    assert list(m.stage(iter([[ts[0]], [ts[1]]]))) == [0, 1]
    assert m.page_out() == 0 and m.page_out(ts[:2], sync=True) == 0
    assert m.prefetch() == 0 and m.prefetch(ts, device="cpu") == 0
    assert m.enforce_budget() == 0
    m.synchronize()
    s = m.stats()
    assert s.bytes_moved_last_step == 0 and s.paged_tensors == 0


def test_manager_rejects_bad_arguments():
    with pytest.raises(ValueError):
        PageManager(budget_bytes=-1)
    with pytest.raises(ValueError):
        PageManager(arena_bytes=-5)
    with pytest.raises(ValueError):
        PageManager(prefetch_depth=-1)


# ---------------------------------------------------------------------------------------------
# CPU: pipeline logic through a recording fake of the CUDA calls
# ---------------------------------------------------------------------------------------------
class _FakeStream:
    def __init__(self, fake, name):
        self.fake, self.name = fake, name

    def wait_event(self, ev):
        self.fake.log.append(("wait", self.name, ev.name))


class _FakeEvent:
    def __init__(self, fake, name):
        self.fake, self.name, self.stream = fake, name, None

    def record(self, stream):
        self.stream = stream.name
        self.fake.log.append(("record", stream.name, self.name))

    def synchronize(self):
        self.fake.log.append(("sync", self.name))


class _FakeCuda:
    """Stands in for paging._CudaBackend: records stream/event/prefetch calls, moves nothing."""

    def __init__(self):
        self.log = []
        self.current = {}
        self.active = None
        self.n_streams = 0
        self.n_events = 0

    def current_stream(self, d):
        if d not in self.current:
            self.current[d] = _FakeStream(self, f"cur{d}")
        return self.current[d]

    def new_stream(self, d):
        self.n_streams += 1
        return _FakeStream(self, f"s{self.n_streams}@{d}")

    def new_event(self):
        self.n_events += 1
        return _FakeEvent(self, f"e{self.n_events}")

    @contextlib.contextmanager
    def use_stream(self, s):
        prev, self.active = self.active, s
        try:
            yield
        finally:
            self.active = prev

    def use_device(self, d):
        return self.use_stream(self.current_stream(d))

    def prefetch(self, t, to):
        where = "host" if to is None else f"cuda:{to.index}"
        self.log.append(("prefetch", self.active.name, t.data_ptr(), paging._span_bytes(t), where))

    def prefetches(self):
        return [x for x in self.log if x[0] == "prefetch"]


def _fake_manager(**kw):
    m = PageManager(**kw)
    m._cuda = _FakeCuda()
    return m


def _fake_paged(m, nbytes, device=0, state=RESIDENCY_DEVICE):
    t = torch.zeros(nbytes, dtype=torch.uint8)
    m._register(t, True, state, device=device)
    return t


def test_manager_copies_are_empty_and_configured():
    import copy
    import pickle

    m = _fake_manager(budget_bytes=123, arena_bytes=4096, prefetch_depth=3)
    t = _fake_paged(m, 10)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert (c.budget_bytes, c.arena_bytes, c.prefetch_depth) == (123, 4096, 3)
        assert c.stats().paged_tensors == 0 and not c.is_paged(t)
    assert m.stats().paged_tensors == 1 and "paged_tensors=1" in repr(m)


def test_fake_resident_stage_is_free():
    m = _fake_manager()
    ts = [_fake_paged(m, 100) for _ in range(6)]
    assert m.stats().resident_bytes == 600 and m.stats().paged_tensors == 6
    assert m.all_resident()
    assert list(m.stage([ts[0:2], ts[2:4], ts[4:6]])) == [0, 1, 2]
    assert m._cuda.log == []  # no stream, event or driver call at all
    m.page_out(ts[:1])
    assert not m.all_resident()
    assert m.is_paged(ts[0]) and not m.is_paged(torch.zeros(3))


def test_fake_page_out_then_stage_pipeline():
    m = _fake_manager(prefetch_depth=1)
    fake = m._cuda
    ts = [_fake_paged(m, 1000 + i) for i in range(8)]
    total = sum(t.numel() for t in ts)
    m.begin_step()
    assert m.page_out() == total
    s = m.stats()
    assert s.resident_bytes == 0 and s.host_bytes == total and s.bytes_moved_last_step == total
    outs = fake.prefetches()
    assert len(outs) == 8 and all(p[1] == "cur0" and p[4] == "host" for p in outs)
    assert m.page_out() == 0  # already on the host: no driver call
    assert len(fake.prefetches()) == 8
    pageout_event = [x for x in fake.log if x[0] == "record"][-1][2]

    chunks = [ts[0:3], ts[3:5], ts[5:8], []]
    fake.log.clear()
    m.begin_step()
    seen = []
    for i in m.stage(chunks):
        # every tensor of chunk i was prefetched to the device before the yield, and the current
        # stream waited for the side stream's event recorded after those prefetches
        log = list(fake.log)
        for t in chunks[i]:
            k = next(j for j, x in enumerate(log) if x[0] == "prefetch" and x[2] == t.data_ptr())
            assert log[k][4] == "cuda:0" and log[k][1].startswith("s")
            rec = next(j for j in range(k, len(log)) if log[j][0] == "record")
            ev = log[rec][2]
            assert ("wait", "cur0", ev) in log[rec:]
        # prefetch_depth=1: chunk i+1 is issued, chunk i+2 is not yet
        issued = {x[2] for x in log if x[0] == "prefetch"}
        for j, c in enumerate(chunks):
            for t in c:
                assert (t.data_ptr() in issued) == (j <= i + 1)
        assert all(m._entry(t).state == RESIDENCY_DEVICE for t in chunks[i])
        seen.append(i)
    assert seen == [0, 1, 2, 3]
    # the side stream waited for the page-out before its first page-in
    first_prefetch = next(j for j, x in enumerate(fake.log) if x[0] == "prefetch")
    assert ("wait", fake.log[first_prefetch][1], pageout_event) in fake.log[:first_prefetch]
    s = m.stats()
    assert s.resident_bytes == total and s.host_bytes == 0
    assert s.page_in_bytes_last_step == total and s.page_out_bytes_last_step == 0
    # everything resident again: the next stage is free
    fake.log.clear()
    assert list(m.stage(chunks)) == [0, 1, 2, 3]
    assert fake.log == []


def test_fake_stage_resets_step_until_begin_step_is_explicit():
    m = _fake_manager()
    ts = [_fake_paged(m, 10) for _ in range(2)]
    m.page_out()
    assert m.stats().bytes_moved_last_step == 20
    list(m.stage([ts[:1]]))  # implicit begin_step: the page-out is forgotten
    assert m.stats().page_out_bytes_last_step == 0 and m.stats().page_in_bytes_last_step == 10
    list(m.stage([ts[1:]]))
    assert m.stats().page_in_bytes_last_step == 10
    m.begin_step()
    m.page_out()
    list(m.stage([ts[:1]]))
    list(m.stage([ts[1:]]))  # explicit steps: both stages count in one step
    assert m.stats().page_out_bytes_last_step == 20 and m.stats().page_in_bytes_last_step == 20


def test_fake_multi_device():
    m = _fake_manager()
    fake = m._cuda
    a = [_fake_paged(m, 64, device=0) for _ in range(3)]
    b = [_fake_paged(m, 32, device=1) for _ in range(3)]
    m.page_out()
    assert {p[1] for p in fake.prefetches()} == {"cur0", "cur1"}
    fake.log.clear()
    chunks = [[a[0], b[0]], [a[1]], [b[1], b[2], a[2]]]
    assert list(m.stage(chunks)) == [0, 1, 2]
    by_ptr = {p[2]: p for p in fake.prefetches()}
    for t in a:
        assert by_ptr[t.data_ptr()][4] == "cuda:0" and by_ptr[t.data_ptr()][1].endswith("@0")
    for t in b:
        assert by_ptr[t.data_ptr()][4] == "cuda:1" and by_ptr[t.data_ptr()][1].endswith("@1")
    waits = {x[1] for x in fake.log if x[0] == "wait" and x[1].startswith("cur")}
    assert waits == {"cur0", "cur1"}
    assert m.stats().resident_bytes_by_device == {0: 192, 1: 96}
    fake.log.clear()
    assert m.prefetch(device="cuda:1") == 0  # already resident
    m.page_out(b)
    assert m.stats().resident_bytes_by_device == {0: 192}
    assert m.prefetch(device=1) == 96 and fake.prefetches()[-1][4] == "cuda:1"


def test_fake_arena_runs_are_merged():
    m = _fake_manager()
    fake = m._cuda
    storage = torch.zeros(8 * 4096, dtype=torch.uint8).untyped_storage()
    views = []
    for k, (off, n) in enumerate([(0, 1000), (4096, 4096), (8192, 100), (16384, 50)]):
        v = torch.empty(0, dtype=torch.uint8).set_(storage, off, (n,))
        m._register(v, True, RESIDENCY_DEVICE, ordinal=k, device=0)
        views.append(v)
    lone = _fake_paged(m, 10)
    assert m.page_out(views + [lone]) == 16384 + 50 + 10
    pre = fake.prefetches()
    base = storage.data_ptr()
    # ordinals 0..3 are consecutive and their gaps are small: one call from views[0] to views[3]'s end
    assert (base, 16384 + 50) in {(p[2], p[3]) for p in pre}
    assert len(pre) == 2
    assert all(m._entry(v).state == RESIDENCY_HOST for v in views)
    # a view of a registered tensor finds it
    assert m.is_paged(views[1][10:20])
    fake.log.clear()
    assert list(m.stage([[views[1], views[2]], [views[0]]])) == [0, 1]
    pre = fake.prefetches()
    assert [(p[2] - base, p[3]) for p in pre] == [(4096, 4096 + 100), (0, 1000)]


def test_fake_nonblocking_prefetch_is_awaited():
    m = _fake_manager()
    fake = m._cuda
    ts = [_fake_paged(m, 10) for _ in range(2)]
    m.page_out(sync=True)
    assert fake.log[-1][0] == "sync"
    fake.log.clear()
    m.prefetch(non_blocking=True)
    assert all(p[1].startswith("s") for p in fake.prefetches())
    ev = [x for x in fake.log if x[0] == "record"][-1][2]
    assert list(m.stage([ts])) == [0]  # everything resident: fast path, but it waits for the event
    assert ("wait", "cur0", ev) in fake.log
    assert len(fake.prefetches()) == 2


def test_fake_budget_keeps_resident_bytes_bounded():
    budget = 2500
    m = _fake_manager(budget_bytes=budget, prefetch_depth=2)
    fake = m._cuda
    ts = [_fake_paged(m, 500) for _ in range(12)]  # 6000 bytes
    chunks = [ts[2 * k:2 * k + 2] for k in range(6)]  # 1000 bytes each
    assert list(m.stage(chunks)) == list(range(6))  # over budget: slow path, evicts at the end
    assert m.stats().resident_bytes <= budget
    for step in range(4):
        fake.log.clear()
        m.begin_step()
        for i in m.stage(chunks):
            assert all(m._entry(t).state == RESIDENCY_DEVICE for t in chunks[i])
            # the window never grows past budget + the chunks in flight
            assert m.stats().resident_bytes <= budget + 3 * 1000
            # nothing that this stage has yet to use was paged out
            paged_out = {x[2] for x in fake.log if x[0] == "prefetch" and x[4] == "host"}
            assert not paged_out & {t.data_ptr() for c in chunks[i:] for t in c}
        s = m.stats()
        assert s.resident_bytes <= budget
        assert s.resident_bytes + s.host_bytes == 6000
        assert s.page_in_bytes_last_step > 0 and s.page_out_bytes_last_step > 0
        # page-outs go to a separate stream that first waited for the current stream
        outs = [x for x in fake.log if x[0] == "prefetch" and x[4] == "host"]
        assert outs and all(not p[1].startswith("cur") for p in outs)
    # enlarging the budget: nothing to evict, and after one stage everything is resident and free
    m.budget_bytes = 10_000
    list(m.stage(chunks))
    fake.log.clear()
    list(m.stage(chunks))
    assert fake.log == [] and m.stats().resident_bytes == 6000


def test_fake_budget_evicts_stale_first():
    m = _fake_manager(budget_bytes=300)
    stale = _fake_paged(m, 100)
    used = [_fake_paged(m, 100) for _ in range(3)]
    for _ in range(3):
        m.begin_step()
        list(m.stage([used]))
    assert m._entry(stale).state == RESIDENCY_HOST  # never used: the first victim
    assert all(m._entry(t).state == RESIDENCY_DEVICE for t in used)


def test_fake_weakrefs_do_not_keep_memory():
    m = _fake_manager()
    ts = [_fake_paged(m, 100) for _ in range(4)]
    m.page_out(ts[:2])
    del ts[0]
    gc.collect()
    s = m.stats()
    assert s.paged_tensors == 3 and s.host_bytes == 100 and s.resident_bytes == 200
    ts.clear()
    gc.collect()
    s = m.stats()
    assert s.paged_tensors == 0 and s.host_bytes == 0 and s.resident_bytes == 0
    assert m._non_resident == 0 and not m._by_storage and not m._entries


def test_fake_stage_closed_early():
    m = _fake_manager(budget_bytes=100)
    ts = [_fake_paged(m, 100) for _ in range(4)]
    m.page_out()
    it = m.stage([[t] for t in ts])
    assert next(it) == 0
    it.close()
    assert list(m.stage([[t] for t in ts])) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# CUDA: real managed memory (small sizes only; see the device-safety note at the top)
# ---------------------------------------------------------------------------------------------
def _require_paging(device="cuda:0"):
    reason = paging.paging_unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.cuda
def test_cuda_managed_empty_is_a_real_cuda_tensor():
    _require_paging()
    t = paging.managed_empty((256, 128), torch.float32, "cuda")
    assert t.is_cuda and t.shape == (256, 128) and t.dtype == torch.float32 and t.is_contiguous()
    assert paging.is_managed(t) and paging.is_managed(t[3:5])
    assert not paging.is_managed(torch.zeros(4, device="cuda")) and not paging.is_managed(torch.zeros(4))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    ref = torch.arange(t.numel(), dtype=torch.float32).view(256, 128)
    assert torch.equal((t * 2 + 1).cpu(), ref * 2 + 1)
    w = torch.randn(128, 64, device="cuda")
    torch.testing.assert_close(t @ w, t.clone() @ w)
    assert torch.equal(t.cpu(), ref)
    e = paging.managed_empty((0, 5), torch.bfloat16, "cuda:0")
    assert e.shape == (0, 5) and e.is_cuda and not paging.is_managed(e)
    for dtype in (torch.uint8, torch.bfloat16, torch.float16, torch.int64):
        x = paging.managed_empty((33,), dtype, torch.device("cuda", 0))
        x.fill_(3)
        assert x.dtype == dtype and int(x.sum().item()) == 99
    with pytest.raises(RuntimeError, match="CUDA device"):
        paging.managed_empty((4,), torch.float32, "cpu")


@pytest.mark.cuda
def test_cuda_ops_reject_unmanaged_tensors():
    _require_paging()
    t = torch.zeros(1024, device="cuda")
    with pytest.raises(RuntimeError, match="not in CUDA managed memory"):
        paging.prefetch_(t, None)
    with pytest.raises(RuntimeError, match="not in CUDA managed memory"):
        paging.residency(t)
    m = paging.managed_empty((1024,), torch.float32, "cuda:0")
    if torch.cuda.device_count() > 1:
        with pytest.raises(RuntimeError, match="own device"):
            paging.prefetch_(m, "cuda:1")


@pytest.mark.cuda
def test_cuda_residency_follows_page_out_and_prefetch():
    _require_paging()
    m = PageManager()
    ts = [m.zeros((1 << 20,), torch.uint8, "cuda") for _ in range(4)]  # 4 MiB in all
    ts[0].fill_(7)
    assert all(m.is_paged(t) and paging.is_managed(t) for t in ts)
    s = m.stats()
    assert s.paged_tensors == 4 and s.resident_bytes == 4 * MiB and s.host_bytes == 0
    m.begin_step()
    assert m.page_out(sync=True) == 4 * MiB
    assert all(paging.residency(t) == RESIDENCY_HOST for t in ts)
    s = m.stats()
    assert s.resident_bytes == 0 and s.host_bytes == 4 * MiB and s.bytes_moved_last_step == 4 * MiB
    assert m.prefetch(ts[:2]) == 2 * MiB
    torch.cuda.synchronize()
    assert [paging.residency(t) for t in ts] == [RESIDENCY_DEVICE] * 2 + [RESIDENCY_HOST] * 2
    assert m.stats().bytes_moved_last_step == 6 * MiB
    m.prefetch(device="cuda")
    torch.cuda.synchronize()
    assert all(paging.residency(t) == RESIDENCY_DEVICE for t in ts)
    assert m.stats().resident_bytes == 4 * MiB
    assert int(ts[0].sum().item()) == 7 * MiB and int(ts[1].sum().item()) == 0
    fresh = paging.managed_empty((4096,), torch.float32, "cuda")
    assert paging.residency(fresh) == RESIDENCY_UNKNOWN
    assert m.register(fresh) and m.stats().unknown_bytes == 4096 * 4
    assert not m.register(torch.zeros(3, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("arena", [0, 4 * MiB])
@pytest.mark.parametrize("budget", [None, 3 * MiB])
def test_cuda_stage_gives_correct_results_after_page_out(depth, arena, budget):
    _require_paging()
    torch.manual_seed(0)
    m = PageManager(budget, arena_bytes=arena, prefetch_depth=depth)
    shapes = [(1000, 257), (4096,), (3, 5, 7), (2048, 300), (1,), (123_457,), (700, 700)]
    states = [m.zeros(s, torch.float32, "cuda") for s in shapes]  # about 8 MiB
    refs = [torch.randn(s) for s in shapes]
    for t, r in zip(states, refs):
        t.copy_(r)
    chunks = [states[0:2], states[2:3], states[3:5], states[5:7]]
    for step in range(3):
        m.begin_step()
        m.page_out(sync=(step == 0))
        for i in m.stage(chunks):
            for t in chunks[i]:
                t.mul_(0.5).add_(1.0)  # one "kernel" per tensor, on the current stream
        for r in refs:
            r.mul_(0.5).add_(1.0)
        s = m.stats()
        assert s.bytes_moved_last_step > 0
        if budget is not None:
            assert s.resident_bytes <= budget
    torch.cuda.synchronize()
    for t, r in zip(states, refs):
        torch.testing.assert_close(t.cpu(), r, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_stage_on_a_side_stream_caller():
    """The caller's current stream is not the default stream: waits and launches follow it."""
    _require_paging()
    m = PageManager()
    a = m.zeros((1 << 18,), torch.float32, "cuda")
    b = m.zeros((1 << 18,), torch.float32, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # zeros() zero-filled on the current stream
    with torch.cuda.stream(s):
        a.fill_(1)
        b.fill_(2)
        m.page_out()
        for i in m.stage([[a], [b]]):
            (a if i == 0 else b).add_(1)
    s.synchronize()
    assert a.sum().item() == 2 * (1 << 18) and b.sum().item() == 3 * (1 << 18)


@pytest.mark.cuda
def test_cuda_budget_initializes_overflow_on_host():
    _require_paging()
    m = PageManager(budget_bytes=2 * MiB)
    ts = [m.zeros((MiB // 4,), torch.float32, "cuda") for _ in range(4)]  # 1 MiB each
    s = m.stats()
    assert s.resident_bytes == 2 * MiB and s.host_bytes == 2 * MiB
    torch.cuda.synchronize()
    assert all(int(torch.count_nonzero(t).item()) == 0 for t in ts)
    for i in m.stage([[t] for t in ts]):
        ts[i].add_(i)
    torch.cuda.synchronize()
    assert [t.sum().item() for t in ts] == [i * (MiB // 4) for i in range(4)]
    assert m.stats().resident_bytes <= 2 * MiB


@pytest.mark.cuda
def test_cuda_host_preferred_advice():
    _require_paging()
    t = paging.managed_empty((1 << 20,), torch.float32, "cuda")
    t.fill_(1)
    paging.advise_preferred_location_(t, None)  # stays on the host, the GPU reads it over the bus
    t.mul_(3)
    assert t.sum().item() == 3 * (1 << 20)
    paging.advise_preferred_location_(t, "cuda")
    paging.prefetch_(t, "cuda")
    t.add_(1)
    torch.cuda.synchronize()
    assert paging.residency(t) == RESIDENCY_DEVICE and t.sum().item() == 4 * (1 << 20)


@pytest.mark.cuda
def test_cuda_no_leak_after_200_allocations():
    _require_paging()
    size = 8 * MiB

    def cycle(k):
        m = PageManager(arena_bytes=4 * MiB if k % 2 else 0)
        t = paging.managed_empty((size,), torch.uint8, "cuda")
        t.fill_(1)
        paging.prefetch_(t, None)  # populate host pages too
        u = m.zeros((size // 4,), torch.float32, "cuda")
        small = [m.zeros((1000,), torch.float32, "cuda") for _ in range(4)]
        m.page_out(sync=True)
        del t, u, small, m

    for k in range(5):  # warm up: CUDA context, allocator, UVM driver state
        cycle(k)
    gc.collect()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    rss0 = _rss_bytes()
    for k in range(200):
        cycle(k)
    gc.collect()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    rss1 = _rss_bytes()
    assert free1 >= free0 - 64 * MiB, f"GPU free memory fell by {(free0 - free1) / MiB:.1f} MiB"
    assert rss1 <= rss0 + 64 * MiB, f"RSS grew by {(rss1 - rss0) / MiB:.1f} MiB"


@pytest.mark.cuda
def test_cuda_two_devices_page_to_their_own_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _require_paging("cuda:0")
    _require_paging("cuda:1")
    m = PageManager()
    a = m.zeros((1 << 18,), torch.float32, "cuda:0")
    b = m.zeros((1 << 18,), torch.float32, "cuda:1")
    m.page_out(sync=True)
    assert paging.residency(a) == RESIDENCY_HOST and paging.residency(b) == RESIDENCY_HOST
    for i in m.stage([[a, b]]):
        a.add_(1)
        with torch.cuda.device(1):
            b.add_(2)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert paging.residency(a) == RESIDENCY_DEVICE and paging.residency(b) == RESIDENCY_DEVICE
    assert a.sum().item() == (1 << 18) and b.sum().item() == 2 * (1 << 18)
    assert m.stats().resident_bytes_by_device == {0: 1 << 20, 1: 1 << 20}


# ---------------------------------------------------------------------------------------------
# bench smoke: on CPU it reports "skipped: no CUDA"; on a GPU it is a tiny real run (64 MiB)
# ---------------------------------------------------------------------------------------------
def test_bench_paging_smoke(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "paging.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_paging.py"), "--smoke", "--out",
                           str(out)], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "paging"
    if "skipped" in doc:
        assert "skipped" in proc.stdout
    else:
        for k in ("pinned_h2d", "uvm_page_in", "uvm_page_in_stage", "uvm_page_out", "host_preferred_rw"):
            assert doc["results"][k]["gbps"] > 0


def test_split_by_bytes_closes_a_chunk_once_it_reaches_the_limit():
    from pagedopt.paging import split_by_bytes

    sizes = [3, 4, 10, 1, 1, 1, 2]
    assert split_by_bytes(sizes, lambda s: s, 7) == [[3, 4], [10], [1, 1, 1, 2]]
    assert split_by_bytes([], lambda s: s, 7) == []
    assert split_by_bytes(sizes, lambda s: s, 100) == [sizes]
