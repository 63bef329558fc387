"""Checkpoints of torch.optim.Adam/AdamW and of bitsandbytes load into pagedopt optimizers;
pagedopt.convert.to_torch_state_dict exports to torch; load_state_dict hooks see what they should.

Continuing after a load is compared with torch within bounds derived as in
test_optim_vs_torch.py. For one flat parameter, with e_m, e_v, e_p bounds on |ours - torch|:

  e_m(t) = beta1 e_m(t-1) + (1-beta1) dg + q1(t) + R (|m_torch(t-1)| + |g|)
  e_v(t) = beta2 e_v(t-1) + (1-beta2) dg (2|g| + dg) + q2(t) + R (v_torch(t-1) + g^2)

q is the requantization error of an 8-bit state (quantization_error_bound in reference.py: half
the gap between the two codes around the value, times the block's absmax, plus 4 ulps of
absmax), 0 for a 32-bit state. dg = wd e_p(t-1) for L2 decay, 0 for decoupled. R = 2^-21
covers the float32 rounding of the moment update on both sides: each side rounds at most 3
times (torch's lerp/addcmul, our fma) by half an ulp (2^-24) of operands no larger than
|m| + |g| (v + g^2), so 6 * 2^-24 < 2^-21. With s = sqrt(v)/sqrt(bc2) + eps the update m/s
differs by at most du = e_m/s_lo + |m| d/sqrt(bc2)/(s_lo s), s_lo from v - e_v, where
d = min(sqrt(e_v), e_v/(sqrt(v - e_v) + sqrt(v))) bounds |sqrt(v_ours) - sqrt(v_torch)|, and

  e_p(t) = decay e_p(t-1) + lr/bc1 du + 2^-22 |p| + 2^-20 lr/bc1 |m|/s

2^-22 |p|: two roundings of p per side (decay, then update) of half an ulp (2^-24 |p|) each;
2^-20 lr/bc1 |m|/s: the float32 computation of the update itself (sqrt, two divisions or
multiplications by reciprocals, the eps add, the step size: at most 8 roundings per side,
16 * 2^-24 = 2^-20 of the update).
"""
import copy
import math

import pytest
import torch

import pagedopt
from pagedopt import _ops
from pagedopt.convert import to_torch_state_dict
from pagedopt.quant import STATE_BLOCK_SIZE, dequantize_blockwise_reference, dynamic_codebook, second_moment_codebook

from reference import quantization_error_bound

pytestmark = pytest.mark.filterwarnings("ignore:paged optimizer states are not paged")

SHAPES = [(300,), (73,), (20, 30)]
MIN_8BIT = 100  # 300 and 600 elements get 8-bit states in an 8-bit group, 73 stays 32-bit
# Not pagedopt's defaults, so that a load that drops the group's values fails the comparisons.
HYPER = dict(lr=3e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.05)
R = 2.0**-21
BNB_QUANT = "__bnb_optimizer_quant_state__"


def make_params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in SHAPES]


def clone(params):
    return [p.detach().clone().requires_grad_(True) for p in params]


def make_grads(seed, params):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g)) for p in params]


def step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype).clone()
    opt.step()


def moments(opt, p):
    s = opt.state[p]
    if s["state1"].dtype == torch.uint8:
        m = dequantize_blockwise_reference(s["state1"].reshape(-1), s["absmax1"], s["qmap1"])
        v = dequantize_blockwise_reference(s["state2"].reshape(-1), s["absmax2"], s["qmap2"])
        return m.double(), v.double()
    return s["state1"].reshape(-1).double(), s["state2"].reshape(-1).double()


def torch_moments(ref, r):
    s = ref.state[r]
    return s["exp_avg"].reshape(-1).double(), s["exp_avg_sq"].reshape(-1).double()


