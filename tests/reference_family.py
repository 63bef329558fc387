"""Float64 oracles for Lion and AdEMAMix, from the semantics in tests/FAMILY_SEMANTICS.md
(bitsandbytes 0.50.x, the Lion and AdEMAMix papers). Pure torch, no pagedopt import: every
function takes tensors (any float dtype, any device) and computes in float64 on the CPU.

Two independent formulations are kept for each optimizer, so that the oracles can be checked
against each other (tests/test_family_oracles.py): the bitsandbytes kernel order
(`lion_step_reference`, `ademamix_step_reference`) and the published reference code's order
(`lion_pytorch_step`: lion-pytorch's lerp form; `ademamix_paper_step`: the paper's Algorithm 1
with bias-corrected moments formed first).
"""
import math

import torch


def _f64(*xs):
    return [x.detach().to(device="cpu", dtype=torch.float64) for x in xs]


def lion_step_reference(p, g, m, lr, beta1, beta2, weight_decay):
    """One Lion step: decoupled decay, sign of the beta1-interpolation of the old m and g, then
    the beta2 update of m. Returns (new_p, new_m), float64."""
    p, g, m = _f64(p, g, m)
    direction = torch.sign(beta1 * m + (1 - beta1) * g)
    new_p = p * (1 - lr * weight_decay) - lr * direction
    new_m = beta2 * m + (1 - beta2) * g
    return new_p, new_m


def lion_direction_argument(g, m, beta1):
    """The value whose sign Lion steps by, and the size of its terms (for rounding bounds),
    float64: (beta1*m + (1-beta1)*g, beta1*|m| + (1-beta1)*|g|)."""
    g, m = _f64(g, m)
    return beta1 * m + (1 - beta1) * g, beta1 * m.abs() + (1 - beta1) * g.abs()


def lion_pytorch_step(p, g, exp_avg, lr, beta1, beta2, weight_decay):
    """lion-pytorch's published update order (its `update_fn`), in float64: shrink p by
    (1 - lr*wd); update = sign(lerp(exp_avg, g, 1 - beta1)); p -= lr*update; then
    exp_avg = lerp(exp_avg, g, 1 - beta2). Returns (new_p, new_exp_avg)."""
    p, g, exp_avg = _f64(p, g, exp_avg)
    p = p.mul(1 - lr * weight_decay)
    update = exp_avg.clone().lerp_(g, 1 - beta1).sign_()
    p = p.add(update, alpha=-lr)
    exp_avg = exp_avg.lerp(g, 1 - beta2)
    return p, exp_avg


def ademamix_schedule(step, alpha, beta1, beta3, t_alpha, t_beta3):
    """(alpha_t, beta3_t) at `step` (counted after the increment: 1 on the first step). A falsy
    t_alpha / t_beta3 (None or 0) switches that schedule off, as in bitsandbytes."""
    alpha_t = min(step * alpha / t_alpha, alpha) if t_alpha else alpha
    if t_beta3:
        ln1, ln3 = math.log(beta1), math.log(beta3)
        s = step / t_beta3
        beta3_t = min(math.exp(ln1 * ln3 / ((1 - s) * ln3 + s * ln1)), beta3)
    else:
        beta3_t = beta3
    return alpha_t, beta3_t


def ademamix_update(m1, m2, nu, step, beta1, beta2, alpha_t, eps):
    """AdEMAMix's update direction from the *new* moments, float64:
    (m1/c1 + alpha_t*m2) / (sqrt(nu)/c2 + eps) with c1 = 1 - beta1^t, c2 = sqrt(1 - beta2^t);
    m2 is not bias-corrected. Also returns the size of its terms,
    (|m1|/c1 + alpha_t*|m2|) / (sqrt(nu)/c2 + eps), for rounding bounds (the numerator may cancel)."""
    m1, m2, nu = _f64(m1, m2, nu)
    c1 = 1 - beta1**step
    c2 = math.sqrt(1 - beta2**step)
    denom = nu.sqrt() / c2 + eps
    return (m1 / c1 + alpha_t * m2) / denom, (m1.abs() / c1 + abs(alpha_t) * m2.abs()) / denom


def ademamix_apply(p, update, lr, weight_decay, decay_after=False):
    """p moved by -lr*update with decoupled decay (1 - lr*wd): before the update (the paper,
    bitsandbytes' CPU backend) or after it (bitsandbytes' CUDA kernels). float64."""
    (p,) = _f64(p)
    (update,) = _f64(update)
    if decay_after:
        return (p - lr * update) * (1 - lr * weight_decay)
    return p * (1 - lr * weight_decay) - lr * update


def ademamix_moments(g, m1, m2, nu, beta1, beta2, beta3_t):
    """The three EMAs after one gradient, float64: (m1, m2, nu)."""
    g, m1, m2, nu = _f64(g, m1, m2, nu)
    return beta1 * m1 + (1 - beta1) * g, beta3_t * m2 + (1 - beta3_t) * g, beta2 * nu + (1 - beta2) * g * g


def ademamix_step_reference(p, g, m1, m2, nu, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay,
                            t_alpha, t_beta3, decay_after=False):
    """One AdEMAMix step at `step` (after the increment) from the old moments, float64.
    Returns (new_p, new_m1, new_m2, new_nu)."""
    alpha_t, beta3_t = ademamix_schedule(step, alpha, beta1, beta3, t_alpha, t_beta3)
    m1, m2, nu = ademamix_moments(g, m1, m2, nu, beta1, beta2, beta3_t)
    update, _ = ademamix_update(m1, m2, nu, step, beta1, beta2, alpha_t, eps)
    return ademamix_apply(p, update, lr, weight_decay, decay_after), m1, m2, nu


def ademamix_paper_step(p, g, m1, m2, nu, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay,
                        t_alpha, t_beta3):
    """AdEMAMix as the paper's Algorithm 1 writes it, independently of ademamix_step_reference:
    schedules computed here from their own formulas, m1_hat = m1/(1-beta1^t),
    nu_hat = nu/(1-beta2^t), theta -= lr*((m1_hat + alpha*m2)/(sqrt(nu_hat) + eps) + wd*theta)."""
    p, g, m1, m2, nu = _f64(p, g, m1, m2, nu)
    a = alpha if not t_alpha else min(step * alpha / t_alpha, alpha)
    b3 = beta3
    if t_beta3:
        frac = step / t_beta3
        b3 = min(beta3, math.exp(math.log(beta1) * math.log(beta3) /
                                 ((1 - frac) * math.log(beta3) + frac * math.log(beta1))))
    m1 = m1.lerp(g, 1 - beta1)
    m2 = m2.lerp(g, 1 - b3)
    nu = nu.lerp(g * g, 1 - beta2)
    m1_hat = m1 / (1 - beta1**step)
    nu_hat = nu / (1 - beta2**step)
    p = p - lr * ((m1_hat + a * m2) / (nu_hat.sqrt() + eps) + weight_decay * p)
    return p, m1, m2, nu
