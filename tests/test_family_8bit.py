"""8-bit Lion and AdEMAMix against the float64 oracles (tests/FAMILY_SEMANTICS.md): after every
step the dequantized states are within the quantization bound of the oracle's new states computed
from the previous dequantized ones, and the parameter moved as the oracle says given those states
(bounds derived in family_checks.py)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import family_checks as fc

import pagedopt
from device_params import DEVICES, needs_cuda

EIGHT = ["Lion8bit", "PagedLion8bit", "AdEMAMix8bit", "PagedAdEMAMix8bit"]


def make(name, params, **kw):
    if name in ("Lion", "PagedLion", "AdEMAMix", "PagedAdEMAMix"):
        kw.setdefault("optim_bits", 8)
    return getattr(pagedopt, name)(params, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", EIGHT + ["Lion", "AdEMAMix"])  # the last two with optim_bits=8
def test_8bit_matches_float64_oracle(name, device):
    """10 steps on a (40, 130) parameter (5200 elements: 20 full blocks and a tail of 80) and a
    5000-element one; min_8bit_size default, both 8-bit. Lion's elements whose sign argument is
    within rounding of 0 are left free (family_checks.check_lion_step); they must be (nearly) none."""
    gen = torch.Generator().manual_seed(10)
    params = [torch.randn(40, 130, generator=gen).to(device).requires_grad_(True),
              torch.randn(5000, generator=gen).to(device).requires_grad_(True)]
    opt = make(name, params, lr=1e-3, weight_decay=0.1)
    free, total, _ = fc.run_and_check(opt, params, gen, 10)
    assert all(opt.state[p]["state1"].dtype == torch.uint8 for p in params)
    assert free <= 1e-4 * total, (free, total)


@pytest.mark.parametrize("device", DEVICES)
def test_8bit_moments_are_quantized_after_the_update(device):
    """bitsandbytes steps AdEMAMix by the new moments before requantizing them. A step taken from
    the requantized (dequantized) moments instead would differ by the quantization error, about
    1e-2 of the update: far outside the bound, which the oracle check asserts. Here the premise:
    on this data the two orders do differ by more than the bound allows."""
    from reference_family import ademamix_update
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(5000, generator=gen).to(device).requires_grad_(True)
    opt = make("AdEMAMix8bit", [p], lr=1e-2, weight_decay=0.0)
    fc.run_and_check(opt, [p], gen, 2)
    m1, m2, nu = fc.moments(opt, p)
    g = torch.randn(5000, generator=gen) * 0.1
    exact = fc.ademamix_moments(g, m1, m2, nu, 0.9, 0.999, 0.9999)
    u, u_mag = ademamix_update(*exact, 3, 0.9, 0.999, 5.0, 1e-8)
    s = {"qmap1": opt.state[p]["qmap1"].cpu(), "qmap2": opt.state[p]["qmap2"].cpu()}
    from pagedopt.quant import dequantize_blockwise_reference as dq, quantize_blockwise_reference as qz
    requant = [dq(*qz(x.float(), s[k]), s[k]).double() for x, k in zip(exact, ("qmap1", "qmap1", "qmap2"))]
    u_q, _ = ademamix_update(*requant, 3, 0.9, 0.999, 5.0, 1e-8)
    rel_u = 16 * fc.U + fc.U / 0.1 + fc.U / 0.001  # family_checks.ademamix_p_tol's relative part
    assert ((u_q - u).abs() > 10 * rel_u * u_mag).float().mean() > 0.5


SHAPES = [(1,), (7,), (255,), (256,), (257,), (1000,), (3000,), (3, 100), (50, 60), (13, 17)]


@given(seed=st.integers(0, 2**31), shape=st.sampled_from(SHAPES), lion=st.booleans(), steps=st.integers(1, 4),
       lr=st.sampled_from([1e-4, 1e-3, 1e-2]), wd=st.sampled_from([0.0, 1e-2, 0.1]),
       betas_i=st.integers(0, 2), scale=st.sampled_from([1e-3, 1.0, 1e2]), sched=st.sampled_from([None, 3]))
def test_8bit_step_property(seed, shape, lion, steps, lr, wd, betas_i, scale, sched):
    """Any shape (tails, 2-D), lr, betas, weight decay and gradient scale: every step within the
    oracle bounds (CPU, min_8bit_size=0 so every tensor is 8-bit)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen).requires_grad_(True)
    if lion:
        betas = [(0.9, 0.99), (0.95, 0.98), (0.0, 0.9)][betas_i]
        opt = pagedopt.Lion8bit([p], lr=lr, betas=betas, weight_decay=wd, min_8bit_size=0)
    else:
        betas = [(0.9, 0.999, 0.9999), (0.8, 0.95, 0.999), (0.5, 0.9, 0.99)][betas_i]
        opt = pagedopt.AdEMAMix8bit([p], lr=lr, betas=betas, weight_decay=wd, t_alpha=sched, t_beta3=sched,
                                    min_8bit_size=0)
    free, total, _ = fc.run_and_check(opt, [p], gen, steps, scale=scale)
    assert opt.state[p]["state1"].dtype == torch.uint8
    assert free <= max(1, 1e-3 * total)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["Lion8bit", "AdEMAMix8bit", "PagedAdEMAMix8bit"])
