"""Page-locked host copies made ahead of their first page-out: :class:`PinAhead`.

A page-out through host copies (``PageManager(host_copies=True)``) needs one page-locked host
copy per managed storage. Allocating it (``cudaHostAlloc``) costs far more than the copy itself:
about 1.4 s for 2 GiB against 44 ms for the copy (bench/RESULTS.md, bench_paging
``copy_page_out_first``). So a manager asks for each storage's copy as soon as it tracks the
storage, and one worker thread allocates them in that order while the caller goes on (the
allocation releases the GIL). The first page-out then takes copies that are ready, and waits only
for those still being made.

At most ``PIN_AHEAD_SHARE`` of the host memory available when the first copy is asked for is
pinned ahead; storages beyond it get their copy at their first page-out, as without pinning
ahead. Part of :mod:`pagedopt.paging`; it knows storages by key and size, nothing of their users.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from concurrent.futures import Future
from typing import Optional

import torch

# the share of the host's available memory that host copies may take before any page-out
PIN_AHEAD_SHARE = 0.5


def available_host_bytes() -> int:
    """The host memory available now (``MemAvailable``, else the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class PinAhead:
    """Host copies of storages, allocated ahead on the process's pinning thread through ``cuda.pinned_empty``.

    ``request(key, nbytes, device)`` queues one (at most one per key, within the limit);
    ``take(key, nbytes)`` hands it over (waiting for it if it is still being made; None when none
    was asked for, its size differs, or it failed: the caller then allocates as before);
    ``drop(key)`` forgets it (its storage is gone). ``pending_bytes``: asked for and not yet taken
    or dropped. Called from one thread only; the worker touches only its queue and futures."""

    def __init__(self, cuda, share: float = PIN_AHEAD_SHARE):
        self.cuda = cuda
        self.share = share
        self.pending_bytes = 0
        self._pending: dict[int, tuple[int, Future]] = {}
        self._limit: Optional[int] = None

    def request(self, key: int, nbytes: int, device: int) -> bool:
        """Queue the host copy of storage ``key`` (``nbytes``, its managed memory on ``device``);
        False when one is queued already or it would pass the limit."""
        if key in self._pending or nbytes <= 0:
            return False
        if self._limit is None:
            self._limit = int(available_host_bytes() * self.share)
        if self.pending_bytes + nbytes > self._limit:
            return False
        fut: Future = Future()
        self._pending[key] = (nbytes, fut)
        self.pending_bytes += nbytes
        _work_queue().put((fut, self.cuda, nbytes, device))
        return True

    def take(self, key: int, nbytes: int) -> Optional[torch.Tensor]:
        """The host copy made ahead for storage ``key`` if it is ``nbytes`` long (waiting for it
        if need be), else None."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return None
        size, fut = entry
        self.pending_bytes -= size
        if size != nbytes:
            fut.cancel()
            return None
        try:
            return fut.result()
        except Exception:  # the caller allocates again and reports a failure itself
            return None

    def drop(self, key: int) -> None:
        """Forget storage ``key``'s copy (a queued one is never made; a made one is freed)."""
        entry = self._pending.pop(key, None)
        if entry is not None:
            self.pending_bytes -= entry[0]
            entry[1].cancel()

    def drop_all(self) -> None:
        for key in list(self._pending):
            self.drop(key)

    def wait(self) -> None:
        """Wait until every copy asked for so far is made (or has failed)."""
        for _, fut in list(self._pending.values()):
            try:
                fut.result()
            except Exception:
                pass


_QUEUE: Optional[queue.SimpleQueue] = None
_THREAD: Optional[threading.Thread] = None
_QUEUE_LOCK = threading.Lock()
_STOPPING = threading.Event()
# at exit, how long to wait for the allocation in flight (cudaHostAlloc: about 1.4 s for 2 GiB)
EXIT_WAIT_S = 60.0


def _work_queue() -> queue.SimpleQueue:
    """The queue of the process's one pinning thread (started at the first request)."""
    global _QUEUE, _THREAD
    with _QUEUE_LOCK:
        if _QUEUE is None:
            q = queue.SimpleQueue()
            _THREAD = threading.Thread(target=_pin_worker, args=(q,), name="pagedopt-pin-ahead", daemon=True)
            _THREAD.start()
            _QUEUE = q
        return _QUEUE


def _stop_at_exit() -> None:
    """At interpreter exit: copies still queued are not made (they are not worth the wait), and the
    one being made is waited for, so that no thread is inside the CUDA runtime while it shuts down."""
    _STOPPING.set()
    with _QUEUE_LOCK:
        q, t = _QUEUE, _THREAD
    if q is not None and t is not None and t.is_alive():
        q.put(None)
        t.join(EXIT_WAIT_S)


atexit.register(_stop_at_exit)


def _forget_queue_in_child() -> None:
    global _QUEUE, _THREAD
    _QUEUE = _THREAD = None  # a forked child has no pinning thread: it starts its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_queue_in_child)


def _pin_worker(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        fut, cuda, nbytes, device = item
        if _STOPPING.is_set():
            fut.cancel()
            continue
        if not fut.set_running_or_notify_cancel():
            continue  # dropped before its turn
        try:
            with cuda.use_device(device):
                fut.set_result(cuda.pinned_empty(nbytes))
        except BaseException as exc:  # handed to whoever takes it
            fut.set_exception(exc)
