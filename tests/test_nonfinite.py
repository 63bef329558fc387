"""Non-finite and huge gradients: one bad element must not poison its 256-element block.

The policy (README, "Non-finite gradients"; csrc/include/pagedopt/codebook.h and algorithms/adam.h), the same
on the CPU and the GPU:

* quantize_blockwise: a block's absmax is the max |x| over its finite values (NaN and +-inf left
  out). Non-finite values are stored saturated: +inf as the largest code (1.0), -inf as the
  smallest (-0.993, the signed map's code nearest -1.0; 0.0 in the unsigned map), NaN as the code
  of 0.0. A block with no finite value of at least the smallest normal float quantizes to the
  code of 0.0 throughout.
* The fused 8-bit Adam step (quantized_step_ with the Adam functor): an element whose new v is not finite (a NaN or +-inf gradient, or a
  finite one above ~5.8e20 whose square overflows float32) counts for neither block absmax, and
  its moments are stored saturated. Its parameter takes this step's update from the unquantized
  fp32 moments, as torch.optim does in float32: NaN for a NaN or +-inf gradient, and no Adam
  movement (m / sqrt(inf) = 0) for an overflowing v. The block's other elements get exactly the
  states and parameters they would get without the bad element.

The CPU tests compare with torch.optim.AdamW/Adam (float64 for the other elements, float32 for the
bad element, whose float64 v does not overflow) and with the pure-torch reference of
tests/reference.py; the CUDA tests compare the GPU with the CPU bit for bit.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pagedopt
from pagedopt import _ops
from pagedopt.quant import (STATE_BLOCK_SIZE, dequantize_blockwise_reference, dynamic_codebook,
                            quantize_blockwise_reference)

from adam_call import adam8bit_step
from reference import adam8bit_step_reference, quantization_error_bound

N = 3 * STATE_BLOCK_SIZE + 17  # three full blocks and a tail
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# gradient values that used to poison their block; the last two are finite but overflow v
BAD = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "1e30": 1e30, "-1e25": -1e25}
# (state1 code, state2 code) of the bad element after its step, in float32: NaN as the code of 0.0,
# +-inf and finite values beyond the block's absmax at the ends (v >= 0: +inf or NaN only)
ZERO1 = int((dynamic_codebook(True) == 0).nonzero())
SATURATED = {"nan": (ZERO1, 0), "+inf": (255, 255), "-inf": (0, 255), "1e30": (255, 255), "-1e25": (0, 255)}


def rand_nonzero(n, gen, scale=1.0):
    """Random values over several orders of magnitude, never zero."""
    x = torch.randn(n, generator=gen) * scale * torch.exp(torch.randn(n, generator=gen))
    x[x == 0] = 1e-3 * scale
    return x


def blockwise_max(x, keep, blocksize=STATE_BLOCK_SIZE):
    """max |x| over each block's elements where `keep` holds (0 for none), in float64."""
    vals = torch.where(keep, x.double().abs(), torch.zeros((), dtype=torch.float64))
    pad = (-vals.numel()) % blocksize
    return torch.cat([vals, vals.new_zeros(pad)]).view(-1, blocksize).amax(dim=1)


# ---------------------------------------------------------------------------------------------
# The optimizer against torch.optim over the bad step and two normal steps after it
# ---------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31), bad=st.sampled_from(sorted(BAD)), pos=st.integers(0, N - 1),
       bad_step=st.integers(1, 3), lr=st.sampled_from([1e-4, 1e-3, 1e-2]),
       betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.0, 0.99)]), eps=st.sampled_from([1e-8, 1e-6]),
       wd=st.sampled_from([0.0, 1e-2]), decoupled=st.booleans(), grad_scale=st.sampled_from([1e-3, 1.0]))
