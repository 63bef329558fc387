"""LARS and LAMB on the generic engine: each step scales the update u of every tensor by
min(1, max_unorm * ||p|| / ||u||) (||p|| before the step), bitsandbytes' rule. The oracles below
compute a step in float64 from the optimizer's own previous states (dequantized when 8-bit), so
each step is checked alone; U = 2^-24 is the float32 unit roundoff."""
import inspect
import io
import math

import pytest
import torch

import pagedopt
from pagedopt.quant import dequantize_blockwise_reference, max_rounding_error

from device_params import DEVICES, needs_cuda
from reference import block_absmax_float64

U = 2.0**-24
CLASSES = ["LARS", "LARS8bit", "LARS32bit", "LAMB", "LAMB8bit", "LAMB32bit"]


def _clip(u, p, max_unorm):
    unorm, pnorm = u.norm().item(), p.norm().item()
    return max_unorm * pnorm / unorm if max_unorm > 0 and unorm > max_unorm * pnorm else 1.0


def lars_reference(p, g, buf, t, lr, momentum, dampening, wd, nesterov, max_unorm):
    """One LARS step in float64: torch's SGD-momentum direction, clipped. (new_p, new_buf, ||d||)."""
    p, g, buf = p.double(), g.double(), buf.double()
    g = g + wd * p
    buf = g.clone() if t == 1 else momentum * buf + (1 - dampening) * g
    d = g + momentum * buf if nesterov else buf
    return p - lr * _clip(d, p, max_unorm) * d, buf, d.norm().item()


def lamb_reference(p, g, m, v, t, lr, beta1, beta2, eps, wd, adam_w_mode, bias_correction, max_unorm):
    """One LAMB step in float64: Adam's bias-corrected direction, clipped. (new_p, m, v, ||u||)."""
    p, g, m, v = p.double(), g.double(), m.double(), v.double()
    if not adam_w_mode:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    c1, c2 = (1 - beta1**t, 1 - beta2**t) if bias_correction else (1.0, 1.0)
    u = (m / c1) / ((v / c2).sqrt() + eps)
    decay = 1 - lr * wd if adam_w_mode else 1.0
    return p * decay - lr * _clip(u, p, max_unorm) * u, m, v, u.norm().item()


def _moment(state, key, absmax_key, qmap_key):
    t = state[key]
    if t.dtype != torch.uint8:
        return t.double().clone()
    return dequantize_blockwise_reference(t, state[absmax_key], state[qmap_key], 256, torch.float64)


def _quantization_bound(ref, state, absmax_key, qmap_key):
    """How far an 8-bit state may be from the float64 value it stores: half the largest code gap
    around it, times the block's float64 absmax, plus 4 U of that absmax (x/absmax and code*absmax
    round once each, twice over)."""
    absmax = block_absmax_float64(ref.float())
    per_elem = absmax.repeat_interleave(256)[:ref.numel()]
    return max_rounding_error(state[qmap_key], (ref / per_elem).float()).double() * per_elem + 4 * U * per_elem


@pytest.mark.parametrize("name", ["LARS32bit", "LARS8bit"])
@pytest.mark.parametrize("max_unorm, nesterov", [(0.02, False), (0.02, True), (0.0, False), (100.0, False)])
def test_lars_matches_the_float64_oracle(name, max_unorm, nesterov):
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(3000))
    hp = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=nesterov)
    opt = getattr(pagedopt, name)([p], max_unorm=max_unorm, min_8bit_size=256, **hp)
    buf = torch.zeros(3000, dtype=torch.float64)
    clipped = 0
    for t in range(1, 7):
        g = torch.randn(3000)
        p_old = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        ref_p, ref_buf, dnorm = lars_reference(p_old, g, buf, t, hp["lr"], hp["momentum"], hp["dampening"],
                                               hp["weight_decay"], nesterov, max_unorm)
        st = opt.state[p]
        clipped += _clip(ref_buf, p_old.double(), max_unorm) < 1
        # the parameter: a few fp32 roundings of |p| and of lr * |d| (d itself and the scale, from
        # double norms, within a few U); 16 U of both covers them with room
        d_terms = ref_buf.abs() + (hp["momentum"] * ref_buf.abs() + (g.double().abs() + 0.01 * p_old.double().abs())
                                   if nesterov else 0)
        bound = 16 * U * (p_old.double().abs() + hp["lr"] * d_terms)
        assert ((p.detach().double() - ref_p).abs() <= bound).all(), ((p.detach().double() - ref_p).abs() - bound).max()
        assert math.isclose(st["unorm_vec"].item(), dnorm, rel_tol=1e-5)  # ||d||, float32 of a double norm
        buf = _moment(st, "state1", "absmax1", "qmap1")
        if st["state1"].dtype == torch.uint8:
            bound = _quantization_bound(ref_buf, st, "absmax1", "qmap1") + 8 * U * ref_buf.abs()
        else:  # the buffer: momentum * buf + g' in fp32, 4 roundings of its terms
            bound = 4 * U * (hp["momentum"] * buf.abs() + g.double().abs() + p_old.double().abs())
        assert ((buf - ref_buf).abs() <= bound).all()
    assert (clipped > 0) == (max_unorm == 0.02)  # the oracle's clip was active exactly where intended


