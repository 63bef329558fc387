"""The step counters of a step plan live in one tensor per device (pagedopt/optim/step_counters.py):
each parameter still counts its own steps, a step increments them with one add, and checkpoints
see one owned scalar per parameter."""
from __future__ import annotations

import copy

import torch

import pagedopt


def _params(n=3, size=600):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(size)) for _ in range(n)]


def _step(opt, params, with_grad):
    for p in params:
        p.grad = torch.randn_like(p) if p in with_grad else None
    opt.step()


def test_each_parameter_counts_its_own_steps_through_the_shared_counters():
    a, b, c = _params()
    opt = pagedopt.AdamW8bit([a, b, c], lr=1e-3, min_8bit_size=256)
    for _ in range(3):
        _step(opt, [a, b, c], {a})
    _step(opt, [a, b, c], {a, b, c})
    _step(opt, [a, b, c], {b, c})
    assert [float(opt.state[p]["step"]) for p in (a, b, c)] == [4.0, 2.0, 2.0]
    # the counters of the last plan (b, c) are views of one tensor; a keeps the one of an earlier plan
    sb, sc = opt.state[b]["step"], opt.state[c]["step"]
    assert sb.dim() == 0 and sb.dtype == torch.float32
    assert sb.untyped_storage().data_ptr() == sc.untyped_storage().data_ptr()
    # a checkpoint holds one owned scalar per parameter, with the counts
    sd = opt.state_dict()
    steps = [sd["state"][i]["step"] for i in range(3)]
    assert [float(s) for s in steps] == [4.0, 2.0, 2.0]
    assert all(s.untyped_storage().nbytes() == 4 and s.storage_offset() == 0 for s in steps)


def test_the_bias_correction_uses_each_parameters_own_count():
    """Two parameters with equal gradients but different step counts: after a common step, each
    matches an optimizer that stepped that parameter alone the same number of times."""
    torch.manual_seed(1)
    a0 = torch.randn(600)
    b0 = a0.clone()
    grads = [torch.randn(600) for _ in range(4)]
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    opt = pagedopt.AdamW8bit([a, b], lr=1e-2, min_8bit_size=256)
    for g in grads[:3]:  # a alone: steps 1..3
        a.grad, b.grad = g.clone(), None
        opt.step()
    a.grad, b.grad = grads[3].clone(), grads[3].clone()  # a's step 4, b's step 1
    opt.step()
    ref_a, ref_b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    ra = pagedopt.AdamW8bit([ref_a], lr=1e-2, min_8bit_size=256)
    rb = pagedopt.AdamW8bit([ref_b], lr=1e-2, min_8bit_size=256)
    for g in grads:
        ref_a.grad = g.clone()
        ra.step()
    ref_b.grad = grads[3].clone()
    rb.step()
    # the same kernel on the same values and counts: bit for bit
    assert torch.equal(a, ref_a) and torch.equal(b, ref_b)


def test_counters_replaced_by_hand_or_copied_keep_counting():
    a, b, c = _params()
    opt = pagedopt.AdamW8bit([a, b, c], lr=1e-3, min_8bit_size=256)
    _step(opt, [a, b, c], {a, b, c})
    opt.state[b]["step"] = torch.tensor(10.0)  # a state change: the plan is rebuilt, counters shared again
    _step(opt, [a, b, c], {a, b, c})
    assert [float(opt.state[p]["step"]) for p in (a, b, c)] == [2.0, 11.0, 2.0]
    twin = copy.deepcopy(opt)
    _step(opt, [a, b, c], {a, b, c})
    assert [float(opt.state[p]["step"]) for p in (a, b, c)] == [3.0, 12.0, 3.0]
    twin_params = twin.param_groups[0]["params"]
    assert [float(twin.state[p]["step"]) for p in twin_params] == [2.0, 11.0, 2.0]  # the copy is independent