def test_bad_gradient_element_does_not_poison_its_block(seed, bad, pos, bad_step, lr, betas, eps, wd, decoupled,
                                                       grad_scale):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen)
    p = p0.clone().requires_grad_(True)
    p64 = p0.double().requires_grad_(True)  # the other elements' reference
    p32 = p0.clone().requires_grad_(True)   # the bad element's reference (its v overflows in float32)
    ours_cls, ref_cls = (pagedopt.AdamW8bit, torch.optim.AdamW) if decoupled else (pagedopt.Adam8bit, torch.optim.Adam)
    opt = ours_cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, min_8bit_size=0)
    ref64 = ref_cls([p64], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    ref32 = ref_cls([p32], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    beta1, beta2 = betas
    others = torch.ones(N, dtype=torch.bool)
    others[pos] = False
    block = pos // STATE_BLOCK_SIZE
    # the error bound of tests/test_optim_vs_torch.py, elementwise (the bad element's entries become
    # NaN or meaningless after its step and are not looked at)
    e_m = torch.zeros(N, dtype=torch.float64)
    e_v = torch.zeros(N, dtype=torch.float64)
    e_p = torch.zeros(N, dtype=torch.float64)
    m_prev = torch.zeros(N, dtype=torch.float64)
    v_prev = torch.zeros(N, dtype=torch.float64)
    for t in range(1, bad_step + 3):
        g = rand_nonzero(N, gen, grad_scale)
        if t == bad_step:
            g[pos] = BAD[bad]
        p_before = p.detach().double().clone()
        p32_before = p32.detach().clone()
        p.grad, p64.grad, p32.grad = g.clone(), g.double(), g.clone()
        opt.step()
        ref64.step()
        ref32.step()
        s = opt.state[p]
        pd = p.detach()
        if t >= bad_step:
            # (a) no other element is NaN or inf, at the bad step or at the two normal steps after it
            assert torch.isfinite(pd[others]).all(), (t, (~torch.isfinite(pd) & others).nonzero().reshape(-1)[:5])
            assert torch.isfinite(s["absmax1"]).all() and torch.isfinite(s["absmax2"]).all()
        if t == bad_step:
            # (b) the bad element: NaN exactly when torch's (float32) is, else torch's value (no Adam
            # movement, only the decoupled decay)
            assert bool(torch.isnan(pd[pos])) == bool(torch.isnan(p32.detach()[pos]))
            if math.isfinite(BAD[bad]):
                # (the two differ before this step by the 8-bit states' error, so each is compared
                # with its own previous value)
                decay = torch.tensor(1 - lr * wd if decoupled else 1.0, dtype=torch.float32)
                assert pd[pos].item() == (p_before[pos].float() * decay).item()
                assert p32.detach()[pos].item() == (p32_before[pos] * decay).item()
            else:
                assert math.isnan(pd[pos].item())
            # its moments are stored saturated
            assert (s["state1"][pos].item(), s["state2"][pos].item()) == SATURATED[bad]
        m_r = ref64.state[p64]["exp_avg"]
        v_r = ref64.state[p64]["exp_avg_sq"]
        g_o = g.double() if decoupled else g.double() + wd * p_before
        m_pre = (beta1 * m_prev + (1 - beta1) * g_o).float()
        v_pre = (beta2 * v_prev + (1 - beta2) * g_o * g_o).float()
        if t == bad_step:
            # (c) the poisoned block's new absmax is that of its other elements: the bad element is
            # left out of both (its m of 1e29 for a gradient of 1e30 too); rtol as the reference
            # comparison of tests/test_adam_engine.py (m_pre is recomputed in float64 here)
            for key, x in (("absmax1", m_pre), ("absmax2", v_pre)):
                want = blockwise_max(x, others)[block].float()
                torch.testing.assert_close(s[key][block], want, rtol=1e-6, atol=0)
        # (c) every other element within the derived bound of tests/test_optim_vs_torch.py: since
        # the bad element sets no absmax, the quantization terms q1, q2 of its block's other
        # elements are the usual ones (half a code gap of the block's finite absmax)
        m_o = dequantize_blockwise_reference(s["state1"].reshape(-1), s["absmax1"], s["qmap1"]).double()
        v_o = dequantize_blockwise_reference(s["state2"].reshape(-1), s["absmax2"], s["qmap2"]).double()
        q1 = quantization_error_bound(m_pre, s["absmax1"], s["qmap1"]).double()
        q2 = quantization_error_bound(v_pre, s["absmax2"], s["qmap2"]).double()
        dg = 0.0 if decoupled else wd * e_p
        g_r = g.double() if decoupled else g.double() + wd * p64.detach()
        fp32 = 1e-6
        e_m = beta1 * e_m + (1 - beta1) * dg + q1 + fp32 * m_r.abs()
        e_v = beta2 * e_v + (1 - beta2) * dg * (2 * g_r.abs() + dg) + q2 + fp32 * v_r.abs()
        assert ((m_o - m_r).abs() <= e_m)[others].all()
        assert ((v_o - v_r).abs() <= e_v)[others].all()
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        s_ref = v_r.sqrt() / bc2**0.5 + eps
        s_lo = (v_r - e_v).clamp_min(0).sqrt() / bc2**0.5 + eps
        du = e_m / s_lo + m_r.abs() * e_v.sqrt() / bc2**0.5 / (s_lo * s_ref)
        decay = (1 - lr * wd) if decoupled else 1.0
        e_p = decay * e_p + (lr / bc1) * du + 2.0**-23 * (p64.detach().abs() + lr)
        err = (pd.double() - p64.detach()).abs()
        assert (err <= e_p)[others].all(), (err - e_p)[others].max()
        m_prev, v_prev = m_o, v_o


# ---------------------------------------------------------------------------------------------
# The fused step op against the pure-torch reference, from random populated states
# ---------------------------------------------------------------------------------------------
def populated_state(n, dtype, gen):
    blocks = (n + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
    return dict(p=torch.randn(n, generator=gen).to(dtype), g=rand_nonzero(n, gen).to(dtype),
                q1=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                q2=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                a1=torch.rand(blocks, generator=gen) * 0.1 + 1e-4, a2=torch.rand(blocks, generator=gen) * 0.01 + 1e-6)


def insert_bad(g, kinds, positions):
    g = g.clone()
    for k, i in zip(kinds, positions):
        g[i] = BAD[k]  # rounded to g's dtype: 1e30 and -1e25 become +-inf in float16
    return g


hyper = st.fixed_dictionaries(dict(
    lr=st.sampled_from([1e-4, 1e-3, 3e-2]), beta1=st.sampled_from([0.0, 0.9, 0.95]),
    beta2=st.sampled_from([0.0, 0.95, 0.999]), eps=st.sampled_from([1e-8, 1e-6]),
    wd=st.sampled_from([0.0, 0.01, 0.1]), decoupled=st.booleans(), step=st.integers(1, 50)))


@given(seed=st.integers(0, 2**31), n=st.sampled_from([N, 256, 1000, 40]), dtype=st.sampled_from(DTYPES), h=hyper,
       kinds=st.lists(st.sampled_from(sorted(BAD)), min_size=1, max_size=4), data=st.data())
def test_fused_step_with_bad_gradients_matches_reference(seed, n, dtype, h, kinds, data):
    gen = torch.Generator().manual_seed(seed)
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=len(kinds), max_size=len(kinds), unique=True))
    code1, code2 = dynamic_codebook(True), dynamic_codebook(False)
    t = populated_state(n, dtype, gen)
    t["g"] = insert_bad(t["g"], kinds, positions)
    b = {k: v.clone() for k, v in t.items()}
    adam8bit_step([t["p"]], [t["g"]], [t["q1"]], [t["q2"]], [t["a1"]], [t["a2"]], [torch.tensor(float(h["step"]))],
                  code1, code2, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["wd"],
                  decoupled=h["decoupled"])
    p, q1, q2, a1, a2, m, v = adam8bit_step_reference(b["p"], b["g"], b["q1"], b["q2"], b["a1"], b["a2"], h["step"],
                                                      code1, code2, h["lr"], h["beta1"], h["beta2"], h["eps"],
                                                      h["wd"], h["decoupled"])
    bad = torch.zeros(n, dtype=torch.bool)
    bad[positions] = True
    # the bad elements' v is not finite, the others' is (so "others" is exactly the counted set)
    assert not torch.isfinite(v[bad]).any() and torch.isfinite(v[~bad]).all()
    # absmax: that of the other elements only (the reference's, with the rtol of test_adam_engine.py)
    assert torch.isfinite(t["a1"]).all() and torch.isfinite(t["a2"]).all()
    torch.testing.assert_close(t["a1"], blockwise_max(m, ~bad).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(t["a2"], blockwise_max(v, ~bad).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(t["a1"], a1, rtol=1e-6, atol=0)
    torch.testing.assert_close(t["a2"], a2, rtol=1e-6, atol=0)
    # the bad elements' codes: saturated, as the reference
    assert torch.equal(t["q1"][bad], q1[bad]) and torch.equal(t["q2"][bad], q2[bad])
    if dtype == torch.float32:
        for k, i in zip(kinds, positions):
            assert (t["q1"][i].item(), t["q2"][i].item()) == SATURATED[k], (k, i)
    # the others' codes: nearest codes of their moments (all but a handful of fp32 ties exactly the
    # reference's, as in test_adam_engine.py)
    m_q = dequantize_blockwise_reference(t["q1"], t["a1"], code1)
    v_q = dequantize_blockwise_reference(t["q2"], t["a2"], code2)
    assert ((m_q - m).abs() <= quantization_error_bound(m, t["a1"], code1) * (1 + 1e-5))[~bad].all()
    assert ((v_q - v).abs() <= quantization_error_bound(v, t["a2"], code2) * (1 + 1e-5))[~bad].all()
    assert (t["q1"] != q1).sum() <= max(2, n // 500) and (t["q2"] != q2).sum() <= max(2, n // 500)
    # params: NaN exactly where the reference's is (the NaN and +-inf gradients), finite elsewhere,
    # within one ulp of the param dtype of the reference (as test_adam_engine.py)
    assert torch.equal(torch.isnan(t["p"]), torch.isnan(p))
    assert torch.isfinite(t["p"][~bad]).all()
    fin = ~torch.isnan(p)
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    ref = p.double()[fin]
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny)))) * 2.0**-mant
    assert ((t["p"].double()[fin] - ref).abs() <= ulp).all()


