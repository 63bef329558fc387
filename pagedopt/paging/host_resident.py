"""Host-resident tensors streamed through a fixed device buffer: :class:`HostResidentPager`.

The tensors it makes live in page-locked host memory between steps. ``stream(device, groups)``
runs one pass over them: group i is copied into a region of the device buffer (host to device, on
a stream of its own), the caller's work on group i runs on the current stream, then the region is
copied back (device to host, on a third stream), so that the copy in of group i+1, the work on
group i and the copy back of group i-1 overlap. A region is reused only after its copy back has
finished (stream waits on events; the host never waits). The buffer is the only device memory it
ever holds: ``device_buffer_bytes`` per device, allocated at the first pass.

On a CPU device the same schedule runs with plain copies (no streams), so the logic is testable
anywhere. The pager knows nothing of what the tensors hold: it moves them and gives back device
views. A pass itself is :class:`.stream_pass.StreamPass`.

Part of :mod:`pagedopt.paging`, which re-exports :class:`HostResidentPager` and the constants here.
"""
from __future__ import annotations

import math
import weakref
from typing import Iterable, Iterator, Optional, Sequence

import torch

from .backends import HostBackend, TimedCudaBackend
from .managed import DeviceLike, as_device, paging_built
from .resident_set import ResidentSet
from .stats import PagingStats
from .stream_pass import PassPlan, StreamPass, Traffic

# Regions in the device buffer start at multiples of this many bytes (the kernels' widest vector
# loads are 16 bytes; 256 also keeps every view as aligned as a fresh allocation).
REGION_ALIGN = 256
DEFAULT_DEVICE_BUFFER = 256 << 20
# Host tensors of at most a quarter of this are carved one after the other from page-locked slabs of
# at most this size (fewer, larger copies; and one cudaHostAlloc per slab instead of per tensor).
# The first slab is small and each new one twice the last, so that a pager of few small tensors (a
# tiny model in a sweep of many) pins about what they need, not a whole 64 MiB slab
HOST_SLAB_BYTES = 64 << 20
FIRST_HOST_SLAB_BYTES = 1 << 20


def aligned_bytes(n: int) -> int:
    """``n`` bytes rounded up to a multiple of REGION_ALIGN (where regions of the buffer start)."""
    return (n + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN


class _Layout:
    """A group's place in a region: each tensor's offset (None for a tensor kept on its device,
    ``stays``), the region's size, and its copies: runs of (a tensor of the run, its storage's
    first and end byte, offset in the region); the device views of a region, made once per place
    in a buffer (``views``); ``moved``: the bytes that cross the link each way."""
    __slots__ = ("offsets", "size", "runs", "likes", "stays", "moved", "_views", "_pairs", "_lists")

    def __init__(self, offsets: list, size: int, runs: list, likes: list, stays: Optional[dict] = None):
        self.offsets, self.size, self.runs, self.likes = offsets, size, runs, likes
        self.stays = stays or {}  # position -> a tensor kept on its device, handed out as it is
        self.moved = sum(nbytes for j, (_, _, nbytes) in enumerate(likes) if j not in self.stays)
        self._views: dict = {}
        self._pairs: dict = {}
        self._lists: dict = {}

    def copy_pairs(self, buf: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device bytes, host bytes) of each run, for the region at ``start`` of ``buf``: the
        copies in and back, made once per place like the views."""
        key = (buf.data_ptr(), start)
        pairs = self._pairs.get(key)
        if pairs is None:
            pairs = self._pairs[key] = [(buf[start + off:start + off + last - first], self.host_bytes(t, first, last))
                                        for t, first, last, off in self.runs]
        return pairs

    def copy_lists(self, buf: torch.Tensor, start: int) -> tuple[list, list]:
        """``copy_pairs`` as two lists (device bytes, host bytes), for one ``copy_bytes_`` call."""
        key = (buf.data_ptr(), start)
        lists = self._lists.get(key)
        if lists is None:
            pairs = self.copy_pairs(buf, start)
            lists = self._lists[key] = ([d for d, _ in pairs], [h for _, h in pairs])
        return lists

    def views(self, buf: torch.Tensor, start: int) -> list[torch.Tensor]:
        """The group's tensors as views of ``buf`` in the region at ``start`` (a pass that runs
        step after step puts a group at the same place: the views are made the first time only)."""
        key = (buf.data_ptr(), start)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [self.stays[j] if off is None else
                                        buf[start + off:start + off + nbytes].view(dtype).view(shape)
                                        for j, (off, (dtype, shape, nbytes)) in enumerate(zip(self.offsets, self.likes))]
        return views

    @staticmethod
    def host_bytes(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The bytes [start, end) of ``t``'s storage, as a flat uint8 tensor."""
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), start, (end - start,))


