"""Updates during backward with every residency (states resident in an optimizer that does not
page, paged and resident, paged under a device budget, host-resident): bit for bit the ordinary
step, and the gradients released as their updates run (``p.grad = None``) unless
``keep_grads=True``, which leaves them as the ordinary step would. On CUDA the released gradients
show in the memory backward holds."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pagedopt

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# (class, set_pager arguments): None for the ordinary step's reference
MODES = {
    "unpaged": ("AdamW8bit", {}),
    "resident": ("PagedAdamW8bit", {"residency": "device"}),
    "budget": ("PagedAdamW8bit", {"device_budget": 64 << 10, "device_buffer": 256 << 10}),
    "auto": ("PagedAdamW8bit", {"residency": "auto"}),
    "host": ("PagedAdamW8bit", {"residency": "host", "device_buffer": 256 << 10}),
    "lion_resident": ("PagedLion8bit", {"residency": "device"}),
    "ademamix_unpaged": ("AdEMAMix8bit", {}),
}


def _require(device):
    if device == "cuda":
        from pagedopt import paging

        reason = paging.paging_unavailable_reason("cuda:0")
        if reason is not None:
            pytest.skip(reason)


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 24)).to(device)


def _make(name, m, pager: dict, bwd: bool, keep_grads: bool = False):
    opt = getattr(pagedopt, name)(m.parameters(), lr=1e-2, min_8bit_size=1024)
    if bwd:
        opt.set_pager(**pager, update_in_backward=True, keep_grads=keep_grads)
    elif pager:
        opt.set_pager(**pager)
    return opt


def _train(m, opt, device, steps, seen=None):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(device)
        m(x).square().mean().backward()
        if seen is not None:
            seen.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_residency_updates_during_backward_bit_for_bit_and_releases_gradients(device, mode):
    _require(device)
    name, pager = MODES[mode]
    runs = {}
    for key, bwd, keep in (("ordinary", False, False), ("released", True, False), ("kept", True, True)):
        m = _model(device)
        opt = _make(name, m, pager, bwd, keep)
        seen = []
        _train(m, opt, device, 4, seen)
        runs[key] = (m, opt, seen)
    n = len(list(runs["ordinary"][0].parameters()))
    for key in ("released", "kept"):
        for a, b in zip(runs["ordinary"][0].parameters(), runs[key][0].parameters()):
            assert torch.equal(a, b), key
        for p, q in zip(runs["ordinary"][0].parameters(), runs[key][0].parameters()):
            s, t = runs["ordinary"][1].state[p], runs[key][1].state[q]
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, t[k]), (key, k)
    # the first step is ordinary (it learns the order of the gradients): every gradient there after
    # backward; from the second on, none is left after backward (all released by their updates) ...
    assert all(g is not None for g in runs["released"][2][0])
    assert all(all(g is None for g in grads) for grads in runs["released"][2][1:]), mode
    # ... unless kept: then they are the ordinary run's gradients (the model's parameters moved
    # during backward, but each gradient was final before its update)
    for grads, ref in zip(runs["kept"][2], runs["ordinary"][2]):
        assert len(grads) == n and all(torch.equal(a, b) for a, b in zip(grads, ref))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_set_by_hand_are_updated_in_step_and_kept(device):
    """A step whose gradients come from no backward (no hook fires) is done by step(), and its
    gradients stay (step() never frees gradients)."""
    _require(device)
    m, ref_m = _model(device), _model(device)
    opt, ref = _make("PagedAdamW8bit", m, {"residency": "device"}, True), _make("PagedAdamW8bit", ref_m, {}, False)
    _train(m, opt, device, 2)
    _train(ref_m, ref, device, 2)
    gen = torch.Generator().manual_seed(5)
    for p, q in zip(m.parameters(), ref_m.parameters()):
        p.grad = torch.randn(p.shape, generator=gen).to(device)
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert all(p.grad is not None for p in m.parameters())
    for p, q in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)


@pytest.mark.cuda
def test_released_gradients_lower_the_memory_backward_holds(monkeypatch):
    """Measured, not assumed: the peak memory allocated during a backward with updates is lower
    with released gradients than with kept ones, by at least half the gradients' bytes (each is
    freed once its chunk's update has read it; a few chunks may be in flight). Chunks of 4 MiB of
    states (two of the 24 layers' 2 MiB of 8-bit states), so that the model spans twelve of them
    (with the default 64 MiB chunk it would be one chunk, updated after the last gradient)."""
    _require("cuda")
    from pagedopt.optim import residency

    monkeypatch.setattr(residency, "CHUNK_BYTES", 4 << 20)
    torch.manual_seed(0)
    peaks = {}
    for keep in (True, False):
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)]).cuda()
        opt = pagedopt.AdamW8bit(m.parameters(), lr=1e-3)
        opt.set_pager(update_in_backward=True, keep_grads=keep)
        x = torch.randn(16, 1024, device="cuda")
        for step in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            m(x).square().mean().backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks[keep] = peak  # the last step's: updates during backward from the second on
    grad_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert peaks[True] - peaks[False] >= grad_bytes / 2, (peaks, grad_bytes)
