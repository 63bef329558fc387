"""HostResidentPager and residency='host' on the CPU: the streaming schedule (regions of the device
buffer, wrap-around, no group overwritten while in use, copies back), its refusals, and every paged
optimizer streamed through a buffer a few chunks wide, bit for bit against resident states, through
checkpoints and copies. On CUDA: tests/test_paging_cuda.py."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import pagedopt
from pagedopt.paging import HostResidentPager
from pagedopt.paging.host_resident import REGION_ALIGN

PAGED = [name for name in pagedopt.__all__ if name.startswith("Paged")]


def _host_tensors(sizes_dtypes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, dtype in sizes_dtypes:
        if dtype == torch.uint8:
            out.append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
        else:
            out.append(torch.randn(n, generator=g).to(dtype))
    return out


@pytest.mark.parametrize("buffer", [4096, 6144, 20000])
def test_pass_copies_in_works_and_copies_back_every_group(buffer):
    pager = HostResidentPager(buffer, prefetch_depth=2)
    groups = [_host_tensors([(300, torch.float32), (700, torch.uint8)], seed=i) for i in range(9)]
    groups += [_host_tensors([(100, torch.bfloat16)], seed=99)]
    expected = [[t.clone() for t in g] for g in groups]
    seen = []
    for i, views in pager.stream("cpu", groups):
        seen.append(i)
        # the group's views hold its host tensors (no later copy-in overwrote them) and are not them
        for v, t in zip(views, groups[i]):
            assert torch.equal(v, t) and v.data_ptr() != t.data_ptr()
            assert v.untyped_storage().data_ptr() == pager._buffers[torch.device("cpu")].untyped_storage().data_ptr()
            assert (v.data_ptr() - v.untyped_storage().data_ptr()) % REGION_ALIGN == 0
        for v in views:
            v.mul_(3) if v.is_floating_point() else v.add_(7)
        for e in expected[i]:
            e.mul_(3) if e.is_floating_point() else e.add_(7)
    assert seen == list(range(len(groups)))
    for g, e in zip(groups, expected):
        assert all(torch.equal(t, x) for t, x in zip(g, e))
    s = pager.stats()
    moved = sum(t.numel() * t.element_size() for g in groups for t in g)
    assert s.page_in_bytes_last_step == moved and s.page_out_bytes_last_step == moved
    assert s.device_buffer_bytes == buffer and s.resident_bytes == 0


def test_regions_wrap_around_the_buffer():
    pager = HostResidentPager(3 * 1024, prefetch_depth=1)
    groups = [[torch.full((200,), float(i))] for i in range(7)]  # 800 bytes -> 1024-byte regions
    starts = []
    for i, views in pager.stream("cpu", groups):
        starts.append(views[0].data_ptr() - views[0].untyped_storage().data_ptr())
    assert starts == [0, 1024, 2048, 0, 1024, 2048, 0]


def test_refused_groups_move_nothing():
    pager = HostResidentPager(1024)
    ok = [torch.ones(10)]
    big = [torch.ones(300)]  # 1200 bytes
    with pytest.raises(ValueError, match="stream group 1 needs 1280 bytes of device buffer"):
        pager.stream("cpu", [ok, big])
    assert pager._buffers == {} and pager.stats().page_in_bytes_last_step == 0
    with pytest.raises(ValueError, match="non-contiguous"):
        pager.stream("cpu", [[torch.ones(4, 4).t()]])
    with pytest.raises(ValueError, match="device_buffer_bytes must be an int"):
        HostResidentPager(10)
    with pytest.raises(ValueError, match="device_buffer_bytes must be an int"):
        HostResidentPager(True)
    with pytest.raises(ValueError, match="prefetch_depth"):
        HostResidentPager(4096, prefetch_depth=-1)


def test_a_failed_iteration_copies_nothing_back_and_stops():
    pager = HostResidentPager(8192)
    groups = [[torch.zeros(10)] for _ in range(4)]
    with pytest.raises(RuntimeError, match="boom"):
        for i, views in pager.stream("cpu", groups):
            views[0].fill_(i + 1)
            if i == 2:
                raise RuntimeError("boom")
    assert [float(g[0][0]) for g in groups] == [1.0, 2.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------- optimizers
def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 33), (1000,), (7,), (300, 40), (5000,), (129, 31), (1,), (2048,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _make(name, params):
    cls = getattr(pagedopt, name)
    kw = {"lr": 1e-2, "min_8bit_size": 256}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pagedopt.paging.PagingFallbackWarning)
        return cls(params, **kw)


def _train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pagedopt.paging.PagingFallbackWarning)
            opt.step()


def _state_tensors(opt):
    sd = opt.state_dict()["state"]
    return {(k, kk): v for k, s in sd.items() for kk, v in s.items() if isinstance(v, torch.Tensor)}


# A buffer of 64 KiB: chunks of at most ~21 KiB of state (about 52 KiB in all), so the 8 parameters stream as several
# chunks and the regions wrap around; the largest 32-bit state (300x40 fp32, two moments: 96000
# bytes) needs a larger buffer, so the 32-bit classes get 200 KiB (chunks of ~68 KiB, still several).
def _buffer_for(name):
    return "64KiB" if "8bit" in name else "200KiB"


@pytest.mark.parametrize("name", PAGED)
def test_host_residency_is_bit_identical_to_resident_states(name):
    ref_params, host_params = _params(), _params()
    ref = _make(name, ref_params)
    host = _make(name, host_params)
    host.set_pager(residency="host", device_buffer=_buffer_for(name))
    _train(ref, ref_params, 3, seed=1)
    _train(host, host_params, 3, seed=1)
    for a, b in zip(ref_params, host_params):
        assert torch.equal(a, b)
    ref_state, host_state = _state_tensors(ref), _state_tensors(host)
    assert ref_state.keys() == host_state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k].cpu(), host_state[k].cpu()), k
    s = host.paging_stats()
    assert s.resident_bytes == 0 and s.host_bytes > 0
    # every state byte went in and came back in the last step
    assert s.page_in_bytes_last_step == s.page_out_bytes_last_step == s.host_bytes
    assert s.device_buffer_bytes == pagedopt.optim.byte_sizes.parse_bytes(_buffer_for(name))
    # no state tensor is on the parameters' side of the buffer: each lives in its own host storage
    buf = host._pager._buffers[torch.device("cpu")].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() != buf for st in host.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdEMAMix8bit", "PagedAdamW32bit"])
def test_host_residency_checkpoint_and_copy_continue_bit_identically(name):
    ref_params, host_params = _params(), _params()
    ref, host = _make(name, ref_params), _make(name, host_params)
    host.set_pager(residency="host", device_buffer=_buffer_for(name))
    _train(ref, ref_params, 2, seed=2)
    _train(host, host_params, 2, seed=2)
    buf = io.BytesIO()
    torch.save(host.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    # a host-resident checkpoint loads into a resident optimizer, and a copy stays host-resident
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in host_params]
    resumed = _make(name, resumed_params)
    resumed.load_state_dict(saved)
    twin = copy.deepcopy(host)
    assert isinstance(twin._pager, HostResidentPager)
    assert twin._pager.device_buffer_bytes == host._pager.device_buffer_bytes
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for opt, params in ((ref, ref_params), (host, host_params), (resumed, resumed_params), (twin, twin_params)):
        _train(opt, params, 2, seed=3)
    for params in (host_params, resumed_params, twin_params):
        for a, b in zip(ref_params, params):
            assert torch.equal(a, b)


def test_set_pager_host_refusals_name_the_argument_and_change_nothing():
    params = _params()
    opt = _make("PagedAdamW8bit", params)
    with pytest.raises(ValueError, match="residency must be 'host', 'auto' or 'device'"):
        opt.set_pager(residency="gpu")
    with pytest.raises(ValueError, match="device_buffer=... goes with residency='host'"):
        opt.set_pager(device_buffer="1MiB")
    with pytest.raises(ValueError, match="device_budget=... goes with residency='auto'"):
        opt.set_pager(residency="host", device_budget="1GiB")
    with pytest.raises(ValueError, match="device_buffer"):
        opt.set_pager(residency="host", device_buffer="lots")
    with pytest.raises(ValueError, match="device_buffer"):
        opt.set_pager(residency="host", device_buffer=16)
    with pytest.raises(ValueError, match="not a paged optimizer"):
        pagedopt.AdamW8bit(_params()).set_pager(residency="host")
    assert not isinstance(opt._pager, HostResidentPager)
    # states that cannot be cut (AdEMAMix's stacked moments) and do not fit the buffer: refused
    # before any state is made
    params = _params()
    opt = _make("PagedAdEMAMix8bit", params)
    opt.set_pager(residency="host", device_buffer="4KiB")
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: its states take \d+ bytes"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(len(s) == 0 for s in opt.state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW32bit", "PagedLion8bit", "PagedAdam"])
def test_states_larger_than_the_device_buffer_stream_in_pieces_bit_for_bit(name, dtype):
    """No parameter is refused for its size: with a 16 KiB buffer, states larger than the whole
    buffer (a transposed, non-contiguous (96, 200) parameter's, through a contiguous copy) and
    than a chunk stream in pieces of whole blocks, bit for bit the resident states' step."""
    runs = []
    for residency in ("device", "host"):
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(3)]
        big = torch.nn.Parameter(torch.randn(200, 96, generator=torch.Generator().manual_seed(9)).to(dtype).t())
        params.append(big)  # non-contiguous, 19200 elements
        opt = _make(name, params)
        opt.set_pager(residency=residency, **({"device_buffer": "16KiB"} if residency == "host" else {}))
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pagedopt.paging.PagingFallbackWarning)
                opt.step()
        runs.append((params, opt))
    (ref, ref_opt), (host, host_opt) = runs
    for a, b in zip(ref, host):
        assert torch.equal(a, b)
    largest = max(sum(t.numel() * t.element_size() for k, t in host_opt.state[p].items()
                      if k.startswith(("state", "absmax"))) for p in host)
    assert largest > 16 << 10  # some state is larger than the whole buffer
    for p, q in zip(ref, host):
        for k, v in ref_opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, host_opt.state[q][k]), k