@pytest.mark.parametrize("name", ["LAMB32bit", "LAMB8bit"])
@pytest.mark.parametrize("adam_w_mode, bias_correction, max_unorm",
                         [(True, True, 1.0), (False, True, 1.0), (True, False, 1.0), (True, True, 0.01)])
def test_lamb_matches_the_float64_oracle(name, adam_w_mode, bias_correction, max_unorm):
    if name == "LAMB8bit" and max_unorm != 1.0:
        pytest.skip("LAMB8bit takes max_unorm = 1.0 only (as in bitsandbytes)")
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(3000) * 0.01)  # small weights: the clip acts at max_unorm = 1
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt = getattr(pagedopt, name)([p], adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                                  max_unorm=max_unorm, min_8bit_size=256, **hp)
    m = torch.zeros(3000, dtype=torch.float64)
    v = torch.zeros(3000, dtype=torch.float64)
    clipped = 0
    for t in range(1, 7):
        g = torch.randn(3000)
        p_old = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        ref_p, ref_m, ref_v, unorm = lamb_reference(p_old, g, m, v, t, hp["lr"], *hp["betas"], hp["eps"],
                                                    hp["weight_decay"], adam_w_mode, bias_correction, max_unorm)
        st = opt.state[p]
        c1 = 1 - 0.9**t if bias_correction else 1.0
        u_ref_terms = (ref_m.abs() / c1) / ((ref_v / ((1 - 0.999**t) if bias_correction else 1.0)).sqrt() + hp["eps"])
        clipped += max_unorm > 0 and unorm > max_unorm * p_old.double().norm().item()
        # u = m * (1/c1) / (sqrt(v) / sqrt(c2) + eps): about 8 roundings, each within U of u's size;
        # the scale from double norms within a few U; the parameter a few more roundings of |p|
        bound = 16 * U * (p_old.double().abs() + hp["lr"] * u_ref_terms)
        assert ((p.detach().double() - ref_p).abs() <= bound).all(), ((p.detach().double() - ref_p).abs() - bound).max()
        assert math.isclose(st["unorm_vec"].item(), unorm, rel_tol=1e-4)
        m, v = _moment(st, "state1", "absmax1", "qmap1"), _moment(st, "state2", "absmax2", "qmap2")
        if st["state1"].dtype == torch.uint8:
            assert ((m - ref_m).abs() <= _quantization_bound(ref_m, st, "absmax1", "qmap1") + 8 * U * ref_m.abs()).all()
            assert ((v - ref_v).abs() <= _quantization_bound(ref_v, st, "absmax2", "qmap2") + 8 * U * ref_v.abs()).all()
    assert clipped > 0  # small weights: the clip acts (the test would not see a missing scale otherwise)


def test_max_unorm_changes_lamb32bit_and_lamb8bit_refuses_it():
    torch.manual_seed(3)
    p0 = torch.randn(1000) * 0.01
    out = []
    for max_unorm in (1.0, 0.1):
        p = torch.nn.Parameter(p0.clone())
        opt = pagedopt.LAMB32bit([p], max_unorm=max_unorm)
        p.grad = torch.ones(1000)
        opt.step()
        out.append(p.detach().clone())
    assert not torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match="max_unorm"):
        pagedopt.LAMB8bit([torch.nn.Parameter(p0.clone())], max_unorm=0.5)
    with pytest.raises(ValueError, match="amsgrad"):
        pagedopt.LAMB8bit([torch.nn.Parameter(p0.clone())], amsgrad=True)
    with pytest.raises(ValueError, match="momentum"):
        pagedopt.LARS8bit([torch.nn.Parameter(p0.clone())], lr=0.1)


