"""Lion and AdEMAMix (all 12 bitsandbytes classes) against the float64 oracles of
reference_family.py, as tests/FAMILY_SEMANTICS.md sets them out. The oracles' own checks run
always; the rest test pagedopt's classes (8-bit tests: test_family_8bit.py).
Every tolerance is derived where it is used or in family_checks.py."""
import inspect
import io
import math

import pytest
import torch

import family_checks as fc
from reference_family import (ademamix_paper_step, ademamix_schedule, ademamix_step_reference, lion_pytorch_step,
                              lion_step_reference)

import pagedopt
from device_params import DEVICES

ALL = fc.LION + fc.ADEMAMIX
U = fc.U
EMPTY = inspect.Parameter.empty


make, case = fc.make, fc.case


# ------------------------------------------------------------------ the oracles against each other

def test_lion_oracles_agree():
    """lion_step_reference (bitsandbytes' order) against lion_pytorch_step (lion-pytorch's lerp
    form), 20 chained steps in float64. Both round differently only in forming the interpolation:
    a + w(b - a) vs beta*a + (1-beta)*b, each within 4 float64 roundings (2^-53) of the terms'
    size, so m agrees within 8 * 2^-53 of its terms per step, summed over the steps; the sign
    agrees wherever the argument is farther than that from 0 (all but none here, asserted)."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(5000, generator=gen, dtype=torch.float64)
    m = torch.zeros_like(p)
    pa, ma, pb, mb = p, m, p.clone(), m.clone()
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    e = 2.0**-53
    for _ in range(20):
        g = torch.randn(5000, generator=gen, dtype=torch.float64)
        terms = b1 * ma.abs() + (1 - b1) * g.abs()
        assert ((b1 * ma + (1 - b1) * g).abs() > 1e6 * e * terms).all()  # the premise: no sign is ambiguous
        pa, ma = lion_step_reference(pa, g, ma, lr, b1, b2, wd)
        pb, mb = lion_pytorch_step(pb, g, mb, lr, b1, b2, wd)
        assert (ma - mb).abs().max() <= 20 * 8 * e * (ma.abs() + g.abs()).max()
        torch.testing.assert_close(pa, pb, rtol=20 * 4 * e, atol=0)  # (1 - lr wd) p and +- lr: 4e of |p|
    # and the step is the paper's: p moved by exactly lr*sign plus the decay, for a chosen case
    p1, m1 = lion_step_reference(torch.tensor([2.0]), torch.tensor([-3.0]), torch.tensor([1.0]), 0.5, 0.9, 0.99, 0.1)
    assert p1.item() == 2.0 * (1 - 0.05) - 0.5 and m1.item() == pytest.approx(0.96, rel=1e-15)  # sign(0.6) = +1


def test_ademamix_oracles_agree():
    """ademamix_step_reference against ademamix_paper_step (the paper's Algorithm 1: nu_hat formed
    first, lerp EMAs, decay as + wd*theta) over 15 chained float64 steps, with and without the
    schedules: each step rounds each quantity a handful of times (say 8, each 2^-53 of the terms'
    size), so over 15 steps within 15 * 8 * 2^-53 < 2e-14 of the terms' size, which for EMAs that
    may cancel to near 0 is bounded by the tensor's largest value (hence atol from it)."""
    for sched in [(None, None), (10, 10), (3, 7)]:
        gen = torch.Generator().manual_seed(2)
        p = torch.randn(3000, generator=gen, dtype=torch.float64)
        z = torch.zeros_like(p)
        a, b = [p, z, z, z], [p.clone(), z, z, z]
        for t in range(1, 16):
            g = torch.randn(3000, generator=gen, dtype=torch.float64)
            hp = (t, 1e-2, 0.9, 0.999, 0.9999, 5.0, 1e-8, 0.1) + sched
            a = list(ademamix_step_reference(a[0], g, *a[1:], *hp))
            b = list(ademamix_paper_step(b[0], g, *b[1:], *hp))
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=2e-14, atol=2e-14 * y.abs().max().item())


