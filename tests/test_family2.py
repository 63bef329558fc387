"""SGD, RMSprop and Adagrad (the nine bitsandbytes classes) against the float64 oracles of
reference_family2.py, as tests/FAMILY2_SEMANTICS.md sets them out: the classes' API, refusals,
state layout, 32-bit steps and state_dict round trip
(8-bit steps: test_family2_8bit.py; the oracles against torch.optim, always run:
test_family2_oracles.py). Every tolerance is derived where it is used or in reference_family2.py."""
import gc
import inspect
import io
import math
import re

import pytest
import torch

import family_checks as fc
from reference_family2 import sgd_step, step_bound, torch_run, trajectory_bound

import pagedopt
from device_params import DEVICES

SGD = ["SGD", "SGD8bit", "SGD32bit"]
RMSPROP = ["RMSprop", "RMSprop8bit", "RMSprop32bit"]
ADAGRAD = ["Adagrad", "Adagrad8bit", "Adagrad32bit"]
ALL = SGD + RMSPROP + ADAGRAD
EMPTY = inspect.Parameter.empty


def algo_of(name):
    return "sgd" if name.startswith("SGD") else "rmsprop" if name.startswith("RMSprop") else "adagrad"


def hparams(name, **kw):
    """The torch-style hyperparameters (what the oracles take) of `name` built with kwargs `kw`:
    bitsandbytes' defaults (FAMILY2_SEMANTICS.md) updated by kw."""
    algo = algo_of(name)
    if algo == "sgd":
        hp = dict(lr=None, momentum=0, dampening=0, weight_decay=0, nesterov=False)
    elif algo == "rmsprop":
        hp = dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0)
    else:
        hp = dict(lr=1e-2, eps=1e-10, weight_decay=0)
    hp.update({k: v for k, v in kw.items() if k in hp})
    return hp


make, case, gradients = fc.make, fc.case, fc.gradients


def state_of(opt, p):
    """The optimizer's state1 of p as a float64 CPU tensor (dequantized when 8-bit); zeros before
    the first step; None when there is no state1 (plain SGD)."""
    s = opt.state[p]
    if not s:
        return torch.zeros(p.shape, dtype=torch.float64)
    if "state1" not in s:
        return None
    if s["state1"].dtype == torch.uint8:
        return fc.deq(s["state1"], s["absmax1"], s["qmap1"])
    return s["state1"].cpu().double()


def check_step(opt, p, p_prev, g, prev, t, algo, hp):
    """One step of p from p_prev and state `prev` (dequantized) with gradient g, against the
    oracle's bound from those exact inputs (reference_family2.step_bound): the stored state within
    its fp32 error (8-bit: within the quantization bound of family_checks.check_stored), the
    parameter within its error. Returns the number of ill-conditioned elements (bound = cap)."""
    s = opt.state[p]
    assert int(s["step"]) == t
    p_ref, s_ref, p_err, s_err, loose = step_bound(algo, p_prev, g, prev, t, hp)
    if s_ref is None:
        assert "state1" not in s, "plain SGD keeps no state1"
    else:
        fc.check_stored(state_of(opt, p), s_ref, s_err, s, "state1", None, "qmap1")
    err = (p.detach().cpu().double() - p_ref).abs()
    assert (err <= p_err).all(), f"p: {(err - p_err).max()} over; step {t}"
    return int(loose.sum())


def run_and_check(opt, params, gen, steps, algo, hp, scale=0.1, alts=None):
    """`steps` steps, every element of every parameter checked after each (check_step). `alts`:
    {name: fn(p_prev, g, prev, t) -> p} alternative semantics; returns (ill-conditioned elements,
    total elements, {alt name: steps at which it fell outside the bound})."""
    loose, total, rejected = 0, 0, {}
    for t in range(1, steps + 1):
        before = [(p.detach().cpu().double().clone(), state_of(opt, p)) for p in params]
        grads = gradients(params, gen, scale)
        opt.step()
        for p, g, (p_prev, prev) in zip(params, grads, before):
            loose += check_step(opt, p, p_prev, g, prev, t, algo, hp)
            total += p.numel()
            p_err = step_bound(algo, p_prev, g, prev, t, hp)[2]
            for alt, fn in (alts or {}).items():
                if ((p.detach().cpu().double() - fn(p_prev, g, prev, t)).abs() > p_err).any():
                    rejected.setdefault(alt, []).append(t)
    return loose, total, rejected


# ------------------------------------------------------------------ API