def track(opt, params, ref, ref_params, seeds, decoupled, e_m, e_v):
    """Step both optimizers with the same gradients, asserting the bounds of the module docstring.
    e_m / e_v: the bounds at the start, one per parameter. Returns the final e_p."""
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    e_p = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    for seed in seeds:
        before = [(moments(opt, p), torch_moments(ref, r), p.detach().reshape(-1).double().clone(),
                   r.detach().reshape(-1).double().clone()) for p, r in zip(params, ref_params)]
        grads = make_grads(seed, params)
        step(opt, params, grads)
        step(ref, ref_params, grads)
        for i, (p, r) in enumerate(zip(params, ref_params)):
            (mo0, vo0), (mr0, vr0), po0, pr0 = before[i]
            s = opt.state[p]
            t = float(s["step"])
            assert t == float(ref.state[r]["step"])
            g = grads[i].reshape(-1).double()
            g_o = g if decoupled else g + wd * po0
            g_r = g if decoupled else g + wd * pr0
            if s["state1"].dtype == torch.uint8:
                q1 = quantization_error_bound((b1 * mo0 + (1 - b1) * g_o).float(), s["absmax1"], s["qmap1"])
                q2 = quantization_error_bound((b2 * vo0 + (1 - b2) * g_o * g_o).float(), s["absmax2"], s["qmap2"])
            else:
                q1 = q2 = torch.zeros(1)
            dg = 0.0 if decoupled else wd * e_p[i]
            e_m[i] = b1 * e_m[i] + (1 - b1) * dg + q1.double() + R * (mr0.abs() + g_r.abs())
            e_v[i] = b2 * e_v[i] + (1 - b2) * dg * (2 * g_r.abs() + dg) + q2.double() + R * (vr0 + g_r * g_r)
            mo, vo = moments(opt, p)
            mr, vr = torch_moments(ref, r)
            assert ((mo - mr).abs() <= e_m[i]).all(), (i, ((mo - mr).abs() - e_m[i]).max())
            assert ((vo - vr).abs() <= e_v[i]).all(), (i, ((vo - vr).abs() - e_v[i]).max())
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            s_ref = vr.sqrt() / bc2**0.5 + eps
            v_lo = (vr - e_v[i]).clamp_min(0)
            s_lo = v_lo.sqrt() / bc2**0.5 + eps
            # |sqrt(a) - sqrt(b)| <= |a - b| / (sqrt(a) + sqrt(b)), and <= sqrt(|a - b|)
            den = v_lo.sqrt() + vr.sqrt()
            d_sqrt = torch.where(den > 0, torch.minimum(e_v[i].sqrt(), e_v[i] / den.clamp_min(1e-300)),
                                 e_v[i].sqrt())
            du = e_m[i] / s_lo + mr.abs() * d_sqrt / bc2**0.5 / (s_lo * s_ref)
            decay = 1 - lr * wd if decoupled else 1.0
            pr = r.detach().reshape(-1).double()
            e_p[i] = decay * e_p[i] + lr / bc1 * du + 2.0**-22 * pr.abs() + 2.0**-20 * lr / bc1 * mr.abs() / s_ref
            err = (p.detach().reshape(-1).double() - pr).abs()
            assert (err <= e_p[i]).all(), (i, (err - e_p[i]).max())
    return e_p


def train_torch(torch_cls, params, steps=3, **kw):
    ref = torch_cls(params, **HYPER, **kw)
    for seed in range(steps):
        step(ref, params, make_grads(seed, params))
    return ref


# ----------------------------------------------------------------------------- (a) torch -> pagedopt
LOAD_TORCH = [(pagedopt.AdamW, torch.optim.AdamW), (pagedopt.AdamW8bit, torch.optim.AdamW),
              (pagedopt.Adam8bit, torch.optim.Adam), (pagedopt.Adam32bit, torch.optim.Adam),
              (pagedopt.PagedAdamW8bit, torch.optim.AdamW), (pagedopt.PagedAdam32bit, torch.optim.Adam),
              (pagedopt.PagedAdamW, torch.optim.AdamW)]


