"""The schedule of updates during backward (backward_updates.py): the parameters of a step plan
cut into chunks in the order their gradients arrived, per device, each at most ``limit`` bytes of
state (a parameter larger than that is cut into pieces of whole blocks), the progress of one
step's chunks (``Run``) and the update of a chunk's part of one bucket (``update_part``)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _ops
from . import kernels
from .grad_checks import raise_bad_grad
from .plan import group_of
from .residency import cuttable, make_chunk, pieces

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


def update_part(opt, bucket, pieces: list, view_of: dict, stepped: set, verdict: Optional[int] = None) -> list:
    """A chunk's pieces of one bucket updated with one call, with the gradients they have (those
    without one are left alone); ``view_of``: id of a state tensor -> its view in this chunk;
    ``stepped``: the bucket's positions whose step counter this step incremented (a parameter cut
    into pieces counts once, at its first); ``verdict``: the gradients' check, when done already.
    Returns the parameters updated."""
    pieces = [piece for piece in pieces if bucket.params[piece.j].grad is not None]
    if not pieces:
        return []
    params = [bucket.params[piece.j] for piece in pieces]
    grads = [p.grad for p in params]
    if verdict is None:  # not checked by the hook
        verdict = _ops.check_grads(params, grads)
        if verdict >= 0:
            raise_bad_grad(opt.param_groups, params[verdict])
    if any(piece.start is not None for piece in pieces):  # flat ranges of whole blocks
        params = [p if piece.start is None else p.view(-1)[piece.start:piece.end] for p, piece in zip(params, pieces)]
        grads = [g if piece.start is None else g.reshape(-1)[piece.start:piece.end]
                 for g, piece in zip(grads, pieces)]
        contiguous = all(g.is_contiguous() for g in grads)
    else:
        contiguous = verdict == _ops.GRADS_CONTIGUOUS
    lists = {key: [view_of[id(piece.by_key[key])] if key in piece.by_key else bucket.states[piece.j][key]
                   for piece in pieces] for key in bucket.lists}
    counters = [bucket.states[piece.j]["step"] for piece in pieces if piece.j not in stepped]
    stepped.update(piece.j for piece in pieces)
    if counters:
        torch._foreach_add_(counters, 1.0)  # once per parameter, at its first piece
    kernels.step_chunk(opt.algorithm, bucket, group_of(opt.param_groups, bucket),
                       make_chunk(params, grads, lists, contiguous, [piece.j for piece in pieces],
                                  [piece.start or 0 for piece in pieces]), None, None)
    return [bucket.params[piece.j] for piece in pieces]
