"""The fast step: a step whose host work does not grow with Python lists of tensors.

An ordinary step builds the lists of parameters with gradients and of their gradients in Python,
checks them in one C++ call and hands both to each bucket's fused op: about 0.15 us per tensor for
each list at each crossing, so about 1-2 ms per step for 2000 parameters. When the step plan holds
every parameter of the optimizer in C++ state lists (QuantizedStateList, which keeps the address of
each parameter's Python object; csrc/include/pagedopt/quantized_state_list.h), a step
instead asks each list to collect the gradients itself (``gather_grads``: in C++, a few tens of ns
per parameter) and runs the same op on them (``step_gathered``), so the Python work is a few calls
per bucket. The op is the engine's, or torch's fused Adam/AdamW for 32-bit states of fp32
parameters (a held list of that algorithm: the same call the ordinary step makes from Python).

The fast step runs only when it would do exactly what the ordinary step does, and otherwise gives
way to it before anything changes: every parameter of the param groups had a gradient when the
plan was built and still has one, contiguous and matching it; the plan is current (same state,
groups and parameters, in order: this is also what keeps the held Python objects alive); states
are resident (or not paged); the optimizer steps through held lists (not LARS/LAMB, whose norm
pass comes first, nor DTensor parameters). A parameter swapped by torch.utils.swap_tensors
(module.to() with swapping on) is read as it is now, from its Python object. Buckets without a
held list (32-bit Adam on 16-bit parameters, which runs torch's fused kernel on fp32 copies; plain
SGD without states) take their ordinary step on Python lists of their own parameters, usually the
few small ones.
"""
from __future__ import annotations

from itertools import chain

from .. import _ops
from . import capture, executor, kernels
from .plan import FUSED32, StepPlan, group_of, is_current
from .residency import all_resident, streams_now


def hold_params_for_fast_steps(plan: StepPlan, params: list, param_groups: list[dict], pager, spec) -> StepPlan:
    """When a new plan qualifies for fast steps, hold its parameters in its state lists; the plan,
    with ``fast`` set when it does."""
    if plan.sharded or spec.norm_scaled or streams_now(pager):
        return plan
    if not any(b.held is not None for b in plan.buckets):
        return plan
    if len(params) != sum(len(g["params"]) for g in param_groups):  # some parameter had no gradient
        return plan
    for b in plan.buckets:
        if b.held is not None:
            b.held.hold_params(b.params)
    return plan._replace(fast=True)


def fast_step(opt, plan: StepPlan) -> bool:
    """The step of ``plan`` if it can run fast (see the module's docstring); False, with nothing
    changed, when the ordinary step must run instead."""
    groups = opt.param_groups
    if not is_current(plan, opt.state, opt.plan_version):
        return False
    if tuple(map(id, chain.from_iterable(g["params"] for g in groups))) != plan.key[3]:  # about 20 ns a parameter
        return False
    pager, spec = opt.pager, opt.algorithm
    if not all_resident(pager):
        return False
    buckets = plan.buckets
    if capture.capturing(buckets[0].params[0]):
        capture.capture_check(opt, plan)
    calls = []
    for b in buckets:  # every held bucket's hyperparameters read before anything changes
        group = group_of(groups, b)
        if b.kernel == FUSED32:
            hyper, lr = kernels.fused32_hyper(group, kernels.lr_tensor(group, b.device))
        else:
            hyper, lr = kernels.hyper_and_lr(spec, group, b.device)
        calls.append((group, None if b.held is None else [float(h) for h in hyper], lr, kernels.sr_seed(group, b)))
    unheld = {}  # buckets without a held list (32-bit Adam on 16-bit params, plain SGD): their ordinary step
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
        group, hyper, lr, seed = calls[i]
        if b.held is None:
            executor.step_bucket(spec, pager, group, b, b.params, unheld[i], True, scale, inf)
        else:
            b.held.step_gathered(hyper, scale, inf, lr, seed)

    executor.count_and_step(pager, plan, step_bucket, getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None))
    return True
