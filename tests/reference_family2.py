"""Float64 oracles for SGD, RMSprop and Adagrad with torch.optim's semantics (the ones pagedopt
follows; tests/FAMILY2_SEMANTICS.md says where bitsandbytes differs), and rounding bounds for
them. Pure torch, no pagedopt import: every function takes tensors (any float dtype, any device)
and computes in float64 on the CPU.

Oracles (one step, the step count `t` counted after its increment: 1 on the first step):
* sgd_step: L2 decay into g; buffer = g on step 1, then momentum*buf + (1-dampening)*g; nesterov;
  momentum == 0 is plain SGD (no buffer).
* rmsprop_step: L2 decay; v = alpha*v + (1-alpha)*g*g; p -= lr*g/(sqrt(v) + eps) (momentum 0, not
  centered).
* adagrad_step: L2 decay; s = s + g*g; p -= lr*g/(sqrt(s) + eps) (lr_decay 0, accumulator from 0).

Bounds (`*_step_bound`): the same step with, for each output, how far a computation whose every
operation is rounded with unit roundoff `r` (2^-24 for fp32, 2^-53 for float64) may be from the
exact result, given inputs already off by at most `p_err` / `s_err`. Chained along a trajectory
they bound a whole fp32 run; with zero input errors they bound one step from known inputs. Each
count of roundings is derived in the function that uses it. Elementwise: error bounds are tensors.
"""
import math

import torch

F32 = 2.0**-24
F64 = 2.0**-53


def _f64(*xs):
    return [None if x is None else torch.as_tensor(x).detach().to(device="cpu", dtype=torch.float64) for x in xs]


# ------------------------------------------------------------------ oracles

def sgd_step(p, g, buf, t, lr, momentum, dampening, weight_decay, nesterov):
    """One torch.optim.SGD step. Returns (new_p, new_buf); new_buf is None when momentum == 0."""
    p, g, buf = _f64(p, g, buf)
    g = g + weight_decay * p
    if momentum == 0:
        return p - lr * g, None
    buf = g.clone() if t == 1 else momentum * buf + (1 - dampening) * g
    d = g + momentum * buf if nesterov else buf
    return p - lr * d, buf


def rmsprop_step(p, g, v, lr, alpha, eps, weight_decay):
    """One torch.optim.RMSprop step (momentum 0, not centered). Returns (new_p, new_v)."""
    p, g, v = _f64(p, g, v)
    g = g + weight_decay * p
    v = alpha * v + (1 - alpha) * g * g
    return p - lr * (g / (v.sqrt() + eps)), v


def adagrad_step(p, g, s, lr, eps, weight_decay):
    """One torch.optim.Adagrad step (lr_decay 0). Returns (new_p, new_s)."""
    p, g, s = _f64(p, g, s)
    g = g + weight_decay * p
    s = s + g * g
    return p - lr * (g / (s.sqrt() + eps)), s


# ------------------------------------------------------------------ rounding bounds

def _decayed_grad(p, g, wd, p_err, r):
    """g + wd*p and its error: the input p_err times wd; the cast wd (r wd|p|), the product
    (r wd|p|) and the sum (r|g + wd p| <= r(|g| + wd|p|)): <= 3r(|g| + wd|p|), |p| widened by p_err.
    Also returns |gw| + err >= |computed g + wd p|, for the magnitudes of later terms."""
    gw = g + wd * p
    err = wd * p_err + 3 * r * (g.abs() + wd * (p.abs() + p_err))
    return gw, err, gw.abs() + err


def _apply(p, p_err, lr, u, u_err, u_mag, r):
    """p - lr*u: the input errors (p_err, lr*u_err), the cast lr and the product (2r lr|u|) and the
    sum (r|p_new| <= r(|p| + p_err + lr|u|)). |u| <= u_mag."""
    new_p = p - lr * u
    return new_p, p_err + lr * u_err + 2 * r * lr * u_mag + r * (p.abs() + p_err + lr * u_mag)


def div_sqrt_bound(num, num_err, num_mag, v, v_err, eps, r, cap):
    """num / (sqrt(v) + eps), v >= 0 exact, num and v computed with errors num_err, v_err.
    Exact errors: |sqrt(a) - sqrt(b)| <= min(sqrt|a - b|, |a - b|/sqrt(b)) (b = v); roundings: the
    sqrt (2r of sqrt(v_hi): an approximate GPU sqrt is within 2 ulp), the cast eps (r eps) and the
    sum (r(s_hi + eps)), so the denominator is off by dden = ds + r(3 s_hi + 2 eps); then
    |a/b - a'/b'| <= |a - a'|/b_lo + |a| dden/(b_lo b) and the division's own 2r (GPU fast
    division is within 2 ulp) of |u| <= num_mag/b_lo. Where num is within its error of 0 and v
    holds little but num^2 (step 1 of RMSprop / Adagrad), u is a sign-like function of num and that
    bound blows up; the computed u is always within `cap` (see the callers) of 0, so
    |u_f - u| <= |u| + cap there. Returns (u, u_err, u_mag, loose): loose marks the elements whose
    bound is that cap (ill-conditioned: the tests require them to be few)."""
    s = v.clamp_min(0).sqrt()
    den = s + eps
    ds = torch.minimum(v_err.sqrt(), torch.where(s > 0, v_err / s.clamp_min(1e-300), torch.full_like(s, math.inf)))
    s_hi = (v + v_err).clamp_min(0).sqrt()
    dden = ds + r * (3 * s_hi + 2 * eps)
    den_lo = den - dden
    ok = den_lo > 0
    den_lo = torch.where(ok, den_lo, torch.ones_like(den_lo))
    u = num / den
    inf = torch.full_like(u, math.inf)
    u_mag = torch.where(ok, num_mag / den_lo, inf)
    u_err = torch.where(ok, num_err / den_lo + num_mag * dden / (den_lo * den) + 2 * r * u_mag, inf)
    loose = u_err > u.abs() + cap
    return u, torch.where(loose, u.abs() + cap, u_err), u_mag.clamp_max(cap), loose