def test_ademamix_schedules():
    """alpha_t = min(t alpha / T, alpha), linear from 0; beta3_t runs from beta1 (t = 0) to beta3
    (t = T), increasing, clamped at beta3 after T; falsy T = off (bitsandbytes' truthiness)."""
    b1, b3 = 0.9, 0.9999
    assert ademamix_schedule(0, 5.0, b1, b3, 10, 10) == (0.0, pytest.approx(b1, rel=1e-12))
    assert ademamix_schedule(10, 5.0, b1, b3, 10, 10) == (5.0, pytest.approx(b3, rel=1e-12))
    assert ademamix_schedule(3, 5.0, b1, b3, 10, None) == (1.5, b3)
    assert ademamix_schedule(3, 5.0, b1, b3, 0, 0) == (5.0, b3)
    seq = [ademamix_schedule(t, 5.0, b1, b3, 10, 10) for t in range(0, 15)]
    assert all(x[1] < y[1] for x, y in zip(seq[:9], seq[1:10])) and all(s == (5.0, b3) for s in seq[11:])
    # half way in t, beta3_t is where ln(beta3_t) is the harmonic interpolation of ln beta1, ln beta3
    half = ademamix_schedule(5, 5.0, b1, b3, 10, 10)[1]
    assert math.log(half) == pytest.approx(1 / (0.5 / math.log(b1) + 0.5 / math.log(b3)), rel=1e-12)


# ------------------------------------------------------------------ API

def expected_signature(name):
    """bitsandbytes' parameter list (FAMILY_SEMANTICS.md). Lion: 0.50 dropped percentile_clipping
    and block_wise; the form that matches pagedopt's own Adam8bit (0.49 or 0.50) is required."""
    old = "percentile_clipping" in inspect.signature(pagedopt.Adam8bit.__init__).parameters
    base = name.replace("Paged", "")
    if fc.is_lion(name):
        ps = [("params", EMPTY), ("lr", 1e-4), ("betas", (0.9, 0.99)), ("weight_decay", 0)]
        ps += [("optim_bits", 32)] if base == "Lion" else []
        ps += [("args", None), ("min_8bit_size", 4096)]
        ps += [("percentile_clipping", 100), ("block_wise", True)] if old else []
    else:
        ps = [("params", EMPTY), ("lr", 1e-3), ("betas", (0.9, 0.999, 0.9999)), ("alpha", 5.0), ("t_alpha", None),
              ("t_beta3", None), ("eps", 1e-8), ("weight_decay", 1e-2)]
        ps += [("optim_bits", 32)] if base == "AdEMAMix" else []
        ps += [("min_8bit_size", 4096)]
    ps += [] if name.startswith("Paged") else [("is_paged", False)]
    return ps + [("capturable", False), ("bf16_stochastic_round", False)]  # pagedopt's own, last (README)


@pytest.mark.parametrize("name", ALL)
def test_signature_and_defaults(name):
    sig = inspect.signature(getattr(pagedopt, name).__init__)
    got = [(k, v.default) for k, v in sig.parameters.items()][1:]
    assert got == expected_signature(name)
    # and the defaults reach the param group
    opt = make(name, [torch.zeros(3, requires_grad=True)])
    group = opt.param_groups[0]
    want = dict(expected_signature(name))
    for k in ("lr", "betas", "weight_decay", "alpha", "t_alpha", "t_beta3", "eps"):
        if k in want:
            assert group[k] == want[k], k