@pytest.mark.parametrize("layout", ["40x130", "1001", "offset"])
def test_cuda_and_cpu_codes_are_bit_identical(name, layout):
    """Same parameters, same gradients, 3 steps on CPU and on CUDA: the 8-bit codes and the absmax
    are bit for bit the same after every step (the moments see only g and the shared element math;
    decoupled decay keeps p out of them). Parameters: an FMA contraction or the GPU's approximate
    sqrt and division may differ by one fp32 ulp of p and 2^-19 of the update per step, with
    |update| <= 5 lr here (Adam's 3.2 lr bound of the first steps plus alpha*m2's share; Lion: lr).
    Layouts: 20 full blocks and a tail of 80; 1001 elements (AdEMAMix's second stacked moment starts
    at byte 1001 of state1, not 8-byte aligned: the kernel's scalar path); a parameter at element
    offset 1 of its storage (not 16-byte aligned: every block on the scalar path)."""
    gen = torch.Generator().manual_seed(12)
    shape = {"40x130": (40, 130), "1001": (1001,), "offset": (40, 130)}[layout]
    p0 = torch.randn(shape, generator=gen)
    if layout == "offset":
        pc = torch.randn(p0.numel() + 1)[1:].view(shape).copy_(p0).requires_grad_(True)
        pg = torch.randn(p0.numel() + 1, device="cuda")[1:].view(shape).copy_(p0).requires_grad_(True)
        assert pg.data_ptr() % 16 != 0
    else:
        pc, pg = p0.clone().requires_grad_(True), p0.cuda().requires_grad_(True)
    oc = getattr(pagedopt, name)([pc], lr=1e-3, weight_decay=0.1, min_8bit_size=256)
    og = getattr(pagedopt, name)([pg], lr=1e-3, weight_decay=0.1, min_8bit_size=256)
    for t in range(3):
        g = torch.randn(shape, generator=gen) * 0.1
        pc.grad, pg.grad = g.clone(), g.cuda()
        oc.step()
        og.step()
        assert oc.state[pc]["state1"].dtype == torch.uint8  # min_8bit_size=256: every layout is 8-bit
        for k in ("state1", "absmax1", "state2", "absmax2"):
            if k in oc.state[pc]:
                assert torch.equal(oc.state[pc][k], og.state[pg][k].cpu()), (k, t)
        torch.testing.assert_close(pg.detach().cpu(), pc.detach(), rtol=(t + 1) * 2.0**-23,
                                   atol=(t + 1) * 2.0**-19 * 5 * 1e-3)