# ---------------------------------------------------------------------------------------------
# quantize_blockwise on blocks with NaN and infinities
# ---------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31), n=st.integers(1, 3000), blocksize=st.sampled_from([32, 64, 256, 1024]),
       dtype=st.sampled_from(DTYPES), signed=st.booleans(), n_bad=st.integers(1, 40), whole_block=st.booleans())
def test_quantize_blockwise_nonfinite(seed, n, blocksize, dtype, signed, n_bad, whole_block):
    gen = torch.Generator().manual_seed(seed)
    code = dynamic_codebook(signed)
    x = rand_nonzero(n, gen).to(dtype)
    x[x == 0] = 1e-3
    if not signed:
        x = x.abs()
    specials = torch.tensor([math.nan, math.inf, -math.inf])
    idx = torch.randint(0, n, (n_bad,), generator=gen)
    x[idx] = specials[torch.randint(0, 3, (n_bad,), generator=gen)].to(dtype)
    if whole_block:  # the first block: nothing finite but zeros
        lo = min(n, blocksize)
        x[:lo] = specials[torch.randint(0, 3, (lo,), generator=gen)].to(dtype)
        x[: lo : 3] = 0.0
    finite = torch.isfinite(x)
    codes, absmax = _ops.quantize_blockwise(x, code, blocksize)
    # absmax: the max |x| over the block's finite values, exactly
    assert torch.equal(absmax, blockwise_max(x.float(), finite, blocksize).float())
    # non-finite values saturate: +inf -> last code, -inf -> first, NaN -> the code of 0.0
    zero = int((code == 0).nonzero())
    want = torch.where(torch.isnan(x), zero, torch.where(x > 0, 255, 0)).to(torch.uint8)
    # (a block with no finite value of at least the smallest normal float: all codes of 0.0)
    empty = (blockwise_max(x.float(), finite, blocksize) < torch.finfo(torch.float32).tiny)
    want[empty.repeat_interleave(blocksize)[:n]] = zero
    nonfin = ~finite
    assert torch.equal(codes[nonfin], want[nonfin])
    # the finite values get exactly the codes they get without the non-finite ones (set to 0)
    codes0, absmax0 = _ops.quantize_blockwise(torch.where(finite, x, torch.zeros((), dtype=dtype)), code, blocksize)
    assert torch.equal(absmax, absmax0)
    assert torch.equal(codes[finite], codes0[finite])
    if whole_block:
        assert absmax[0].item() == 0.0 and (codes[: min(n, blocksize)] == zero).all()
    # and the pure-torch reference follows the same rules
    ref_codes, ref_absmax = quantize_blockwise_reference(x, code, blocksize)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_nonfinite_examples(signed):
    """A hand-made block: absmax 2.0 (not inf), the infinities at the ends, NaN at 0.0; a block of
    NaN, infinities and zeros alone quantizes to the code of 0.0 with absmax 0."""
    code = dynamic_codebook(signed)
    zero = int((code == 0).nonzero())
    x = torch.tensor([0.5, math.inf, -2.0 if signed else 2.0, math.nan, -math.inf, 1.0, 0.0, 1e-3] * 4
                     + [math.nan, math.inf, -math.inf, 0.0] * 8)
    for codes, absmax in (_ops.quantize_blockwise(x, code, 32), quantize_blockwise_reference(x, code, 32)):
        assert absmax.tolist() == [2.0, 0.0]
        assert codes[[1, 4, 3]].tolist() == [255, 0, zero]
        assert codes[2].item() == (0 if signed else 255)
        assert (codes[32:] == zero).all()
        out = _ops.dequantize_blockwise(codes, absmax, code, 32, torch.float32)
        assert torch.isfinite(out).all()
        assert out[1].item() == 2.0 and out[4].item() == code[0].item() * 2.0


