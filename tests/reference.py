"""Pure-torch references for the 8-bit Adam step, used by the tests."""
import torch

from pagedopt.quant import (STATE_BLOCK_SIZE, dequantize_blockwise_reference, max_rounding_error,
                            quantize_blockwise_reference)


def _f32(x: float) -> float:
    """x rounded to float32, as a Python float."""
    return float(torch.tensor(x, dtype=torch.float32))


def _fma(a, b, c) -> torch.Tensor:
    """fmaf(a, b, c) for float32 operands: the product is exact in float64, then one rounding to
    float64 and one to float32 (differs from a single rounding only in rare double-rounding ties)."""
    t = lambda x: x.double() if isinstance(x, torch.Tensor) else float(x)
    return (t(a) * t(b) + t(c)).float()


def adam8bit_step_reference(p, g, q1, q2, a1, a2, step, code1, code2, lr, beta1, beta2, eps, wd, decoupled,
                            grad_scale=None):
    """One fused 8-bit Adam step in float32 torch ops, in the order of pagedopt/adam_update.h (fused
    multiply-adds emulated in float64, IEEE sqrt and division as on the CPU): dequantize, update,
    requantize. Returns (p_new (p.dtype), q1, q2, a1, a2, m_unquantized, v_unquantized)."""
    pf = p.float().reshape(-1).clone()
    gf = g.float().reshape(-1)
    if grad_scale is not None:
        gf = gf * _f32(1.0 / _f32(grad_scale))
    m = dequantize_blockwise_reference(q1.reshape(-1), a1, code1)
    v = dequantize_blockwise_reference(q2.reshape(-1), a2, code2)
    if decoupled:
        pf = pf * _f32(1 - lr * wd)
    elif wd != 0:
        gf = _fma(_f32(wd), pf, gf)
    m = _fma(_f32(beta1), m, _f32(1 - beta1) * gf)
    v = _fma(_f32(beta2), v, _f32(1 - beta2) * gf * gf)
    step_size = _f32(lr / (1 - beta1**step))
    inv_bc2 = _f32(1 / (1 - beta2**step) ** 0.5)
    # sqrt and division through float64, then one rounding: correctly rounded, as on the CPU
    # (torch's float32 CPU sqrt is not always; float64 leaves no double-rounding error for these)
    denom = _fma(v.double().sqrt().float(), inv_bc2, _f32(eps))
    pf = _fma(-step_size, (m.double() / denom.double()).float(), pf)
    # an element whose v is not finite (NaN or infinite gradient, or a finite one whose square
    # overflows) counts for neither block absmax; its moments are stored saturated (algorithms/adam.h)
    ok = torch.isfinite(v)
    pad = (-m.numel()) % STATE_BLOCK_SIZE
    term1 = torch.cat([torch.where(ok, m.abs(), 0.0), m.new_zeros(pad)]).view(-1, STATE_BLOCK_SIZE)
    term2 = torch.cat([torch.where(ok, v.abs(), 0.0), v.new_zeros(pad)]).view(-1, STATE_BLOCK_SIZE)
    nq1, na1 = quantize_blockwise_reference(m, code1, STATE_BLOCK_SIZE, absmax=term1.amax(dim=1))
    nq2, na2 = quantize_blockwise_reference(v, code2, STATE_BLOCK_SIZE, absmax=term2.amax(dim=1))
    return (pf.reshape(p.shape).to(p.dtype), nq1.reshape(p.shape), nq2.reshape(p.shape), na1, na2, m, v)


def block_absmax_float64(x, blocksize=STATE_BLOCK_SIZE):
    """Each block's largest finite |x|, in float64, computed from x alone (not by the code under
    test): the oracle for a stored absmax. Exact for float32/bf16/fp16 inputs."""
    flat = x.detach().reshape(-1).double()
    flat = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % blocksize)])
    return flat.view(-1, blocksize).amax(dim=1)


def half_ulp(x, dtype) -> torch.Tensor:
    """Half the spacing of `dtype` (float32, bfloat16, float16) around |x|, in float64: the most
    one round-to-nearest of x into dtype changes it (subnormals included)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    a = x.detach().double().abs().clamp_min(torch.finfo(dtype).tiny)
    _, e = torch.frexp(a)  # a = f * 2^e with f in [0.5, 1)
    return torch.ldexp(torch.full_like(a, 0.5), (e - 1 - mantissa).to(torch.int32))


def quantization_error_bound(x, absmax, code):
    """Elementwise bound on |dequantize(quantize(x)) - x| for a flat fp32 x and its blocks' absmax.
    Pass the absmax of a reference (block_absmax_float64), not the one under test: a too small
    stored absmax would shrink the bound along with the values it fails to cover."""
    per_elem = absmax.repeat_interleave(STATE_BLOCK_SIZE)[: x.numel()]
    safe = torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))
    bound = max_rounding_error(code, x / safe) * per_elem
    return bound + 4 * 2.0**-24 * per_elem
