"""Settings changed in ``param_groups`` after construction are checked when the next step runs,
with the constructor's messages, and a refused step changes nothing (parameters, states, step
counters); the ordinary step and the fast step alike."""
import math

import pytest
import torch

import pagedopt

BAD = [("lr", -1e-3, "must be a finite float >= 0"), ("lr", math.inf, "must be a finite float >= 0"),
       ("betas", (1.5, 0.999), "must be a float in [0, 1)"), ("eps", math.nan, "must be a finite float >= 0"),
       ("weight_decay", -0.1, "must be a finite float >= 0"), ("betas", (0.9,), "must be a pair of floats")]


def _opt(cls, fast: bool):
    torch.manual_seed(0)
    a, b = torch.randn(80, 64).requires_grad_(True), torch.randn(30).requires_grad_(True)
    opt = cls([{"params": [a]}, {"params": [b], "lr": 1e-2}])
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    if not fast:
        b.grad = None  # a parameter without a gradient: the ordinary step
    return opt, (a, b)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "ordinary"])
@pytest.mark.parametrize("cls", [pagedopt.AdamW8bit, pagedopt.AdamW32bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("key,value,why", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_setting_changed_by_hand_is_refused_at_the_next_step_changing_nothing(cls, fast, key, value, why):
    opt, params = _opt(cls, fast)
    plan = opt.step_plan
    assert plan is not None and plan.fast  # both qualify: the "ordinary" case then gives way
    for p in params:
        if p.grad is not None:
            p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=rf"Invalid param_groups\[1\]\['{key}'\]: .*{__import__('re').escape(why)}"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    for p, s in zip(params, states):
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k
    # put right, the step runs and counts once
    opt.param_groups[1][key] = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}[key]
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 2.0


def test_a_scheduler_that_changes_lr_every_step_keeps_working():
    opt, params = _opt(pagedopt.AdamW8bit, True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
    assert float(opt.state[params[0]]["step"]) == 4.0
