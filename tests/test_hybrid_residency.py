"""Hybrid residency (``set_pager(residency="auto")``, or ``device_budget=`` alone): the states that
fit in the budget stay on the device and are never moved, the rest live on the host and stream
through the device buffer. Bit for bit the resident step; only the host part crosses the link; a
budget that holds everything steps as if resident (held states, no device buffer); the budget
"auto" takes from the memory counters. On the CPU the "device" is the CPU itself: the pager's
resident tensors are ordinary tensors and its host tensors are the ones it streams."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedopt
from pagedopt.paging import HostResidentPager
from pagedopt.paging.resident_set import AUTO_MARGIN_MIN, auto_budget

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
GiB = 1 << 30
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _require(device):
    if device == "cuda":
        from pagedopt import paging

        reason = paging.paging_unavailable_reason("cuda:0")
        if reason is not None:
            pytest.skip(reason)


def _params(device, seed=0):
    """A mix: a large contiguous parameter (cut into pieces when streamed), a non-contiguous one,
    mid-sized ones and a small one under min_8bit_size (fp32 states)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 512), (64, 64), (300, 40), (2000,), (20,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    ps.append(torch.nn.Parameter(torch.randn(80, 48, generator=g).to(device).t()))  # non-contiguous
    return ps


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


def _run(name, device, pager_args, steps=4, seed=0):
    params = _params(device, seed)
    opt = getattr(pagedopt, name)(params, lr=1e-2, min_8bit_size=1024)
    if pager_args is not None:
        opt.set_pager(**pager_args)
    for s in range(steps):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        opt.step()
    return params, opt


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
               if isinstance(t, torch.Tensor) and k.startswith(("state", "absmax")))


def _assert_same(a_params, a_opt, b_params, b_opt):
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
    for p, q in zip(a_params, b_params):
        for k, v in a_opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.cpu(), b_opt.state[q][k].cpu()), k


# ---------------------------------------------------------------- the budget "auto" takes
def test_auto_budget_worked_example():
    # an 80 GiB GPU with 20 GiB free; torch holds 50 GiB reserved of which 45 allocated; the step's
    # peak allocated 60 GiB (15 GiB of activations freed since): 20 + 5 - 15 = 10 GiB available;
    # margin max(80 GiB / 20, 1 GiB) = 4 GiB; the 256 MiB device buffer: 10 - 4 - 0.25 = 5.75 GiB
    assert auto_budget(20 * GiB, 80 * GiB, 50 * GiB, 45 * GiB, 60 * GiB, 256 << 20) == int(5.75 * GiB)


@given(free=st.integers(0, 200 * GiB), total=st.integers(1, 200 * GiB), reserved=st.integers(0, 100 * GiB),
       allocated=st.integers(0, 100 * GiB), extra_peak=st.integers(0, 50 * GiB), reserve=st.integers(0, 4 * GiB),
       more=st.integers(1, 10 * GiB))
