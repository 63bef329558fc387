"""Updates during backward (``set_pager(residency="host", update_in_backward=True)``): bit for bit the
ordinary step of every paged class, on fp32 and bf16 parameters, while parameters really change
during backward(); what step() is left to do; refusals (GradScaler, a second backward, settings
that cannot hold) that change nothing; checkpoints, copies, schedulers, parameters without
gradients, gradients set by hand; the pager's open_pass. The same tests run on CUDA
(``@pytest.mark.cuda``), where the updates run on a stream of their own beside backward's."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import pagedopt
from pagedopt.paging import HostResidentPager

PAGED = [name for name in pagedopt.__all__ if name.startswith("Paged")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KiB = 1 << 10

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")


@pytest.fixture(autouse=True, params=[False, True], ids=["in_hooks", "update_thread"])
def update_thread(request):
    """Every test twice: the chunks updated in the gradient hooks, and on the worker thread."""
    from pagedopt.optim.backward_updates import BackwardUpdates

    saved = BackwardUpdates.update_thread
    BackwardUpdates.update_thread = request.param
    yield request.param
    BackwardUpdates.update_thread = saved


class Net(nn.Module):
    """Layers of several sizes (some under min_8bit_size, so 32-bit states beside 8-bit ones) and a
    switch that leaves one layer out of the graph (its parameters then get no gradient)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(24, 96)
        self.norm = nn.LayerNorm(96)
        self.mid = nn.Linear(96, 96)
        self.skip = nn.Linear(96, 96)
        self.out = nn.Linear(96, 40)
        self.use_skip = True

    def forward(self, x):
        h = self.norm(torch.nn.functional.gelu(self.inp(x)))
        h = self.mid(h)
        if self.use_skip:
            h = h + self.skip(h)
        return self.out(h)


def _model(device, dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(device, dtype)


def _groups(m):
    big = [m.inp.weight, m.mid.weight, m.skip.weight, m.out.weight]
    small = [p for p in m.parameters() if all(p is not q for q in big)]
    return [{"params": big}, {"params": small, "lr": 3e-3}]


def _make(name, m, bwd, buffer=None, **kw):
    """``bwd``: None: resident states; False: host-resident; True: host-resident, updated in backward.
    The buffer holds the largest parameter's states (mid.weight's 9216 elements times the moments,
    half a byte, 1 or 4 bytes each, plus 4 KiB for absmax and alignment) with a quarter to spare, so that its
    chunks (a quarter of it) cut the whole model's states (about 2.7 times mid.weight's) in three or more."""
    if buffer is None:
        moments = 1 if "Lion" in name else 3 if "AdEMAMix" in name else 2
        buffer = int((9216 * moments * (1 if "8bit" in name else 0.5 if "4bit" in name else 4) + 4 * KiB) * 1.25)
    opt = getattr(pagedopt, name)(_groups(m), lr=1e-2, min_8bit_size=1024, **kw)
    opt.set_pager(residency="host", device_buffer=buffer, update_in_backward=bwd) if bwd is not None else \
        opt.set_pager(residency="device")
    return opt


def _batches(device, dtype, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 24, generator=g).to(device, dtype) for _ in range(n)]


def _steps_taken(opt, m) -> list[float]:
    return [float(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0.0 for p in m.parameters()]


def _train(m, opt, xs, between=None):
    """Train on xs; per step, how many parameters had been updated (their step counter moved on)
    when backward() returned (with the update thread: by the chunks handed to it during backward)."""
    changed = []
    for i, x in enumerate(xs):
        before = _steps_taken(opt, m)
        m(x).float().square().mean().backward()
        bwd = getattr(opt, "_backward_updates", None)
        if bwd is not None:  # the chunks handed to the update thread during backward: done before counting
            bwd._join_worker()
        changed.append(sum(a != b for a, b in zip(before, _steps_taken(opt, m))))
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(i)
    return changed


def _assert_same(m1, o1, m2, o2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].keys() == s2[k].keys()
        for kk, v in s1[k].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.cpu(), s2[k][kk].cpu()), (k, kk)


