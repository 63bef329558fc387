"""The pieces of one bucket's fused call: the whole bucket at once while its paged states are
resident, else chunks of about ``chunk_bytes`` of state that the pager stages (paging in the next
chunk while the current one is updated), or, for a pager that streams host-resident states
(HostResidentPager), chunks whose state lists hold device views that the pager copies in before
and back after each chunk's call; non-contiguous parameters go through contiguous copies that are
written back."""
from __future__ import annotations

import torch


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


def _state_bytes(state: dict, keys) -> int:
    return sum(state[k].numel() * state[k].element_size() for k in keys if k in state)


def _chunks(pager, keys, states: list[dict], chunk_bytes: int) -> list[list[int]]:
    """Positions in the bucket, in chunks: all at once unless paged states are not resident."""
    everything = [list(range(len(states)))]
    if pager is None or pager.all_resident():
        return everything
    from ..paging import split_by_bytes

    return split_by_bytes(everything[0], lambda j: _state_bytes(states[j], keys), chunk_bytes)


def _stages(pager, keys, states: list[dict], chunks: list[list[int]]):
    if pager is None or pager.all_resident():
        return range(len(chunks))
    return pager.stage([[states[j][k] for j in chunk for k in keys if k in states[j]] for chunk in chunks])


def bucket_chunks(pager, keys, states: list[dict], lists: tuple, bucket_params: list[torch.Tensor],
                  grads: list[torch.Tensor], contiguous: bool, chunk_bytes: int):
    """(params, work params, work grads, state lists) per chunk, in the order the chunks are to be
    updated. ``keys``: the state keys that take memory (what the pager stages); ``lists``: the
    bucket's state lists (one per key of the fused call)."""
    if getattr(pager, "streams_states", False):
        yield from _streamed_chunks(pager, keys, states, lists, bucket_params, grads, contiguous, chunk_bytes)
        return
    chunks = _chunks(pager, keys, states, chunk_bytes)
    for i in _stages(pager, keys, states, chunks):
        chunk = chunks[i]
        if len(chunks) == 1:
            params, chunk_grads, chunk_lists = bucket_params, grads, lists
        else:
            params = [bucket_params[j] for j in chunk]
            chunk_grads = [grads[j] for j in chunk]
            chunk_lists = tuple([lst[j] for j in chunk] for lst in lists)
        if contiguous:
            yield params, params, chunk_grads, chunk_lists
        else:
            work_params, work_grads = contiguous_views(params, chunk_grads)
            yield params, work_params, work_grads, chunk_lists


def _streamed_chunks(pager, keys, states: list[dict], lists: tuple, bucket_params: list[torch.Tensor],
                     grads: list[torch.Tensor], contiguous: bool, chunk_bytes: int):
    """bucket_chunks for a pager that streams host-resident states through a device buffer: each
    chunk's state tensors are swapped for the device views that ``pager.stream`` hands out (their
    contents are copied back after the chunk's call, when the caller asks for the next chunk)."""
    from ..paging import split_by_bytes

    chunk_bytes = min(chunk_bytes, max(pager.device_buffer_bytes // 3, 1))
    chunks = split_by_bytes(list(range(len(states))), lambda j: _state_bytes(states[j], keys), chunk_bytes)
    groups = [[states[j][k] for j in chunk for k in keys if k in states[j]] for chunk in chunks]
    for i, views in pager.stream(bucket_params[0].device, groups):
        chunk = chunks[i]
        view_of = {id(t): v for t, v in zip(groups[i], views)}
        params = [bucket_params[j] for j in chunk]
        chunk_grads = [grads[j] for j in chunk]
        chunk_lists = tuple([view_of.get(id(lst[j]), lst[j]) for j in chunk] for lst in lists)
        if contiguous:
            yield params, params, chunk_grads, chunk_lists
        else:
            work_params, work_grads = contiguous_views(params, chunk_grads)
            yield params, work_params, work_grads, chunk_lists


def flat_runs(numels: list[int], max_numel: int, align: int = 1) -> list[list[tuple[int, int, int]]]:
    """Runs of at most ``max_numel`` elements over the concatenation of tensors of ``numels``
    elements, in order: each run a list of (tensor index, start, end) of flat element ranges. A
    tensor that does not fit the rest of a run is cut, for elementwise updates, at multiples of
    ``align`` elements from its start (a kernel that treats a vector-width remainder differently
    then sees the same remainders as on the whole tensor); ``max_numel`` must be a multiple of
    ``align``."""
    if max_numel < align or max_numel % align:
        raise ValueError(f"max_numel ({max_numel}) must be a positive multiple of align ({align})")
    runs, current, room = [], [], max_numel
    for i, n in enumerate(numels):
        start = 0
        while start < n:
            take = n - start if n - start <= room else room // align * align
            if take == 0:  # less than `align` left in this run: the tensor goes on in the next one
                runs.append(current)
                current, room = [], max_numel
                continue
            current.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                runs.append(current)
                current, room = [], max_numel
    if current:
        runs.append(current)
    return runs


def flat_parts(tensors: list[torch.Tensor], run: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The flat views of ``tensors`` (contiguous) that a run of flat_runs names."""
    return [tensors[i].view(-1)[start:end] for i, start, end in run]
