"""References for the engine's 4-bit states (csrc/include/pagedopt/four_bit.h), used by the tests.

* adam4bit_step_reference: one 4-bit Adam step in pure torch (dequantize, the float32 update in
  the order of pagedopt/adam_update.h, requantize per 128-element block), as tests/reference.py's
  adam8bit_step_reference does it for 8-bit states.
* step_via_fp32: any algorithm of pagedopt/algorithms.h, its element math taken from the engine's
  32-bit path (held to float64 oracles elsewhere: test_family_oracles.py, test_family2_oracles.py,
  test_adam_engine.py): the 4-bit states dequantized by the pure-torch reference, one 32-bit step,
  the new moments requantized by the pure-torch reference. The 4-bit kernels perform exactly these
  float32 operations (code * absmax, the algorithm's update(), the block's largest counted |x|,
  x * (1 / absmax), the nearest code with ties to the lower index), so they must agree bit for bit.
* ALGORITHMS: each algorithm's state keys (moments stacked per key), codebooks and a hyper list.
"""
import torch

from pagedopt import _ops
from pagedopt.quant import (STATE_BLOCK_SIZE_4, dequantize_4bit_reference, linear_codebook_4bit_no_zero,
                            normal_codebook_4bit, quantize_4bit_reference)

from reference import _f32, _fma

BLOCK4 = STATE_BLOCK_SIZE_4

# name -> (moments per state key, codebook kind per key: "m" signed, "v" the unsigned no-zero map,
# hyper list in the functor's documented order, whether it takes per-tensor scales)
ALGORITHMS = {
    "adam": ([1, 1], ["m", "v"], [1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0], False),
    "lion": ([1], ["m"], [1e-3, 0.9, 0.99, 0.1], False),
    "ademamix": ([2, 1], ["m", "v"], [1e-3, 0.9, 0.999, 0.9999, 5.0, 1e-8, 0.01, 100.0, 100.0], False),
    "sgd_momentum": ([1], ["m"], [1e-2, 0.9, 0.0, 1e-4, 0.0], False),
    "rmsprop": ([1], ["v"], [1e-2, 0.99, 1e-8, 0.01], False),
    "adagrad": ([1], ["v"], [1e-2, 1e-10, 0.01], False),
    "lars": ([1], ["m"], [1e-2, 0.9, 0.0, 1e-4, 0.0], True),
    "lamb": ([1, 1], ["m", "v"], [1e-3, 0.9, 0.999, 1e-6, 0.01, 1.0, 1.0], True),
}


def codebooks(kinds, device="cpu"):
    # the optimizers' maps (base.codebooks_on): the normal-quantile map for signed states
    return [normal_codebook_4bit(device) if k == "m" else linear_codebook_4bit_no_zero(device) for k in kinds]


def packed(n):
    return (n + 1) // 2


def blocks4(n):
    return (n + BLOCK4 - 1) // BLOCK4


def dequantize_state(state, absmax, code, n, stack):
    """A key's `stack` moments of n elements, float32, stacked flat: (stack * n,)."""
    nb, na = packed(n), blocks4(n)
    return torch.cat([dequantize_4bit_reference(state[s * nb:(s + 1) * nb], absmax[s * na:(s + 1) * na], code, n)
                      for s in range(stack)])


def block_absmax(x, counted):
    """Each 128-block's largest |x| over the counted elements (the engine's rule), float32."""
    a = torch.where(counted, x.abs(), torch.zeros_like(x))
    a = torch.cat([a, a.new_zeros((-a.numel()) % BLOCK4)])
    return a.view(-1, BLOCK4).amax(dim=1)


def requantize(moments, codes):
    """moments: per key a (stack, n) float32 tensor; codes: per key its codebook. An element counts
    toward its blocks' absmaxes when all of its moments are finite. Returns per key (packed states
    (stack * ceil(n/2),), absmax (stack * ceil(n/128),))."""
    counted = torch.stack([torch.isfinite(m).all(dim=0) for m in moments]).all(dim=0)
    out = []
    for m, code in zip(moments, codes):
        qs, As = [], []
        for row in m:
            q, a = quantize_4bit_reference(row, code, BLOCK4, absmax=block_absmax(row, counted))
            qs.append(q)
            As.append(a)
        out.append((torch.cat(qs), torch.cat(As)))
    return out


def step_via_fp32(algorithm, params, grads, states, absmax, steps, qmaps, stacks, hyper, **kw):
    """The reference 4-bit step of `algorithm` on copies: (params, states, absmax) after it, states
    and absmax as lists per key of per-parameter tensors."""
    params = [p.clone() for p in params]
    fp32 = [[dequantize_state(states[k][i], absmax[k][i], qmaps[k].cpu(), p.numel(), stacks[k])
             for i, p in enumerate(params)] for k in range(len(stacks))]
    _ops.quantized_step_(algorithm, params, grads, fp32, [], steps, [], hyper, **kw)
    new_states, new_absmax = [[] for _ in stacks], [[] for _ in stacks]
    for i, p in enumerate(params):
        moments = [fp32[k][i].view(stacks[k], -1) for k in range(len(stacks))]
        for k, (q, a) in enumerate(requantize(moments, [c.cpu() for c in qmaps])):
            new_states[k].append(q)
            new_absmax[k].append(a)
    return params, new_states, new_absmax


def adam4bit_step_reference(p, g, q1, q2, a1, a2, step, code1, code2, lr, beta1, beta2, eps, wd, decoupled,
                            grad_scale=None):
    """One fused 4-bit Adam step in float32 torch ops, in the order of pagedopt/adam_update.h (fused
    multiply-adds emulated in float64, IEEE sqrt and division), independent of the engine:
    dequantize, update, requantize per 128-block. Returns (p_new (p.dtype), q1, q2, a1, a2,
    m_unquantized, v_unquantized)."""
    n = p.numel()
    pf = p.float().reshape(-1).clone()
    gf = g.float().reshape(-1)
    if grad_scale is not None:
        gf = gf * _f32(1.0 / _f32(grad_scale))
    m = dequantize_4bit_reference(q1, a1, code1, n)
    v = dequantize_4bit_reference(q2, a2, code2, n)
    if decoupled:
        pf = pf * _f32(1 - lr * wd)
    elif wd != 0:
        gf = _fma(_f32(wd), pf, gf)
    m = _fma(_f32(beta1), m, _f32(1 - beta1) * gf)
    v = _fma(_f32(beta2), v, _f32(1 - beta2) * gf * gf)
    step_size = _f32(lr / (1 - beta1**step))
    inv_bc2 = _f32(1 / (1 - beta2**step) ** 0.5)
    denom = _fma(v.double().sqrt().float(), inv_bc2, _f32(eps))
    pf = _fma(-step_size, (m.double() / denom.double()).float(), pf)
    ok = torch.isfinite(v)  # Adam's absmax rule (algorithms/adam.h)
    nq1, na1 = quantize_4bit_reference(m, code1, BLOCK4, absmax=block_absmax(m, ok))
    nq2, na2 = quantize_4bit_reference(v, code2, BLOCK4, absmax=block_absmax(v, ok))
    return pf.reshape(p.shape).to(p.dtype), nq1, nq2, na1, na2, m, v
