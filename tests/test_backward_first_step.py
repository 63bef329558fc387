"""Updates during backward in a step without a schedule (pagedopt/optim/backward_first_step.py):
the first step after ``set_pager(update_in_backward=True)``, and the first after a load, update
their parameters in chunks as the gradients arrive and release the gradients, for every
residency: bit for bit the ordinary run (parameters, states, counters, state_dict), gradients held
during the first backward about a chunk, keep_grads, gradients set by hand, parameters without
gradients, a second backward, running out of memory while a chunk's states are made. The CUDA
twins (``@pytest.mark.cuda``) run the chunks on the update stream beside backward's kernels."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import pagedopt
from pagedopt.optim import residency

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KiB = 1 << 10
WIDTH, LAYERS = 64, 7  # chunks of three layers (below): the last chunk, of one layer, waits for step()
# a chunk of updates: 20 KiB of states, so that the first step's chunks hold two or three layers
# of 8-bit states (a 64 x 64 weight: 4096 codes per moment and 16 absmax floats per moment) and
# one layer of 32-bit ones (32 KiB for Adam's two moments)
CHUNK = 20 * KiB
# set_pager arguments of each residency (the buffer: four chunks, as chunks_per_buffer says)
RESIDENCIES = {
    "resident": {"residency": "device"},
    "budget": {"device_budget": 24 * KiB, "device_buffer": 4 * CHUNK},
    "host": {"residency": "host", "device_buffer": 4 * CHUNK},
    "auto": {"residency": "auto", "device_buffer": 4 * CHUNK},
}
CASES = ([(name, "resident") for name in ("AdamW8bit", "AdamW32bit", "Lion8bit", "AdEMAMix8bit", "LAMB8bit")]
         + [(name, mode) for name in ("PagedAdamW8bit", "PagedAdamW32bit", "PagedLion8bit", "PagedAdEMAMix8bit")
            for mode in RESIDENCIES])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(residency, "CHUNK_BYTES", CHUNK)


class Net(nn.Module):
    """LAYERS linear layers, one of which (``unused``) the graph leaves out: its parameters get no
    gradient; ``extra``, in the optimizer but not in the graph, gets its gradient by hand."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Parameter(torch.randn(300))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _require(device):
    if device == "cuda":
        from pagedopt import paging

        reason = paging.paging_unavailable_reason("cuda:0")
        if reason is not None:
            pytest.skip(reason)


def _make(name, mode, bwd, device="cpu", keep_grads=False):
    torch.manual_seed(0)
    m = Net().to(device)
    opt = getattr(pagedopt, name)(m.parameters(), lr=1e-2, min_8bit_size=1024)
    pager = RESIDENCIES[mode] if name.startswith("Paged") else {}
    if bwd:
        opt.set_pager(**pager, update_in_backward=True, keep_grads=keep_grads)
    elif pager:
        opt.set_pager(**pager)
    return m, opt


