"""A state replaced by hand in ``opt.state`` (or resized in place) that the kernels cannot read is
refused by the next step with a ValueError naming the parameter and the key, and the step changes
nothing: parameters, states and step counters stay bit for bit as they were. The kernels trust the
states' sizes (torch's fused Adam reads and writes a moment of its parameter's size whatever the
moment's size: a smaller one was a heap overflow), so the check comes before any of them runs."""
import pytest
import torch

import pagedopt

CLASSES = ["AdamW32bit", "AdamW8bit", "AdamW4bit", "Lion8bit", "Adam32bit"]


def _warm(name):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 34), (700,))]
    opt = getattr(pagedopt, name)(params, lr=1e-2, weight_decay=0.1, min_8bit_size=100)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return opt, params


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _same(snapshot, opt, params, skip_key=None):
    values, states = snapshot
    for p, v, st in zip(params, values, states):
        assert torch.equal(p.detach(), v)
        for k, t in st.items():
            if not (p is params[0] and k == skip_key):
                assert torch.equal(opt.state[p][k], t), k


BAD = {
    "smaller": lambda t: torch.zeros(5, dtype=t.dtype),
    "other dtype": lambda t: t.double(),
    "not a tensor": lambda t: t.tolist(),
    "sparse": lambda t: t.to_sparse(),
    "not contiguous": lambda t: t.reshape(-1).repeat(2)[::2].reshape(t.shape) if t.dim() else t,
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", CLASSES)
def test_a_moment_replaced_by_hand_is_refused_changing_nothing(name, bad):
    opt, params = _warm(name)
    good = opt.state[params[0]]["state1"]
    before = _snapshot(opt, params)
    opt.state[params[0]]["state1"] = BAD[bad](good)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*state\['state1'\]"):
        opt.step()
    _same(before, opt, params, skip_key="state1")
    opt.state[params[0]]["state1"] = good  # put back: the step runs as if nothing had happened
    opt.step()
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


@pytest.mark.parametrize("key", ["absmax1", "qmap1"])
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_a_quantized_state_s_absmax_or_codebook_replaced_by_hand_is_refused(name, key):
    opt, params = _warm(name)
    good = opt.state[params[0]][key]
    before = _snapshot(opt, params)
    opt.state[params[0]][key] = good[:-1].clone()
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[0\].*state\['{key}'\]"):
        opt.step()
    _same(before, opt, params, skip_key=key)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "ordinary"])
@pytest.mark.parametrize("name", ["AdamW32bit", "Adam32bit"])
def test_a_32bit_moment_resized_in_place_is_refused_not_overrun(name, fast):
    """``resize_`` keeps the tensor (the plan does not see a change): the fast step gives way to the
    ordinary one, which refuses it by name before torch's fused kernel runs; the parameters are
    unchanged (the step counters have moved: the check is the kernel's own, made per call)."""
    opt, params = _warm(name)
    if not fast:
        params[1].grad = None  # the ordinary step
    values = [p.detach().clone() for p in params]
    opt.state[params[0]]["state2"].resize_(7)
    # the fast step's plan is current: the per-call check (has 7 elements); the ordinary step's
    # parameters changed (a gradient fewer), so a new plan checks the states first (of shape (7,))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*state\['state2'\] "
                                         r"(has 7 elements|is torch.float32 of shape \(7,\))"):
        opt.step()
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values))


@pytest.mark.cuda
@pytest.mark.parametrize("name", CLASSES)
def test_a_moment_moved_to_another_device_by_hand_is_refused(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda")) for s in ((40, 34), (700,))]
    opt = getattr(pagedopt, name)(params, lr=1e-2, min_8bit_size=100)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device="cuda")
    opt.step()
    before = _snapshot(opt, params)
    opt.state[params[0]]["state1"] = opt.state[params[0]]["state1"].cpu()
    with pytest.raises(ValueError, match=r"state\['state1'\] is on cpu"):
        opt.step()
    _same(before, opt, params, skip_key="state1")


@pytest.mark.parametrize("name", ["PagedAdamW32bit", "PagedAdamW8bit"])
def test_a_host_resident_moment_replaced_by_hand_is_refused_changing_nothing(name):
    """Streamed states (residency="host") are checked alike (their device aside: they live in host
    memory), before the pager sizes its copies from them."""
    import warnings

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 34), (700,))]
    opt = getattr(pagedopt, name)(params, lr=1e-2, min_8bit_size=100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not paged on cpu": the host pager streams on the CPU too
        opt.set_pager(residency="host", device_buffer="1MiB")
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        good = opt.state[params[0]]["state2"]
        before = _snapshot(opt, params)
        opt.state[params[0]]["state2"] = good.reshape(-1)[:3].clone()
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*state\['state2'\]"):
            opt.step()
    _same(before, opt, params, skip_key="state2")
