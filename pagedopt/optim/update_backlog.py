"""How far updates during backward may fall behind backward: :class:`UpdateBacklog`.

Updates during backward release each gradient once its update is queued (``p.grad = None``), but
the memory of a released gradient goes back to the caching allocator only once the update stream
has passed the update that reads it. When the updates are slower than backward (states streamed
from the host, so that the host link rather than the GPU bounds them: a 13B-parameter model's 8-bit
states take about 0.5 s each way, its backward about 0.15 s), backward runs ahead, and every
gradient of the model waits for its update: the peak of a step without updates in backward. The
only bound was the depth of the GPU's launch queues.

So before a chunk is queued the hook admits it: with ``limit`` chunks queued and not yet done on
the GPU, the host waits for the oldest. Backward's kernels already queued go on meanwhile, and the
update stream still has ``limit - 1`` chunks before it, so neither the link nor the GPU runs dry;
the gradients held are at most about ``limit`` chunks' worth. With the updates on a worker thread
(``BackwardUpdates.update_thread``), the chunks handed to it and not yet run hold their gradients
too: the hook first waits until fewer than ``limit`` are, and counts them (``admit(ahead)``).

Knows nothing of optimizers: it holds the events recorded after each chunk's update.
"""
from __future__ import annotations

import collections


class UpdateBacklog:
    """At most ``limit`` chunk updates queued and not yet done (see the module)."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"UpdateBacklog: limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self._queued: collections.deque = collections.deque()  # events, oldest first
        self.waits = 0  # how many times admit() made the host wait for the GPU

    def __len__(self) -> int:
        return len(self._queued)

    def admit(self, ahead: int = 0) -> None:
        """Before queuing a chunk: forget the chunks done; with ``limit`` still queued (counting
        ``ahead`` more whose events are yet to come: chunks handed to a worker thread, fewer than
        ``limit``), wait for the oldest."""
        if not 0 <= ahead < self.limit:
            raise ValueError(f"UpdateBacklog.admit: ahead must be in [0, {self.limit}), got {ahead!r}")
        queued = self._queued
        while queued and queued[0].query():
            queued.popleft()
        while len(queued) + ahead >= self.limit:
            self.waits += 1
            queued.popleft().synchronize()

    def queued(self, event) -> None:
        """A chunk's update was queued; ``event`` was recorded after it on its stream."""
        self._queued.append(event)

    def clear(self) -> None:
        """A new step: the last one's updates are all waited for (step() makes the caller wait)."""
        self._queued.clear()