def _step(m, opt, i, device, before_step=None):
    """One training step (batch ``i``); ``extra`` gets its gradient by hand before step(). Returns how
    many of the layers' parameters had a state when backward() returned (updated during backward: the first step's
    states are made by the chunks)."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, WIDTH, generator=g).to(device)
    m(x).square().mean().backward()
    bwd = opt._backward_updates
    if bwd is not None:
        bwd._join_worker()
    with_state = sum(1 for p in m.layers.parameters() if "step" in opt.state.get(p, {}))
    m.extra.grad = torch.randn(m.extra.shape, generator=g).to(device)
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    return with_state


def _assert_same_state_dicts(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys(), k
        for kk, v in sa["state"][k].items():
            w = sb["state"][k][kk]
            assert torch.equal(v.cpu(), w.cpu()) if isinstance(v, torch.Tensor) else v == w, (k, kk)


def _assert_same(m1, o1, m2, o2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    _assert_same_state_dicts(o1, o2)


@pytest.mark.parametrize("update_thread", [False, True], ids=["in_hooks", "update_thread"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,mode", CASES)
def test_the_first_step_updates_in_chunks_bit_for_bit(name, mode, device, update_thread, monkeypatch):
    _require(device)
    from pagedopt.optim.backward_updates import BackwardUpdates

    monkeypatch.setattr(BackwardUpdates, "update_thread", update_thread)
    ref_m, ref = _make(name, mode, False, device)
    m, opt = _make(name, mode, True, device)
    with_state = []
    for i in range(3):
        _step(ref_m, ref, i, device)
        with_state.append(_step(m, opt, i, device))
        if i == 0:  # the first step's state_dict: the same keys and tensors, none for `unused`
            _assert_same(ref_m, ref, m, opt)
            assert all(p not in opt.state or len(opt.state[p]) == 0 for p in m.unused.parameters())
    _assert_same(ref_m, ref, m, opt)
    assert [float(opt.state[p]["step"]) for p in m.layers.parameters()] == [3.0] * 2 * LAYERS
    assert float(opt.state[m.extra]["step"]) == 3.0
    # the first backward made (and updated) the states of the chunks that filled (8-bit states:
    # two of three layers, the last layer left to step(); 32-bit: a layer each): two chunks at least
    assert 2 * 2 <= with_state[0] <= 2 * LAYERS, with_state
    assert with_state[1:] == [2 * LAYERS] * 2  # then the schedule: every layer during backward
    assert opt._backward_updates._schedule is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["resident", "host"])
def test_gradients_held_during_the_first_backward_stay_about_a_chunk(mode, device):
    """Counted by a hook of the test's own, registered after the optimizer's (so it runs after
    it): the bytes of the gradients alive at each gradient's arrival. A chunk is CHUNK bytes of
    8-bit states: two 64 x 64 layers (8.3 KiB each, with biases of 0.5 KiB of 32-bit states) and
    the start of a third, so the gradients alive are at most three layers' (weights and biases),
    the chunk filling up plus the one that fills it, where the ordinary step holds all seven."""
    _require(device)
    m, opt = _make("PagedAdamW8bit", mode, True, device)
    params = list(m.layers.parameters())
    live = []

    def count(p):
        live.append(sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))
    for p in params:
        p.register_post_accumulate_grad_hook(count)
    layer = (WIDTH * WIDTH + WIDTH) * 4  # a layer's fp32 gradients
    for i in range(2):
        live.clear()
        _step(m, opt, i, device)
        assert len(live) == len(params)
        assert max(live) <= 3 * layer, (i, max(live), layer)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("device", DEVICES)
def test_keep_grads_keeps_every_gradient_of_the_first_step(device):
    _require(device)
    ref_m, ref = _make("PagedAdamW8bit", "host", False, device)
    m, opt = _make("PagedAdamW8bit", "host", True, device, keep_grads=True)
    for i in range(3):
        seen = {}

        def look(m=m, seen=seen):
            seen["grads"] = [None if p.grad is None else p.grad.clone() for p in m.parameters()]

        def look_ref(ref_m=ref_m, seen=seen):
            seen["ref"] = [None if p.grad is None else p.grad.clone() for p in ref_m.parameters()]
        _step(ref_m, ref, i, device, look_ref)
        with_state = _step(m, opt, i, device, look)
        assert with_state > 0  # updated during backward, gradients kept all the same
        for a, b in zip(seen["grads"], seen["ref"]):
            assert (a is None and b is None) or torch.equal(a, b)
    _assert_same(ref_m, ref, m, opt)


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_backward_before_the_first_step_raises(device):
    _require(device)
    m, opt = _make("PagedAdamW8bit", "host", True, device)
    x = torch.randn(8, WIDTH, device=device)
    m(x).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"received a second gradient before step\(\).*update_in_backward = False"):
        m(x).square().mean().backward()


def test_a_resumed_first_step_and_a_load_bit_for_bit():
    """A checkpoint of the first step loaded into a new optimizer with update_in_backward (whose
    first step then has states but no schedule) goes on as the uninterrupted ordinary run."""
    ref_m, ref = _make("PagedAdamW8bit", "host", False)
    m, opt = _make("PagedAdamW8bit", "host", True)
    _step(ref_m, ref, 0, "cpu")
    _step(m, opt, 0, "cpu")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed_m = copy.deepcopy(m)
    resumed = getattr(pagedopt, "PagedAdamW8bit")(resumed_m.parameters(), lr=1e-2, min_8bit_size=1024)
    resumed.set_pager(**RESIDENCIES["host"], update_in_backward=True)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    counts = []
    for i in range(1, 4):
        _step(ref_m, ref, i, "cpu")
        counts.append(_step(resumed_m, resumed, i, "cpu"))
    _assert_same(ref_m, ref, resumed_m, resumed)
    assert all(c == 2 * LAYERS for c in counts)  # states loaded: every layer had one already


class _OutOfMemoryFrom:
    """An allocator for the optimizer's states that raises torch.OutOfMemoryError from its ``n``-th
    call on while ``on`` (as the CUDA caching allocator does while a state does not fit)."""

    def __init__(self, real, n: int):
        self.real, self.n, self.calls, self.on = real, n, 0, True

    def __call__(self, shape, dtype, device):
        self.calls += 1
        if self.on and self.calls >= self.n:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return self.real(shape, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "AdamW32bit", "PagedAdEMAMix8bit"])
def test_out_of_memory_making_a_chunks_states_leaves_the_rest_to_step(name, device):
    """Out of memory while the second chunk's states are made during the first backward: a
    warning; the first chunk stays updated, backward goes on holding the other gradients; step()
    raises torch.OutOfMemoryError while memory is still short, changing nothing; once memory is
    free step() finishes the step, and the run is bit for bit the uninterrupted one."""
    _require(device)
    mode = "host" if name.startswith("Paged") else "resident"
    ref_m, ref = _make(name, mode, False, device)
    # a probe of the same first backward: how many states the chunks allocate before each one
    probe_m, probe = _make(name, mode, True, device)
    counting = _OutOfMemoryFrom(probe.state_zeros, 0)
    counting.on, starts, make_plan = False, [], probe.make_plan
    probe.state_zeros = counting
    probe.make_plan = lambda *args: (starts.append(counting.calls), make_plan(*args))[1]
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100)).to(device)
    probe_m(x).square().mean().backward()
    assert len(starts) >= 2
    m, opt = _make(name, mode, True, device)
    injected = _OutOfMemoryFrom(opt.state_zeros, starts[1] + 2)  # the second chunk's second state (or its first)
    opt.state_zeros = injected
    with pytest.warns(RuntimeWarning, match=r"could not be made during backward \(OutOfMemoryError"):
        m(x).square().mean().backward()
    updated = [p for p in m.parameters() if "step" in opt.state.get(p, {})]
    assert updated and all(p.grad is None for p in updated)  # the chunks before the failure: updated, released
    left = [p for p in m.layers.parameters() if p.grad is not None]
    assert left and all(len(opt.state.get(p, {})) == 0 for p in left)  # no half-made state
    snapshot = [p.detach().clone() for p in m.parameters()]
    g = torch.Generator().manual_seed(100)
    torch.randn(8, WIDTH, generator=g)
    m.extra.grad = torch.randn(m.extra.shape, generator=g).to(device)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, m.parameters()))
    assert all(len(opt.state.get(p, {})) == 0 for p in left)
    injected.on = False  # memory is free again
    opt.step()
    opt.zero_grad()
    _step(ref_m, ref, 0, device)
    _assert_same(ref_m, ref, m, opt)
    for i in range(1, 3):
        _step(ref_m, ref, i, device)
        assert _step(m, opt, i, device) == 2 * LAYERS  # the schedule, made by the finished step
    _assert_same(ref_m, ref, m, opt)


def test_a_group_without_states_is_left_to_step():
    """Plain SGD (momentum 0) keeps no state: its parameters wait for step() with their gradients,
    bit for bit, while another group's are updated during backward."""
    def make(bwd):
        torch.manual_seed(0)
        m = Net()
        opt = pagedopt.SGD8bit([{"params": m.layers[:5].parameters()},  # 4.4 KiB of states a layer: one chunk
                                {"params": list(m.layers[5:].parameters()) + [m.extra], "momentum": 0.0}],
                               lr=1e-2, momentum=0.9, min_8bit_size=1024)
        if bwd:
            opt.set_pager(update_in_backward=True)
        return m, opt
    (ref_m, ref), (m, opt) = make(False), make(True)
    counts = []
    for i in range(3):
        _step(ref_m, ref, i, "cpu")
        counts.append(_step(m, opt, i, "cpu"))
    _assert_same(ref_m, ref, m, opt)
    assert all(c >= 2 * 5 for c in counts)