@pytest.mark.parametrize("ours_cls, torch_cls", LOAD_TORCH, ids=lambda c: c.__name__)
def test_torch_checkpoint_loads_and_continues_like_torch(ours_cls, torch_cls):
    ref_params = make_params(0)
    ref = train_torch(torch_cls, ref_params)
    saved = ref.state_dict()
    sd = copy.deepcopy(saved)
    params = clone(ref_params)
    opt = ours_cls(params, min_8bit_size=MIN_8BIT)  # default hyperparameters: the load must bring HYPER
    bits = opt.param_groups[0]["optim_bits"]
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    for k, v in HYPER.items():
        assert tuple(group[k]) == v if k == "betas" else group[k] == v, k
    assert group["optim_bits"] == bits and group["min_8bit_size"] == MIN_8BIT  # absent from torch's groups
    e_m, e_v = [], []
    for p, r in zip(params, ref_params):
        s, rs = opt.state[p], ref.state[r]
        assert float(s["step"]) == float(rs["step"]) == 3
        if bits == 8 and p.numel() >= MIN_8BIT:
            # converted to the group's 8-bit kind: exactly the quantize_blockwise op's codes
            for i, (name, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False)), 1):
                code = dynamic_codebook(True) if signed else second_moment_codebook()
                codes, absmax = _ops.quantize_blockwise(rs[name], code)
                assert s[f"state{i}"].dtype == torch.uint8 and s[f"state{i}"].shape == p.shape
                assert torch.equal(s[f"state{i}"], codes) and torch.equal(s[f"absmax{i}"], absmax)
                assert s[f"absmax{i}"].dtype == torch.float32 and torch.equal(s[f"qmap{i}"], code)
            e_m.append(quantization_error_bound(rs["exp_avg"].reshape(-1), s["absmax1"], s["qmap1"]).double())
            e_v.append(quantization_error_bound(rs["exp_avg_sq"].reshape(-1), s["absmax2"], s["qmap2"]).double())
            m, v = moments(opt, p)
            assert ((m - rs["exp_avg"].reshape(-1)).abs() <= e_m[-1]).all()
            assert ((v - rs["exp_avg_sq"].reshape(-1)).abs() <= e_v[-1]).all()
        else:  # a 32-bit state is torch's, bit for bit
            assert s["state1"].dtype == s["state2"].dtype == torch.float32
            assert torch.equal(s["state1"], rs["exp_avg"]) and torch.equal(s["state2"], rs["exp_avg_sq"])
            e_m.append(torch.zeros(p.numel(), dtype=torch.float64))
            e_v.append(torch.zeros(p.numel(), dtype=torch.float64))
    for k, v in saved["state"].items():  # the checkpoint itself is left alone
        assert torch.equal(v["exp_avg"], sd["state"][k]["exp_avg"])
    e_p = track(opt, params, ref, ref_params, range(3, 6), ours_cls.decoupled, e_m, e_v)
    if bits == 32:  # float32 rounding only: below 1% of one step (a wrong lr or state is off by ~a step)
        assert max(e.max().item() for e in e_p) < 1e-2 * HYPER["lr"]
    else:  # informative: most elements are bounded well below the size of the three steps taken
        assert torch.cat(e_p).lt(HYPER["lr"]).float().mean() > 0.5