def test_residency_device_is_the_default_pager():
    opt = _make("PagedAdamW8bit", _params())
    opt.set_pager(residency="device")  # spelled out: the ordinary PageManager
    assert isinstance(opt._pager, pagedopt.PageManager)


# ---------------------------------------------------------------------------------- what users do
def _host(name, params, buffer="64KiB"):
    opt = _make(name, params)
    opt.set_pager(residency="host", device_buffer=buffer)
    return opt


def test_host_residency_under_grad_scaler_skips_inf_steps_like_resident_states():
    ref_params, host_params = _params(5), _params(5)
    ref, host = _make("PagedAdamW8bit", ref_params), _host("PagedAdamW8bit", host_params)
    for step in range(3):
        for opt, params in ((ref, ref_params), (host, host_params)):
            scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
            opt.zero_grad()
            loss = sum((p ** 2).sum() * (k + 1) for k, p in enumerate(params))
            scaler.scale(loss).backward()
            if step == 1:
                params[2].grad[0] = float("inf")  # this step is skipped: nothing may change
            scaler.step(opt)
    for a, b in zip(ref_params, host_params):
        assert torch.equal(a, b)
    ref_state, host_state = _state_tensors(ref), _state_tensors(host)
    for k in ref_state:
        assert torch.equal(ref_state[k], host_state[k]), k
    assert all(float(s["step"]) == 2 for s in host.state.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_host_residency_with_16bit_and_non_contiguous_params(dtype):
    def params():
        g = torch.Generator().manual_seed(9)
        base = [torch.randn(96, 40, generator=g).to(dtype), torch.randn(3000, generator=g).to(dtype)]
        return [torch.nn.Parameter(base[0].t()), torch.nn.Parameter(base[1])]  # a transposed (non-contiguous) one

    ref_params, host_params = params(), params()
    assert not ref_params[0].is_contiguous()
    ref, host = _make("PagedAdamW8bit", ref_params), _host("PagedAdamW8bit", host_params, "32KiB")
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in ref_params]
        for opt, ps in ((ref, ref_params), (host, host_params)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
    for a, b in zip(ref_params, host_params):
        assert torch.equal(a, b)


def test_host_residency_in_a_compiled_training_step():
    def model_and_opt(host):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        opt = _make("PagedAdamW8bit", list(model.parameters()))
        if host:
            opt.set_pager(residency="host", device_buffer="48KiB")
        return model, opt

    def train_step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = torch.compile(train_step, backend="inductor")
    (m_ref, o_ref), (m_host, o_host) = model_and_opt(False), model_and_opt(True)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pagedopt.paging.PagingFallbackWarning)
            train_step(m_ref, o_ref, x)
            compiled(m_host, o_host, x)
    for a, b in zip(m_ref.parameters(), m_host.parameters()):
        assert torch.equal(a, b)
    assert o_host.paging_stats().page_in_bytes_last_step == o_host.paging_stats().host_bytes > 0


