"""Updates during backward in a step without a schedule (backward_updates.py): the first step after
``set_pager(update_in_backward=True)``, and the first after anything that drops the schedule
(``load_state_dict``, ``add_param_group``, new states, a different set of parameters with
gradients).

There is no order of gradients to follow yet, and maybe no states. So the parameters are taken as
their gradients arrive: per device, once the states of those waiting (the bytes they have, or would
have once made: ``planned_state_bytes``) reach the chunk limit, they are updated as one chunk and
their gradients released, so that the gradients held during backward stay about one chunk (with a
parameter larger than a chunk, that parameter). A chunk is a step plan of its own parameters
(``opt.make_plan``: the states they lack made as one transaction, the same code as the ordinary
step's) run by the executor, so each parameter gets the ordinary step's kernels on the same
tensors, its step counter incremented once: bit for bit the ordinary step. ``step()`` updates the
parameters still waiting (the last chunk, never full) and any whose gradient came without a hook,
then makes the schedule from the order the gradients arrived in.

Left to ``step()``, with their gradients: parameters whose group keeps no states (plain SGD), DTensor
parameters and, once running out of memory (or a device buffer too small) made one chunk's states
fail, every parameter after it in that backward (a warning says so; the chunk's states were not
made, so ``step()`` makes them as the ordinary step does, and raises if memory is still short: the
repeated ``step()`` then finishes the step, bit for bit the uninterrupted one). Raising from the
hook instead would stop backward, and the gradients of the parameters after it would never come.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch

from .. import _ops
from . import executor, residency
from .grad_checks import raise_bad_grad
from .sharding import is_dtensor


class FirstStep:
    """The progress of one step without a schedule: the parameters whose gradient arrived and that
    wait for their chunk, per device, and their states' bytes (see the module)."""

    def __init__(self, opt, chunks_per_buffer: int):
        self.stopped = False     # a chunk's states could not be made: the rest waits for step()
        self._waiting: dict = {}  # device -> [params]
        self._bytes: dict = {}    # device -> their states' bytes
        # each parameter's settings (its group's, with GlobalOptimManager's overrides), read once a step
        self.overrides = opt.overrides(opt.param_groups)
        self._config = {}
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                override = self.overrides.get((gi, pi))
                self._config[id(p)] = {**group, **override} if override else group
        pager = opt.pager
        if residency.streams_states(pager) and not residency.cuttable(opt.algorithm):
            self._fit_device_buffer(opt)
        self.limit = residency.pass_chunk_bytes(pager, chunks_per_buffer, before_states=True)

    def _fit_device_buffer(self, opt) -> None:
        """States that stream in one piece (stacked moments, norm-scaled updates) must fit the
        device buffer, which a default-sized one grows to hold before its first pass: the ordinary
        step checks every parameter with a gradient first; here, before the first chunk allocates
        the buffer, every parameter that may get one (the largest tensors, embeddings, often come
        last). One that cannot fit leaves the whole step to step(), which raises before anything
        changes if it has a gradient."""
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    try:
                        opt.check_fits_device_buffer(self._config[id(p)], p, gi, pi)
                    except ValueError:
                        self.stopped = True
                        return

    def arrive(self, opt, p: torch.Tensor) -> Optional[list]:
        """``p``'s gradient is final: the chunk to update now (a list of parameters), or None."""
        config = self._config.get(id(p))
        if self.stopped or config is None or not opt.algorithm.needs_states(config) or is_dtensor(p):
            return None
        device = p.device
        waiting = self._waiting.setdefault(device, [])
        waiting.append(p)
        self._bytes[device] = self._bytes.get(device, 0) + (opt.planned_state_bytes(config, p) or 0)
        if self._bytes[device] < self.limit:
            return None
        del self._waiting[device], self._bytes[device]
        return waiting


def update_chunk(opt, params: list, overrides: dict, stream, begin: bool) -> bool:
    """Update ``params`` (a chunk, their gradients final) with the ordinary step's kernels, on
    ``stream`` (None: the current one) after the work queued so far; ``overrides``: FirstStep's;
    ``begin``: tell the pager that a step begins. The gradients are checked first (a ValueError
    names a bad one, nothing changed), then the states made (one transaction), then the device
    buffer of a streaming pager allocated: running out of memory there (or a device buffer too
    small for a state) leaves the states as they were, warns and returns False. True once the
    update is queued."""
    grads = [p.grad for p in params]
    verdict = _ops.check_grads(params, grads)
    if verdict >= 0:
        raise_bad_grad(opt.param_groups, params[verdict])
    pager = opt.pager
    try:
        plan = opt.make_plan(params, overrides)
        if residency.streams_now(pager):  # allocated on the caller's stream, as the ordinary step does
            for device in plan.steps_by_device:
                pager.reserve(device)
    except (torch.OutOfMemoryError, ValueError) as exc:
        warnings.warn(f"{type(opt).__name__}: the states of {len(params)} parameters could not be made during "
                      f"backward ({type(exc).__name__}: {exc}); they and the rest of this step's parameters keep "
                      "their gradients and are updated in step()", RuntimeWarning, stacklevel=2)
        return False
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        executor.run(opt.algorithm, pager, opt.param_groups, plan, params, grads, verdict == _ops.GRADS_CONTIGUOUS,
                     None, None, begin=begin)
    return True