@pytest.mark.parametrize("name", ["Lion8bit", "PagedLion", "AdEMAMix32bit", "PagedAdEMAMix8bit"])
def test_positional_order(name):
    p = torch.zeros(3, requires_grad=True)
    if fc.is_lion(name):
        group = make(name, [p], 1e-3, (0.8, 0.9), 0.1).param_groups[0]
        assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-3, (0.8, 0.9), 0.1)
    else:
        group = getattr(pagedopt, name)([p], 1e-2, (0.8, 0.9, 0.99), 3.0, 5, 7, 1e-6, 0.2).param_groups[0]
        got = tuple(group[k] for k in ("lr", "alpha", "t_alpha", "t_beta3", "eps", "weight_decay"))
        assert got == (1e-2, 3.0, 5, 7, 1e-6, 0.2) and tuple(group["betas"]) == (0.8, 0.9, 0.99)


@pytest.mark.parametrize("name, kwargs", [
    ("Lion8bit", dict(betas=(1.0, 0.99))), ("Lion", dict(betas=(0.9, -0.1))), ("PagedLion", dict(lr=-1.0)),
    ("Lion32bit", dict(weight_decay=-1.0)), ("AdEMAMix", dict(betas=(0.9, 0.999, 1.0))),
    ("AdEMAMix8bit", dict(eps=-1.0)), ("PagedAdEMAMix", dict(lr=-1e-3)), ("AdEMAMix32bit", dict(weight_decay=-0.1))])
