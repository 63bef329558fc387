"""Host copies made ahead (``PageManager(pin_ahead=True)``, :mod:`pagedopt.paging.pin_ahead`), on the
CPU through the copying fake of the CUDA calls: each storage's page-locked copy is allocated on the
pinning thread as soon as the manager tracks the storage, so the first page-out allocates nothing
itself; a storage that dies first never gets one; the limit, a failure on the thread and a size
that no longer matches fall back to allocating at the page-out, with the data intact. Real pinned
memory: tests/test_host_paging_cuda.py."""
from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from pagedopt.paging import PageManager, pin_ahead
from pagedopt.paging.pin_ahead import PinAhead

from test_host_copies import GARBAGE, _CopyingFake, _lone, _slab_tensors

PIN_THREAD = "pagedopt-pin-ahead"


class _ThreadRecordingFake(_CopyingFake):
    """The copying fake whose pinned_empty also records the thread it ran on, and may be held
    (``gate``) or fail on the pinning thread (``fail_on_thread``)."""

    def __init__(self, gate: threading.Event | None = None, fail_on_thread: bool = False):
        super().__init__()
        self.gate = gate
        self.fail_on_thread = fail_on_thread
        self.started = threading.Event()
        self.pinned = []  # (nbytes, thread name)

    def pinned_empty(self, nbytes):
        name = threading.current_thread().name
        self.started.set()
        if self.gate is not None and name == PIN_THREAD:
            assert self.gate.wait(30), "the test never released the pinning thread"
        if self.fail_on_thread and name == PIN_THREAD:
            raise RuntimeError("pinned_empty: cudaHostAlloc failed: out of memory")
        self.pinned.append((nbytes, name))
        return super().pinned_empty(nbytes)


def _manager(fake=None, **kw):
    m = PageManager(**kw)
    m._cuda = fake or _ThreadRecordingFake()
    return m


def test_copies_are_made_ahead_on_the_pinning_thread_and_the_page_out_allocates_none():
    m = _manager()
    ts = _slab_tensors(m, [1000, 5000, 300], seed=11) + [_lone(m, 7000, 12)]
    before = [t.clone() for t in ts]
    m.wait_pinned()
    slab = ts[0].untyped_storage().nbytes()
    # one copy per storage (the slab once, though three tensors live in it), all on the thread
    assert sorted(m._cuda.pinned) == sorted([(slab, PIN_THREAD), (7000, PIN_THREAD)])
    m.page_out()
    assert len(m._cuda.pinned) == 2  # the page-out took the copies made ahead
    assert all(bool((t == GARBAGE).all()) for t in ts)  # really paged out (discarded)
    assert m.stats().host_copy_bytes == slab + 7000
    m.prefetch()
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_without_pin_ahead_the_first_page_out_makes_the_copies():
    m = _manager(pin_ahead=False)
    ts = [_lone(m, 5000, 1), _lone(m, 6000, 2)]
    m.wait_pinned()
    assert m._cuda.pinned == []
    m.page_out()
    assert sorted(m._cuda.pinned) == [(5000, "MainThread"), (6000, "MainThread")]
    assert m.pin_ahead is False and copy.deepcopy(m).pin_ahead is False
    assert copy.deepcopy(PageManager()).pin_ahead is True
    del ts


def test_a_page_out_before_the_copy_is_made_waits_for_it():
    gate = threading.Event()
    m = _manager(_ThreadRecordingFake(gate=gate))
    t = _lone(m, 9000, 3)
    before = t.clone()
    assert m._cuda.started.wait(30)  # the thread is making the copy, held
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    m.page_out()  # waits for the thread's copy, makes none itself
    assert m._cuda.pinned == [(9000, PIN_THREAD)]
    m.prefetch()
    assert torch.equal(t, before)