def _require(device):
    if device == "cuda":
        from pagedopt import paging

        reason = paging.paging_unavailable_reason("cuda:0")
        if reason is not None:
            pytest.skip(reason)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", PAGED)
def test_bit_for_bit_the_ordinary_step_while_updating_during_backward(device, dtype, name):
    _require(device)
    xs = _batches(device, dtype, 5)
    runs = {}
    for mode in (None, False, True):  # resident states, host-resident, host-resident updated in backward
        m = _model(device, dtype)
        opt = _make(name, m, mode)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        runs[mode] = (m, opt, _train(m, opt, xs, between=lambda i: sched.step()))
    n = len(list(runs[True][0].parameters()))
    _assert_same(*runs[None][:2], *runs[True][:2])
    _assert_same(*runs[False][:2], *runs[True][:2])
    # the first step makes the states and learns the order of the gradients: its parameters are
    # updated during backward as their chunks fill (a last chunk that is not full waits for
    # step()); from the second on, every parameter is updated before backward() returns (the last
    # chunk in the last gradient's hook), in several chunks
    assert 0 < runs[True][2][0] <= n and runs[False][2] == [0] * 5
    assert all(c == n for c in runs[True][2][1:]), runs[True][2]
    bwd = runs[True][1]._backward_updates
    chunks = next(iter(bwd._schedule.values()))
    assert len(chunks) >= 3
    # mid.weight's states exceed a chunk: cut into pieces of whole blocks, but for stacked moments
    cut = any(piece.start is not None for parts, _ in chunks for _, pieces in parts for piece in pieces)
    assert cut == ("AdEMAMix" not in name), name
    # each step copies every state in and back once, as the ordinary host-resident step does
    assert runs[True][1].paging_stats().page_in_bytes_last_step == runs[False][1].paging_stats().page_in_bytes_last_step
    assert runs[True][1].paging_stats().page_out_bytes_last_step == runs[False][1].paging_stats().page_in_bytes_last_step


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_without_gradients_or_with_gradients_set_by_hand(device):
    _require(device)
    xs = _batches(device, torch.float32, 6)
    runs = []
    for bwd in (False, True):
        m = _model(device)
        opt = _make("PagedAdamW8bit", m, bwd)

        def between(i, m=m, opt=opt):
            m.use_skip = i not in (1, 2)  # steps 2 and 3 leave `skip` out: its parameters get no gradient
            if i == 3:  # a step whose gradients come from no backward: no hook fires, step() does it all
                g = torch.Generator().manual_seed(7)
                for p in m.parameters():
                    p.grad = torch.randn(p.shape, generator=g).to(device)
                opt.step()
                opt.zero_grad()
        runs.append((m, opt, _train(m, opt, xs, between)))
    _assert_same(*runs[0][:2], *runs[1][:2])
    assert all(c > 0 for c in runs[1][2][1:])


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_backward_before_step_raises_and_accumulation_turns_it_off(device):
    _require(device)
    xs = _batches(device, torch.float32, 9)
    m = _model(device)
    opt = _make("PagedAdamW8bit", m, True)
    _train(m, opt, xs[:2])
    m(xs[2]).square().mean().backward()
    with pytest.raises(RuntimeError, match=rf"param_groups\[1\]\['params'\]\[5\] \(shape \(40,\), torch.float32, {device}(:0)?\) received a "
                       r"second gradient before "
                       r"step\(\).*update_in_backward = False"):
        m(xs[3]).square().mean().backward()
    # gradient accumulation: off for the micro-batches before the last, on for the last
    runs = []
    for bwd in (False, True):
        m = _model(device)
        opt = _make("PagedAdamW8bit", m, bwd)
        _train(m, opt, xs[:2])
        for k in range(2):
            for j, x in enumerate(xs[2 + 3 * k:5 + 3 * k]):
                if bwd:
                    opt.update_in_backward = j == 2
                m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((m, opt))
    assert runs[1][1].update_in_backward
    _assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_is_refused_in_the_first_step_before_step_updates_anything(device):
    """GradScaler cannot be seen during backward: the first backward updates the chunks that fill
    (with scaled gradients, as every later backward would), then the scaler's step is refused before
    step() updates anything (the parameters still holding gradients keep their values and get no
    state). With the mode off, the scaler steps those, like any optimizer's."""
    _require(device)
    xs = _batches(device, torch.float32, 3)
    m = _model(device)
    opt = _make("PagedAdamW8bit", m, True)
    scaler = torch.amp.GradScaler(device)
    scaler.scale(m(xs[0]).square().mean()).backward()
    left = [p for p in m.parameters() if p.grad is not None]  # not updated during backward: step()'s
    assert 0 < len(left) < len(list(m.parameters()))
    before = [p.detach().clone() for p in left]
    with pytest.raises(RuntimeError, match="update_in_backward=True cannot run under GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, left))
    assert all(len(opt.state.get(p, {})) == 0 for p in left)
    # turned off, the scaler works as for any optimizer
    opt.update_in_backward = False
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(a, b) for a, b in zip(before, left))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in m.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_scaler_brought_in_after_updates_began(device):
    """Once the schedule runs, a GradScaler's step is refused (the backward's updates keep theirs);
    with the mode then turned off, the scaler steps on like any optimizer's from the next batch."""
    _require(device)
    xs = _batches(device, torch.float32, 5)
    m = _model(device)
    opt = _make("PagedAdamW8bit", m, True)
    _train(m, opt, xs[:2])  # the schedule exists: the next backward updates during backward
    scaler = torch.amp.GradScaler(device)
    scaler.scale(m(xs[2]).square().mean()).backward()
    with pytest.raises(RuntimeError, match="update_in_backward=True cannot run under GradScaler"):
        scaler.step(opt)
    opt.zero_grad()
    opt.update_in_backward = False
    for x in xs[3:]:
        before = [p.detach().clone() for p in m.parameters()]
        scaler.scale(m(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_settings_that_cannot_hold_are_refused():
    m = _model("cpu")
    with pytest.raises(ValueError, match="keep_grads must be True or False, got 'no'"):
        pagedopt.PagedAdamW8bit(m.parameters()).set_pager(residency="device", update_in_backward=True, keep_grads="no")
    with pytest.raises(ValueError, match="AdamW8bit is not a paged optimizer.*set_pager\\(update_in_backward=True\\) alone"):
        pagedopt.AdamW8bit(m.parameters()).set_pager(residency="host", update_in_backward=True)
    with pytest.raises(ValueError, match="update_in_backward must be True or False, got 1"):
        pagedopt.PagedAdamW8bit(m.parameters()).set_pager(residency="host", update_in_backward=1)
    with pytest.raises(ValueError, match=r"capturable=True"):
        pagedopt.PagedAdamW8bit(m.parameters(), capturable=True).set_pager(residency="host", update_in_backward=True)
    opt = pagedopt.PagedAdamW8bit(m.parameters())
    assert opt.update_in_backward is False
    opt.update_in_backward = False  # nothing to turn off
    with pytest.raises(ValueError, match=r"set_pager\(update_in_backward=True\) first"):
        opt.update_in_backward = True
    opt.set_pager(residency="host", update_in_backward=True)
    with pytest.raises(ValueError, match="update_in_backward must be True or False, got 'yes'"):
        opt.update_in_backward = "yes"
    assert opt.update_in_backward is True
    # a refused set_pager leaves the optimizer as it was: no hooks were added
    other = pagedopt.PagedAdamW8bit(m.parameters())
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters())
    with pytest.raises(ValueError):
        other.set_pager(residency="device", update_in_backward=1)
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters()) == hooks
    assert other._backward_updates is None


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_copies_and_load_state_dict_between_steps(device):
    _require(device)
    xs = _batches(device, torch.float32, 6)
    ref_m = _model(device)
    ref = _make("PagedAdamW8bit", ref_m, False)
    m = _model(device)
    opt = _make("PagedAdamW8bit", m, True)
    _train(ref_m, ref, xs[:3])
    _train(m, opt, xs[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed_m = copy.deepcopy(m)
    resumed = _make("PagedAdamW8bit", resumed_m, True)
    resumed.load_state_dict(saved)
    twin_m, twin = copy.deepcopy((m, opt))  # the copy's parameters are the copied model's, with hooks of their own
    assert twin.update_in_backward and twin._backward_updates is not opt._backward_updates
    opt.load_state_dict(saved)  # between steps: the schedule is made again
    counts = [_train(*pair, xs[3:]) for pair in ((ref_m, ref), (m, opt), (resumed_m, resumed), (twin_m, twin))]
    for mm, oo in ((m, opt), (resumed_m, resumed), (twin_m, twin)):
        _assert_same(ref_m, ref, mm, oo)
    for c in counts[1:]:
        # after a load no schedule: the first step updates its chunks as the gradients arrive, then the schedule
        assert all(x > 0 for x in c), counts


def test_a_bad_gradient_met_during_backward_names_the_parameter():
    m = _model("cpu")
    bad = {"on": False}  # a hook of the user's, before the optimizer's: it spoils mid.weight's gradient
    m.mid.weight.grad_dtype = None  # torch refuses a float64 gradient of a float32 tensor otherwise
    m.mid.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.grad.double()) if bad["on"] else None)
    opt = _make("PagedAdamW8bit", m, True)
    xs = _batches("cpu", torch.float32, 4)
    _train(m, opt, xs[:2])
    bad["on"] = True
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*gradient dtype torch.float64.*"
                       r"met during backward with update_in_backward=True"):
        m(xs[2]).square().mean().backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*gradient dtype torch.float64"):
        opt.step()  # the ordinary step refuses it too, before anything changes
    bad["on"] = False
    opt.zero_grad()
    assert _train(m, opt, xs[2:])[1] > 0  # the step after is ordinary (a new schedule), then in backward again


