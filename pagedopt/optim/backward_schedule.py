"""The schedule of updates during backward (backward_updates.py): the parameters of a step plan
cut into chunks in the order their gradients arrived, per device, each at most ``limit`` bytes of
state (a parameter larger than that is cut into pieces of whole blocks), and the progress of one
step's chunks (``Run``)."""
from __future__ import annotations

from .residency import cuttable, pieces

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
    cut = cuttable(spec)
    schedule: dict = {}
    sizes: dict = {}
    for pid in order:
        bi, j = position[pid]
        b = plan.buckets[bi]
        for piece in pieces(j, b.params[j], b.states[j], spec.memory_keys, limit, cut):
            chunks = schedule.setdefault(b.device, [])
            if not chunks or (sizes[b.device] + piece.nbytes > limit and chunks[-1][1]):
                chunks.append(({}, []))
                sizes[b.device] = 0
            parts, ids = chunks[-1]
            parts.setdefault(bi, []).append(piece)
            ids.append(pid)
            sizes[b.device] += piece.nbytes
    return {device: [(list(parts.items()), ids) for parts, ids in chunks] for device, chunks in schedule.items()}
