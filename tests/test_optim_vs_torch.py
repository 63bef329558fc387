"""AdamW8bit / Adam8bit against torch.optim.AdamW / Adam (float64) over several steps.

The bounds are derived, not tuned. With e_m = m_ours - m_ref (likewise e_v, e_p):

  e_m(t) = beta1 e_m(t-1) + (1-beta1)(g_ours - g_ref) + q1(t)
  e_v(t) = beta2 e_v(t-1) + (1-beta2)(g_ours^2 - g_ref^2) + q2(t)

where q is the requantization error, at most half the gap between the two codes around the
value (times the block's absmax), and g_ours - g_ref = wd * e_p(t-1) for L2 decay (0 for AdamW).
With s = sqrt(v)/sqrt(bc2) + eps, the update m/s differs from the reference's by at most

  E_m / s_lo + |m_ref| sqrt(E_v) / sqrt(bc2) / (s_lo s_ref),   s_lo = sqrt(max(v_ref - E_v, 0))/sqrt(bc2) + eps

and e_p(t) <= decay * e_p(t-1) + lr/bc1 * that + fp32 rounding of p.

Every absmax in a bound is a float64 reference's (block_absmax_float64 of the values), never the
stored one under test. The 32-bit path (torch's fused kernels behind our state layout, dtype
handling, write-back and GradScaler hand-off) is held to a float64 Adam/AdamW written here.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pagedopt
from pagedopt.quant import dequantize_blockwise_reference

from reference import _f32, block_absmax_float64, half_ulp, quantization_error_bound

U = 2.0**-24  # float32 unit roundoff


def state_values(opt, p):
    s = opt.state[p]
    m = dequantize_blockwise_reference(s["state1"].reshape(-1), s["absmax1"], s["qmap1"]).double()
    v = dequantize_blockwise_reference(s["state2"].reshape(-1), s["absmax2"], s["qmap2"]).double()
    return m, v


@given(seed=st.integers(0, 2**31), n=st.sampled_from([1, 7, 255, 256, 257, 1000, 3000]),
       steps=st.integers(1, 8), lr=st.sampled_from([1e-4, 1e-3, 1e-2]),
       betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.0, 0.99)]), eps=st.sampled_from([1e-8, 1e-6]),
       wd=st.sampled_from([0.0, 1e-2, 0.1]), decoupled=st.booleans(), grad_scale=st.sampled_from([1e-3, 1.0, 1e2]),
       plant=st.booleans())
def test_8bit_tracks_torch_within_derived_bounds(seed, n, steps, lr, betas, eps, wd, decoupled, grad_scale, plant):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    p = p0.clone().requires_grad_(True)
    p_ref = p0.double().requires_grad_(True)
    ours_cls, ref_cls = (pagedopt.AdamW8bit, torch.optim.AdamW) if decoupled else (pagedopt.Adam8bit, torch.optim.Adam)
    opt = ours_cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, min_8bit_size=0)
    ref = ref_cls([p_ref], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    beta1, beta2 = betas
    e_m = torch.zeros(n, dtype=torch.float64)
    e_v = torch.zeros(n, dtype=torch.float64)
    e_p = torch.zeros(n, dtype=torch.float64)
    m_prev = torch.zeros(n, dtype=torch.float64)
    v_prev = torch.zeros(n, dtype=torch.float64)
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * grad_scale * torch.exp(torch.randn(n, generator=gen))
        if plant:  # each block's largest |g| moved to its last index (the tail block's included)
            for lo in range(0, n, 256):
                hi = min(n, lo + 256)
                k = lo + int(g[lo:hi].abs().argmax())
                g[[k, hi - 1]] = g[[hi - 1, k]].clone()
        p_before = p.detach().double().clone()
        p.grad = g.clone()
        p_ref.grad = g.double()
        opt.step()
        ref.step()
        m_o, v_o = state_values(opt, p)
        s = opt.state[p]
        assert s["step"].item() == t
        m_r = ref.state[p_ref]["exp_avg"]
        v_r = ref.state[p_ref]["exp_avg_sq"]
        # the unquantized moments our kernel computed before requantizing (fp32 math)
        g_o = g.double() if decoupled else g.double() + wd * p_before
        m_pre = (beta1 * m_prev + (1 - beta1) * g_o).float()
        v_pre = (beta2 * v_prev + (1 - beta2) * g_o * g_o).float()
        # the blocks' absmax from the float64 reference values, not the stored (maybe too small) one
        a1_ref, a2_ref = block_absmax_float64(m_pre), block_absmax_float64(v_pre)
        q1 = quantization_error_bound(m_pre, a1_ref.float(), s["qmap1"]).double()
        q2 = quantization_error_bound(v_pre, a2_ref.float(), s["qmap2"]).double()
        # and the stored absmax is that max, up to the fp32 rounding of the few operations that made
        # m and v (relative to the size of their terms, which m's may exceed: cancellation)
        terms1 = block_absmax_float64(beta1 * m_prev.abs() + (1 - beta1) * g_o.abs())
        terms2 = block_absmax_float64(beta2 * v_prev + (1 - beta2) * g_o * g_o)
        assert ((s["absmax1"].double() - a1_ref).abs() <= 8 * U * terms1).all(), (s["absmax1"].double() - a1_ref)
        assert ((s["absmax2"].double() - a2_ref).abs() <= 8 * U * terms2).all(), (s["absmax2"].double() - a2_ref)
        dg = 0.0 if decoupled else wd * e_p
        g_r = g.double() if decoupled else g.double() + wd * p_ref.detach().double()
        # fp32 rounding of one step's moment update, ours and torch's: each computes beta*s + (1-beta)*x
        # with at most 4 roundings (the weight-decay add, x*x, two products and the sum), each within
        # U of the largest term, so the two differ by at most 8 U times the terms' size (not |m|: m's
        # terms may cancel)
        r_m = 8 * U * (beta1 * m_r.abs() + (1 - beta1) * g_r.abs())
        r_v = 8 * U * (beta2 * v_r + (1 - beta2) * g_r * g_r)
        e_m = beta1 * e_m + (1 - beta1) * dg + q1 + r_m
        e_v = beta2 * e_v + (1 - beta2) * dg * (2 * g_r.abs() + dg) + q2 + r_v
        assert ((m_o - m_r).abs() <= e_m).all(), ((m_o - m_r).abs() - e_m).max()
        assert ((v_o - v_r).abs() <= e_v).all(), ((v_o - v_r).abs() - e_v).max()
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        s_ref = v_r.sqrt() / bc2**0.5 + eps
        s_lo = (v_r - e_v).clamp_min(0).sqrt() / bc2**0.5 + eps
        du = e_m / s_lo + m_r.abs() * e_v.sqrt() / bc2**0.5 / (s_lo * s_ref)
        decay = (1 - lr * wd) if decoupled else 1.0
        e_p = decay * e_p + (lr / bc1) * du + 2.0**-23 * (p_ref.detach().abs() + lr)
        err = (p.detach().double() - p_ref.detach()).abs()
        assert (err <= e_p).all(), (err - e_p).max()
        m_prev, v_prev = m_o, v_o
    # the bound is informative: most elements' errors are far below one update's size
    assert (e_p < lr * steps).float().mean() > 0.5


@pytest.mark.parametrize("cls_pair", [(pagedopt.AdamW, torch.optim.AdamW), (pagedopt.Adam, torch.optim.Adam),
                                      (pagedopt.AdamW32bit, torch.optim.AdamW)])
def test_32bit_matches_torch(cls_pair):
    ours_cls, ref_cls = cls_pair
    torch.manual_seed(0)
    p0 = [torch.randn(300, 20), torch.randn(17)]
    ps = [x.clone().requires_grad_(True) for x in p0]
    rs = [x.clone().requires_grad_(True) for x in p0]
    opt = ours_cls(ps, lr=1e-2, weight_decay=0.1)
    ref = ref_cls(rs, lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        for a, b in zip(ps, rs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    # 5 steps; per step, p * (1 - lr*wd) and p - step_size * m_hat / (sqrt(v_hat) + eps) round at most
    # twice in p (2 U |p|) and, in the update, up to 8 times (8 U |update|), where
    # |update| <= lr * (1 - beta1) / sqrt(1 - beta2) = 3.2 lr for the first steps (Adam's bound)
    steps, lr = 5, 1e-2
    for a, b in zip(ps, rs):
        torch.testing.assert_close(a, b, rtol=steps * 2 * U, atol=steps * 8 * U * 3.2 * lr)


CUDA_KERNELS = torch.cuda.is_available() and pagedopt._ops.has_cuda_kernels()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not CUDA_KERNELS, reason="needs a CUDA GPU and the CUDA kernels")])]


@pytest.mark.parametrize("device", DEVICES)
def test_8bit_state_absmax_is_the_float64_block_max(device):
    """After one step from zero states, m = fl32(fl32(1 - beta1) * g) and v = fl32(fl32(fl32(1 -
    beta2) * g) * g) exactly (the fused multiply-adds add a zero product), so each stored absmax must
    equal the float64 max over its block of those values, exactly. Each block's largest gradient
    sits at its last index (255) and the tail block's at its last element, signs alternating."""
    n = 256 * 3 + 100
    gen = torch.Generator().manual_seed(7)
    g = torch.rand(n, generator=gen) * 2 - 1
    last = torch.tensor([255, 511, 767, n - 1])
    g[last] = torch.tensor([4.0, -5.0, 6.0, -7.0])
    p = torch.randn(n, generator=gen).to(device).requires_grad_(True)
    beta1, beta2 = 0.9, 0.999
    opt = pagedopt.AdamW8bit([p], betas=(beta1, beta2), min_8bit_size=0)
    p.grad = g.to(device)
    opt.step()
    s = {k: v.cpu() for k, v in opt.state[p].items()}
    m = (_f32(1 - beta1) * g.double()).float()
    v = ((_f32(1 - beta2) * g.double()).float().double() * g.double()).float()
    a1, a2 = block_absmax_float64(m), block_absmax_float64(v)
    assert torch.equal(a1, m.double().abs()[last]) and torch.equal(a2, v.double()[last])  # the premise
    assert torch.equal(s["absmax1"].double(), a1), s["absmax1"].double() - a1
    assert torch.equal(s["absmax2"].double(), a2), s["absmax2"].double() - a2
    # and the maxima are stored as the end codes (+1 or the signed map's most negative code)
    m_deq = dequantize_blockwise_reference(s["state1"], s["absmax1"], s["qmap1"]).double()
    bound = quantization_error_bound(m, a1.float(), s["qmap1"]).double()
    assert ((m_deq - m.double()).abs() <= bound).all()