@pytest.mark.parametrize("scheduled", [False, True], ids=["first_step", "scheduled"])
def test_a_setting_spoiled_by_hand_is_refused_in_backward_before_any_update(scheduled):
    """A hyperparameter set by hand to a value the constructor refuses is refused at the step's
    first gradient, before any update (scheduled steps and steps without a schedule alike): the
    parameters, states and counters stay as they were, and once it is fixed the run goes on bit for
    bit like one that never met it."""
    xs = _batches("cpu", torch.float32, 5)
    m_ref = _model("cpu")
    o_ref = _make("PagedAdamW8bit", m_ref, True)
    _train(m_ref, o_ref, xs)
    m = _model("cpu")
    opt = _make("PagedAdamW8bit", m, True)
    _train(m, opt, xs[:2] if scheduled else [])
    params = [p.detach().clone() for p in m.parameters()]
    states = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[1]["betas"] = (1.5, 0.999)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\].*1\.5.*before any update: nothing was "
                       r"changed"):
        m(xs[2 if scheduled else 0]).square().mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), params))
    after = opt.state_dict()["state"]
    assert after.keys() == states.keys()
    for k in states:
        for kk, v in states[k].items():
            assert not isinstance(v, torch.Tensor) or torch.equal(v, after[k][kk]), (k, kk)
    opt.param_groups[1]["betas"] = o_ref.param_groups[1]["betas"]
    opt.zero_grad()
    _train(m, opt, xs[2:] if scheduled else xs)
    _assert_same(m_ref, o_ref, m, opt)


