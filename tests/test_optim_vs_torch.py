"""AdamW8bit / Adam8bit against torch.optim.AdamW / Adam (float64) over several steps.

The bounds are derived, not tuned. With e_m = m_ours - m_ref (likewise e_v, e_p):

  e_m(t) = beta1 e_m(t-1) + (1-beta1)(g_ours - g_ref) + q1(t)
  e_v(t) = beta2 e_v(t-1) + (1-beta2)(g_ours^2 - g_ref^2) + q2(t)

where q is the requantization error, at most half the gap between the two codes around the
value (times the block's absmax), and g_ours - g_ref = wd * e_p(t-1) for L2 decay (0 for AdamW).
With s = sqrt(v)/sqrt(bc2) + eps, the update m/s differs from the reference's by at most

  E_m / s_lo + |m_ref| sqrt(E_v) / sqrt(bc2) / (s_lo s_ref),   s_lo = sqrt(max(v_ref - E_v, 0))/sqrt(bc2) + eps

and e_p(t) <= decay * e_p(t-1) + lr/bc1 * that + fp32 rounding of p.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pagedopt
from pagedopt.quant import dequantize_blockwise_reference

from reference import quantization_error_bound


def state_values(opt, p):
    s = opt.state[p]
    m = dequantize_blockwise_reference(s["state1"].reshape(-1), s["absmax1"], s["qmap1"]).double()
    v = dequantize_blockwise_reference(s["state2"].reshape(-1), s["absmax2"], s["qmap2"]).double()
    return m, v


@given(seed=st.integers(0, 2**31), n=st.sampled_from([1, 7, 255, 256, 257, 1000, 3000]),
       steps=st.integers(1, 8), lr=st.sampled_from([1e-4, 1e-3, 1e-2]),
       betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.0, 0.99)]), eps=st.sampled_from([1e-8, 1e-6]),
       wd=st.sampled_from([0.0, 1e-2, 0.1]), decoupled=st.booleans(), grad_scale=st.sampled_from([1e-3, 1.0, 1e2]))
def test_8bit_tracks_torch_within_derived_bounds(seed, n, steps, lr, betas, eps, wd, decoupled, grad_scale):
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
        q1 = quantization_error_bound(m_pre, s["absmax1"], s["qmap1"]).double()
        q2 = quantization_error_bound(v_pre, s["absmax2"], s["qmap2"]).double()
        dg = 0.0 if decoupled else wd * e_p
        g_r = g.double() if decoupled else g.double() + wd * p_ref.detach().double()
        fp32 = 1e-6  # relative rounding allowance for the fp32 arithmetic of one step
        e_m = beta1 * e_m + (1 - beta1) * dg + q1 + fp32 * m_r.abs()
        e_v = beta2 * e_v + (1 - beta2) * dg * (2 * g_r.abs() + dg) + q2 + fp32 * v_r.abs()
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
    for a, b in zip(ps, rs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