def adam_float64_step(p, g, m, v, t, lr, beta1, beta2, eps, wd, decoupled):
    """torch.optim.Adam/AdamW's step in float64 from float64 p, g (already unscaled), m, v at step t:
    (p_new, m_new, v_new, update), with update = lr / bc1 * m_new / denom."""
    if not decoupled and wd != 0:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    update = lr / bc1 * m / (v.sqrt() / bc2**0.5 + eps)
    if decoupled:
        p = p * (1 - lr * wd)
    return p - update, m, v, update


def make_32bit_case(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(300, 20, generator=gen), torch.randn(17, generator=gen),
              torch.randn(9, 64, generator=gen).t()]  # the last one non-contiguous
    return gen, [x.to(dtype).detach().requires_grad_(True) for x in leaves]


@pytest.mark.parametrize("scale", [None, 1024.0, 1000.0])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_32bit_path_matches_float64_adam(dtype, decoupled, scale):
    """The 32-bit path's states and parameters, step by step, against a float64 Adam/AdamW taken
    from the previous step's actual values (so errors do not compound), with a derived tolerance:

    * m, v: the fp32 kernel rounds the cast betas, the gradient (unscaling, L2 term), the products
      and the sum, at most 8 roundings, each within 2^-24 of the terms' magnitudes:
      |e_m| <= 8u (beta1 |m| + (1-beta1)(|g| + wd|p|)), |e_v| <= 8u (beta2 v + (1-beta2)(|g| + wd|p|)^2).
    * p (from our new m, v): fp32 decay (2 roundings of |p|), update (cast step size, sqrt, two
      divisions, eps, product: <= 12u of |update|), the sum (u of |p_new|); then a bf16/fp16
      parameter is written back with one round to nearest: half an ulp of its dtype.

    grad_scale is handed over as GradScaler does it (opt.grad_scale, opt.found_inf = 0). A skipped
    write-back (half parameters or the non-contiguous one unchanged) or an ignored grad_scale
    (moments `scale` times too large) is far outside these bounds."""
    cls = pagedopt.AdamW if decoupled else pagedopt.Adam
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    gen, params = make_32bit_case(dtype, 1)
    opt = cls(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    assert all(opt.param_groups[0]["optim_bits"] == 32 for _ in params)
    m = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    v = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    informative = []
    for t in range(1, 5):
        p_prev = [p.detach().double().clone() for p in params]
        grads = []
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 0.1 * torch.exp(torch.randn(p.shape, generator=gen) * 0.5)
            p.grad = (g * (scale or 1.0)).to(dtype)
            grads.append(p.grad.double() / (scale or 1.0))  # the unscaled gradient the step must use
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
            opt.found_inf = torch.tensor(0.0)
        opt.step()
        for i, p in enumerate(params):
            s = opt.state[p]
            assert set(s) == {"step", "state1", "state2"} and s["state1"].dtype == torch.float32
            assert s["step"].item() == t
            m_o, v_o = s["state1"].double(), s["state2"].double()
            _, m_ref, v_ref, _ = adam_float64_step(p_prev[i], grads[i], m[i], v[i], t, lr, beta1, beta2, eps, wd,
                                                   decoupled)
            g_mag = grads[i].abs() + (0.0 if decoupled else wd * p_prev[i].abs())
            tol_m = 8 * U * (beta1 * m[i].abs() + (1 - beta1) * g_mag)
            tol_v = 8 * U * (beta2 * v[i] + (1 - beta2) * g_mag * g_mag)
            assert ((m_o - m_ref).abs() <= tol_m).all(), ((m_o - m_ref).abs() - tol_m).max()
            assert ((v_o - v_ref).abs() <= tol_v).all(), ((v_o - v_ref).abs() - tol_v).max()
            # parameters: from our new moments (checked above), so the bound is one step's rounding
            bc1, bc2 = 1 - beta1**t, 1 - beta2**t
            update = lr / bc1 * m_o / (v_o.sqrt() / bc2**0.5 + eps)
            p_ref = (p_prev[i] * (1 - lr * wd) if decoupled else p_prev[i]) - update
            p_o = p.detach().double()
            tol_p = 2 * U * p_prev[i].abs() + 12 * U * update.abs() + U * p_ref.abs()
            if dtype != torch.float32:
                tol_p = tol_p + half_ulp(torch.maximum(p_o.abs(), p_ref.abs() + tol_p), dtype)
            assert ((p_o - p_ref).abs() <= tol_p).all(), ((p_o - p_ref).abs() - tol_p).max()
            informative.append((tol_p < update.abs()).double().mean().item())
            m[i], v[i] = m_o, v_o
    # the bound is informative: for most elements a parameter left unchanged would break it
    assert min(informative) > 0.5, informative


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_32bit_grad_scale_equals_unscaled_run(dtype, decoupled):
    """With grad_scale = 2^10 handed over as GradScaler does, states and parameters are bit for bit
    those of an unscaled run given the gradients divided by the scale (exact for a power of two)."""
    cls = pagedopt.AdamW if decoupled else pagedopt.Adam
    scale = 1024.0
    gen, pa = make_32bit_case(dtype, 2)
    _, pb = make_32bit_case(dtype, 2)
    oa, ob = cls(pa, lr=1e-2, weight_decay=0.1), cls(pb, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for a, b in zip(pa, pb):
            g = torch.randn(a.shape, generator=gen) * 0.1
            b.grad = g.to(dtype)
            a.grad = (b.grad.float() * scale).to(dtype)
            assert torch.equal(b.grad.double() * scale, a.grad.double())  # the premise: exact
        oa.grad_scale, oa.found_inf = torch.tensor(scale), torch.tensor(0.0)
        oa.step()
        ob.step()
    for a, b in zip(pa, pb):
        for k in ("state1", "state2", "step"):
            assert torch.equal(oa.state[a][k], ob.state[b][k]), k
        assert torch.equal(a.detach(), b.detach())