def test_open_pass_hands_out_groups_in_order_and_a_dropped_pass_is_harmless():
    pager = HostResidentPager(4096, prefetch_depth=1)
    groups = [[torch.full((200,), float(i))] for i in range(6)]
    p = pager.open_pass("cpu", groups)
    with pytest.raises(RuntimeError, match=r"take\(1\): groups are taken in order"):
        p.take(1)
    views = p.take(0)
    with pytest.raises(RuntimeError, match=r"take\(1\).*after give_back"):
        p.take(1)
    with pytest.raises(RuntimeError, match=r"give_back\(1\): group 1 is not the one taken"):
        p.give_back(1)
    views[0].add_(10)
    p.give_back(0)
    p.take(1)[0].add_(10)  # taken and dropped without give_back: nothing goes back
    del p
    for i, views in pager.stream("cpu", groups):
        views[0].mul_(2)
    assert [g[0][0].item() for g in groups] == [20.0, 2.0, 4.0, 6.0, 8.0, 10.0]


@pytest.mark.cuda
def test_cuda_compiled_model_and_the_memory_it_holds():
    """A torch.compile'd model (its backward runs the hooks as an eager one does), bit for bit the
    ordinary host-resident step; updates during backward hold no more GPU memory than it: the same
    device buffer, and per chunk only the kernels' metadata (1 MiB is far above it)."""
    _require("cuda")
    xs = _batches("cuda", torch.float32, 5)
    runs = []
    for bwd in (False, True):
        m = _model("cuda")
        opt = _make("PagedAdamW8bit", m, bwd)
        compiled = torch.compile(m)
        _train(compiled, opt, xs[:2])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        counts = _train(compiled, opt, xs[2:])
        torch.cuda.synchronize()
        runs.append((m, opt, counts, torch.cuda.max_memory_allocated() - before))
    _assert_same(*runs[0][:2], *runs[1][:2])
    n = len(list(runs[1][0].parameters()))
    assert runs[1][2] == [n] * 3 and runs[0][2] == [0] * 3
    assert runs[1][3] <= runs[0][3] + (1 << 20), (runs[1][3], runs[0][3])


