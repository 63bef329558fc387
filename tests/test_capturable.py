"""capturable=True on the CPU: every class takes it, a tensor lr steps bit for bit like a float lr
(also under a scheduler), bad values are refused naming the argument, and the refusals of a step
being captured in a CUDA graph (simulated: the capture probe patched) change nothing. The captured
steps themselves run on the GPU: tests/test_capturable_cuda.py."""
from __future__ import annotations

import copy
import inspect
import io
import os

import pytest
import torch

import pagedopt
from pagedopt.optim import capture as capture_module

OPTIMIZERS = [name for name in pagedopt.__all__
              if isinstance(getattr(pagedopt, name), type) and issubclass(getattr(pagedopt, name), torch.optim.Optimizer)
              and not name.endswith("Base") and name != "QuantizedOptimizer"]


def _kwargs(name: str) -> dict:
    kw: dict = {"min_8bit_size": 1}
    if name.startswith(("SGD", "LARS")):
        kw["momentum"] = 0.9
    return kw


def _params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # one tensor of several 256-element blocks and a ragged last block, one smaller than a block
    return [torch.nn.Parameter(torch.randn(33, 40, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(100, generator=g).to(dtype))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _snapshot(opt, params) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        for key in sorted(opt.state[p]):
            v = opt.state[p][key]
            if isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def _run(name: str, lr, steps: int = 3, capturable: bool = True, sgd_momentum=None, scheduler=False):
    params = _params(0)
    kw = _kwargs(name)
    if sgd_momentum is not None:
        kw["momentum"] = sgd_momentum
    opt = getattr(pagedopt, name)(params, lr=lr, capturable=capturable, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    for step in range(steps):
        _grads(params, step)
        opt.step()
        if sched is not None:
            sched.step()
    return opt, params


def test_the_classes_are_all_here():
    assert len(OPTIMIZERS) == 45 and "PagedAdamW8bit" in OPTIMIZERS and "LAMB32bit" in OPTIMIZERS and "PagedLion4bit" in OPTIMIZERS


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_class_takes_capturable_and_keeps_bitsandbytes_group_keys(name):
    cls = getattr(pagedopt, name)
    assert inspect.signature(cls).parameters["capturable"].default is False
    plain = cls(_params(0), lr=1e-3, **_kwargs(name))
    opt = cls(_params(0), lr=torch.tensor(1e-3), capturable=True, **_kwargs(name))
    assert plain.capturable is False and opt.capturable is True
    # the flag is the optimizer's: param groups and checkpoints keep the keys bitsandbytes writes
    assert "capturable" not in opt.param_groups[0] and set(opt.param_groups[0]) == set(plain.param_groups[0])
    assert copy.deepcopy(opt).capturable is True and copy.deepcopy(plain).capturable is False


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_tensor_lr_steps_bit_for_bit_like_a_float_lr(name):
    # 1e-3 is not a float32 value: the float run hands the kernels float(1e-3) (a double), the tensor
    # run the float32 nearest to it widened; so the float run gets that float32 value as well, and
    # any difference is the tensor path's own.
    lr = float(torch.tensor(1e-3, dtype=torch.float32))
    ref_opt, ref_params = _run(name, lr, capturable=False)
    opt, params = _run(name, torch.tensor(lr), capturable=True)
    for a, b in zip(_snapshot(ref_opt, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)
    assert not torch.equal(params[0], _params(0)[0])  # it stepped


@pytest.mark.parametrize("name", ["SGD", "SGD32bit"])
def test_a_tensor_lr_steps_stateless_sgd_like_a_float_lr(name):
    lr = float(torch.tensor(1e-2, dtype=torch.float32))
    ref_opt, ref_params = _run(name, lr, capturable=False, sgd_momentum=0.0)
    opt, params = _run(name, torch.tensor(lr), sgd_momentum=0.0)
    for a, b in zip(_snapshot(ref_opt, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW32bit", "Lion8bit", "LAMB8bit"])
def test_a_scheduler_writes_a_tensor_lr_in_place_and_steps_like_a_float_lr(name):
    # StepLR halves lr after every step: 2^-k times a float32 value is a float32 value, so the float
    # run and the tensor run see the same lr at every step.
    lr = float(torch.tensor(1e-3, dtype=torch.float32))
    ref_opt, ref_params = _run(name, lr, steps=4, capturable=False, scheduler=True)
    lr_t = torch.tensor(lr)
    opt, params = _run(name, lr_t, steps=4, scheduler=True)
    assert opt.param_groups[0]["lr"] is lr_t and float(lr_t) == lr / 16  # written in place: a graph would see it
    for a, b in zip(_snapshot(ref_opt, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, match", [
    (dict(capturable="yes"), r"Invalid argument 'capturable': 'yes'"),
    (dict(capturable=1), r"Invalid argument 'capturable': 1"),
    (dict(lr=torch.tensor([1e-3, 2e-3])), r"Invalid argument 'lr': a torch.float32 tensor of shape \(2,\)"),
    (dict(lr=torch.tensor(1)), r"Invalid argument 'lr': a torch.int64 tensor"),
])
def test_bad_capturable_or_lr_is_refused_naming_it(bad, match):
    kw = {"lr": 1e-3, **bad}
    with pytest.raises(ValueError, match=match):
        pagedopt.AdamW8bit(_params(0), **kw)


# ------------------------------------------------------------------ refusals of a captured step
@pytest.fixture
def capturing(monkeypatch):
    """Makes step() believe its stream is being captured (the probe is patched, nothing else)."""
    monkeypatch.setattr(capture_module, "capturing", lambda p: True)


def _warm(name="AdamW8bit", capturable=True, lr=None, **kw):
    params = _params(0)
    opt = getattr(pagedopt, name)(params, lr=torch.tensor(1e-3) if lr is None else lr, capturable=capturable,
                                  **_kwargs(name), **kw)
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    return opt, params


def _refused(opt, params, match, monkeypatch):
    before = _snapshot(opt, params)
    monkeypatch.setattr(capture_module, "capturing", lambda p: True)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    monkeypatch.undo()
    if opt._pager is not None:
        opt.settle()
    for a, b in zip(before, _snapshot(opt, params)):
        assert torch.equal(a, b)  # nothing changed: params, states, step counters


def test_capture_of_a_non_capturable_optimizer_is_refused(monkeypatch):
    opt, params = _warm(capturable=False, lr=1e-3)
    _refused(opt, params, r"made with capturable=False: construct it with capturable=True", monkeypatch)


def test_capture_before_the_states_exist_is_refused_and_makes_none(capturing):
    params = _params(0)
    opt = pagedopt.AdamW8bit(params, lr=torch.tensor(1e-3), capturable=True, min_8bit_size=1)
    _grads(params, 0)
    with pytest.raises(RuntimeError, match=r"AdamW8bit.step\(\) is being captured .* before its states exist.*"
                       r"run eager warm-up steps"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(params[0], _params(0)[0])


def test_capture_after_a_new_param_group_is_refused_until_an_eager_step(monkeypatch):
    opt, params = _warm()
    extra = torch.nn.Parameter(torch.randn(300))
    extra.grad = torch.randn(300)
    opt.add_param_group({"params": [extra]})
    _refused(opt, params, r"after they changed", monkeypatch)
    assert extra not in opt.state


def test_capture_with_an_lr_tensor_on_another_device_is_refused_naming_it(monkeypatch):
    opt, params = _warm()
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")
    _refused(opt, params, r"param_groups\[0\]\['lr'\] is a tensor on meta, the parameters on cpu", monkeypatch)


def test_capture_with_host_resident_states_is_refused(monkeypatch):
    params = _params(0)
    opt = pagedopt.PagedAdamW8bit(params, lr=torch.tensor(1e-3), capturable=True, min_8bit_size=1)
    opt.set_pager(residency="host", device_buffer="1MiB")
    _grads(params, 0)
    opt.step()  # eager: streamed through the buffer
    _grads(params, 1)
    _refused(opt, params, r"host-resident states \(residency='host'\)", monkeypatch)


def test_capture_with_paged_states_not_resident_is_refused(monkeypatch):
    opt, params = _warm("PagedAdamW8bit")
    monkeypatch.setattr(opt._pager, "all_resident", lambda: False)  # as after page_out() on a GPU
    before = _snapshot(opt, params)
    monkeypatch.setattr(capture_module, "capturing", lambda p: True)
    with pytest.raises(RuntimeError, match=r"while paged states are not all resident"):
        opt.step()
    for a, b in zip(before, _snapshot(opt, params)):
        assert torch.equal(a, b)


def test_a_captured_step_that_passes_the_checks_runs_the_step(monkeypatch):
    # On the CPU nothing is captured: with the probe patched, a step that passes the checks is the
    # same step as an eager one.
    opt, params = _warm()
    ref, ref_params = _warm()
    monkeypatch.setattr(capture_module, "capturing", lambda p: True)
    opt.step()
    monkeypatch.undo()
    ref.step()
    for a, b in zip(_snapshot(ref, ref_params), _snapshot(opt, params)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ checkpoints and copies
def test_a_tensor_lr_survives_a_checkpoint_and_stays_a_tensor_of_the_loading_optimizer():
    opt, params = _run("AdamW8bit", torch.tensor(2e-3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    mine = torch.tensor(5e-4, dtype=torch.float64)
    other = pagedopt.AdamW8bit(params, lr=mine, capturable=True, min_8bit_size=1)
    other.load_state_dict(sd)
    lr = other.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64 and float(lr) == float(torch.tensor(2e-3))
    assert other.capturable is True and "capturable" not in sd["param_groups"][0]


def test_readme_documents_capturable():
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        text = f.read()
    assert "capturable=True" in text and "torch.cuda.graph" in text
