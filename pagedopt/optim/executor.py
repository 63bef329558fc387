"""The executor: the one traversal of a step plan. For each bucket it asks the residency for the
bucket's chunks (residency.py) and hands each chunk to the bucket's kernel functional
(kernels.py); around the buckets it keeps the step counters (+1 before, minus GradScaler's
found_inf after, so that a skipped step does not count).

Who calls it decides when a chunk runs: ``step()`` (the ordinary step, base.py), the fast step
(fast_step.py, on states held in C++), the captured step (the same calls inside a CUDA graph) and
updates during backward (backward_updates.py, chunk by chunk from gradient hooks or the worker
thread). None of them has a loop of its own over kernels.
"""
from __future__ import annotations

from typing import Callable, Optional

from .. import _ops
from . import kernels, residency
from .algorithms.spec import AlgorithmSpec
from .plan import ENGINE, STATELESS, Bucket, StepPlan, group_of
from .sharding import is_dtensor
from .step_counters import add_to_counters, subtract_from_counters


def count_and_step(pager, plan: StepPlan, step_bucket: Callable, grad_scale, found_inf, begin: bool = True,
                   workspace: Optional[dict] = None) -> None:
    """What every step does around its buckets: a streaming pager's device buffers allocated and
    ``workspace`` (device -> bytes of the step's temporaries) made sure of (so that running out of
    memory there leaves everything as it was), step counters + 1, the pager told that a step begins
    (``begin``; not when updates during backward already told it), ``step_bucket(i, bucket,
    grad_scale, found_inf)`` per bucket with GradScaler's tensors on the bucket's device, then
    counters - found_inf."""
    if residency.streams_now(pager):  # the device buffers first: out of memory there changes nothing
        for device in plan.steps_by_device:
            pager.reserve(device)
    for device, nbytes in (workspace or {}).items():
        kernels.reserve_workspace(device, nbytes)
    for steps in plan.steps_by_device.values():
        add_to_counters(steps, 1.0)
    if pager is not None and begin:
        pager.begin_step()
    for i, bucket in enumerate(plan.buckets):
        scale = None if grad_scale is None else grad_scale.to(bucket.device, non_blocking=True)
        inf = None if found_inf is None else found_inf.to(bucket.device, non_blocking=True)
        step_bucket(i, bucket, scale, inf)
    if found_inf is not None:
        for device, steps in plan.steps_by_device.items():
            subtract_from_counters(steps, found_inf.to(device, non_blocking=True))


def run(spec: AlgorithmSpec, pager, param_groups: list[dict], plan: StepPlan, work_params: list, work_grads: list,
        contiguous: bool, grad_scale, found_inf, begin: bool = True) -> None:
    """The ordinary step of ``plan``: ``work_params``/``work_grads`` are step()'s parameters with
    gradients (local shards of DTensor parameters), in the plan's order, all checked (``begin``:
    see count_and_step)."""
    inputs = []  # each bucket's (params, grads), gathered once for the workspace and the step
    for bucket in plan.buckets:
        grads = [work_grads[k] for k in bucket.index]
        inputs.append(([work_params[k] for k in bucket.index] if plan.sharded else bucket.params, grads))

    def one_bucket(i, bucket, scale, inf):
        params, grads = inputs[i]
        step_bucket(spec, pager, group_of(param_groups, bucket), bucket, params, grads, contiguous, scale, inf)

    workspace: dict = {}
    for bucket, (params, grads) in zip(plan.buckets, inputs):
        nbytes = kernels.workspace_bytes(spec, bucket, group_of(param_groups, bucket), params, grads, contiguous,
                                         runs_held(bucket, contiguous, pager))
        workspace[bucket.device] = max(workspace.get(bucket.device, 0), nbytes)
    count_and_step(pager, plan, one_bucket, grad_scale, found_inf, begin, workspace)


def runs_held(bucket: Bucket, contiguous: bool, pager) -> bool:
    """Whether the bucket is updated by one call of the engine on the states it holds in C++
    (resident states, contiguous parameters; a FUSED32 bucket's held list serves the fast step
    only, its ordinary step is torch's op on Python lists)."""
    return bucket.held is not None and bucket.kernel == ENGINE and contiguous and residency.all_resident(pager)


def step_bucket(spec: AlgorithmSpec, pager, group: dict, bucket: Bucket, params, grads, contiguous: bool,
                grad_scale, found_inf) -> None:
    """One bucket: a single call on the states it holds in C++ while they are resident, else its
    chunks as the residency hands them out, each through the bucket's kernel."""
    if bucket.kernel == STATELESS:
        kernels.plain_sgd(group, params, grads, grad_scale, found_inf, bucket)
        return
    if runs_held(bucket, contiguous, pager):
        hyper, lr = kernels.hyper_and_lr(spec, group, bucket.device)
        _ops.quantized_step_list_(bucket.held, params, grads, hyper, grad_scale, found_inf, lr,
                                  kernels.sr_seed(group, bucket))
        return
    chunks = residency.chunks(pager, spec.memory_keys, bucket, params, grads, contiguous, residency.cuttable(spec))
    if spec.norm_scaled and any(is_dtensor(p) for p in bucket.params):
        _step_sharded_norm_scaled(spec, pager, group, bucket, params, chunks, grad_scale, found_inf)
        return
    for chunk in chunks:
        kernels.step_chunk(spec, bucket, group, chunk, grad_scale, found_inf)


def _step_sharded_norm_scaled(spec, pager, group, bucket, params, chunks, grad_scale, found_inf) -> None:
    """A norm-scaled bucket of DTensor (FSDP2) parameters: each shard holds part of each norm, so
    every chunk's sums of squares come first, then one reduction over the shards for the bucket
    (the same collective calls on every rank, whatever its chunks), then the updates."""
    import torch

    if residency.streams_now(pager):
        raise ValueError(f"{spec.name}: host-resident states (residency='host') are not supported for DTensor "
                         "(FSDP2) parameters, whose norms need every chunk before any update")
    hyper, lr = kernels.hyper_and_lr(spec, group, bucket.device)
    position = {id(t): j for j, t in enumerate(params)}
    chunks = list(chunks)
    squares = torch.zeros((len(params), 2), dtype=torch.float64, device=params[0].device)
    rows = []
    for chunk in chunks:
        index = [position[id(t)] for t in chunk.params]
        squares[index] = kernels.update_squares(spec, bucket, chunk, hyper, lr, grad_scale)
        rows.append(index)
    kernels.sum_over_shards(bucket.params, squares)
    for chunk, index in zip(chunks, rows):
        kernels.step_chunk(spec, bucket, group, chunk, grad_scale, found_inf, squares[index])