@pytest.mark.cuda
def test_cuda_the_first_backward_holds_about_a_chunk_of_gradients():
    """Measured on the GPU: the first backward's peak memory with released gradients is lower than
    with kept ones by at least half the gradients' bytes (each chunk's gradients are freed once
    its update on the update stream has read them; a few chunks may be in flight)."""
    _require("cuda")
    torch.manual_seed(0)
    peaks = {}
    for keep in (True, False):
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)]).cuda()
        opt = pagedopt.AdamW8bit(m.parameters(), lr=1e-3)
        opt.set_pager(update_in_backward=True, keep_grads=keep)
        x = torch.randn(16, 1024, device="cuda")
        residency.CHUNK_BYTES = 4 << 20  # the fixture restores it
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(x).square().mean().backward()
        torch.cuda.synchronize()
        peaks[keep] = torch.cuda.max_memory_allocated() - base
        opt.step()
        opt.zero_grad(set_to_none=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert peaks[True] - peaks[False] >= grad_bytes / 2, (peaks, grad_bytes)


def test_a_new_backward_after_a_step_that_raised_starts_a_new_step():
    """step() raised (out of memory for the states of the parameters left to it) and the caller
    goes on with a new batch instead of repeating it: that backward is a new step (no "second
    gradient" error), and every parameter's counter counts the steps it took."""
    m, opt = _make("PagedAdamW8bit", "host", True)
    injected = _OutOfMemoryFrom(opt.state_zeros, 10 ** 9)  # every allocation succeeds during backward
    opt.state_zeros = injected
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100))
    m(x).square().mean().backward()
    updated = {p for p in m.layers.parameters() if p.grad is None}
    assert updated
    injected.n = 0  # now memory runs out: step() cannot make the rest's states
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    injected.on = False
    opt.zero_grad()
    for i in range(1, 3):
        assert _step(m, opt, i, "cpu") > 0
    assert [float(opt.state[p]["step"]) for p in m.layers.parameters()] == [
        3.0 if p in updated else 2.0 for p in m.layers.parameters()]


