"""Tests of pagedopt.paging on the CPU: the fallback path (ordinary tensors, one warning), and the
PageManager's pipeline, budget and statistics logic driven through a recording fake of its CUDA
calls. The tests on real managed memory are in tests/test_paging_cuda.py.
"""
from __future__ import annotations

import contextlib
import gc
import os
import warnings

import pytest
import torch

from pagedopt import paging
from pagedopt.paging import RESIDENCY_DEVICE, RESIDENCY_HOST, PageManager, PagingFallbackWarning
from pagedopt.paging.managed import _reset_fallback_warnings, span_bytes

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# CPU: fallback
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_warnings():
    _reset_fallback_warnings()
    yield
    _reset_fallback_warnings()


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
    """Stands in for pagedopt.paging.backends.CudaBackend: records stream/event/prefetch calls, moves nothing."""

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
        self.log.append(("prefetch", self.active.name, t.data_ptr(), span_bytes(t), where))

    def prefetches(self):
        return [x for x in self.log if x[0] == "prefetch"]


def _fake_manager(**kw):
    kw.setdefault("host_copies", False)  # the driver-migration path; tests/test_host_copies.py covers the copies
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


def test_fake_budget_evicts_several_stale_tensors_least_recently_used_first_and_before_the_page_in():
    """Resident tensors used in one step in the order a, b, c, d, z (z paged in then, so that the
    stage takes its slow path, which records each use), then left alone for two steps (stale);
    under a budget set afterwards, a stage that pages in two more evicts a, then b, then c (least
    recently used first; d and z stay), each page-out issued before the page-in it makes room for,
    the resident bytes within the budget at every page-in. (A stage whose tensors are all resident
    and within budget records no use: that is its free path.)"""
    m = _fake_manager(prefetch_depth=0)
    fake = m._cuda
    a, b, c, d = (_fake_paged(m, 100) for _ in range(4))
    z = _fake_paged(m, 100, state=RESIDENCY_HOST)
    m.begin_step()
    list(m.stage([[a], [b], [c], [d], [z]]))
    m.budget_bytes = 400  # 500 resident now
    m.begin_step()
    m.begin_step()  # a, b, c, d, z: last used two steps ago
    e, f = (_fake_paged(m, 100, state=RESIDENCY_HOST) for _ in range(2))
    resident_at_page_in = []
    real_prefetch = fake.prefetch

    def prefetch(t, to):
        if to is not None:
            resident_at_page_in.append(m.stats().resident_bytes)
        real_prefetch(t, to)

    fake.prefetch = prefetch
    fake.log.clear()
    list(m.stage([[e], [f]]))
    states = [m._entry(t).state for t in (a, b, c, d, z)]
    assert states == [RESIDENCY_HOST] * 3 + [RESIDENCY_DEVICE] * 2, states
    moves = [(x[2], x[4]) for x in fake.prefetches()]
    ptr = {t.data_ptr(): n for t, n in zip((a, b, c, d, z, e, f), "abcdzef")}
    named = [(ptr[p], w) for p, w in moves]
    # one eviction for e's room (a and b, issued in address order), then e; then c, then f
    assert sorted(named[:2]) == [("a", "host"), ("b", "host")]
    assert named[2:] == [("e", "cuda:0"), ("c", "host"), ("f", "cuda:0")]
    # each page-in found its room made: 300 resident beside the 100 coming in
    assert resident_at_page_in == [300, 300]
    assert m.stats().resident_bytes == 400


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
