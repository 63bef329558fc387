"""The fast step: a step whose host work does not grow with Python lists of tensors.

An ordinary step builds the lists of parameters with gradients and of their gradients in Python,
checks them in one C++ call and hands both to each bucket's fused op: about 0.15 us per tensor for
each list at each crossing, so about 1-2 ms per step for 2000 parameters. When the step plan holds
every parameter of the optimizer in C++ state lists (QuantizedStateList, which keeps the address of
each parameter's Python object; csrc/include/pagedopt/quantized_state_list.h), a step
instead asks each list to collect the gradients itself (``gather_grads``: in C++, a few tens of ns
per parameter) and runs the same op on them (``step_gathered``), so the Python work is a few calls
per bucket.

The fast step runs only when it would do exactly what the ordinary step does, and otherwise gives
way to it before anything changes: every parameter of the param groups had a gradient when the
plan was built and still has one, contiguous and matching it; the plan is current (same state,
groups and parameters, in order: this is also what keeps the held Python objects alive); states
are resident (or not paged); the optimizer steps through held lists (not LARS/LAMB, whose norm
pass comes first, nor DTensor parameters). A parameter swapped by torch.utils.swap_tensors
(module.to() with swapping on) is read as it is now, from its Python object. Buckets without a held list (32-bit Adam, which
runs torch's fused kernel; plain SGD without states) take their ordinary step on Python lists of
their own parameters, usually the few small ones.
"""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

from .. import _ops
from . import capture
from .capture import capture_check, lr_tensor
from .state_table import StateTable

if TYPE_CHECKING:
    from .base import QuantizedOptimizer


def hold_params_for_fast_steps(opt: "QuantizedOptimizer", buckets: list, params: list, sharded: bool) -> bool:
    """When a new plan qualifies for fast steps, hold its parameters in its state lists; whether it does."""
    if sharded or not opt._held_step_only or getattr(opt._pager, "streams_states", False):
        return False
    if not any(b.held is not None for b in buckets):
        return False
    if len(params) != sum(len(g["params"]) for g in opt.param_groups):  # some parameter had no gradient
        return False
    for b in buckets:
        if b.held is not None:
            b.held.hold_params(b.params)
    return True


def fast_step(opt: "QuantizedOptimizer", plan) -> bool:
    """The step of ``plan`` if it can run fast (see the module's docstring); False, with nothing
    changed, when the ordinary step must run instead."""
    state = opt.state
    groups = opt.param_groups
    if not isinstance(state, StateTable) or plan.key[:3] != (id(state), state.version, opt._plan_version):
        return False
    if tuple(map(id, chain.from_iterable(g["params"] for g in groups))) != plan.key[3]:  # about 20 ns a parameter
        return False
    pager = opt._pager
    if pager is not None and not pager.all_resident():
        return False
    buckets = plan.buckets
    if capture.capturing(buckets[0].params[0]):
        capture_check(opt, plan)
    calls = []
    for b in buckets:  # every held bucket's hyperparameters read before anything changes
        group = opt._group_of(b)
        lr = lr_tensor(group, b.device)
        hyper = None if b.held is None else [float(h) for h in opt._engine_hyper(group if lr is None else
                                                                                   {**group, "lr": 0.0})]
        calls.append((b, hyper, lr))
    unheld = {}  # the buckets without a held list (32-bit Adam, plain SGD): their ordinary step, on Python lists
    for i, b in enumerate(buckets):
        if b.held is None:
            grads = [p.grad for p in b.params]
            if any(g is None for g in grads) or _ops.check_grads(b.params, grads) != _ops.GRADS_CONTIGUOUS:
                return False
            unheld[i] = grads
    for b in buckets:
        if b.held is not None and not b.held.gather_grads():
            for other in buckets:
                if other.held is not None:
                    other.held.release()
            return False

    def step_bucket(i, b, scale, inf):
        if b.held is None:
            opt._step_bucket(opt._group_of(b), b, b.params, unheld[i], True, scale, inf)
        else:
            b.held.step_gathered(calls[i][1], scale, inf, calls[i][2])

    opt._count_and_step(plan, step_bucket)
    return True