def expected_signature(name):
    """bitsandbytes' parameter list (FAMILY2_SEMANTICS.md). 0.50 dropped percentile_clipping and
    block_wise; the form that matches pagedopt's own Adam8bit (0.49 or 0.50) is required. None of
    these classes has is_paged."""
    old = "percentile_clipping" in inspect.signature(pagedopt.Adam8bit.__init__).parameters
    algo = algo_of(name)
    base = name in ("SGD", "RMSprop", "Adagrad")
    if algo == "sgd":
        ps = [("params", EMPTY), ("lr", EMPTY), ("momentum", 0), ("dampening", 0), ("weight_decay", 0),
              ("nesterov", False)] + ([("optim_bits", 32)] if base else [])
    elif algo == "rmsprop":
        ps = [("params", EMPTY), ("lr", 1e-2), ("alpha", 0.99), ("eps", 1e-8), ("weight_decay", 0), ("momentum", 0),
              ("centered", False)] + ([("optim_bits", 32)] if base else [])
    else:  # every Adagrad keeps optim_bits; Adagrad8bit's default is 8
        ps = [("params", EMPTY), ("lr", 1e-2), ("lr_decay", 0), ("weight_decay", 0), ("initial_accumulator_value", 0),
              ("eps", 1e-10), ("optim_bits", 8 if name == "Adagrad8bit" else 32)]
    ps += [("args", None), ("min_8bit_size", 4096)]
    ps += [("percentile_clipping", 100), ("block_wise", True)] if old else []
    return ps + [("capturable", False), ("bf16_stochastic_round", False)]  # pagedopt's own, last (README)


@pytest.mark.parametrize("name", ALL)
def test_signature_and_defaults(name):
    sig = inspect.signature(getattr(pagedopt, name).__init__)
    got = [(k, v.default) for k, v in sig.parameters.items()][1:]
    assert got == expected_signature(name)
    kw = dict(lr=0.1, momentum=0.9) if algo_of(name) == "sgd" else {}
    group = make(name, [torch.zeros(3, requires_grad=True)], **kw).param_groups[0]
    want = dict(expected_signature(name)) | kw
    for k in ("lr", "weight_decay", "eps"):  # the keys bitsandbytes and torch share
        if k in want:
            assert group[k] == want[k], k


@pytest.mark.parametrize("name, args", [
    ("SGD8bit", (0.1, 0.9, 0.5, 0.05)), ("SGD", (0.1, 0.8, 0.0, 0.05, True)), ("SGD32bit", (0.1, 0.0, 0.0, 0.05)),
    ("RMSprop", (0.02, 0.9, 1e-3, 0.05)), ("RMSprop8bit", (0.02, 0.5, 1e-4, 0.0)),
    ("Adagrad32bit", (0.02, 0, 0.05, 0, 1e-3)), ("Adagrad8bit", (0.02, 0.0, 0.1, 0.0, 1e-4))])
def test_positional_order(name, args):
    """Positional arguments in bitsandbytes' order run exactly as the same values by keyword,
    bit for bit (the oracle tests below use keywords, so this pins the positional meaning)."""
    keys = [k for k, _ in expected_signature(name)[1:1 + len(args)]]
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(64, 80, generator=gen)
    pa, pb = p0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    a, b = make(name, [pa], *args), make(name, [pb], **dict(zip(keys, args)))
    for _ in range(3):
        g = torch.randn(64, 80, generator=gen) * 0.1
        pa.grad, pb.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(pa, pb) and not torch.equal(pa, p0)


def live_optimizers():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer))


REFUSED = [
    ("RMSprop", dict(momentum=0.9), "momentum"), ("RMSprop8bit", dict(centered=True), "centered"),
    ("RMSprop32bit", dict(momentum=0.5, centered=True), "momentum|centered"),
    ("Adagrad", dict(lr_decay=0.1), r"(?i)lr.?decay"), ("Adagrad32bit", dict(initial_accumulator_value=0.1),
                                                         r"(?i)initial.?accumulator"),
    ("Adagrad8bit", dict(optim_bits=32), "optim_bits"), ("Adagrad8bit", dict(lr_decay=1e-3), r"(?i)lr.?decay"),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "(?i)nesterov"),
    ("SGD8bit", dict(lr=0.1, nesterov=True), "(?i)nesterov"),
    ("SGD32bit", dict(lr=-0.1, momentum=0.9), "Invalid"), ("SGD", dict(lr=0.1, momentum=-0.5), "Invalid"),
    ("SGD8bit", dict(lr=0.1, momentum=0.9, dampening=-0.1), "Invalid"),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=-1.0), "Invalid"), ("RMSprop", dict(alpha=1.0), "Invalid"),
    ("RMSprop8bit", dict(alpha=-0.1), "Invalid"), ("RMSprop32bit", dict(eps=-1e-8), "Invalid"),
    ("RMSprop", dict(lr=-1.0), "Invalid"), ("Adagrad", dict(eps=-1.0), "Invalid"),
    ("Adagrad8bit", dict(weight_decay=-0.1), "Invalid"), ("Adagrad32bit", dict(lr=-0.01), "Invalid")]