# ---------------------------------------------------------------------------------------------
# CUDA: bit-identical states with the CPU for blocks holding non-finite values
# ---------------------------------------------------------------------------------------------
def _needs_cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not _ops.has_cuda_kernels():
        pytest.skip("pagedopt was built without its CUDA kernels")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,blocksize", [(3000, 256), (3000, 64), (3000, 2048), ((1 << 22) + 5, 256)])
@pytest.mark.parametrize("signed", [True, False])
def test_cuda_quantize_nonfinite_matches_cpu(dtype, n, blocksize, signed):
    """Both search paths (n >= 2^22 uses the table search), full and tail blocks, vector and
    strided loads: codes and absmax bit for bit."""
    _needs_cuda_kernels()
    from test_cuda_kernels import CUDA, assert_bitwise

    gen = torch.Generator().manual_seed(n + blocksize)
    code = dynamic_codebook(signed)
    x = rand_nonzero(n, gen).to(dtype)
    if not signed:
        x = x.abs()
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0]).to(dtype)
    idx = torch.randint(0, n, (max(8, n // 50),), generator=gen)
    x[idx] = specials[torch.randint(0, 4, (idx.numel(),), generator=gen)]
    x[:blocksize] = specials[torch.randint(0, 4, (blocksize,), generator=gen)]  # a block with no finite nonzero
    x[-1] = math.inf  # the tail block
    q_cpu, a_cpu = _ops.quantize_blockwise(x, code, blocksize)
    q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA), code.to(CUDA), blocksize)
    assert torch.isfinite(a_cpu).all()
    assert_bitwise(q_gpu, q_cpu, "codes")
    assert_bitwise(a_gpu, a_cpu, "absmax")
    # an unaligned view (the strided path)
    q_cpu, a_cpu = _ops.quantize_blockwise(x[1:], code, blocksize)
    q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA)[1:], code.to(CUDA), blocksize)
    assert_bitwise(q_gpu, q_cpu, "codes (offset 1)")
    assert_bitwise(a_gpu, a_cpu, "absmax (offset 1)")