def test_invalid_arguments_raise(name, kwargs):
    """bitsandbytes raises ValueError('Invalid ...') for each (FAMILY_SEMANTICS.md)."""
    with pytest.raises(ValueError, match="Invalid"):
        make(name, [torch.zeros(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_state_layout(name, device):
    """Keys, shapes and dtypes after one step, for a tensor of min_8bit_size elements and one of
    one fewer (always 32-bit states), as bitsandbytes lays them out."""
    from pagedopt.quant import dynamic_codebook, second_moment_codebook
    big = torch.randn(64, 64, device=device, requires_grad=True)  # 4096 = min_8bit_size
    small = torch.randn(4095, device=device, requires_grad=True)
    opt = make(name, [big, small])
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    eight = "8bit" in name
    for p in (big, small):
        s = opt.state[p]
        q = eight and p is big
        shape1 = p.shape if fc.is_lion(name) else (2, *p.shape)
        keys = {"step", "state1"} | ({"absmax1", "qmap1"} if q else set())
        if not fc.is_lion(name):
            keys |= {"state2"} | ({"absmax2", "qmap2"} if q else set())
        assert set(s) == keys and int(s["step"]) == 1
        assert s["state1"].shape == shape1 and s["state1"].dtype == (torch.uint8 if q else torch.float32)
        if "state2" in s:
            assert s["state2"].shape == p.shape and s["state2"].dtype == s["state1"].dtype
        if q:
            nb = math.ceil(p.numel() / 256)
            assert s["absmax1"].shape == ((nb,) if fc.is_lion(name) else (2, nb))
            assert s["absmax1"].dtype == torch.float32
            assert torch.equal(s["qmap1"].cpu(), dynamic_codebook(True))
            if "qmap2" in s:
                assert torch.equal(s["qmap2"].cpu(), second_moment_codebook()) and s["absmax2"].shape == (nb,)


# ------------------------------------------------------------------ (a) 32-bit, (c) decay kind, (d) schedules

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in ALL if "8bit" not in n])
def test_32bit_matches_float64_oracle(name, device):
    """10 steps, every element checked after each against the oracle from the previous step's
    actual state (the bounds in family_checks.py). Lion's sign is discontinuous: elements whose
    argument is within fp32 rounding of 0 may step either way; on this random data they must be
    (nearly) none, so the check covers all but a negligible few."""
    gen, params = case(device)
    hp = dict(lr=1e-3, weight_decay=0.1) | (dict(betas=(0.9, 0.99)) if fc.is_lion(name) else {})
    opt = make(name, params, **hp)
    free, total, _ = fc.run_and_check(opt, params, gen, 10)
    assert free <= 1e-4 * total, (free, total)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_weight_decay_is_decoupled(name, device):
    """wd*|p| = 0.2 >> |g| <= 2e-3 with g against p's sign: an L2 term folded into the gradient
    (g + wd p) would flip Lion's sign and AdEMAMix's first update (by ~2 lr); decoupled decay leaves
    the moments those of g alone. One step from zero states (exact same oracle checks as above)."""
    gen = torch.Generator().manual_seed(3)
    p0 = (1 + torch.rand(64, 80, generator=gen)) * torch.where(torch.rand(64, 80, generator=gen) < 0.5, -1.0, 1.0)
    p = p0.clone().to(device).requires_grad_(True)
    opt = make(name, [p], lr=1e-2, weight_decay=0.1)
    g = -torch.sign(p0) * 1e-3 * (1 + torch.rand(64, 80, generator=gen))
    p.grad = g.to(device)
    prev = fc.moments(opt, p)
    opt.step()
    hp = opt.param_groups[0]
    if fc.is_lion(name):
        assert fc.check_lion_step(opt, p, p0.double(), g, prev, 1, hp) == 0
        coupled, _ = lion_step_reference(p0, g + 0.1 * p0, prev[0], 1e-2, *hp["betas"], 0.0)
    else:
        fc.check_ademamix_step(opt, p, p0.double(), g, prev, 1, hp)
        z = torch.zeros_like(p0)
        coupled = ademamix_step_reference(p0, g + 0.1 * p0, z, z, z, 1, 1e-2, *hp["betas"], 5.0, 1e-8, 0.0,
                                          None, None)[0]
    assert ((p.detach().cpu().double() - coupled).abs() > 1e-2).all()  # the premise: coupling is far off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["AdEMAMix32bit", "PagedAdEMAMix", "AdEMAMix8bit"])
def test_ademamix_schedules_steps_1_to_12(name, device):
    """t_alpha = t_beta3 = 10: steps 1..12 (the last two past the warm-up) against the oracle,
    whose schedules use the step count after its increment. The same bound rejects, at some step,
    schedules taken at t - 1 (the count before the increment) and no schedules at all."""
    gen, params = case(device, 4)
    kw = dict(min_8bit_size=0) if "8bit" in name else {}
    opt = make(name, params, lr=1e-2, t_alpha=10, t_beta3=10, weight_decay=0.1, **kw)
    b1, _, b3 = opt.param_groups[0]["betas"]

    def alts(t):
        return {"before increment": ademamix_schedule(t - 1, 5.0, b1, b3, 10, 10), "unscheduled": (5.0, b3)}

    _, _, rejected = fc.run_and_check(opt, params, gen, 12, alts_fn=alts)
    assert set(rejected) == {"before increment", "unscheduled"}, rejected


# ------------------------------------------------------------------ (f) state_dict round trip

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip(name, device):
    """3 steps, state_dict through torch.save / torch.load(weights_only=True) into a fresh optimizer
    on copies of the parameters; then both take the same 2 steps: parameters and every state
    tensor bit for bit equal (a resumed run is the same run)."""
    gen, pa = case(device, 5)
    pa.insert(0, torch.randn(64, 80, generator=gen).to(device).requires_grad_(True))  # 8-bit for 8-bit classes
    a = make(name, pa, weight_decay=0.1)
    for _ in range(3):
        fc.gradients(pa, gen)
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    pb = [p.detach().clone().requires_grad_(True) for p in pa]
    b = make(name, pb, weight_decay=0.1)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(2):
        grads = fc.gradients(pa, gen)
        for p, g in zip(pb, grads):
            p.grad = g.to(device)
        a.step()
        b.step()
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        sa, sb = a.state[x], b.state[y]
        assert set(sa) == set(sb)
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(torch.as_tensor(va).cpu(), torch.as_tensor(vb).cpu()), k
            if torch.is_tensor(va):
                assert va.device == vb.device and va.dtype == vb.dtype