def test_a_dropped_optimizer_is_freed_with_its_hooks_and_worker(update_thread):
    """An optimizer updating in backward (on the update thread or not) is freed once the user drops
    it; its worker thread ends; the model trains on with a new optimizer."""
    import gc
    import weakref

    m = _model("cpu")
    xs = _batches("cpu", torch.float32, 4)
    opt = _make("PagedAdamW8bit", m, True)
    _train(m, opt, xs[:3])
    worker = opt._backward_updates._worker
    thread = worker._thread if worker is not None else None
    assert (thread is not None) == update_thread
    ref = weakref.ref(opt)
    del opt, worker
    gc.collect()
    assert ref() is None
    if thread is not None:
        thread.join(5)
        assert not thread.is_alive()
    # its hooks came off the parameters: each has the one of the optimizer made next
    assert all(not p._post_accumulate_grad_hooks for p in m.parameters())
    fresh = _make("PagedAdamW8bit", m, True)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in m.parameters())
    _train(m, fresh, xs[3:])


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_optimizer_takes_the_parameters_over_from_a_live_one(device):
    """Two live optimizers on the same parameters, both with update_in_backward (the old one still
    referenced when a new one is made, as when a notebook cell runs again): the new one takes the
    hooks over with a warning naming a parameter, so every backward updates each parameter once,
    bit for bit as if the old optimizer did not exist; the old one's states stay as they were."""
    m = _model(device)
    xs = _batches(device, torch.float32, 5)
    old = _make("PagedAdamW8bit", m, True)
    _train(m, old, xs[:2])
    old_steps = _steps_taken(old, m)
    twin = copy.deepcopy(m)  # the reference: the same weights, no old optimizer hooked on them
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['params'\]\[0\].*and 9 more.*another live optimizer"):
        new = _make("PagedAdamW8bit", m, True)
    ref = _make("PagedAdamW8bit", twin, True)
    _train(m, new, xs[2:])
    _train(twin, ref, xs[2:])
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert _steps_taken(old, m) == old_steps  # the old one did not update during these backwards
    assert _steps_taken(new, m) == [3.0] * len(old_steps)
