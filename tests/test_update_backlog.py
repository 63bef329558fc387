"""How far updates during backward may fall behind backward (pagedopt/optim/update_backlog.py): at
most ``backlog_chunks`` chunk updates queued and not done, the host waiting for the oldest, so that
the gradients held stay a few chunks' even when the updates are slower than backward (states
streamed over the host link)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pagedopt
from pagedopt.optim.update_backlog import UpdateBacklog

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")


class FakeEvent:
    """An event that is done once ``clock[0]`` reaches ``at``; synchronize() advances the clock."""

    def __init__(self, clock: list, at: int, log: list):
        self.clock, self.at, self.log = clock, at, log

    def query(self) -> bool:
        return self.clock[0] >= self.at

    def synchronize(self) -> None:
        self.log.append(self.at)
        self.clock[0] = max(self.clock[0], self.at)


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_admit_keeps_at_most_limit_queued_and_waits_for_the_oldest(limit):
    clock, log = [0], []
    backlog = UpdateBacklog(limit)
    for k in range(1, 20):
        backlog.admit()
        assert len(backlog) < limit  # room for the one about to be queued
        backlog.queued(FakeEvent(clock, k, log))
        assert len(backlog) <= limit
    # nothing finished by itself: every wait was for the oldest queued, in order
    assert log == list(range(1, 20 - limit))
    assert backlog.waits == len(log)


def test_admit_forgets_finished_chunks_without_waiting():
    clock, log = [0], []
    backlog = UpdateBacklog(2)
    for k in range(1, 4):
        backlog.admit()
        backlog.queued(FakeEvent(clock, k, log))
        clock[0] = k  # the GPU keeps up: each chunk done before the next is queued
    backlog.admit()
    assert log == [] and backlog.waits == 0 and len(backlog) == 0


def test_clear_forgets_everything():
    clock, log = [0], []
    backlog = UpdateBacklog(1)
    backlog.queued(FakeEvent(clock, 5, log))
    backlog.clear()
    backlog.admit()
    assert log == [] and len(backlog) == 0


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_chunks_ahead_count_towards_the_limit(ahead):
    """Chunks handed to the worker thread, whose events are yet to come, take room in the backlog."""
    clock, log = [0], []
    backlog = UpdateBacklog(4)
    for k in range(1, 5):
        backlog.queued(FakeEvent(clock, k, log))
    backlog.admit(ahead)
    assert len(backlog) + ahead < 4
    assert log == list(range(1, 2 + ahead))  # the oldest first, as many as the room needs


@pytest.mark.parametrize("ahead", [-1, 4, 5])
def test_ahead_out_of_range_is_refused_and_nothing_waits(ahead):
    clock, log = [0], []
    backlog = UpdateBacklog(4)
    backlog.queued(FakeEvent(clock, 1, log))
    with pytest.raises(ValueError, match="ahead"):
        backlog.admit(ahead)
    assert log == [] and len(backlog) == 1


def test_worker_wait_below_returns_once_enough_calls_finished():
    """Three calls, each held by a gate of its own; the first two let go: wait_below(2) returns
    once fewer than 2 have yet to finish, the third still held."""
    import threading

    from pagedopt.optim.update_worker import UpdateWorker

    gates = [threading.Event() for _ in range(3)]
    ran = []
    worker = UpdateWorker()
    try:
        for i in range(3):
            worker.submit(lambda i=i: (gates[i].wait(5), ran.append(i)))
        assert worker.wait_below(4) == 3  # already below: no wait
        timers = [threading.Timer(0.05 * (i + 1), gates[i].set) for i in range(2)]
        for t in timers:
            t.start()
        assert worker.wait_below(2) == 1
        assert ran == [0, 1]
        gates[2].set()
        assert worker.wait_below(1) == 0 and ran == [0, 1, 2]
    finally:
        for g in gates:
            g.set()
        worker.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_bad_limit_is_refused(bad):
    with pytest.raises(ValueError, match="limit"):
        UpdateBacklog(bad)


@pytest.mark.cuda
@pytest.mark.parametrize("update_thread", [False, True], ids=["in_hooks", "update_thread"])
def test_slow_updates_do_not_pile_up_gradients(monkeypatch, update_thread):
    """Updates slowed on the GPU (a sleep of about 8 ms queued before each chunk's update, as the host
    link slows streamed states) against a fast backward. Unbounded, backward runs ahead and nearly
    every gradient waits for its update; with a backlog of 2 chunks the peak is lower by at least
    half the gradients' bytes (the model: 24 layers of 4 MiB of fp32 gradients, chunks of 1 MiB of
    states, half a layer, so at most about 3 layers' gradients are held), and the parameters are bit
    for bit the same.

    The peak is of *reserved* memory, from an emptied cache: a released gradient still read by a
    queued update counts as freed in ``memory_allocated`` at once (the caching allocator subtracts
    it when the tensor dies), but its block is not reused until the update stream passes the event
    recorded for it, so later gradients take new segments: that is the memory the backlog bounds.
    Segments of 4 MiB blocks come 20 MiB at a time, so each peak is known to within 20 MiB; the gap
    allowed (half the gradients, 48 MiB, against about 21 layers' 84 MiB expected) leaves room for
    two such roundings. How far an unbounded backward runs ahead is the ratio of an update's time to
    the host time of backward between two chunks (its autograd work and the hooks'): with a 2 ms
    sleep the gap on an H100 was 40 MiB in one run and over 48 MiB in another, too near the allowed
    gap; at 8 ms a chunk the 48 chunks' updates take about 0.4 s against a backward of a few tens of
    ms, and nearly every gradient is still held when backward ends."""
    from pagedopt import paging
    from pagedopt.optim import backward_updates

    reason = paging.paging_unavailable_reason("cuda:0")
    if reason is not None:
        pytest.skip(reason)
    real = backward_updates.update_part

    def slow_update_part(*args, **kwargs):
        torch.cuda._sleep(15_000_000)  # about 8 ms at 1.7-2 GHz, on the update stream
        return real(*args, **kwargs)

    monkeypatch.setattr(backward_updates, "update_part", slow_update_part)
    monkeypatch.setattr(backward_updates.BackwardUpdates, "update_thread", update_thread)
    peaks, params = {}, {}
    for limit in (2, 1 << 20):
        monkeypatch.setattr(backward_updates.BackwardUpdates, "backlog_chunks", limit)
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)]).cuda()
        opt = pagedopt.PagedAdamW8bit(m.parameters(), lr=1e-3)
        opt.set_pager(residency="host", device_buffer=4 << 20, update_in_backward=True)
        x = torch.randn(16, 1024, device="cuda")
        for _ in range(3):  # the first step without a schedule, then two with one
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_reserved()
            m(x).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_reserved() - base
            opt.zero_grad(set_to_none=True)
        peaks[limit] = peak
        params[limit] = [p.detach().clone() for p in m.parameters()]
    grad_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert peaks[1 << 20] - peaks[2] >= grad_bytes / 2, (peaks, grad_bytes)
    for a, b in zip(params[2], params[1 << 20]):
        assert torch.equal(a, b)