@settings(max_examples=200, deadline=None)
def test_auto_budget_is_bounded_and_moves_the_right_way(free, total, reserved, allocated, extra_peak, reserve, more):
    peak = allocated + extra_peak
    b = auto_budget(free, total, reserved, allocated, peak, reserve)
    assert b >= 0
    # never more than the memory free beyond the peak, less the larger of 5% of the GPU and 1 GiB
    assert b <= max(free + max(reserved - allocated, 0) - extra_peak - max(total // 20, AUTO_MARGIN_MIN) - reserve, 0) + 1
    # more free memory never lowers it; a higher peak or a larger buffer never raises it
    assert auto_budget(free + more, total, reserved, allocated, peak, reserve) >= b
    assert auto_budget(free, total, reserved, allocated, peak + more, reserve) <= b
    assert auto_budget(free, total, reserved, allocated, peak, reserve + more) <= b


# ---------------------------------------------------------------- the pager
def test_pager_keeps_what_fits_and_streams_the_rest():
    pager = HostResidentPager(64 << 10, resident_bytes=10_000)
    a = pager.zeros((1000,), torch.float32, "cpu")   # 4000 bytes: stays
    b = pager.zeros((1500,), torch.float32, "cpu")   # 6000 more: 10000, stays (the budget is inclusive)
    c = pager.zeros((10,), torch.uint8, "cpu")       # over the budget: host
    assert pager.holds_resident(a) and pager.holds_resident(b) and not pager.holds_resident(c)
    assert pager.holds_resident(a.view(-1)[100:200])  # a view of a resident tensor stays too
    assert [id(t) for t in pager.tensors()] == [id(c)]
    assert not pager.all_resident()
    a.fill_(1.5)
    c.fill_(7)
    moved = []
    for i, views in pager.stream("cpu", [[a, c], [b]]):
        assert views[0] is ([a, c], [b])[i][0]  # the resident tensor itself, not a copy
        views[0].add_(1)
        if i == 0:
            assert views[1] is not c and torch.equal(views[1], c)
            views[1].add_(1)
        moved.append(pager.stats().page_in_bytes_last_step)
    assert torch.all(a == 2.5) and torch.all(c == 8) and torch.all(b == 1)
    s = pager.stats()
    assert s.page_in_bytes_last_step == 10 and s.page_out_bytes_last_step == 10  # only c crossed
    assert s.resident_bytes == 10_000 and s.host_bytes == 10 and s.budget_bytes == 10_000
    del a, b, views  # the last group's views hold b
    assert pager.stats().resident_bytes == 0
    # freed resident tensors give their budget back
    d = pager.zeros((2500,), torch.float32, "cpu")
    assert pager.holds_resident(d)


def test_pager_with_everything_resident_is_all_resident_and_pickles_its_budget():
    pager = HostResidentPager(4096, resident_bytes="auto")
    ts = [pager.zeros((n,), torch.float32, "cpu") for n in (10, 5000, 300)]  # "auto" on the CPU: no bound
    assert pager.all_resident() and all(pager.holds_resident(t) for t in ts)
    assert pager.resident_limit("cpu") is None
    clone = copy.deepcopy(pager)
    assert clone.resident_bytes == "auto" and clone.device_buffer_bytes == 4096
    assert not HostResidentPager(4096).holds_resident(ts[0])  # a pure host pager keeps nothing


@pytest.mark.parametrize("bad", [-1, 1.5, "lots", True])
def test_pager_refuses_a_bad_resident_budget(bad):
    with pytest.raises(ValueError, match="resident_bytes"):
        HostResidentPager(4096, resident_bytes=bad)


# ---------------------------------------------------------------- optimizers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedLion8bit", "PagedAdEMAMix8bit", "PagedAdamW32bit"])
def test_part_resident_part_streamed_is_bit_for_bit_resident(device, name, monkeypatch):
    _require(device)
    ref_params, ref = _run(name, device, {"residency": "device"} if device == "cuda" else None)
    total = _state_bytes(ref)
    budget = total // 2
    # a buffer a few chunks wide; AdEMAMix's stacked moments cannot be cut, and its largest states
    # (150 KB) do not fit 96 KiB: the default buffer (made that small here) grows to hold them
    monkeypatch.setattr("pagedopt.paging.host_resident.DEFAULT_DEVICE_BUFFER", 96 << 10)
    params, opt = _run(name, device, {"device_budget": budget})
    _assert_same(ref_params, ref, params, opt)
    pager = opt.pager
    kept = sum(t.numel() * t.element_size() for t in pager.resident_tensors())
    host = sum(t.numel() * t.element_size() for t in pager.tensors())
    assert 0 < kept <= budget and host > 0
    assert kept + host == total
    stats = opt.paging_stats()
    # the last step moved the host part in and back, and not a byte of the resident part
    assert stats.page_in_bytes_last_step == host and stats.page_out_bytes_last_step == host
    grown = name == "PagedAdEMAMix8bit"
    assert (opt.pager.device_buffer_bytes > 96 << 10) == grown
    for p in params:
        for k, t in opt.state[p].items():
            if k.startswith(("state", "absmax")):
                assert (t.device.type == device) == pager.holds_resident(t) or device == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_a_budget_that_holds_everything_steps_as_resident(device):
    _require(device)
    ref_params, ref = _run("PagedAdamW8bit", device, {"residency": "device"} if device == "cuda" else None)
    params, opt = _run("PagedAdamW8bit", device, {"residency": "auto", "device_budget": "1GiB"})
    _assert_same(ref_params, ref, params, opt)
    stats = opt.paging_stats()
    assert opt.pager.all_resident() and stats.host_bytes == 0 and stats.resident_bytes == _state_bytes(ref)
    assert stats.bytes_moved_last_step == 0 and stats.device_buffer_bytes == 0  # no buffer was ever made
    assert opt.step_plan.fast  # the held-states step, as with resident states


def test_budget_zero_streams_everything_like_host_residency():
    ref_params, ref = _run("PagedAdamW8bit", "cpu", {"residency": "host", "device_buffer": 96 << 10})
    params, opt = _run("PagedAdamW8bit", "cpu", {"device_budget": 0, "device_buffer": 96 << 10})
    _assert_same(ref_params, ref, params, opt)
    assert opt.pager.resident_tensors() == [] and opt.paging_stats().page_in_bytes_last_step == _state_bytes(ref)


def test_checkpoint_and_copies_keep_the_hybrid_pager():
    params, opt = _run("PagedAdamW8bit", "cpu", {"device_budget": 20_000, "device_buffer": 96 << 10}, steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    clone = copy.deepcopy(opt)
    assert clone.pager.resident_bytes == 20_000 and clone.pager.device_buffer_bytes == 96 << 10
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = pagedopt.PagedAdamW8bit(fresh_params, lr=1e-2, min_8bit_size=1024)
    fresh.set_pager(device_budget=20_000, device_buffer=96 << 10)
    fresh.load_state_dict(sd)
    for s in range(2, 4):
        for group in (params, fresh_params):
            for p, g in zip(group, _grads(group, s)):
                p.grad = g
        opt.step()
        fresh.step()
    _assert_same(params, opt, fresh_params, fresh)
    assert 0 < sum(t.numel() for t in fresh.pager.resident_tensors())


def test_a_buffer_set_by_hand_does_not_grow():
    params = _params("cpu")
    opt = pagedopt.PagedAdEMAMix8bit(params, lr=1e-2, min_8bit_size=1024)
    opt.set_pager(residency="host", device_buffer=96 << 10)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*device_buffer"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and all(len(s) == 0 for s in opt.state.values())
    assert opt.pager.device_buffer_bytes == 96 << 10


def test_refusals_name_the_argument_and_change_nothing():
    params = _params("cpu")
    opt = pagedopt.PagedAdamW8bit(params)
    before = opt.pager
    with pytest.raises(ValueError, match="device_budget=... goes with residency='auto'"):
        opt.set_pager(residency="host", device_budget="1GiB")
    with pytest.raises(ValueError, match="device_budget=... goes with residency='auto'"):
        opt.set_pager(residency="device", device_budget="1GiB")
    with pytest.raises(ValueError, match="exactly one"):
        opt.set_pager(HostResidentPager(4096), residency="auto")
    with pytest.raises(ValueError, match="device_budget"):
        opt.set_pager(residency="auto", device_budget="lots")
    with pytest.raises(ValueError, match="residency must be 'host', 'auto' or 'device'"):
        opt.set_pager(residency="hybrid")
    assert opt.pager is before


def test_auto_on_the_cpu_keeps_every_state():
    params, opt = _run("PagedAdamW8bit", "cpu", {"residency": "auto"}, steps=1)
    assert opt.pager.all_resident() and opt.pager.tensors() == []
    assert math.isclose(opt.paging_stats().resident_bytes, _state_bytes(opt))


@pytest.mark.cuda
def test_auto_on_the_gpu_measures_its_budget_from_free_memory():
    _require("cuda")
    params, opt = _run("PagedAdamW8bit", "cuda", {"residency": "auto"}, steps=2)
    limit = opt.pager.resident_limit("cuda")
    free, total = torch.cuda.mem_get_info()
    # a few MiB of states on a GPU with gigabytes free: a bound was measured, and everything fits in it
    assert limit is not None and 0 < limit <= free + torch.cuda.memory_reserved()
    assert opt.pager.all_resident() and all(t.is_cuda for t in opt.pager.resident_tensors())
    assert opt.paging_stats().bytes_moved_last_step == 0