def sgd_step_bound(p, g, buf, t, lr, momentum, dampening, weight_decay, nesterov, p_err=0.0, s_err=0.0, r=F32):
    """sgd_step and (p_err, buf_err) for a computation rounding with r from inputs off by p_err,
    s_err. Returns (new_p, new_buf, p_err, buf_err, loose) (buffer terms None when momentum == 0;
    loose: no element, SGD is never ill-conditioned).
    Buffer after step 1: m*b + (1-d)*gw. Roundings: the cast momentum, an 8-bit buffer's
    dequantization and the product (3r m|b|); 1-d formed from a rounded d or rounded itself
    (absolute error <= r, so r|gw|), its product (r(1-d)|gw|) and the sum (r(m|b| + (1-d)|gw|)):
    <= 4r m|b| + 3r|gw|, plus m s_err and (1-d) gw_err. Step 1: buf = gw (gw_err).
    Nesterov: d = gw + m*buf: gw_err + m buf_err, the cast m and product (2r m|buf|) and the sum
    (r(|gw| + m|buf|))."""
    p, g, buf = _f64(p, g, buf)
    p_err, s_err = (torch.as_tensor(x, dtype=torch.float64) for x in (p_err, s_err))
    gw, gw_err, gw_mag = _decayed_grad(p, g, weight_decay, p_err, r)
    if momentum == 0:
        new_p, new_p_err = _apply(p, p_err, lr, gw, gw_err, gw_mag, r)
        return new_p, None, new_p_err, None, torch.zeros_like(p, dtype=torch.bool)
    if t == 1:
        new_buf, buf_err = gw.clone(), gw_err
    else:
        b_mag = buf.abs() + s_err
        new_buf = momentum * buf + (1 - dampening) * gw
        buf_err = momentum * s_err + (1 - dampening) * gw_err + 4 * r * momentum * b_mag + 3 * r * gw_mag
    nb_mag = new_buf.abs() + buf_err
    if nesterov:
        d = gw + momentum * new_buf
        d_err = gw_err + momentum * buf_err + 2 * r * momentum * nb_mag + r * (gw_mag + momentum * nb_mag)
        d_mag = gw_mag + momentum * nb_mag
    else:
        d, d_err, d_mag = new_buf, buf_err, nb_mag
    new_p, new_p_err = _apply(p, p_err, lr, d, d_err, d_mag, r)
    return new_p, new_buf, new_p_err, buf_err, torch.zeros_like(p, dtype=torch.bool)


def rmsprop_step_bound(p, g, v, lr, alpha, eps, weight_decay, p_err=0.0, s_err=0.0, r=F32):
    """rmsprop_step and (p_err, v_err). v' = a*v + (1-a)*gw^2. Roundings: the cast alpha, an 8-bit
    v's dequantization and the product (3r a|v|); the square (r gw^2); 1-a formed from a rounded a
    or rounded itself (absolute error <= r: r gw^2), its product (r(1-a)gw^2); the sum
    (r(a|v| + (1-a)gw^2)): <= 4r(a|v| + gw^2), |v| widened by s_err and gw^2 by gw_err. Input
    errors: a s_err and (1-a)(2|gw| gw_err + gw_err^2). Then u = gw/(sqrt(v') + eps) by
    div_sqrt_bound and p - lr*u. Returns (new_p, new_v, p_err, v_err, loose)."""
    p, g, v = _f64(p, g, v)
    p_err, s_err = (torch.as_tensor(x, dtype=torch.float64) for x in (p_err, s_err))
    gw, gw_err, gw_mag = _decayed_grad(p, g, weight_decay, p_err, r)
    new_v = alpha * v + (1 - alpha) * gw * gw
    v_err = (alpha * s_err + (1 - alpha) * (2 * gw.abs() * gw_err + gw_err * gw_err)
             + 4 * r * (alpha * (v.abs() + s_err) + gw_mag * gw_mag))
    # cap: all of v's terms are >= 0 and 1-a is formed within r, so the computed v >= (1-a-r)(1-3r) gw^2
    # and the computed |u| <= (1+6r)/sqrt((1-a-r)(1-3r)) <= (1+8r)/sqrt(1-a-r) (sqrt, sum, division)
    cap = (1 + 8 * r) / math.sqrt(1 - alpha - r) if 1 - alpha > r else math.inf
    u, u_err, u_mag, loose = div_sqrt_bound(gw, gw_err, gw_mag, new_v, v_err, eps, r, cap)
    new_p, new_p_err = _apply(p, p_err, lr, u, u_err, u_mag, r)
    return new_p, new_v, new_p_err, v_err, loose