def test_a_storage_that_dies_first_never_gets_its_copy():
    gate = threading.Event()
    m = _manager(_ThreadRecordingFake(gate=gate))
    a = _lone(m, 4000, 4)
    assert m._cuda.started.wait(30)  # a's copy is being made; b's is queued behind it
    b = _lone(m, 8000, 5)
    assert m._migration.pinning_bytes == 4000 + 8000
    del b
    assert m._migration.pinning_bytes == 4000
    gate.set()
    m.wait_pinned()
    assert m._cuda.pinned == [(4000, PIN_THREAD)]
    del a
    assert m._migration.pinning_bytes == 0 and m.stats().host_copy_bytes == 0


def test_no_more_than_the_share_of_available_host_memory_is_pinned_ahead(monkeypatch):
    monkeypatch.setattr(pin_ahead, "available_host_bytes", lambda: 2 * 10000)  # a limit of 10000 bytes
    m = _manager()
    ts = [_lone(m, 6000, 6), _lone(m, 3000, 7), _lone(m, 5000, 8)]
    before = [t.clone() for t in ts]
    m.wait_pinned()
    assert sorted(m._cuda.pinned) == [(3000, PIN_THREAD), (6000, PIN_THREAD)]  # 5000 more would pass 10000
    m.page_out()
    assert sorted(m._cuda.pinned) == [(3000, PIN_THREAD), (5000, "MainThread"), (6000, PIN_THREAD)]
    m.prefetch()
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_a_failure_on_the_pinning_thread_falls_back_to_the_page_out():
    m = _manager(_ThreadRecordingFake(fail_on_thread=True))
    t = _lone(m, 5000, 9)
    before = t.clone()
    m.wait_pinned()
    m.page_out()
    assert m._cuda.pinned == [(5000, "MainThread")]
    assert bool((t == GARBAGE).all())
    m.prefetch()
    assert torch.equal(t, before)


def test_turning_host_copies_off_drops_the_copies_made_ahead():
    m = _manager()
    t = _lone(m, 5000, 10)
    before = t.clone()
    m.wait_pinned()
    assert m._migration.pinning_bytes == 5000
    m.host_copies = False
    assert m._migration.pinning_bytes == 0
    m.page_out()
    assert [c[0] for c in m._cuda.calls if c[0] != "pinned_empty"] == ["prefetch"]  # the driver's migration
    assert torch.equal(t, before)  # nothing discarded


def test_pin_ahead_take_refuses_a_copy_of_another_size():
    fake = _ThreadRecordingFake()
    p = PinAhead(fake)
    assert p.request(1, 4096, 0) and not p.request(1, 4096, 0)  # one request a key
    assert p.take(1, 8192) is None  # the storage at that key is another one now
    assert p.pending_bytes == 0 and p.take(1, 4096) is None
    assert p.request(2, 4096, 0)
    got = p.take(2, 4096)
    assert got is not None and got.numel() == 4096


def test_pin_ahead_is_checked():
    with pytest.raises(ValueError, match="pin_ahead"):
        PageManager(pin_ahead="yes")


def test_a_process_that_exits_while_copies_are_queued_waits_for_the_one_in_flight_only(tmp_path):
    """At exit the copies still queued are not made, the one being made is finished (no thread is
    left inside the CUDA calls while the runtime shuts down), and the process exits cleanly."""
    import subprocess
    import sys
    import textwrap

    log = tmp_path / "pinned.txt"
    script = textwrap.dedent(f"""
        import contextlib, time
        from pagedopt.paging.pin_ahead import PinAhead

        class Slow:
            def use_device(self, d):
                return contextlib.nullcontext()

            def pinned_empty(self, nbytes):
                with open({str(log)!r}, "a") as f:
                    f.write(f"start {{nbytes}}\\n")
                time.sleep(0.5)
                with open({str(log)!r}, "a") as f:
                    f.write(f"done {{nbytes}}\\n")
                return bytearray(1)

        p = PinAhead(Slow())
        for k in range(20):
            assert p.request(k, 4096 + k, 0)
        import os
        deadline = time.time() + 30
        while not os.path.exists({str(log)!r}) and time.time() < deadline:
            time.sleep(0.01)  # until the first copy is being made (the other 19 wait)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert log.read_text().split("\n")[:-1] == ["start 4096", "done 4096"]