def test_torch_checkpoint_of_bf16_params_loads_as_float32_states():
    # torch keeps exp_avg/exp_avg_sq in the parameter's dtype; ours are float32 or 8-bit codes
    ref_params = make_params(1, torch.bfloat16)
    ref = train_torch(torch.optim.AdamW, ref_params)
    assert ref.state[ref_params[0]]["exp_avg"].dtype == torch.bfloat16
    params = clone(ref_params)
    opt = pagedopt.AdamW8bit(params, min_8bit_size=MIN_8BIT)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for p, r in zip(params, ref_params):
        s, rs = opt.state[p], ref.state[r]
        for i, (name, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False)), 1):
            if p.numel() >= MIN_8BIT:
                codes, absmax = _ops.quantize_blockwise(rs[name].float(), dynamic_codebook(signed))
                assert torch.equal(s[f"state{i}"], codes) and torch.equal(s[f"absmax{i}"], absmax)
                assert s[f"absmax{i}"].dtype == s[f"qmap{i}"].dtype == torch.float32
            else:  # bf16 -> float32 is exact
                assert s[f"state{i}"].dtype == torch.float32 and torch.equal(s[f"state{i}"], rs[name].float())
    step(opt, params, make_grads(3, params))


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_torch_checkpoint_with_amsgrad_or_maximize_is_refused(flag):
    ref_params = make_params(0)
    sd = train_torch(torch.optim.AdamW, ref_params, **{flag: True}).state_dict()
    params = clone(ref_params)
    opt = pagedopt.AdamW8bit(params, min_8bit_size=MIN_8BIT)
    step(opt, params, make_grads(7, params))
    before = {p: {k: (v, v.clone()) for k, v in opt.state[p].items()} for p in params}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(ValueError, match=flag):
        opt.load_state_dict(copy.deepcopy(sd))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for p in params:
        assert opt.state[p].keys() == before[p].keys()
        for k, (obj, val) in before[p].items():
            assert opt.state[p][k] is obj and torch.equal(obj, val), k