def adagrad_step_bound(p, g, s, lr, eps, weight_decay, p_err=0.0, s_err=0.0, r=F32):
    """adagrad_step and (p_err, s_err). s' = s + gw^2. Roundings: an 8-bit s's dequantization
    (r|s|), the square (r gw^2), the sum (r(|s| + gw^2)): <= 2r(|s| + gw^2), widened by the input
    errors s_err and 2|gw| gw_err + gw_err^2. Then as rmsprop_step_bound; returns
    (new_p, new_s, p_err, s_err, loose)."""
    p, g, s = _f64(p, g, s)
    p_err, s_err = (torch.as_tensor(x, dtype=torch.float64) for x in (p_err, s_err))
    gw, gw_err, gw_mag = _decayed_grad(p, g, weight_decay, p_err, r)
    new_s = s + gw * gw
    s_err_new = s_err + 2 * gw.abs() * gw_err + gw_err * gw_err + 2 * r * (s.abs() + s_err + gw_mag * gw_mag)
    # cap: the computed s >= (1-2r) gw^2 (nonnegative terms), so the computed |u| <= 1 + 8r
    u, u_err, u_mag, loose = div_sqrt_bound(gw, gw_err, gw_mag, new_s, s_err_new, eps, r, 1 + 8 * r)
    new_p, new_p_err = _apply(p, p_err, lr, u, u_err, u_mag, r)
    return new_p, new_s, new_p_err, s_err_new, loose


def step_bound(algo, p, g, state, t, hp, p_err=0.0, s_err=0.0, r=F32):
    """Dispatch by algorithm name ("sgd", "rmsprop", "adagrad") with hp a param-group-like dict
    (torch's keys: lr, momentum, dampening, nesterov, alpha, eps, weight_decay)."""
    if algo == "sgd":
        return sgd_step_bound(p, g, state, t, hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"],
                              hp["nesterov"], p_err, s_err, r)
    if algo == "rmsprop":
        return rmsprop_step_bound(p, g, state, hp["lr"], hp["alpha"], hp["eps"], hp["weight_decay"], p_err, s_err, r)
    if algo == "adagrad":
        return adagrad_step_bound(p, g, state, hp["lr"], hp["eps"], hp["weight_decay"], p_err, s_err, r)
    raise ValueError(algo)


def trajectory_bound(algo, p0, grads, hp, r=F32):
    """The float64 oracle run from p0 over `grads`, and a bound on how far a run rounding with r
    (from the same p0 and gradients) may be from it after every step: the step bounds chained, each
    step's input errors being the previous step's output errors. Returns [(p, state, p_err,
    state_err, loose)] per step (state None for plain SGD)."""
    (p,) = _f64(p0)
    state = None if algo == "sgd" and hp["momentum"] == 0 else torch.zeros_like(p)
    p_err, s_err = torch.zeros_like(p), torch.zeros_like(p)
    out = []
    for t, g in enumerate(grads, 1):
        p, state, p_err, s_err_new, loose = step_bound(algo, p, g, state, t, hp, p_err, s_err, r)
        s_err = s_err if s_err_new is None else s_err_new
        out.append((p, state, p_err, None if state is None else s_err, loose))
    return out


# ------------------------------------------------------------------ whole runs

TORCH = {"sgd": (torch.optim.SGD, "momentum_buffer"), "rmsprop": (torch.optim.RMSprop, "square_avg"),
         "adagrad": (torch.optim.Adagrad, "sum")}


def torch_run(algo, hp, p0, grads, dtype):
    """torch.optim's run (SGD, RMSprop, Adagrad by algo; hp in torch's keywords) in `dtype` from
    p0 over `grads`: [(p, state)] per step, as float64 (state None for plain SGD)."""
    cls, key = TORCH[algo]
    p = p0.to(dtype).clone().requires_grad_(True)
    opt = cls([p], **hp)
    out = []
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
        st = opt.state[p].get(key)
        out.append((p.detach().double().clone(), None if st is None else st.double().clone()))
    return out


def oracle_run(algo, hp, p0, grads):
    """The float64 oracle chained over `grads` from p0: [(p, state)] per step."""
    p, st, out = p0.double(), torch.zeros(p0.shape, dtype=torch.float64), []
    for t, g in enumerate(grads, 1):
        if algo == "sgd":
            p, st = sgd_step(p, g, st, t, hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"], hp["nesterov"])
        elif algo == "rmsprop":
            p, st = rmsprop_step(p, g, st, hp["lr"], hp["alpha"], hp["eps"], hp["weight_decay"])
        else:
            p, st = adagrad_step(p, g, st, hp["lr"], hp["eps"], hp["weight_decay"])
        out.append((p, st))
    return out