def test_settle_makes_host_states_readable_and_is_a_no_op_unpaged():
    params = _params(11)
    opt = _host("PagedAdamW8bit", params)
    _train(opt, params, 1, seed=12)
    waited = []
    opt._pager.synchronize = lambda: waited.append(True)  # what settle must call for host states
    opt.settle()
    assert waited == [True]
    pagedopt.AdamW8bit(_params()).settle()  # unpaged: nothing to do, no error


def test_neighbouring_host_tensors_move_in_one_copy_and_the_others_stay_untouched():
    pager = HostResidentPager(1 << 20)
    ts = [pager.zeros((n,), torch.float32, "cpu") for n in (100, 3, 64, 257)]  # carved one after the other
    for i, t in enumerate(ts):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32) + 1000 * i)
    before = [t.clone() for t in ts]
    # ts[2] lies between ts[1] and ts[3]: group 0 moves in two copies (ts[1], ts[0] in any order are one)
    p = pager.open_pass("cpu", [[ts[1], ts[3], ts[0]], [ts[2]]])
    assert [len(layout.runs) for layout in p.layouts] == [2, 1]
    views = p.take(0)
    assert all(torch.equal(v, t) for v, t in zip(views, [ts[1], ts[3], ts[0]]))
    assert all((v.data_ptr() - v.untyped_storage().data_ptr()) % REGION_ALIGN == 0 for v in views)  # aligned in the buffer
    for v in views:
        v.mul_(-1)
    p.give_back(0)
    assert torch.equal(ts[2], before[2])  # not in the group: its bytes neither went out nor came back
    assert all(torch.equal(ts[i], -before[i]) for i in (0, 1, 3))
    views = p.take(1)
    views[0].add_(0.5)
    p.give_back(1)
    assert torch.equal(ts[2], before[2] + 0.5) and torch.equal(ts[3], -before[3])
    # tensors of storages of their own (not from zeros()) move one copy each
    own = [torch.ones(10), torch.ones(20)]
    assert len(pager.open_pass("cpu", [own]).layouts[0].runs) == 2


