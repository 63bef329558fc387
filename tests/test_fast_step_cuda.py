"""The fast step on a GPU: taken, and bit for bit the ordinary step, for 8-bit and 32-bit states,
fp32 and bf16 parameters, paged and not, under GradScaler (a skipped step included), and inside a
captured CUDA graph. The CPU side: tests/test_fast_step.py."""
from __future__ import annotations

import pytest
import torch

import pagedopt
from pagedopt.optim import base as optim_base
from pagedopt.optim import fast_step as fast_module

pytestmark = pytest.mark.cuda


def _make(name, dtype, capturable=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    # two 8-bit states (one ragged), one 32-bit state (under min_8bit_size: its own bucket)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").to(dtype))
              for s in ((96, 130), (5000,), (300,))]
    extra = {"momentum": 0.9} if name.startswith("SGD") else {}
    lr = torch.tensor(1e-3, device="cuda") if capturable else 1e-3
    return getattr(pagedopt, name)(params, lr=lr, capturable=capturable, **extra), params


def _steps(opt, params, n, scaled=(2, 3)):
    g = torch.Generator(device="cuda").manual_seed(7)
    for step in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device="cuda").to(p.dtype)
        if step in scaled:  # as GradScaler hands them over; step 3 has found_inf = 1 (skipped)
            scale = torch.tensor(2.0 ** 8, device="cuda")
            for p in params:
                p.grad.mul_(scale.to(p.dtype))
            opt.grad_scale, opt.found_inf = scale, torch.tensor(float(step % 2), device="cuda")
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)


def _snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "Lion8bit", "AdEMAMix32bit", "SGD8bit",
                                  "RMSprop8bit", "AdamW4bit", "PagedLion4bit"])
def test_fast_steps_on_the_gpu_are_the_ordinary_steps(name, dtype, monkeypatch):
    _fast_equals_ordinary(name, dtype, monkeypatch)


@pytest.mark.parametrize("name", ["AdamW32bit", "Adam32bit"])
def test_fast_32bit_adam_on_the_gpu_is_the_ordinary_step(name, monkeypatch):
    """32-bit states of fp32 parameters: torch's fused op called from the held list (C++) against
    the same op called from Python, bit for bit."""
    _fast_equals_ordinary(name, torch.float32, monkeypatch)


def _fast_equals_ordinary(name, dtype, monkeypatch):
    seen = []
    monkeypatch.setattr(optim_base, "fast_step", lambda o, p: seen.append(fast_module.fast_step(o, p)) or seen[-1])
    opt, params = _make(name, dtype)
    _steps(opt, params, 5)
    assert seen == [True] * 4
    monkeypatch.setattr(optim_base, "fast_step", lambda o, p: False)
    ref, ref_params = _make(name, dtype)
    _steps(ref, ref_params, 5)
    for a, b in zip(_snapshot(ref, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)
    assert float(opt.state[params[0]]["step"]) == 4.0


def test_a_fast_step_captured_in_a_graph_replays_as_eager_fast_steps(monkeypatch):
    seen = []
    monkeypatch.setattr(optim_base, "fast_step", lambda o, p: seen.append(fast_module.fast_step(o, p)) or seen[-1])
    opt, params = _make("AdamW8bit", torch.float32, capturable=True)
    ref, ref_params = _make("AdamW8bit", torch.float32, capturable=True)
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    for p, r, g in zip(params, ref_params, grads[0]):
        p.grad, r.grad = g.clone(), g.clone()
    opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()  # a fast step, captured
    assert seen[-1] is True
    ref.step()
    for k in range(1, 4):
        for p, r, g in zip(params, ref_params, grads[k]):
            p.grad.copy_(g)
            r.grad.copy_(g)
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    for a, b in zip(_snapshot(ref, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)
