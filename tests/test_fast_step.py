"""The fast step (pagedopt/optim/fast_step.py): taken when the plan holds every parameter, bit for
bit the ordinary step (GradScaler's scale and skipped steps included), and giving way to it, with
nothing changed, whenever it could differ: a missing, non-contiguous or mismatched gradient, a
parameter replaced in its group or swapped by torch.utils.swap_tensors, LARS/LAMB, 32-bit Adam on
16-bit parameters (fp32 copies). 32-bit Adam/AdamW on fp32 parameters runs torch's fused op on a
held list."""
from __future__ import annotations

import pytest
import torch

import pagedopt
from pagedopt.optim import base as optim_base
from pagedopt.optim import fast_step as fast_module

CLASSES = ["AdamW8bit", "Adam8bit", "Lion8bit", "Lion32bit", "AdEMAMix8bit", "SGD8bit", "RMSprop8bit",
           "Adagrad8bit", "PagedAdamW8bit", "AdamW8bit_bf16", "AdamW32bit", "Adam32bit", "PagedAdamW32bit"]


def _make(name, seed=0, **kw):
    dtype = torch.bfloat16 if name.endswith("_bf16") else torch.float32
    name = name.removesuffix("_bf16")
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((40, 33), (700,), (5,))]
    extra = {"momentum": 0.9} if name.startswith(("SGD", "LARS")) and "momentum" not in kw else {}
    kw.setdefault("weight_decay", 0.05)  # so that Adam's L2 and AdamW's decoupled decay differ
    opt = getattr(pagedopt, name)(params, lr=1e-2, min_8bit_size=100, **extra, **kw)
    return opt, params


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


def _same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def taken(monkeypatch):
    """The fast step's verdicts, step by step (the real function, recorded)."""
    seen = []

    def spy(opt, plan):
        seen.append(fast_module.fast_step(opt, plan))
        return seen[-1]

    monkeypatch.setattr(optim_base, "fast_step", spy)
    return seen


def _run(name, steps, fast: bool, monkeypatch=None, scaler_steps=(), **kw):
    opt, params = _make(name, **kw)
    for step in range(steps):
        _grads(params, step)
        if step in scaler_steps:  # as GradScaler.step hands them over: a scale, and a found_inf
            scale = torch.tensor(2.0 ** 8)
            for p in params:
                p.grad.mul_(scale.to(p.dtype))
            opt.grad_scale, opt.found_inf = scale, torch.tensor(float(step % 2))
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)
    return opt, params


@pytest.mark.parametrize("name", CLASSES)
def test_fast_steps_are_taken_and_bit_for_bit_the_ordinary_ones(name, taken, monkeypatch):
    opt, params = _run(name, 5, True, scaler_steps=(2, 3))
    assert taken == [True] * 4  # the first step builds the plan (ordinary), the others run fast
    monkeypatch.setattr(optim_base, "fast_step", lambda opt, plan: False)
    ref, ref_params = _run(name, 5, False, scaler_steps=(2, 3))
    _same(_snapshot(ref, ref_params), _snapshot(opt, params))
    assert float(opt.state[params[0]]["step"]) == 4.0  # step 3 was skipped (found_inf = 1)


@pytest.mark.parametrize("name", ["LARS8bit", "LAMB8bit", "AdamW32bit_bf16", "SGD"])
def test_no_fast_step_without_held_lists_or_with_a_norm_pass(name, taken):
    kw = {"momentum": 0.0} if name == "SGD" else {}
    _run(name, 3, True, **kw)
    assert taken == []  # the plan never qualified


def _warm(name="AdamW8bit"):
    opt, params = _make(name)
    for step in range(2):
        _grads(params, step)
        opt.step()
    _grads(params, 2)
    return opt, params


def test_a_missing_gradient_gives_way_to_the_ordinary_step(taken):
    opt, params = _warm()
    ref, ref_params = _warm()
    params[1].grad = None
    ref_params[1].grad = None
    opt.step()
    with torch.no_grad():
        ref._plan = None  # the ordinary step, planned afresh
    ref.step()
    assert taken[-1] is False
    _same(_snapshot(ref, ref_params), _snapshot(opt, params))


def test_a_non_contiguous_gradient_gives_way_and_steps_alike(taken):
    opt, params = _warm()
    ref, ref_params = _warm()
    for ps in (params, ref_params):
        ps[0].grad = ps[0].grad.t().contiguous().t()  # same values, column-major
        assert not ps[0].grad.is_contiguous()
    opt.step()
    assert taken[-1] is False
    ref._plan = ref._plan._replace(fast=False)
    ref.step()
    _same(_snapshot(ref, ref_params), _snapshot(opt, params))
    _grads(params, 3)
    opt.step()
    assert taken[-1] is True  # contiguous again: fast again


def test_a_mismatched_gradient_is_refused_by_the_ordinary_step_naming_it_and_changes_nothing(taken):
    opt, params = _warm()
    before = _snapshot(opt, params)
    params[2].grad = torch.randn(5).to_sparse()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\].*sparse"):
        opt.step()
    assert taken[-1] is False
    _same(before, _snapshot(opt, params))


def test_a_parameter_replaced_in_its_group_gives_way(taken):
    opt, params = _warm()
    new = torch.nn.Parameter(params[1].detach().clone())
    new.grad = params[1].grad.clone()
    opt.param_groups[0]["params"][1] = new
    opt.step()
    assert taken[-1] is False
    assert new in opt.state and not torch.equal(new, params[1])  # the new one stepped, the old one did not


def test_a_swapped_parameter_is_stepped_as_it_is_now(taken):
    model = torch.nn.Linear(30, 20)
    ref_model = torch.nn.Linear(30, 20)
    ref_model.load_state_dict(model.state_dict())
    opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=100)
    ref = pagedopt.AdamW8bit(ref_model.parameters(), lr=1e-2, min_8bit_size=100)
    xs = [torch.randn(4, 30, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for m, o in ((model, opt), (ref_model, ref)):
        for x in xs[:2]:
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64).to(torch.float32)  # swaps each parameter's tensor (no extra reference held)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    ref._plan = ref._plan._replace(fast=False)
    for x in xs[2:]:
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    assert taken[-2:] == [True, True]  # fast, on the swapped-in tensors
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_hold_params_refuses_lists_of_the_wrong_length():
    opt, params = _warm()
    held = opt._plan.buckets[0].held
    with pytest.raises(ValueError, match=r"hold_params: 1 params for \d+ held states"):
        held.hold_params(params[:1])
    with pytest.raises(RuntimeError, match=r"gather_grads\(\) did not collect"):
        held.step_gathered([1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0], None, None, None)
