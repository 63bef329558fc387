"""One pass of a HostResidentPager over groups of its host tensors: :class:`StreamPass` (copy in,
hand out, copy back, group after group, in regions of the device buffer), :class:`PassPlan` (groups
laid out once for passes that repeat) and :class:`Traffic` (what a pager's passes moved, and when).

A pass knows nothing of the pager that opened it: it gets the device buffer, the streams, the
stream calls and the pager's :class:`Traffic` (:meth:`HostResidentPager.open_pass`).

Part of :mod:`pagedopt.paging`.
"""
from __future__ import annotations

from typing import Optional

import torch

_COPY_BYTES: list = []  # [the copy_bytes_ op, or None where this build has no kernel for it], once looked up


def _copy_bytes(dst: list, src: list) -> None:
    """dst[i] <- src[i] for a group's runs: one ``copy_bytes_`` call (csrc/copy_bytes.cpp), or one
    ``copy_`` per run with an extension built before it (GPU copies queued on the current stream
    either way)."""
    if not _COPY_BYTES:
        has = torch._C._dispatch_has_kernel_for_dispatch_key("pagedopt::copy_bytes_", "CompositeExplicitAutograd")
        _COPY_BYTES.append(torch.ops.pagedopt.copy_bytes_ if has else None)
    op = _COPY_BYTES[0]
    if op is not None:
        op(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


class Traffic:
    """What the passes of one pager moved, and when: bytes copied in and back since the step began
    (``moved_in``, ``moved_out``), the first and last copy events of the step's passes
    (``timing``: (first, last or None), None before the step's first pass) and, per device, the
    event after the last copy back issued there (``last_copy_back``: the next pass's copies in,
    and the pager's synchronize(), wait for it)."""
    __slots__ = ("moved_in", "moved_out", "timing", "last_copy_back")

    def __init__(self):
        self.moved_in = 0
        self.moved_out = 0
        self.timing: Optional[tuple] = None
        self.last_copy_back: dict = {}

    def new_step(self) -> None:
        self.moved_in = 0
        self.moved_out = 0
        self.timing = None


class _Region:
    __slots__ = ("start", "end", "offsets", "copied_back")

    def __init__(self, start: int, end: int, offsets: list[int]):
        self.start, self.end, self.offsets = start, end, offsets
        self.copied_back = None  # event after the copy back, once issued


class PassPlan:
    """Groups of host tensors and their layouts in a region (``HostResidentPager.plan_pass``)."""
    __slots__ = ("groups", "layouts")

    def __init__(self, groups: list, layouts: list):
        self.groups, self.layouts = groups, layouts


class StreamPass:
    """One pass of a HostResidentPager over groups of its host tensors (``open_pass``): group i is
    copied into a region of the device buffer (on the copy-in stream), handed to the caller by
    ``take(i)`` (the caller's current stream waits for the copy in; the host never waits), and
    copied back by ``give_back(i)`` after the work the caller's current stream has queued by then
    (on the copy-back stream). Groups are taken and given back in order, one at a time. Copies in
    run ahead of the group taken, up to the pager's ``prefetch_depth`` groups and as far as the
    buffer has room; a region is reused only after its copy back (an event the copy-in stream
    waits on). Dropping a pass part way is safe: later passes order their copies after its own.

    The pager hands it what it needs: ``backend`` (the stream calls of ``device``), ``buffer`` (the
    device buffer), ``streams`` (copy-in and copy-back streams) and ``traffic`` (its
    :class:`Traffic`, which the pass updates)."""

    def __init__(self, device: torch.device, groups: list, layouts: list, depth: int, backend, buffer: torch.Tensor,
                 streams: tuple, traffic: Traffic, trace: Optional[list] = None):
        self.device, self.groups, self.layouts, self.depth = device, groups, layouts, depth
        self._trace = trace
        be = self._be = backend
        self._buf = buffer
        self._copy_in, self._copy_back = streams
        self._traffic = traffic
        previous = traffic.last_copy_back.get(device)
        if previous is not None:
            self._copy_in.wait_event(previous)  # the last pass's results are on the host before they are read
        self.first_event = None
        if device.type == "cuda":
            self.first_event = be.new_timing_event()
            self.first_event.record(self._copy_in)
        n = len(groups)
        self._regions: list[Optional[_Region]] = [None] * n
        self._ready: list = [None] * n
        self._live: list[_Region] = []  # copied in, copy back not yet issued
        self._returning: list[_Region] = []  # copy back issued, maybe not finished
        self._head = 0
        self._issued = 0  # groups whose copy in was issued
        self.taken = 0  # groups handed out (the next take() is of this one)
        self._views = None
        self._issue(self.depth)

    def _place(self, size: int) -> Optional[tuple[int, int]]:
        start = self._head if self._head + size <= len(self._buf) else 0
        end = start + size
        if any(r.start < end and start < r.end for r in self._live):
            return None  # would overwrite a group still being worked on: wait for a later give_back
        return start, end

    def _copy_in_group(self, k: int) -> bool:
        layout = self.layouts[k]
        if layout.size == 0:  # every tensor of the group stays on the device: nothing to copy, no room taken
            self._regions[k], self._ready[k] = _Region(0, 0, layout.offsets), None
            return True
        spot = self._place(layout.size)
        if spot is None:
            return False
        start, end = spot
        region = _Region(start, end, layout.offsets)
        for r in list(self._returning):
            if r.start < end and start < r.end:
                self._copy_in.wait_event(r.copied_back)
                self._returning.remove(r)
        marks = self._marks(k, "in", self._copy_in)
        with self._be.use_stream(self._copy_in):
            devs, hosts = layout.copy_lists(self._buf, start)
            _copy_bytes(devs, hosts)
        if marks is not None:  # before the ready event: whoever waits for that has this one behind it
            marks.record(self._copy_in)
        ev = self._be.new_event()
        ev.record(self._copy_in)
        self._regions[k], self._ready[k] = region, ev
        self._live.append(region)
        self._head = end
        return True

    def _marks(self, k: int, what: str, stream):
        """With a trace: a timing event recorded on ``stream`` now, and one returned for the end."""
        if self._trace is None:
            return None
        start, end = self._be.new_timing_event(), self._be.new_timing_event()
        start.record(stream)
        self._trace.append((k, what, start, end))
        return end

    def _issue(self, ahead: int) -> None:
        """Copy in the groups up to ``taken + ahead``, as far as the buffer has room."""
        n = len(self.groups)
        while self._issued < n and self._issued <= self.taken + ahead and self._copy_in_group(self._issued):
            self._issued += 1

    def take(self, i: int) -> list[torch.Tensor]:
        """Group i's device views (i: the next group of the pass, after the last one given back);
        the current stream waits for their copy in."""
        if i != self.taken or self._views is not None:
            raise RuntimeError(f"StreamPass.take({i}): groups are taken in order, one at a time "
                               f"(next: {self.taken}{', after give_back' if self._views is not None else ''})")
        self._issue(self.depth)
        if self._issued <= i:  # cannot happen: with every earlier group returning, group i fits
            raise AssertionError(f"HostResidentPager: group {i} found no room in the device buffer")
        traffic = self._traffic
        if self.first_event is not None and traffic.timing is None:  # the step's first pass opens its transfer time
            traffic.timing = (self.first_event, None)
        if self._ready[i] is not None:
            self._be.current_stream(self.device.index).wait_event(self._ready[i])
        self._views = self.layouts[i].views(self._buf, self._regions[i].start)
        traffic.moved_in += self.layouts[i].moved
        return self._views

    def give_back(self, i: int) -> None:
        """Copy group i's views back to its host tensors after the work queued on the current stream."""
        if i != self.taken or self._views is None:
            raise RuntimeError(f"StreamPass.give_back({i}): group {i} is not the one taken")
        be, traffic = self._be, self._traffic
        region = self._regions[i]
        layout = self.layouts[i]
        if layout.size:  # a group with tensors on the host: they go back after the work queued so far
            done = be.new_event()
            done.record(be.current_stream(self.device.index))
            self._copy_back.wait_event(done)
            marks = self._marks(i, "back", self._copy_back)
            with be.use_stream(self._copy_back):
                devs, hosts = layout.copy_lists(self._buf, region.start)
                _copy_bytes(hosts, devs)
            traffic.moved_out += layout.moved
            last = region.copied_back = be.new_event()
            last.record(self._copy_back)
            if marks is not None:
                marks.record(self._copy_back)
            # the next pass (and settle) wait for it, even if this one stops here
            traffic.last_copy_back[self.device] = last
            self._live.remove(region)
            self._returning.append(region)
        if self.first_event is not None and i == len(self.groups) - 1:  # the pass's copies end here
            end_ev = be.new_timing_event()
            end_ev.record(self._copy_back)
            traffic.timing = (traffic.timing[0] if traffic.timing else self.first_event, end_ev)
        self._views = None
        self.taken += 1
        self._issue(self.depth)  # the next groups' copies in start now, not at the next take