def test_a_slice_ending_inside_its_tensor_moves_without_the_bytes_after_it():
    """Runs merge over padding only: the bytes between a slice that ends inside its tensor and the
    next slot belong to that tensor, and a copy back of the run must not write them."""
    pager = HostResidentPager(1 << 20)
    a, b = pager.zeros((100,), torch.float32, "cpu"), pager.zeros((64,), torch.float32, "cpu")  # b at the slot after a
    a.copy_(torch.arange(100.0))
    b.copy_(torch.arange(64.0) + 500)
    before_a = a.clone()
    head = a[:10]  # ends inside a: a[10:] lies between it and b
    p = pager.open_pass("cpu", [[head, b]])
    assert len(p.layouts[0].runs) == 2
    views = p.take(0)
    a[10:].fill_(-7.0)  # a change to the bytes between, made while the group is out (e.g. another group's copy back)
    for v in views:
        v.add_(1000)
    p.give_back(0)
    assert torch.equal(a[:10], before_a[:10] + 1000) and torch.equal(a[10:], torch.full((90,), -7.0))
    assert torch.equal(b, torch.arange(64.0) + 1500)
    whole = pager.open_pass("cpu", [[a, b]])  # whole tensors of our own: padding between, one copy
    assert len(whole.layouts[0].runs) == 1


def test_a_planned_pass_repeats_with_the_same_views_and_results():
    """plan_pass lays groups out once: passes opened from the plan give the same results as passes
    opened from the groups, and hand out the very same device views step after step (made once per
    place in the buffer); a bad group is refused when planned, before anything moves."""
    pager = HostResidentPager(1 << 20, prefetch_depth=1)
    ts = [pager.zeros((n,), torch.float32, "cpu") for n in (100, 3, 64, 257)]
    ref = [t.clone() for t in ts]
    for i, t in enumerate(ts):
        t.copy_(torch.randn(t.numel()) + i)
        ref[i].copy_(t)
    groups = [[ts[0], ts[1]], [ts[3]], [ts[2]]]
    plan = pager.plan_pass(groups)
    seen = []
    for step in range(3):
        p = pager.open_pass("cpu", plan)
        assert p.groups is plan.groups and p.layouts is plan.layouts
        views = []
        for i in range(len(groups)):
            vs = p.take(i)
            for v in vs:
                v.mul_(0.5).add_(step)
            views.append(vs)
            p.give_back(i)
        seen.append([id(v) for vs in views for v in vs])
        for t in ref:
            t.mul_(0.5).add_(step)
        assert all(torch.equal(t, r) for t, r in zip(ts, ref)), step
    assert seen[0] == seen[1] == seen[2]  # the same view objects each pass
    # a pass from the groups themselves: the same places, new layouts, equal results
    p = pager.open_pass("cpu", groups)
    assert p.layouts is not plan.layouts and [lay.offsets for lay in p.layouts] == [lay.offsets for lay in plan.layouts]
    with pytest.raises(ValueError, match="contiguous"):
        pager.plan_pass([[ts[0]], [torch.ones(4, 4).t()]])
    assert all(torch.equal(t, r) for t, r in zip(ts, ref))