@pytest.mark.parametrize("name, kwargs, match", REFUSED)
def test_refusals_raise_value_error_and_create_nothing(name, kwargs, match):
    """ValueError naming the argument (FAMILY2_SEMANTICS.md, pagedopt's column), and nothing is
    left behind: no optimizer object alive afterwards (the exception and its frames dropped),
    the parameter untouched, no GlobalOptimManager override recorded."""
    p = torch.randn(50, requires_grad=True)
    p0 = p.detach().clone()
    mng = pagedopt.GlobalOptimManager.get_instance()
    overrides = (dict(mng.pid2config), dict(getattr(mng, "index2config", {})))
    live = live_optimizers()
    try:
        make(name, [p], **kwargs)
    except ValueError as e:
        assert re.search(match, str(e)), str(e)
    else:
        raise AssertionError(f"{name}({kwargs}) was accepted")
    assert live_optimizers() == live
    assert torch.equal(p.detach(), p0) and p.grad is None
    assert (dict(mng.pid2config), dict(getattr(mng, "index2config", {}))) == overrides


@pytest.mark.parametrize("name", SGD + RMSPROP)
def test_accepted_where_bitsandbytes_refuses(name):
    """SGD with momentum 0 (plain SGD: only `step` in the state) and RMSprop with alpha 0
    (v = g*g), both as torch: one step each from zero state, within the one-step bound."""
    p = torch.randn(300, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    p0 = p.detach().clone()
    kw = dict(lr=0.1, momentum=0, weight_decay=0.1) if name.startswith("SGD") else dict(alpha=0.0, weight_decay=0.1)
    opt = make(name, [p], **kw)
    g = torch.randn(300, generator=torch.Generator().manual_seed(6)) * 0.1
    p.grad = g.clone()
    opt.step()
    algo = algo_of(name)
    assert check_step(opt, p, p0.double(), g, None if algo == "sgd" else torch.zeros(300, dtype=torch.float64), 1,
                      algo, hparams(name, **kw)) == 0
    if algo == "sgd":
        assert set(opt.state[p]) == {"step"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_state_layout(name, device):
    """Keys, shapes and dtypes after one step for a tensor of min_8bit_size elements and one of
    one fewer (always 32-bit), as bitsandbytes lays them out: state1 (8-bit: absmax1 and qmap1, the
    *signed* dynamic map for all three, as bitsandbytes' Optimizer1State)."""
    from pagedopt.quant import dynamic_codebook
    big = torch.randn(64, 64, device=device, requires_grad=True)  # 4096 = min_8bit_size
    small = torch.randn(4095, device=device, requires_grad=True)
    opt = make(name, [big, small], **(dict(lr=0.1, momentum=0.9) if algo_of(name) == "sgd" else {}))
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    for p in (big, small):
        s = opt.state[p]
        q = "8bit" in name and p is big
        assert set(s) == {"step", "state1"} | ({"absmax1", "qmap1"} if q else set())
        assert int(s["step"]) == 1
        assert s["state1"].shape == p.shape and s["state1"].dtype == (torch.uint8 if q else torch.float32)
        assert s["state1"].device == p.device
        if q:
            assert s["absmax1"].shape == (math.ceil(p.numel() / 256),) and s["absmax1"].dtype == torch.float32
            assert torch.equal(s["qmap1"].cpu(), dynamic_codebook(True))


# ------------------------------------------------------------------ 32-bit steps

CONFIGS = {"sgd": [dict(lr=0.05, momentum=0.9, weight_decay=0.1), dict(lr=0.05, momentum=0.9, dampening=0.5),
                   dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1), dict(lr=0.05, weight_decay=0.1)],
           "rmsprop": [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, alpha=0.5, eps=1e-3)],
           "adagrad": [dict(lr=1e-2, weight_decay=0.1), dict(lr=0.1, eps=1e-3)]}