def test_a_default_device_buffer_grows_for_the_largest_state_that_cannot_be_cut(monkeypatch):
    """AdEMAMix's stacked moments stream in one piece: a device buffer of the default size grows to
    hold the largest before its first pass. The largest here is the first layer's, whose gradient
    comes last, after the first chunks have run (and allocated the buffer): grown before them, as
    the ordinary step grows it, the run is bit for bit the ordinary one."""
    from pagedopt.paging import host_resident

    monkeypatch.setattr(host_resident, "DEFAULT_DEVICE_BUFFER", 16 * KiB)

    def make(bwd):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, WIDTH), *[nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        opt = pagedopt.PagedAdEMAMix8bit(m.parameters(), lr=1e-2, min_8bit_size=1024)
        opt.set_pager(residency="host", update_in_backward=bwd)
        return m, opt
    (ref_m, ref), (m, opt) = make(False), make(True)
    for i in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i))
        for mm, oo in ((ref_m, ref), (m, opt)):
            mm(x).square().mean().backward()
            if oo is opt and i == 0:  # the last layers' chunks ran during the first backward
                assert m[3].weight.grad is None
            oo.step()
            oo.zero_grad()
    assert opt.pager.device_buffer_bytes == ref.pager.device_buffer_bytes > 16 * KiB
    for a, b in zip(ref_m.parameters(), m.parameters()):
        assert torch.equal(a, b)
    _assert_same_state_dicts(ref, opt)
