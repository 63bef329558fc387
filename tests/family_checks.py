"""Step-by-step checks of pagedopt's Lion / AdEMAMix optimizers against the float64 oracles of
reference_family.py, with derived bounds; shared by test_family_oracles.py and
test_family_8bit.py. Imports pagedopt lazily: the oracles' own tests run without it.

Rounding bounds (U = 2^-24, the float32 unit roundoff), each derived where it is defined:
* ema_tol: an fp32 EMA x' = beta*x + (1-beta)*y.
* lion_p_tol / ademamix_p_tol: one parameter update.
"""
import math

import torch

from reference_family import (ademamix_apply, ademamix_moments, ademamix_schedule, ademamix_update,
                              lion_direction_argument, lion_step_reference)

U = 2.0**-24
BLOCK = 256
LION = ["Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit"]
ADEMAMIX = ["AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit"]


def is_lion(name):
    return "Lion" in name


def ema_tol(x, y):
    """fp32 beta*x + (1-beta)*y vs float64: the cast beta (U|x|), a 1-beta formed from the fp32 beta
    or rounded itself (|d(1-beta)| <= U, so U|y|), two products and the sum (3U of the terms, each
    <= |x| or |y|), and an 8-bit x's dequantization (one product, U|x|): <= 5U(|x| + |y|). For
    y = g*g the square's rounding adds U(1-beta)|y|, inside."""
    return 5 * U * (x.abs() + y.abs())


def deq(codes, absmax, code):
    from pagedopt.quant import dequantize_blockwise_reference
    return dequantize_blockwise_reference(codes.cpu(), absmax.cpu(), code.cpu(), BLOCK).double()


def block_max(x):
    flat = x.reshape(-1).double()
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % BLOCK)])
    return flat.view(-1, BLOCK).amax(dim=1)


def moments(opt, p):
    """The optimizer's moments of p as float64 CPU tensors shaped like p (dequantized when 8-bit):
    Lion (m,), AdEMAMix (m1, m2, nu); zeros before the first step."""
    s = opt.state[p]
    shape = p.shape
    if not s:
        z = torch.zeros(shape, dtype=torch.float64)
        return (z,) if is_lion(type(opt).__name__) else (z, z.clone(), z.clone())
    if is_lion(type(opt).__name__):
        if s["state1"].dtype == torch.uint8:
            return (deq(s["state1"], s["absmax1"], s["qmap1"]),)
        return (s["state1"].cpu().double(),)
    if s["state1"].dtype == torch.uint8:
        return (deq(s["state1"][0], s["absmax1"][0], s["qmap1"]), deq(s["state1"][1], s["absmax1"][1], s["qmap1"]),
                deq(s["state2"], s["absmax2"], s["qmap2"]))
    return s["state1"][0].cpu().double(), s["state1"][1].cpu().double(), s["state2"].cpu().double()


def check_stored(stored, ref, tol, s, key, row, qkey):
    """A stored moment (dequantized) against its float64 reference `ref`, whose fp32 computation
    may be off by `tol`. 8-bit: the stored absmax is the block max of the new values (within the
    block max of tol), and each value is within the quantization bound: half the gap between the
    codes around it (pagedopt.quant.max_rounding_error) times the absmax, plus tol, plus 4U of
    absmax (normalization), plus the smallest code's magnitude times absmax (the signed map's sign
    fix-up may move a value next to 0 one code away, across 0); absmax being the reference's widened
    by bt, how far the stored one may be off."""
    if s[key].dtype != torch.uint8:
        bad = (stored - ref).abs() > tol
        assert not bad.any(), f"{key}: {(stored - ref).abs()[bad].max()} over {tol[bad].min()}"
        return
    from pagedopt.quant import max_rounding_error
    code = s[qkey].cpu().float()
    absmax = s["absmax" + key[-1]].cpu().double()
    absmax = absmax[row] if row is not None else absmax
    a_ref = block_max(ref.abs())
    assert ((absmax - a_ref).abs() <= block_max(tol)).all(), f"{key} absmax: {(absmax - a_ref).abs().max()}"
    per = a_ref.repeat_interleave(BLOCK)[: ref.numel()]
    bt = block_max(tol).repeat_interleave(BLOCK)[: ref.numel()]  # how far the stored absmax may be off
    x = ref.reshape(-1)
    # the gap around x normalized by any absmax within bt of the reference's (codes are picked
    # after dividing by the stored one)
    gaps = []
    for a in (per, per + bt, (per - bt).clamp_min(0)):
        safe = torch.where(a > 0, a, torch.ones_like(a))
        gaps.append(max_rounding_error(code, (x / safe).float()).double())
    smallest = code.abs()[code != 0].min().double()
    bound = (torch.stack(gaps).amax(0) + 4 * U + smallest) * (per + bt) + tol.reshape(-1) + bt
    err = (stored.reshape(-1) - ref.reshape(-1)).abs()
    assert (err <= bound).all(), f"{key}: {(err - bound).max()} over the quantization bound"


