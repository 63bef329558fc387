"""Residency: where a bucket's states are while it is updated, behind one small protocol. For
each bucket, ``chunks(pager, keys, bucket, params, grads, contiguous)`` yields the chunks to update
in order, each with the state lists to update it with (``Chunk.lists``, named by key):

* resident (no pager, or every paged state on the GPU): the whole bucket at once;
* staged (a PageManager whose states are not all resident, e.g. under a device budget): chunks of
  about ``CHUNK_BYTES`` of state that the pager pages in ahead of their update;
* streamed (a pager with ``streams_states``, HostResidentPager): chunks whose state lists hold
  device views that the pager copies in before and back after each chunk's update. A hybrid pager
  (``residency="auto"`` or a ``device_budget``) keeps some states on the device: those are handed
  out as they are, first, in one chunk, while the copies in of the others start.

Non-contiguous parameters go through contiguous copies that are written back (``write_back``).
The pagers know nothing of optimizers: they see lists of tensors.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..paging import aligned_bytes
from .state_format import format_of

# Paged steps are split into chunks of about this many state bytes, so that paging in the
# next chunk overlaps the update of the current one.
CHUNK_BYTES = 64 << 20


class Chunk(NamedTuple):
    params: list          # the parameters (or local shards) updated
    work_params: list     # the same, or their contiguous copies (written back after the update)
    work_grads: list
    lists: dict           # key -> the chunk's state tensors (device views of streamed ones)
    index: Optional[list] = None    # each one's position in its bucket (None: the bucket's, in order)
    offsets: Optional[list] = None  # each one's first element in its whole parameter (None: all 0)


def contiguous_views(params: list[torch.Tensor], grads: list[torch.Tensor]):
    """Kernels need contiguous tensors; a non-contiguous parameter is updated through a
    contiguous copy that is written back afterwards (write_back)."""
    work_params = [p if p.is_contiguous() else p.contiguous() for p in params]
    work_grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    return work_params, work_grads


def write_back(params: list[torch.Tensor], work_params: list[torch.Tensor]) -> None:
    for p, w in zip(params, work_params):
        if w is not p:
            p.copy_(w)


def all_resident(pager) -> bool:
    """Whether every state is on its device now (no pager, or a pager that says so)."""
    return pager is None or pager.all_resident()


def streams_states(pager) -> bool:
    """Whether the pager keeps states on the host and streams them through a device buffer."""
    return getattr(pager, "streams_states", False)


def streams_now(pager) -> bool:
    """Whether a step streams states now: a streaming pager that holds some state on the host
    (a hybrid one whose budget took every state streams nothing, and steps as if resident)."""
    return streams_states(pager) and not pager.all_resident()


def make_chunk(params, grads, lists: dict, contiguous: bool, index=None, offsets=None) -> Chunk:
    if contiguous:
        return Chunk(params, params, grads, lists, index, offsets)
    work_params, work_grads = contiguous_views(params, grads)
    return Chunk(params, work_params, work_grads, lists, index, offsets)


# Pieces of a cut parameter start at multiples of this many elements: whole blocks of 8-bit (256
# elements) and 4-bit states (128 elements, 64 bytes), and whole vectors of torch's fused 32-bit CPU kernel (see kernels.FP32_COPY_ALIGN)
CUT_ALIGN = 1024


class Piece:
    """What a chunk updates of one parameter (position ``j`` in its bucket): all of it
    (``start`` None) or the flat elements [start, end), whole blocks; ``host``: the host state
    tensors (or their flat ranges) that the pager moves for it."""

    __slots__ = ("j", "start", "end", "host", "by_key", "nbytes")

    def __init__(self, j: int, start, end, by_key: dict, stays=None):
        self.j, self.start, self.end, self.by_key = j, start, end, by_key
        self.host = list(by_key.values())
        self.nbytes = sum(aligned_bytes(t.numel() * t.element_size()) for t in self.host
                          if stays is None or not stays(t))


def pieces(j: int, p: torch.Tensor, state: dict, keys: tuple, limit: int, cuttable: bool, stays=None) -> list:
    """``p``'s state in pieces of at most ``limit`` bytes of whole blocks (one piece when it fits,
    or cannot be cut: stacked moments, a non-contiguous parameter). ``stays(t)``: whether the
    pager keeps state tensor ``t`` on the device (it then counts no bytes)."""
    host = {k: state[k] for k in keys if k in state}
    whole = Piece(j, None, None, host, stays)
    n = p.numel()
    if not cuttable or whole.nbytes <= limit or not p.is_contiguous():
        return [whole]
    fmt = format_of(state, "qmap1")
    per_element = sum(t.numel() * t.element_size() for k, t in host.items() if k.startswith("state")) / max(n, 1)
    step = max(int(limit // max(per_element, 1e-9)) // CUT_ALIGN * CUT_ALIGN, CUT_ALIGN)
    out = []
    for a in range(0, n, step):
        b = min(a + step, n)
        by_key = {}
        for k, t in host.items():
            by_key[k] = t.view(-1)[fmt.absmax_range(a, b) if k.startswith("absmax") else fmt.code_range(a, b)]
        out.append(Piece(j, a, b, by_key, stays))
    return out


def cuttable(spec) -> bool:
    """Whether a parameter's states may be cut into pieces of whole blocks: not stacked moments
    (AdEMAMix's state1), nor an update scaled by the whole tensor's norm (LARS, LAMB)."""
    return all(s.moments == 1 for s in spec.states) and not spec.norm_scaled


def _state_bytes(state: dict, keys) -> int:
    return sum(state[k].numel() * state[k].element_size() for k in keys if k in state)


def chunks(pager, keys, bucket, params: list[torch.Tensor], grads: list[torch.Tensor], contiguous: bool,
           cut: bool = False, chunk_bytes: int = CHUNK_BYTES):
    """The bucket's chunks in the order they are to be updated (see the module). ``keys``: the
    state keys that take memory (what the pager stages); ``params``/``grads``: the bucket's
    (local shards of DTensor parameters); ``cut``: streamed states larger than a chunk may be cut
    into pieces of whole blocks (``cuttable``)."""
    from ..paging import split_by_bytes

    states, lists = bucket.states, bucket.lists
    if all_resident(pager):
        yield make_chunk(params, grads, lists, contiguous)
        return
    if streams_states(pager):
        yield from _streamed(pager, keys, states, lists, params, grads, contiguous, cut, chunk_bytes)
        return
    positions = split_by_bytes(list(range(len(states))), lambda j: _state_bytes(states[j], keys), chunk_bytes)
    for i in pager.stage([[states[j][k] for j in chunk for k in keys if k in states[j]] for chunk in positions]):
        chunk = positions[i]
        yield make_chunk([params[j] for j in chunk], [grads[j] for j in chunk],
                         {k: [lst[j] for j in chunk] for k, lst in lists.items()}, contiguous, chunk)


def _streamed(pager, keys, states: list[dict], lists: dict, params, grads, contiguous: bool, cut: bool,
              chunk_bytes: int):
    """Chunks of host-resident states streamed through the pager's device buffer: each chunk's
    state tensors are swapped for the device views that ``pager.stream`` hands out (their contents
    are copied back after the chunk's update, when the caller asks for the next chunk). A
    parameter whose states exceed a chunk goes in pieces of whole blocks (flat ranges of the
    parameter, its gradient and its states), so that no state is too large for the buffer; the
    parameters are worked on through contiguous copies when some are not contiguous, written back
    after the last chunk."""
    from ..paging import split_by_bytes

    work_params, work_grads = (params, grads) if contiguous else contiguous_views(params, grads)
    chunk_bytes = min(chunk_bytes, max(pager.device_buffer_bytes // 3, 1))
    items = [piece for j in range(len(states))
             for piece in pieces(j, work_params[j], states[j], keys, chunk_bytes, cut, pager.holds_resident)]
    # states kept on the device (a hybrid pager's) first, in one chunk, updated while the first
    # copies in of the others run
    stay = [piece for piece in items if piece.nbytes == 0]
    positions = ([stay] if stay else []) + split_by_bytes([piece for piece in items if piece.nbytes],
                                                          lambda piece: piece.nbytes, chunk_bytes)
    groups = [[t for piece in chunk for t in piece.host] for chunk in positions]
    for i, views in pager.stream(params[0].device, groups):
        view_of = {id(t): v for t, v in zip(groups[i], views)}
        chunk = positions[i]
        chunk_params = [_flat(work_params[pc.j], pc) for pc in chunk]
        chunk_grads = [_flat(work_grads[pc.j], pc) for pc in chunk]
        chunk_lists = {k: [view_of[id(pc.by_key[k])] if k in pc.by_key else lst[pc.j] for pc in chunk]
                       for k, lst in lists.items()}
        yield Chunk(chunk_params, chunk_params, chunk_grads, chunk_lists, [pc.j for pc in chunk],
                    [pc.start or 0 for pc in chunk])
    if work_params is not params:
        write_back(params, work_params)


def _flat(t: torch.Tensor, piece) -> torch.Tensor:
    """``t`` (contiguous), or the flat range of it that ``piece`` covers."""
    return t if piece.start is None else t.view(-1)[piece.start:piece.end]


# ------------------------------------------------------------------ passes (updates during backward)
class DirectPass:
    """A pass over groups of state tensors that stay where they are (no pager, or a PageManager):
    ``take(k)`` hands out group k's tensors themselves, after a PageManager whose states are not all
    on the GPU has paged them in (its ``stage``, which pages the next groups in ahead); ``give_back``
    has nothing to copy back. The same calls as a HostResidentPager's pass, which copies in and back."""

    def __init__(self, pager, groups: list):
        self.groups = groups
        self._staged = None if all_resident(pager) else iter(pager.stage(groups))

    def take(self, k: int) -> list:
        if self._staged is not None:
            for i in self._staged:
                if i >= k:
                    break
        return self.groups[k]

    def give_back(self, k: int) -> None:
        pass


def pass_chunk_bytes(pager, chunks_per_buffer: int, before_states: bool = False) -> int:
    """The state bytes of a chunk of updates during backward: a share of a streaming pager's
    device buffer (every chunk of it in flight), else CHUNK_BYTES. ``before_states``: in a step
    whose states may not be made yet, a pager that streams states is taken to stream them."""
    if streams_now(pager) or (before_states and streams_states(pager)):
        return max(pager.device_buffer_bytes // chunks_per_buffer, 1)
    return CHUNK_BYTES


def plan_pass(pager, groups: list):
    """Laid out once per schedule: a streaming pager's plan of the groups' copies, else the groups."""
    return pager.plan_pass(groups) if streams_now(pager) else groups


def open_pass(pager, device, planned, depth: int, trace=None):
    """One step's pass over the planned groups (see DirectPass and HostResidentPager.open_pass)."""
    if streams_now(pager) and not isinstance(planned, list):
        return pager.open_pass(device, planned, depth, trace=trace)
    return DirectPass(pager, planned)