@pytest.mark.cuda
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES), h=hyper, n_bad=st.integers(1, 6), offset=st.sampled_from([0, 1]))
def test_cuda_step_with_bad_gradients_matches_cpu(seed, sizes, dtype, h, n_bad, offset):
    """The fused step with NaN, +-inf and overflowing gradients (full, tail and unaligned blocks):
    codes and absmax bit for bit, the params within the bound of test_cuda_kernels.py, NaN at the
    same places; then two normal steps from there."""
    _needs_cuda_kernels()
    from test_cuda_kernels import CUDA, assert_step_matches, clone_to, step_both

    gen = torch.Generator().manual_seed(seed)
    code1, code2 = dynamic_codebook(True), dynamic_codebook(False)
    cpu = []
    for n in sizes:
        s = populated_state(n, dtype, gen)
        if offset:  # views one element in: the kernel's scalar (unaligned) path
            s = {k: (v.new_empty(n + offset)[offset:].copy_(v) if k in ("p", "g", "q1", "q2") else v)
                 for k, v in s.items()}
        cpu.append(s)
    for s in cpu:
        n = s["p"].numel()
        kinds = [sorted(BAD)[int(i)] for i in torch.randint(0, len(BAD), (n_bad,), generator=gen)]
        s["g"] = insert_bad(s["g"], kinds, torch.randint(0, n, (n_bad,), generator=gen).tolist())
    gpu = clone_to(cpu, CUDA)
    if offset:
        gpu = [{k: (v.new_empty(v.numel() + offset)[offset:].copy_(v) if k in ("p", "g", "q1", "q2") else v)
                for k, v in s.items()} for s in gpu]
    hs = {k: v for k, v in h.items() if k != "step"}
    for t in range(3):
        steps = [h["step"] + t] * len(cpu)
        before = step_both(cpu, gpu, steps, code1, code2, hs)
        assert_step_matches(gpu, cpu, before, hs, f"step {t}: ")
        for a, b in zip(gpu, cpu):
            assert torch.equal(torch.isnan(a["p"].cpu()), torch.isnan(b["p"]))
            assert torch.isfinite(b["a1"]).all() and torch.isfinite(b["a2"]).all()
        for s in cpu:  # normal gradients after the bad step
            s["g"] = rand_nonzero(s["p"].numel(), gen).to(dtype)
        for a, b in zip(gpu, cpu):
            a["g"].copy_(b["g"])
