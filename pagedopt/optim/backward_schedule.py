"""The schedule of updates during backward (backward_updates.py): the parameters of a step plan
cut into chunks in the order their gradients arrived, per device, each at most ``limit`` bytes of
state (a parameter larger than that is cut into pieces of whole blocks), and the progress of one
step's chunks (``Run``)."""
from __future__ import annotations

import torch

from ..paging import aligned_bytes
from ..quant import STATE_BLOCK_SIZE

# Pieces of a cut parameter start at multiples of this many elements: whole 256-element blocks of
# 8-bit states, and whole vectors of torch's fused 32-bit CPU kernel (see kernels.FP32_COPY_ALIGN)
CUT_ALIGN = 1024


class _Piece:
    """What a chunk updates of one parameter (position ``j`` in its bucket): all of it
    (``start`` None) or the flat elements [start, end), whole blocks; ``host``: the host state
    tensors (or their flat ranges) that the pager moves for it."""

    __slots__ = ("j", "start", "end", "host", "by_key", "nbytes")

    def __init__(self, j: int, start, end, by_key: dict):
        self.j, self.start, self.end, self.by_key = j, start, end, by_key
        self.host = list(by_key.values())
        self.nbytes = sum(aligned_bytes(t.numel() * t.element_size()) for t in self.host)


def _pieces(j: int, p: torch.Tensor, state: dict, keys: tuple, limit: int, cuttable: bool) -> list:
    """``p``'s state in pieces of at most ``limit`` bytes of whole blocks (one piece when it fits,
    or cannot be cut: stacked moments, a non-contiguous parameter)."""
    host = {k: state[k] for k in keys if k in state}
    whole = _Piece(j, None, None, host)
    n = p.numel()
    if not cuttable or whole.nbytes <= limit or not p.is_contiguous():
        return [whole]
    per_element = sum(t.element_size() for k, t in host.items() if k.startswith("state"))
    step = max(limit // max(per_element, 1) // CUT_ALIGN * CUT_ALIGN, CUT_ALIGN)
    out = []
    for a in range(0, n, step):
        b = min(a + step, n)
        by_key = {}
        for k, t in host.items():
            if k.startswith("absmax"):
                by_key[k] = t.view(-1)[a // STATE_BLOCK_SIZE:(b + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE]
            else:
                by_key[k] = t.view(-1)[a:b]
        out.append(_Piece(j, a, b, by_key))
    return out


class Run:
    """One device's chunks in one step: the pager pass that copies them in, and how far it got."""

    __slots__ = ("chunks", "pass_", "waiting", "next", "queued")

    def __init__(self, chunks: list, pass_):
        self.chunks = chunks            # [(parts, ids)]: parts [(bucket index, positions)], ids of the params
        self.pass_ = pass_
        self.waiting = [len(ids) for _, ids in chunks]  # gradients each chunk still waits for
        self.next = 0                   # the next chunk to update
        self.queued = 0                 # the next chunk to hand out (to the worker: it may be ahead of next)


def cut_into_chunks(spec, plan, arrived: list, position: dict, limit: int) -> dict:
    """device -> [(parts, ids)]: ``parts`` [(bucket index, [pieces])] (one fused call per bucket in
    a chunk), ``ids`` the ids of its parameters; in the order of ``arrived`` (ids of parameters
    whose gradients came through a hook), then the parameters of ``position`` (id -> (bucket
    index, position)) that did not (updated in step())."""
    order = [pid for pid in arrived if pid in position]
    seen = set(order)
    order += [pid for pid in position if pid not in seen]
    # a parameter whose states exceed a chunk is cut into pieces of whole blocks, each a chunk's
    # worth (updates are elementwise within 256-element blocks), so that the largest tensors
    # (embeddings, heads) stream like the rest; not for stacked moments (AdEMAMix's state1), nor
    # for updates scaled by each tensor's whole norm (LARS, LAMB)
    cuttable = all(s.moments == 1 for s in spec.states) and not spec.norm_scaled
    schedule: dict = {}
    sizes: dict = {}
    for pid in order:
        bi, j = position[pid]
        b = plan.buckets[bi]
        for piece in _pieces(j, b.params[j], b.states[j], spec.memory_keys, limit, cuttable):
            chunks = schedule.setdefault(b.device, [])
            if not chunks or (sizes[b.device] + piece.nbytes > limit and chunks[-1][1]):
                chunks.append(({}, []))
                sizes[b.device] = 0
            parts, ids = chunks[-1]
            parts.setdefault(bi, []).append(piece)
            ids.append(pid)
            sizes[b.device] += piece.nbytes
    return {device: [(list(parts.items()), ids) for parts, ids in chunks] for device, chunks in schedule.items()}
