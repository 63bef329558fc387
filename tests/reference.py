"""Pure-torch references for the 8-bit Adam step, used by the tests."""
import torch

from pagedopt.quant import (STATE_BLOCK_SIZE, dequantize_blockwise_reference, max_rounding_error,
                            quantize_blockwise_reference)


def adam8bit_step_reference(p, g, q1, q2, a1, a2, step, code1, code2, lr, beta1, beta2, eps, wd, decoupled,
                            grad_scale=None):
    """One fused 8-bit Adam step in fp32 torch ops: dequantize, update, requantize.
    Returns (p_new (p.dtype), q1, q2, a1, a2, m_unquantized, v_unquantized)."""
    pf = p.float().reshape(-1).clone()
    gf = g.float().reshape(-1)
    if grad_scale is not None:
        gf = gf / grad_scale
    m = dequantize_blockwise_reference(q1.reshape(-1), a1, code1)
    v = dequantize_blockwise_reference(q2.reshape(-1), a2, code2)
    if wd != 0:
        if decoupled:
            pf = pf * (1 - lr * wd)
        else:
            gf = gf + wd * pf
    m = beta1 * m + (1 - beta1) * gf
    v = beta2 * v + (1 - beta2) * gf * gf
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    pf = pf - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
    nq1, na1 = quantize_blockwise_reference(m, code1, STATE_BLOCK_SIZE)
    nq2, na2 = quantize_blockwise_reference(v, code2, STATE_BLOCK_SIZE)
    return (pf.reshape(p.shape).to(p.dtype), nq1.reshape(p.shape), nq2.reshape(p.shape), na1, na2, m, v)


def quantization_error_bound(x, absmax, code):
    """Elementwise bound on |dequantize(quantize(x)) - x| for a flat fp32 x and its blocks' absmax."""
    per_elem = absmax.repeat_interleave(STATE_BLOCK_SIZE)[: x.numel()]
    safe = torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))
    bound = max_rounding_error(code, x / safe) * per_elem
    return bound + 4 * 2.0**-24 * per_elem