def test_signatures_follow_bitsandbytes():
    lars = ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "optim_bits", "args", "min_8bit_size",
            "percentile_clipping", "max_unorm", "capturable", "bf16_stochastic_round"]  # pagedopt's own, last
    lamb = ["params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "optim_bits",
            "args", "min_8bit_size", "percentile_clipping", "block_wise", "max_unorm", "capturable", "bf16_stochastic_round"]
    for name, expected in (("LARS", lars), ("LAMB", lamb)):
        for suffix in ("", "8bit", "32bit"):
            params = inspect.signature(getattr(pagedopt, name + suffix)).parameters
            names = [n for n in expected if suffix == "" or n != "optim_bits"]
            assert list(params) == names, (name + suffix, list(params))
    sig = inspect.signature(pagedopt.LARS).parameters
    assert sig["lr"].default is inspect.Parameter.empty and sig["max_unorm"].default == 0.02
    sig = inspect.signature(pagedopt.LAMB).parameters
    assert (sig["lr"].default, sig["betas"].default, sig["block_wise"].default, sig["max_unorm"].default) == \
        (1e-3, (0.9, 0.999), False, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CLASSES)
def test_state_dict_round_trip_and_grad_scaler(name, device):
    """torch.save / torch.load(weights_only=True) into a fresh optimizer, which continues exactly
    like the original (unorm_vec included); a step GradScaler skips changes no parameter."""
    torch.manual_seed(4)
    kw = dict(lr=0.1, momentum=0.9) if name.startswith("LARS") else dict(lr=1e-2)
    if name in ("LARS", "LAMB"):
        kw["optim_bits"] = 8
    params = [torch.nn.Parameter(torch.randn(600).to(device)), torch.nn.Parameter(torch.randn(20, 30).to(device))]
    opt = getattr(pagedopt, name)(params, min_8bit_size=256, **kw)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert (opt.state[params[0]]["state1"].dtype == torch.uint8) == (not name.endswith("32bit"))
    assert all(opt.state[p]["unorm_vec"].item() > 0 for p in params)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = getattr(pagedopt, name)(twin_params, min_8bit_size=256, **kw)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    before = [p.detach().clone() for p in params]
    for ps, o in ((params, opt), (twin_params, twin)):
        for p in ps:
            p.grad = torch.full_like(p, float("inf"))
        o.grad_scale, o.found_inf = torch.tensor(1.0, device=device), torch.tensor(1.0, device=device)
        o.step()
        del o.grad_scale, o.found_inf
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    grads = [torch.randn_like(p) for p in params]
    for ps, o in ((params, opt), (twin_params, twin)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        o.step()
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
        for k, v in opt.state[a].items():
            assert torch.equal(v, twin.state[b][k]), k


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["LARS8bit", "LAMB8bit", "LAMB32bit"])
def test_cuda_matches_cpu(name):
    """Same inputs on both backends: the states bit for bit (the moments do not depend on the
    scale), the parameters within 2^-18 of the update (the GPU's approximate sqrt and division
    in LAMB's direction, and norms summed in another order)."""
    torch.manual_seed(5)
    kw = dict(lr=0.1, momentum=0.9) if name.startswith("LARS") else dict(lr=1e-2)
    p0 = [torch.randn(5000), torch.randn(300, 7)]
    cpu = [torch.nn.Parameter(p.clone()) for p in p0]
    gpu = [torch.nn.Parameter(p.clone().cuda()) for p in p0]
    oc = getattr(pagedopt, name)(cpu, min_8bit_size=256, **kw)
    og = getattr(pagedopt, name)(gpu, min_8bit_size=256, **kw)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in cpu]
        before = [p.detach().clone() for p in cpu]
        for ps, o, dev in ((cpu, oc, "cpu"), (gpu, og, "cuda")):
            for p, g in zip(ps, grads):
                p.grad = g.to(dev)
            o.step()
        for a, b, p_old in zip(cpu, gpu, before):
            for k, v in oc.state[a].items():
                if k != "unorm_vec":
                    assert torch.equal(v, og.state[b][k].cpu()), k
            step = (a.detach() - p_old).abs().max().item()
            assert (a.detach() - b.detach().cpu()).abs().max().item() <= 2.0**-18 * step + 2 * U * p_old.abs().max()