def alternatives(algo, hp):
    """bitsandbytes' deviations that apply to hp, as one-step float64 functions (p_prev, g, prev, t)."""
    lr, wd = hp["lr"], hp["weight_decay"]
    alts = {}
    if algo == "sgd" and hp["dampening"]:
        alts["dampening ignored"] = lambda p, g, b, t: sgd_step(p, g, b, t, lr, hp["momentum"], 0.0, wd, False)[0]
    if algo == "sgd" and hp["nesterov"]:
        alts["nesterov ignored"] = lambda p, g, b, t: sgd_step(p, g, b, t, lr, hp["momentum"], 0.0, wd, False)[0]
    if algo != "sgd" and wd:
        def raw(p, g, v, t):  # the CUDA 8-bit kernels: v from g + wd p, the update from g
            return p - lr * g.double() / (step_bound(algo, p, g, v, t, hp)[1].sqrt() + hp["eps"])
        alts["raw gradient in the update"] = raw
    return alts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_32bit_matches_float64_oracle(name, device):
    """10 steps, every element checked after each against the oracle's one-step bound from the
    previous step's actual state, for each configuration of CONFIGS (8-bit classes with
    min_8bit_size above the sizes, so 32-bit states). The same bound rejects each of
    bitsandbytes' deviations that applies (dampening or nesterov ignored, raw gradient) at some
    step. Ill-conditioned elements must be (nearly) none."""
    algo = algo_of(name)
    for i, kw in enumerate(CONFIGS[algo]):
        gen, params = case(device, 10 + i)
        opt = make(name, params, **kw, **({"min_8bit_size": 10**9} if "8bit" in name else {}))
        hp = hparams(name, **kw)
        alts = alternatives(algo, hp)
        loose, total, rejected = run_and_check(opt, params, gen, 10, algo, hp, alts=alts)
        assert all(opt.state[p]["state1"].dtype == torch.float32 for p in params if "state1" in opt.state[p])
        assert loose <= 1e-4 * total, (kw, loose, total)
        assert set(rejected) == set(alts), (kw, rejected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["SGD", "SGD32bit", "RMSprop32bit", "RMSprop", "Adagrad", "Adagrad32bit"])
def test_32bit_matches_torch_optim(name, device):
    """10 steps of the class and of torch.optim (both fp32, same start and gradients), one
    configuration per kind: each run is within the fp32 trajectory bound of the float64 oracle
    (reference_family2.trajectory_bound), so the two within twice it, parameters and states."""
    algo = algo_of(name)
    for kw in CONFIGS[algo][:1] + CONFIGS[algo][-1:]:
        hp = hparams(name, **kw)
        gen = torch.Generator().manual_seed(20)
        p0 = torch.randn(3000, generator=gen)
        grads = [torch.randn(3000, generator=gen) * 0.1 for _ in range(10)]
        theirs = torch_run(algo, hp, p0, grads, torch.float32)
        p = p0.to(device).requires_grad_(True)
        opt = make(name, [p], **kw)
        bound = trajectory_bound(algo, p0, grads, hp)
        for t, (g, (pb, sb), (_, _, pe, se, _)) in enumerate(zip(grads, theirs, bound), 1):
            p.grad = g.to(device)
            opt.step()
            assert ((p.detach().cpu().double() - pb).abs() <= 2 * pe).all(), (kw, t)
            if sb is not None:
                assert ((state_of(opt, p) - sb).abs() <= 2 * se).all(), (kw, t)


# ------------------------------------------------------------------ state_dict round trip

ROUND_TRIP = [(n, dict(lr=0.05, momentum=0.9, weight_decay=0.1) if algo_of(n) == "sgd" else dict(weight_decay=0.1))
              for n in ALL] + [("SGD8bit", dict(lr=0.05, weight_decay=0.1)),
                               ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, optim_bits=8))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, kw", ROUND_TRIP)
def test_state_dict_round_trip(name, kw, device):
    """3 steps, state_dict through torch.save / torch.load(weights_only=True) into a fresh optimizer
    on copies of the parameters; then both take the same 2 steps: parameters and every state
    tensor bit for bit equal (a resumed run is the same run). The state_dict holds bitsandbytes'
    keys (flat, or state1/qmap1/absmax1 nested under "__bnb_optimizer_quant_state__")."""
    gen, pa = case(device, 30)
    pa.insert(0, torch.randn(64, 80, generator=gen).to(device).requires_grad_(True))  # 8-bit for 8-bit classes
    a = make(name, pa, **kw)
    for _ in range(3):
        gradients(pa, gen)
        a.step()
    sd = a.state_dict()
    for i, st in sd["state"].items():
        keys = (set(st) - {"__bnb_optimizer_quant_state__"}) | set(st.get("__bnb_optimizer_quant_state__", {}))
        assert keys == set(a.state[pa[i]]), (i, keys)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    pb = [p.detach().clone().requires_grad_(True) for p in pa]
    b = make(name, pb, **kw)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(2):
        grads = gradients(pa, gen)
        for p, g in zip(pb, grads):
            p.grad = g.to(device)
        a.step()
        b.step()
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        sa, sb = a.state[x], b.state[y]
        assert set(sa) == set(sb) and int(sa["step"]) == 5
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(torch.as_tensor(va).cpu(), torch.as_tensor(vb).cpu()), k
            if torch.is_tensor(va):
                assert va.device == vb.device and va.dtype == vb.dtype