class HostResidentPager:
    """Tensors in page-locked host memory that visit the GPU only inside ``stream()``.

    Args:
        device_buffer_bytes: the device buffer per device that every pass streams through
            (default 256 MiB): the most device memory the pager holds at any time. A group must
            fit in it; groups of at most a third of it let three copies overlap.
        prefetch_depth: how many groups ahead of the current one are copied in (as far as the
            buffer has room).
        resident_bytes: how many bytes of the tensors ``zeros()`` makes stay on their device
            instead (per device): None (none, the default), an int, or ``"auto"`` (what the device
            has free when its first tensor is made, less the peak since and a margin:
            :func:`.resident_set.auto_budget`). Those tensors are ordinary device memory, never
            moved: a pass hands them out as they are, so only the others cross the host link.

    ``zeros()`` makes the tensors (CPU tensors, page-locked where CUDA is available);
    ``stream()`` is the pass; ``synchronize()`` waits for the last pass's copies back (after it,
    the host tensors hold the pass's results and may be read on the host); ``stats()`` reports.
    """

    streams_states = True  # its users hand their tensors to stream() instead of stage()

    def __init__(self, device_buffer_bytes: int = DEFAULT_DEVICE_BUFFER, *, prefetch_depth: int = 2,
                 resident_bytes=None):
        if not isinstance(device_buffer_bytes, int) or isinstance(device_buffer_bytes, bool) \
                or device_buffer_bytes < REGION_ALIGN:
            raise ValueError(f"device_buffer_bytes must be an int >= {REGION_ALIGN}, got {device_buffer_bytes!r}")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        self.device_buffer_bytes = device_buffer_bytes
        self.prefetch_depth = prefetch_depth
        self._resident = ResidentSet(resident_bytes, reserve=device_buffer_bytes)
        self.host_slab_bytes = HOST_SLAB_BYTES
        self._slab = None  # the page-locked slab small tensors are carved from, and how much of it is used
        self._slab_used = 0
        self._tensors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> host tensor
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._streams: dict[torch.device, tuple] = {}  # device -> (copy-in stream, copy-back stream)
        self._step = 0
        self._traffic = Traffic()  # what the passes moved this step, when, and the last copy back per device

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        """Copies keep the configuration only (like PageManager)."""
        return {"device_buffer_bytes": self.device_buffer_bytes, "prefetch_depth": self.prefetch_depth,
                "resident_bytes": self.resident_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["device_buffer_bytes"], prefetch_depth=state["prefetch_depth"],
                      resident_bytes=state.get("resident_bytes"))

    def __repr__(self) -> str:
        resident = "" if self.resident_bytes is None else f"resident_bytes={self.resident_bytes!r}, "
        return (f"HostResidentPager(device_buffer_bytes={self.device_buffer_bytes}, {resident}"
                f"tensors={len(self._tensors)}, host_bytes={self._host_bytes()})")

    @property
    def resident_bytes(self):
        """The resident budget it was made with (None, an int or "auto")."""
        return self._resident.budget

    def resident_limit(self, device: DeviceLike) -> Optional[int]:
        """The resident budget in bytes on ``device`` (for "auto", measured on first use; None:
        unbounded, or no tensor stays resident when ``resident_bytes`` is None)."""
        return None if self._resident.budget is None else self._resident.limit(as_device(device))

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def _pinned_available() -> bool:
        return paging_built() and torch.cuda.is_available()

    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
        """A zero-filled host tensor for work on ``device`` (page-locked when CUDA is available)."""
        if isinstance(shape, int):
            shape = (shape,)
        shape = [int(s) for s in shape]
        device = as_device(device)  # a bad device name raises here, as torch.zeros would
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        if self._resident.place(nbytes, device):  # stays on its device, never moved
            t = torch.zeros(shape, dtype=dtype, device=device)
            self._resident.add(t, nbytes)
            return t
        if nbytes > self.host_slab_bytes // 4:
            t = self._host_bytes_block(nbytes).view(dtype).view(shape)
        else:  # carved from a slab: tensors made one after the other lie next to each other (one copy per run)
            if self._slab is None or self._slab_used + nbytes > self._slab.nbytes():
                size = FIRST_HOST_SLAB_BYTES if self._slab is None else 2 * self._slab.nbytes()
                size = min(self.host_slab_bytes, max(size, aligned_bytes(nbytes)))
                self._slab = self._host_bytes_block(size).untyped_storage()
                self._slab_used = 0
            offset = self._slab_used
            t = torch.empty(0, dtype=dtype).set_(self._slab, offset // dtype.itemsize, shape)
            self._slab_used = aligned_bytes(offset + nbytes)
        t.zero_()
        self._tensors[id(t)] = t
        return t

    def _host_bytes_block(self, nbytes: int) -> torch.Tensor:
        if self._pinned_available():
            return torch.ops.pagedopt.pinned_empty([nbytes], torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self._tensors.values()))

    def tensors(self) -> list[torch.Tensor]:
        """The host tensors it made (those it keeps on a device: ``resident_tensors()``)."""
        return list(self._tensors.values())

    def grow_device_buffer(self, nbytes: int) -> bool:
        """Make the device buffer at least ``nbytes`` (for a group that cannot be split), while no
        pass has allocated it yet; False (nothing changed) once it exists."""
        if self._buffers:
            return False
        self.device_buffer_bytes = max(self.device_buffer_bytes, int(nbytes))
        self._resident.reserve = self.device_buffer_bytes
        return True

    def resident_tensors(self) -> list[torch.Tensor]:
        return self._resident.tensors()

    def holds_resident(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) is one that this pager keeps on its device."""
        return self._resident.budget is not None and self._resident.holds(t)

    # ------------------------------------------------------------------ the calls of a PageManager's users
    def begin_step(self) -> None:
        self._step += 1
        self._traffic.new_step()

    def all_resident(self) -> bool:
        """Whether every tensor it made stayed on its device (then nothing is streamed, and its
        users take their resident path); never while it holds a host tensor."""
        return len(self._tensors) == 0

    def page_out(self, tensors=None, **kwargs) -> int:
        """Nothing to do: the tensors are on the host whenever no pass runs."""
        return 0

    def prefetch(self, tensors=None, device=None, **kwargs) -> int:
        """Nothing to do: a pass copies in what it needs."""
        return 0

    def settle(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> int:
        """Make the host tensors readable: wait for the last pass's copies back."""
        self.synchronize()
        return 0

    def synchronize(self) -> None:
        for ev in list(self._traffic.last_copy_back.values()):
            ev.synchronize()

    def stats(self) -> PagingStats:
        host = self._host_bytes()
        traffic = self._traffic
        resident = self._resident
        devices = {t.device for t in resident.tensors()}
        limits = [resident.limit(d) for d in devices] if resident.budget is not None else []
        return PagingStats(resident_bytes=resident.nbytes(), host_bytes=host,
                           budget_bytes=(resident.budget if isinstance(resident.budget, int) else
                                         max(limits) if limits and None not in limits else None),
                           bytes_moved_last_step=traffic.moved_in + traffic.moved_out,
                           page_in_bytes_last_step=traffic.moved_in, page_out_bytes_last_step=traffic.moved_out,
                           paged_tensors=len(self._tensors) + len(resident.tensors()), step=self._step,
                           device_buffer_bytes=sum(b.numel() for b in self._buffers.values()),
                           transfer_ms_last_step=self._transfer_ms())

    def _transfer_ms(self) -> Optional[float]:
        timing = self._traffic.timing
        if timing is None or timing[1] is None:
            return None
        first, last = timing
        if not (first.query() and last.query()):
            return None
        return float(first.elapsed_time(last))

    # ------------------------------------------------------------------ the pass
    def _backend(self, device: torch.device):
        return TimedCudaBackend if device.type == "cuda" else HostBackend

    def reserve(self, device: DeviceLike) -> None:
        """Allocate ``device``'s buffer and copy streams now (a pass would at its start), so that
        a caller can meet a lack of memory before it changes anything."""
        device = as_device(device)
        self._buffer(device)
        self._streams_of(device, self._backend(device))

    def _buffer(self, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = torch.empty(self.device_buffer_bytes, dtype=torch.uint8, device=device)
        return buf

    def _streams_of(self, device: torch.device, be) -> tuple:
        """(copy-in, copy-back) streams of ``device``; the buffer is freed only after their work."""
        if device not in self._streams:
            streams = (be.new_stream(device.index), be.new_stream(device.index))
            if device.type == "cuda":
                for s in streams:
                    self._buffers[device].record_stream(s)
            self._streams[device] = streams
        return self._streams[device]

    def _layout(self, group: list[torch.Tensor], where: str) -> "_Layout":
        """Where each tensor of ``group`` goes in its region, and the copies that move the group:
        tensors that lie next to each other in one host storage (as the tensors of ``zeros()``
        do, carved one after the other from page-locked slabs) keep their relative places in the
        region, so that each such run moves in one copy instead of one per tensor. Tensors it keeps
        on their device (``holds_resident``) take no room and are handed out as they are."""
        for t in group:
            if self.holds_resident(t):
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{where}: HostResidentPager streams contiguous host tensors, got a "
                                 f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.device} tensor")
        spans = []  # (storage address, first byte, end byte, position in the group)
        stays = []  # positions of the tensors handed out as they are
        for j, t in enumerate(group):
            if self.holds_resident(t):
                stays.append(j)
                continue
            start = t.storage_offset() * t.element_size()
            spans.append((t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size(), j))
        spans.sort()
        offsets: list = [None] * len(group)
        runs = []  # (position of the run's first tensor, first byte, end byte, offset in the region)
        size = 0
        previous = None
        for addr, start, end, j in spans:
            last = runs[-1] if runs else None
            # the next tensor begins where the last one ends, or (after a tensor of our own, carved
            # into an aligned slot of its slab) at the next slot: the bytes between are padding
            padding = previous is not None and self._tensors.get(id(previous)) is previous
            if (last is not None and addr == last[4]
                    and (start == last[2] or padding and start == aligned_bytes(last[2]))):
                offsets[j] = last[3] + start - last[1]
                runs[-1] = (last[0], last[1], max(last[2], end), last[3], addr)
            else:
                offsets[j] = size
                runs.append((j, start, end, size, addr))
            size = aligned_bytes(runs[-1][3] + runs[-1][2] - runs[-1][1])
            previous = group[j]
        if size > self.device_buffer_bytes:
            raise ValueError(f"{where} needs {size} bytes of device buffer, more than device_buffer_bytes="
                             f"{self.device_buffer_bytes}; raise the device buffer or split the group")
        likes = [(t.dtype, t.shape, t.numel() * t.element_size()) for t in group]
        return _Layout(offsets, size, [(group[j], start, end, off) for j, start, end, off, _ in runs], likes,
                       {j: group[j] for j in stays})

    def plan_pass(self, groups: Sequence[Sequence[torch.Tensor]]) -> PassPlan:
        """Groups checked and laid out once, for passes that repeat step after step
        (``open_pass(device, plan)``): nothing is laid out again, and each group's device views
        are made once. Valid while the groups' host tensors live."""
        groups = [list(g) for g in groups]
        return PassPlan(groups, [self._layout(g, f"stream group {i}") for i, g in enumerate(groups)])

    def stream(self, device: DeviceLike, groups: Sequence[Sequence[torch.Tensor]]) -> Iterator[tuple[int, list]]:
        """The pass: ``for i, views in pager.stream(device, groups): work on views`` (on the current
        stream). ``views[j]`` is a device tensor holding ``groups[i][j]``; whatever the work leaves
        in it is copied back into ``groups[i][j]`` after the work queued before the next iteration
        (or the end of the loop). Views are valid only until then. Every group is checked
        (host, contiguous, fits the buffer) before anything moves. Nothing is copied back for a
        group whose iteration raised, and none of the later groups is touched."""
        return self._pass(self.open_pass(device, groups))

    def open_pass(self, device: DeviceLike, groups, prefetch_depth: Optional[int] = None,
                  trace: Optional[list] = None) -> StreamPass:
        """A pass that the caller drives one group at a time (``stream()`` drives one in a loop):
        copies in of the first groups start now, ``take(i)`` hands out group i's device views and
        ``give_back(i)`` copies them back after the work queued so far, group after group in
        order, whenever the caller is ready (for example as gradients arrive during backward).
        ``groups``: lists of host tensors, checked like ``stream()``'s before anything moves, or a
        ``plan_pass()`` of them. ``prefetch_depth``: this pass's (default: the pager's).
        ``trace`` (CUDA): a list that gets (group, "in" or "back", start event, end event) for
        every copy, timing events on the copy streams (for profiling)."""
        device = as_device(device)
        plan = groups if isinstance(groups, PassPlan) else self.plan_pass(groups)
        depth = self.prefetch_depth if prefetch_depth is None else prefetch_depth
        be = self._backend(device)
        buf = self._buffer(device)
        streams = self._streams_of(device, be)  # after the buffer: it is freed only after their work
        return StreamPass(device, plan.groups, plan.layouts, depth, be, buf, streams, self._traffic,
                          trace if device.type == "cuda" else None)

    @staticmethod
    def _pass(p: StreamPass) -> Iterator[tuple[int, list]]:
        for i in range(len(p.groups)):
            views = p.take(i)
            yield i, views
            p.give_back(i)
