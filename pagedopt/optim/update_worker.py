"""A thread that runs queued calls in order: :class:`UpdateWorker`.

Updates during backward (backward_updates.py) cost host time in Python: the copies' calls, the
update's list building and op calls, about 0.3-0.7 ms per chunk. Run in the gradient hooks, that
time is taken from the autograd engine's thread, which then launches backward's own kernels late.
With a worker, a hook only checks the chunk's gradients, marks them ready on the GPU (an event) and
queues the chunk; the worker thread does the rest while backward goes on (torch's ops release the
GIL while they run, so the two threads share it in short turns).

The worker knows nothing of optimizers: it runs ``fn(*args)`` under ``torch.no_grad()``, in the
order submitted. The first error is kept, the calls after it are skipped, and ``join()`` raises it.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Callable, Optional

import torch


class UpdateWorker:
    """Runs submitted calls in order on a daemon thread of its own (started at the first call)."""

    def __init__(self, name: str = "pagedopt-update-worker"):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        weakref.finalize(self, self._queue.put, None)  # dropped: the thread ends after the calls queued

    def submit(self, fn: Callable, *args) -> None:
        """Queue ``fn(*args)``; it runs after every call submitted before it."""
        if self._closed:
            raise RuntimeError(f"{self.name}: submit() after close()")
        with self._done:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._queue), name=self.name,
                                            daemon=True)
            _RUNNING[self._thread] = self._queue
            self._thread.start()
        self._queue.put((fn, args))

    def _run_one(self, fn: Callable, args: tuple) -> None:
        try:
            if self._error is None:  # after an error, the rest of the queue is skipped
                with torch.no_grad():
                    fn(*args)
        except BaseException as exc:  # noqa: BLE001 - kept and raised by join()
            self._error = exc
        finally:
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def join(self) -> None:
        """Wait until every submitted call has run; raise the first error one of them raised
        (then forgotten: the worker takes new calls)."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_below(self, n: int) -> int:
        """Wait until fewer than ``n`` submitted calls have yet to finish (run, or skipped after an
        error); returns how many have yet to."""
        with self._done:
            self._done.wait_for(lambda: self._pending < n)
            return self._pending

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def close(self) -> None:
        """Stop the thread after the calls already submitted (it holds no reference to us)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)


# The worker threads still running, and their queues (a thread removes itself when it ends). At exit
# they are told to stop and joined while the interpreter still runs: a daemon thread that wakes up
# once finalization has begun is ended by the interpreter in the middle of whatever C++ frames it is
# in, and the process aborts ("terminate called without an active exception").
_RUNNING: dict = {}
EXIT_JOIN_SECONDS = 10.0


@atexit.register
def _stop_all() -> None:
    for thread, q in list(_RUNNING.items()):
        q.put(None)
        thread.join(EXIT_JOIN_SECONDS)


def _serve(ref: "weakref.ref[UpdateWorker]", q: queue.SimpleQueue) -> None:
    try:
        while True:
            item = q.get()
            if item is None:
                return
            worker = ref()
            if worker is None:
                return
            worker._run_one(*item)
            del worker, item  # while idle, hold nothing the calls referred to (their optimizer may go)
    finally:
        _RUNNING.pop(threading.current_thread(), None)