def lion_p_tol(p_prev, p_ref, lr):
    """fp32 fl(fl(p*fl(1 - lr*wd)) - fl(lr)*sign): the factor (<= 2U relative) and the product (U)
    on |p|, the cast lr (U lr; lr*sign is then exact) and the sum (U|p_new|)."""
    return 3 * U * p_prev.abs() + U * lr + U * p_ref.abs()


def check_lion_step(opt, p, p_prev, g, prev, t, hp):
    """One Lion step of p from p_prev and the moments `prev` (dequantized) with gradient g.
    Returns the number of elements whose sign argument is within rounding of 0 (left free)."""
    lr, (b1, b2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    s = opt.state[p]
    assert int(s["step"]) == t
    (m_prev,) = prev
    p_ref, m_ref = lion_step_reference(p_prev, g, m_prev, lr, b1, b2, wd)
    (m_o,) = moments(opt, p)
    check_stored(m_o, m_ref, ema_tol(m_prev, g.double()), s, "state1", None, "qmap1")
    arg, terms = lion_direction_argument(g, m_prev, b1)
    # fp32 forms beta1*m + (1-beta1)*g within 5U of its terms (ema_tol): closer to 0 than that,
    # its sign may legitimately differ from float64's, and p may be 2 lr away
    free = arg.abs() <= 5 * U * terms
    tol = lion_p_tol(p_prev, p_ref, lr) + free * 2 * lr
    err = (p.detach().cpu().double() - p_ref).abs()
    assert (err <= tol).all(), f"p: {(err - tol).max()} over; step {t}"
    # informative: a wrong sign (2 lr) or a missing decay (lr*wd|p|) is far outside the bound
    assert (lion_p_tol(p_prev, p_ref, lr) < lr).all()
    return int(free.sum())


def ademamix_p_tol(p_prev, p_ref, lr, wd, beta1, beta2, u_mag, du):
    """One AdEMAMix parameter update in fp32 against float64, the new moments being off by at most
    what du propagates. u's fp32 arithmetic (corrections, sqrt, two divisions, eps, alpha product,
    sum): <= 16U of its terms' size u_mag. Bias corrections from fp32-rounded betas: |d beta| <=
    U/2 moves 1 - beta^t by <= t beta^(t-1) U/2 <= (1 - beta^t) U / (2(1 - beta)) (as
    1 - beta^t >= t beta^(t-1)(1 - beta)), so <= U/(1-beta) relative each. The decay's order
    (bitsandbytes' CUDA kernels decay after the update, its CPU backend and the paper before)
    changes p by lr^2 wd |u|. Then the decay factor and product (3U|p|) and the sum (U|p_new|)."""
    rel_u = 16 * U + U / (1 - beta1) + U / (1 - beta2)
    return lr * (du + rel_u * u_mag) + lr * lr * wd * u_mag + 3 * U * p_prev.abs() + U * p_ref.abs()


def check_ademamix_step(opt, p, p_prev, g, prev, t, hp, alts=None):
    """One AdEMAMix step of p (schedules from hp's t_alpha / t_beta3) from p_prev and the moments
    `prev`. `alts`: {name: (alpha_t, beta3_t)} alternative schedules; returns the names of those
    whose parameter would be outside the bound this step (so a test can show each is rejected)."""
    lr, wd, eps, alpha = hp["lr"], hp["weight_decay"], hp["eps"], hp["alpha"]
    b1, b2, b3 = hp["betas"]
    s = opt.state[p]
    assert int(s["step"]) == t
    m1p, m2p, nup = prev
    gd = g.double()
    alpha_t, beta3_t = ademamix_schedule(t, alpha, b1, b3, hp["t_alpha"], hp["t_beta3"])
    m1r, m2r, nur = ademamix_moments(g, m1p, m2p, nup, b1, b2, beta3_t)
    r1, r2, r3 = ema_tol(m1p, gd), ema_tol(m2p, gd), ema_tol(nup, gd * gd)
    m1o, m2o, nuo = moments(opt, p)
    check_stored(m1o, m1r, r1, s, "state1", 0, "qmap1")
    check_stored(m2o, m2r, r2, s, "state1", 1, "qmap1")
    check_stored(nuo, nur, r3, s, "state2", None, "qmap2")
    # the update uses the new unquantized fp32 moments, within r1, r2, r3 of the references:
    # |d num| <= r1/c1 + alpha r2; |sqrt(a) - sqrt(b)| <= sqrt(|a - b|), so the denominator moves by
    # at most ds = sqrt(r3)/c2 and |1/s - 1/s_ref| <= ds/(s_lo s_ref)
    u_ref, u_mag = ademamix_update(m1r, m2r, nur, t, b1, b2, alpha_t, eps)
    c1, c2 = 1 - b1**t, math.sqrt(1 - b2**t)
    s_ref = nur.sqrt() / c2 + eps
    s_lo = (nur - r3).clamp_min(0).sqrt() / c2 + eps
    num = (m1r / c1 + alpha_t * m2r).abs()
    du = (r1 / c1 + abs(alpha_t) * r2) / s_lo + num * (r3.sqrt() / c2) / (s_lo * s_ref)
    p_ref = ademamix_apply(p_prev, u_ref, lr, wd)
    tol = ademamix_p_tol(p_prev, p_ref, lr, wd, b1, b2, u_mag, du)
    p_o = p.detach().cpu().double()
    err = (p_o - p_ref).abs()
    assert (err <= tol).all(), f"p: {(err - tol).max()} over; step {t}"
    rejected = []
    for name, (a_alt, b3_alt) in (alts or {}).items():
        m1a, m2a, nua = ademamix_moments(g, m1p, m2p, nup, b1, b2, b3_alt)
        u_alt, _ = ademamix_update(m1a, m2a, nua, t, b1, b2, a_alt, eps)
        if ((p_o - ademamix_apply(p_prev, u_alt, lr, wd)).abs() > tol).any():
            rejected.append(name)
    return rejected


def make(name, params, *args, **kw):
    """pagedopt's class of that name on ``params``."""
    import pagedopt

    return getattr(pagedopt, name)(params, *args, **kw)


def case(device, seed=0):
    """A generator and two parameters on ``device``: (300, 20), whose tail block is partial, and 17
    elements (under min_8bit_size: 32-bit states)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(300, 20, generator=gen), torch.randn(17, generator=gen)]
    return gen, [p.to(device).requires_grad_(True) for p in params]


def gradients(params, gen, scale=0.1):
    """Nonzero random gradients (a normal times a log-normal), set on params; returned on the CPU."""
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale * torch.exp(torch.randn(p.shape, generator=gen) * 0.5)
        p.grad = g.to(p.device)
        out.append(g)
    return out


def run_and_check(opt, params, gen, steps, scale=0.1, alts_fn=None):
    """`steps` steps of opt, each element of each parameter checked after every step against the
    oracle from the previous step's actual (dequantized) moments. Returns (free sign elements,
    total elements checked, {alt name: steps it was rejected at})."""
    hp = opt.param_groups[0]
    lion = is_lion(type(opt).__name__)
    free, total, rejected = 0, 0, {}
    for t in range(1, steps + 1):
        before = [(p.detach().cpu().double().clone(), moments(opt, p)) for p in params]
        grads = gradients(params, gen, scale)
        opt.step()
        for p, g, (p_prev, prev) in zip(params, grads, before):
            if lion:
                free += check_lion_step(opt, p, p_prev, g, prev, t, hp)
            else:
                for name in check_ademamix_step(opt, p, p_prev, g, prev, t, hp, alts_fn(t) if alts_fn else None):
                    rejected.setdefault(name, []).append(t)
            total += p.numel()
    return free, total, rejected