# ----------------------------------------------------------------------------- (b) bitsandbytes layouts
def bnb_checkpoint(widths, layout, step_kind, seed=0):
    """A checkpoint as bitsandbytes writes it, built by hand: random states of the given widths,
    groups without pagedopt's optim_bits/min_8bit_size. The 0.49.2 nested layout's groups carry
    the keys bnb's Optimizer2State has (alpha, t_alpha, t_beta3, for AdEMAMix, unused by Adam)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i, (shape, bits) in enumerate(zip(SHAPES, widths)):
        n = math.prod(shape)
        if bits == 8:
            blocks = (n + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
            t = dict(state1=torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
                     state2=torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
                     absmax1=torch.rand(blocks, generator=gen) * 0.1 + 1e-3,
                     absmax2=torch.rand(blocks, generator=gen) * 1e-3 + 1e-6,
                     qmap1=dynamic_codebook(True), qmap2=dynamic_codebook(False))
        else:
            t = dict(state1=torch.randn(shape, generator=gen) * 0.1,
                     state2=torch.rand(shape, generator=gen) * 1e-3 + 1e-6)
        n_steps = int(torch.randint(1, 50, (), generator=gen))
        s = {"step": n_steps if step_kind == "int" else torch.tensor(float(n_steps))}
        if layout == "nested":
            s[BNB_QUANT] = t
        else:
            s.update(t)
        state[i] = s
    group = dict(HYPER, params=list(range(len(SHAPES))))
    if layout == "nested":
        group.update(alpha=0.0, t_alpha=None, t_beta3=None)
    return {"state": state, "param_groups": [group]}


def native(sd, optim_bits):
    """The same checkpoint in pagedopt's own layout (flat, float32 step, pagedopt's group keys)."""
    out = copy.deepcopy(sd)
    for s in out["state"].values():
        s.update(s.pop(BNB_QUANT, {}))
        s["step"] = torch.tensor(float(s["step"]))
    out["param_groups"] = [dict(HYPER, params=g["params"], optim_bits=optim_bits, min_8bit_size=MIN_8BIT)
                           for g in out["param_groups"]]
    return out


@pytest.mark.parametrize("cls", [pagedopt.AdamW8bit, pagedopt.AdamW32bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("widths", [(8, 32, 8), (8, 8, 32)], ids=["natural", "kept-widths"])
@pytest.mark.parametrize("layout", ["nested", "flat"])
@pytest.mark.parametrize("step_kind", ["int", "tensor"])
def test_bitsandbytes_checkpoint_loads_as_given(cls, widths, layout, step_kind):
    # "kept-widths": an 8-bit state for a 73-element param (below min_8bit_size) and a 32-bit one
    # for 600 elements in an 8-bit group; with AdamW32bit, 8-bit states in a 32-bit group.
    sd = bnb_checkpoint(widths, layout, step_kind)
    given = copy.deepcopy(sd)
    params = make_params(1)
    opt = cls(params, min_8bit_size=MIN_8BIT)
    bits = opt.param_groups[0]["optim_bits"]
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    for k, v in HYPER.items():
        assert tuple(group[k]) == v if k == "betas" else group[k] == v, k
    assert group["optim_bits"] == bits and group["min_8bit_size"] == MIN_8BIT
    for i, p in enumerate(params):
        s, g = opt.state[p], given["state"][i]
        tensors = g.get(BNB_QUANT, g)
        expected = {k for k in tensors if k != "step"} | {"step"}
        assert set(s) == expected, (i, set(s))
        for k in expected - {"step"}:
            assert s[k].dtype == tensors[k].dtype and torch.equal(s[k], tensors[k]), (i, k)
        assert isinstance(s["step"], torch.Tensor) and s["step"].dtype == torch.float32
        assert float(s["step"]) == float(g["step"])
    # and it steps exactly as the same checkpoint in pagedopt's own layout does
    twin_params = make_params(1)
    twin = cls(twin_params, min_8bit_size=MIN_8BIT)
    twin.load_state_dict(native(given, bits))
    for seed in range(2):
        grads = make_grads(seed, params)
        step(opt, params, grads)
        step(twin, twin_params, grads)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        for k, v in twin.state[q].items():
            assert torch.equal(opt.state[p][k], v), k


# ----------------------------------------------------------------------------- (c) pagedopt -> torch
@pytest.mark.parametrize("ours_cls, torch_cls", [(pagedopt.AdamW8bit, torch.optim.AdamW),
                                                 (pagedopt.AdamW32bit, torch.optim.AdamW),
                                                 (pagedopt.Adam8bit, torch.optim.Adam)], ids=lambda c: c.__name__)
def test_export_to_torch_continues_like_pagedopt(ours_cls, torch_cls):
    params = make_params(2)
    opt = ours_cls(params, min_8bit_size=MIN_8BIT, **HYPER)
    for seed in range(3):
        step(opt, params, make_grads(seed, params))
    sd = opt.state_dict()
    exported = to_torch_state_dict(sd)
    assert set(exported) == {"state", "param_groups"}
    for a, b in zip(exported["param_groups"], to_torch_state_dict(opt)["param_groups"]):
        assert a == b  # passing the optimizer gives the same
    (group,) = exported["param_groups"]
    assert "optim_bits" not in group and "min_8bit_size" not in group and group["params"] == [0, 1, 2]
    for i, p in enumerate(params):
        s, e = sd["state"][i], exported["state"][i]
        assert set(e) == {"step", "exp_avg", "exp_avg_sq"}
        assert e["step"].dtype == torch.float32 and e["step"].dim() == 0 and float(e["step"]) == 3
        m, v = moments(opt, p)  # dequantized with the pure-torch reference (or the 32-bit state)
        for name, want in (("exp_avg", m), ("exp_avg_sq", v)):
            assert e[name].dtype == torch.float32 and e[name].shape == p.shape
            assert torch.equal(e[name].reshape(-1).double(), want), name
            assert all(e[name].data_ptr() != t.data_ptr() for t in s.values() if isinstance(t, torch.Tensor))
    assert opt.state[params[0]]["state1"].dtype == (torch.uint8 if "8bit" in ours_cls.__name__ else torch.float32)
    ref_params = clone(params)
    ref = torch_cls(ref_params, lr=1.0, weight_decay=0.5)  # the load must bring HYPER
    ref.load_state_dict(exported)
    # both start from the same moment values (e = 0): from here the module docstring's bounds
    zeros = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    track(opt, params, ref, ref_params, range(3, 5), ours_cls.decoupled, list(zeros), list(zeros))


@pytest.mark.parametrize("ours_cls, torch_cls", [(pagedopt.AdamW32bit, torch.optim.AdamW),
                                                 (pagedopt.AdamW, torch.optim.AdamW),
                                                 (pagedopt.Adam32bit, torch.optim.Adam)], ids=lambda c: c.__name__)
def test_torch_to_pagedopt_32bit_to_torch_round_trip_is_exact(ours_cls, torch_cls):
    ref_params = make_params(3)
    saved = train_torch(torch_cls, ref_params).state_dict()
    opt = ours_cls(clone(ref_params), min_8bit_size=MIN_8BIT)
    opt.load_state_dict(copy.deepcopy(saved))
    back = to_torch_state_dict(opt.state_dict())
    assert back["state"].keys() == saved["state"].keys()
    for k, s in saved["state"].items():
        b = back["state"][k]
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert b[name].dtype == s[name].dtype and torch.equal(b[name], s[name]), (k, name)
    for b, s in zip(back["param_groups"], saved["param_groups"]):
        for key in ("lr", "eps", "weight_decay", "params"):
            assert b[key] == s[key], key
        assert tuple(b["betas"]) == tuple(s["betas"])


# ----------------------------------------------------------------------------- (d) hooks
def trained(cls, params, seeds, **kw):
    opt = cls(params, min_8bit_size=MIN_8BIT, **kw)
    for seed in seeds:
        step(opt, params, make_grads(seed, params))
    return opt


def test_pre_hook_may_return_a_new_dict_that_is_used_for_everything():
    sd = trained(pagedopt.AdamW8bit, make_params(4), range(3)).state_dict()
    given = copy.deepcopy(sd)
    gen = torch.Generator().manual_seed(5)
    new_lr = float(torch.rand((), generator=gen)) * 1e-2
    new_state1 = torch.randn(SHAPES[1], generator=gen)  # param 1 (73 elements) has a 32-bit state

    def hook(optimizer, state_dict):
        new = copy.deepcopy(state_dict)
        new["param_groups"][0]["lr"] = new_lr
        new["state"][1]["state1"] = new_state1.clone()
        return new

    params = make_params(4)
    opt = trained(pagedopt.AdamW8bit, params, range(10, 12))
    opt.register_load_state_dict_pre_hook(hook)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == new_lr
    assert torch.equal(opt.state[params[1]]["state1"], new_state1)
    for i, p in enumerate(params):  # everything else is the checkpoint's
        for k, v in given["state"][i].items():
            if (i, k) != (1, "state1"):
                assert torch.equal(opt.state[p][k], v), (i, k)
    assert sd["param_groups"][0]["lr"] == given["param_groups"][0]["lr"]  # the hook made a new dict
    step(opt, params, make_grads(12, params))


def test_post_hook_sees_the_final_state_and_its_edits_persist():
    params = make_params(5, torch.bfloat16)
    sd = trained(pagedopt.AdamW8bit, make_params(5, torch.bfloat16), range(3)).state_dict()
    given = copy.deepcopy(sd)
    marker = torch.randn(SHAPES[1], generator=torch.Generator().manual_seed(6))
    seen = {}

    def hook(optimizer):
        s = optimizer.state[params[0]]  # 300 elements, bf16: an 8-bit state
        seen.update({k: (v.dtype, torch.equal(v.to(given["state"][0][k].dtype), given["state"][0][k]))
                     for k, v in s.items()})
        optimizer.state[params[1]]["state1"] = marker

    opt = trained(pagedopt.AdamW8bit, params, range(10, 12))
    opt.register_load_state_dict_post_hook(hook)
    opt.load_state_dict(sd)
    assert seen["absmax1"] == (torch.float32, True) and seen["absmax2"] == (torch.float32, True)
    assert seen["qmap1"] == (torch.float32, True) and seen["state1"] == (torch.uint8, True)
    assert opt.state[params[1]]["state1"] is marker
    before = marker.clone()
    step(opt, params, make_grads(12, params))
    assert opt.state[params[1]]["state1"] is marker and not torch.equal(marker, before)  # stepped in place