def test_a_pass_on_the_cpu_ignores_a_copy_trace():
    pager = HostResidentPager(1 << 20)
    t = pager.zeros((8,), torch.float32, "cpu")
    trace = []
    p = pager.open_pass("cpu", [[t]], trace=trace)
    p.take(0)[0].add_(1)
    p.give_back(0)
    assert trace == [] and torch.equal(t, torch.ones(8))


def test_host_slabs_start_small_and_double_up_to_their_size():
    """Small host tensors are carved from slabs that start at FIRST_HOST_SLAB_BYTES and double, up to
    host_slab_bytes: a tiny optimizer pins one small slab, not a whole 64 MiB one; tensors over a
    quarter of host_slab_bytes get storages of their own; carved tensors lie one after the other."""
    from pagedopt.paging.host_resident import FIRST_HOST_SLAB_BYTES, HOST_SLAB_BYTES, aligned_bytes as _aligned

    pager = HostResidentPager(1 << 20)
    assert pager.host_slab_bytes == HOST_SLAB_BYTES
    pager.host_slab_bytes = 16 * FIRST_HOST_SLAB_BYTES
    quarter = FIRST_HOST_SLAB_BYTES // 4  # bytes: four of these fill the first slab exactly
    ts = [pager.zeros((quarter,), torch.uint8, "cpu") for _ in range(4)]
    slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}
    assert list(slabs.values()) == [FIRST_HOST_SLAB_BYTES]
    assert [t.data_ptr() - ts[0].data_ptr() for t in ts] == [i * quarter for i in range(4)]
    sizes = []
    for _ in range(40):  # 40 quarters of the first slab more: slabs of 2, 4, then 8 (half used)
        t = pager.zeros((quarter,), torch.uint8, "cpu")
        if t.untyped_storage().data_ptr() not in slabs:
            slabs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            sizes.append(t.untyped_storage().nbytes() // FIRST_HOST_SLAB_BYTES)
    assert sizes == [2, 4, 8]
    big = pager.zeros((4 * FIRST_HOST_SLAB_BYTES + 1,), torch.uint8, "cpu")  # over a quarter of 16: its own
    assert big.untyped_storage().nbytes() == 4 * FIRST_HOST_SLAB_BYTES + 1
    for _ in range(30):  # slabs never grow past host_slab_bytes
        t = pager.zeros((3 * FIRST_HOST_SLAB_BYTES,), torch.uint8, "cpu")
        assert t.untyped_storage().nbytes() <= pager.host_slab_bytes
    assert max(s.untyped_storage().nbytes() for s in [t]) == pager.host_slab_bytes
    odd = pager.zeros((3,), torch.float64, "cpu")  # aligned carving: the next tensor starts on REGION_ALIGN
    nxt = pager.zeros((1,), torch.float64, "cpu")
    assert nxt.data_ptr() - odd.data_ptr() == _aligned(24)


def test_a_tiny_host_resident_optimizer_pins_one_small_slab():
    from pagedopt.paging.host_resident import FIRST_HOST_SLAB_BYTES

    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = pagedopt.PagedAdamW8bit(m.parameters(), lr=1e-3, min_8bit_size=1024)
    opt.set_pager(residency="host")
    m(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    made = opt._pager.tensors()  # the host tensors the pager made: the states it streams
    assert len(made) >= 4  # the weight's two moments and absmaxes at least
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in made}
    assert sum(storages.values()) == FIRST_HOST_SLAB_BYTES, storages  # 64x64 weight: far less than 1 MiB
