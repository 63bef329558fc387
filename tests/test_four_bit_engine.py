"""4-bit states in the generic engine (csrc/include/pagedopt/four_bit.h), CPU kernels: the codebooks,
quantize_blockwise / dequantize_blockwise with a 16-entry code, and quantized_step_ of every
algorithm of pagedopt/algorithms.h held to the references of reference_four_bit.py (bit for bit:
the same float32 operations; Adam also against an independent pure-torch step, within derived
bounds), with odd sizes, tails, stacked keys, NaN/inf gradients, bf16/fp16/fp32 parameters,
grad_scale, found_inf, an lr tensor and stochastic rounding; refusals that change nothing; the
held-states op and the norm pass of lars / lamb."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedopt import _ops
from pagedopt.quant import (dequantize_4bit_reference, dynamic_codebook, dynamic_codebook_4bit, normal_codebook_4bit,
                            linear_codebook_4bit_no_zero, pack_4bit, quantize_4bit_reference, unpack_4bit)

from reference_four_bit import (ALGORITHMS, BLOCK4, adam4bit_step_reference, blocks4, codebooks, packed,
                                step_via_fp32)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t):
    """A tensor's bit pattern (NaN == NaN, -0 != +0): exact equality."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} differ, first at {diff.nonzero()[0].tolist()}"


# ------------------------------------------------------------------------------------ codebooks
def test_codebooks():
    code = dynamic_codebook_4bit(True)
    assert code.dtype == torch.float32 and code.numel() == 16
    assert (code[1:] > code[:-1]).all()
    assert code[0] == -1.0 and code[-1] == 1.0 and (code == 0).any()
    unsigned = dynamic_codebook_4bit(False)
    assert unsigned.numel() == 16 and unsigned[0] == 0.0 and unsigned[-1] == 1.0
    assert (unsigned[1:] > unsigned[:-1]).all()
    v = linear_codebook_4bit_no_zero()
    assert torch.equal(v, torch.tensor([(i + 1) / 16 for i in range(16)]))
    assert not (v == 0).any()


def test_the_first_moments_map_is_normal_quantiles():
    """normal_codebook_4bit: 0, 8 positive and 7 negative codes, each side's codes the standard
    normal's quantiles at probabilities evenly spaced from 0.5 to 1 - (1/32 + 1/30) / 2 (8 and 7
    steps), divided by that side's largest: so Phi(code * q_max) steps evenly. Checked in float64
    against the float32 codes (rounding 6e-8 relative, through Phi's slope: under 1e-6)."""
    code = normal_codebook_4bit()
    assert code.dtype == torch.float32 and code.numel() == 16 and (code[1:] > code[:-1]).all()
    assert code[0] == -1.0 and code[-1] == 1.0 and (code == 0).sum() == 1
    top = 1.0 - 0.5 * (1.0 / 32.0 + 1.0 / 30.0)
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    q_max = normal.icdf(torch.tensor(top, dtype=torch.float64))
    pos, neg = code[code > 0].double(), -code[code < 0].double().flip(0)
    for side, steps in ((pos, 8), (neg, 7)):
        probs = normal.cdf(side * q_max)
        expected = 0.5 + (top - 0.5) * torch.arange(1, steps + 1, dtype=torch.float64) / steps
        torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


def test_pack_layout():
    """Element i in byte i // 2, low nibble for even i; an odd n pads the last high nibble with 0."""
    codes = torch.tensor([1, 2, 3, 4, 15], dtype=torch.uint8)
    assert pack_4bit(codes).tolist() == [0x21, 0x43, 0x0F]
    assert torch.equal(unpack_4bit(pack_4bit(codes), 5), codes)


# ---------------------------------------------------------------------- quantize / dequantize
def random_values(n, gen, nonfinite=False):
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    if nonfinite and n > 3:
        idx = torch.randperm(n, generator=gen)[:3]
        x[idx] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    return x


@given(seed=st.integers(0, 2**31), n=st.integers(1, 700), dtype=st.sampled_from(DTYPES),
       blocksize=st.sampled_from([32, 64, 128, 256]), signed=st.booleans(), nonfinite=st.booleans())
@example(seed=0, n=129, dtype=torch.float32, blocksize=128, signed=True, nonfinite=True)
def test_quantize_matches_reference(seed, n, dtype, blocksize, signed, nonfinite):
    gen = torch.Generator().manual_seed(seed)
    x = random_values(n, gen, nonfinite).to(dtype)
    code = dynamic_codebook_4bit(True) if signed else linear_codebook_4bit_no_zero()
    q, a = _ops.quantize_blockwise(x, code, blocksize)
    rq, ra = quantize_4bit_reference(x, code, blocksize)
    assert q.shape == (packed(n),) and a.shape == ((n + blocksize - 1) // blocksize,)
    assert_bitwise(q, rq, "codes")
    assert_bitwise(a, ra, "absmax")
    out = _ops.dequantize_blockwise(q, a, code, blocksize, dtype)
    assert out.shape == (2 * packed(n),)
    assert_bitwise(out[:n], dequantize_4bit_reference(q, a, code, n, blocksize, dtype), "dequantized")


def test_round_trip_error_is_within_half_a_code_gap():
    gen = torch.Generator().manual_seed(3)
    x = random_values(1001, gen)
    code = dynamic_codebook_4bit(True)
    q, a = _ops.quantize_blockwise(x, code, BLOCK4)
    y = _ops.dequantize_blockwise(q, a, code, BLOCK4)[:1001]
    per_elem = a.repeat_interleave(BLOCK4)[:1001]
    from pagedopt.quant import max_rounding_error
    # half the gap around x / absmax times absmax, plus float32 roundings of the normalization and
    # the product (4 U of absmax)
    bound = max_rounding_error(code, x / per_elem) * per_elem + 4 * 2.0**-24 * per_elem
    assert ((y - x).abs() <= bound).all()
    assert ((y - x).abs() > 0).any()  # not vacuous


@pytest.mark.parametrize("bad, message", [
    ("code15", "code must have 256 entries \\(8-bit codes\\) or 16 \\(4-bit codes\\), got 15"),
    ("absmax", "absmax must have 2 elements for 202 codes in blocks of 128, got 1"),
])
def test_quantize_refusals(bad, message):
    x = torch.randn(201)
    code = dynamic_codebook_4bit(True)
    with pytest.raises(RuntimeError, match=message):
        if bad == "code15":
            _ops.quantize_blockwise(x, code[:15].clone(), 128)
        else:
            q, a = _ops.quantize_blockwise(x, code, 128)
            _ops.dequantize_blockwise(q, a[:1].clone(), code, 128)


# ----------------------------------------------------------------------------------- the step
def make_states(stacks, kinds, sizes, gen, dtype, mixed=False):
    """Random parameters, gradients (heavy-tailed) and populated 4-bit states (every nibble value);
    `mixed`: tensor i's parameter in DTYPES[i % 3] instead of `dtype` (one call, several dtypes)."""
    dtypes = [DTYPES[i % len(DTYPES)] if mixed else dtype for i in range(len(sizes))]
    params = [torch.randn(n, generator=gen).to(d) for n, d in zip(sizes, dtypes)]
    grads = [(torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))).to(d)
             for n, d in zip(sizes, dtypes)]
    states = [[torch.randint(0, 256, (s * packed(n),), generator=gen, dtype=torch.uint8) for n in sizes]
              for s in stacks]
    absmax = [[(torch.rand(s * blocks4(n), generator=gen) + 0.05) * (0.01 if kind == "v" else 0.1) for n in sizes]
              for s, kind in zip(stacks, kinds)]
    return params, grads, states, absmax


def clone_lists(lists):
    return [[t.clone() for t in key] for key in lists]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@given(seed=st.integers(0, 2**31), sizes=st.lists(st.integers(1, 700), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES), step=st.integers(1, 30), nonfinite=st.booleans(),
       grad_scale=st.sampled_from([None, 1024.0]), lr_tensor=st.booleans(), sr=st.booleans(), mixed=st.booleans())
@example(seed=1, sizes=[1, 127, 128, 129, 300], dtype=torch.float32, step=1, nonfinite=False, grad_scale=None,
         lr_tensor=False, sr=False, mixed=False)
@example(seed=2, sizes=[257, 3, 64], dtype=torch.bfloat16, step=5, nonfinite=True, grad_scale=1024.0, lr_tensor=True,
         sr=True, mixed=True)
def test_step_matches_reference_bit_for_bit(algorithm, seed, sizes, dtype, step, nonfinite, grad_scale, lr_tensor,
                                            sr, mixed):
    """Every algorithm's 4-bit CPU step equals step_via_fp32 bit for bit (tolerance 0: the kernel and
    the reference perform the same float32 operations on the same values, see reference_four_bit.py):
    parameters, packed codes (padding nibbles included) and absmaxes."""
    stacks, kinds, hyper, takes_scales = ALGORITHMS[algorithm]
    gen = torch.Generator().manual_seed(seed)
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, dtype, mixed)
    if nonfinite:
        for g in grads:
            nonfinite_values = torch.tensor([float("nan"), float("inf")], dtype=g.dtype)
            g[torch.randint(0, g.numel(), (2,), generator=gen)] = nonfinite_values
    qmaps = codebooks(kinds)
    steps = [torch.tensor(float(step)) for _ in sizes]
    kw = {}
    if grad_scale is not None:
        grads = [g * grad_scale for g in grads]
        kw.update(grad_scale=torch.tensor(grad_scale), found_inf=torch.tensor(0.0))
    if lr_tensor:
        kw["lr"] = torch.tensor(hyper[0] * 2, dtype=torch.float64)
    if sr:
        kw.update(sr_ids=list(range(7, 7 + len(sizes))), sr_offsets=[0] + [5] * (len(sizes) - 1), sr_seed=11)
    if takes_scales:
        kw["scales"] = torch.rand(len(sizes), generator=gen) + 0.5
    ref_p, ref_s, ref_a = step_via_fp32(algorithm, params, grads, states, absmax, steps, qmaps, stacks, hyper, **kw)
    _ops.quantized_step_(algorithm, params, grads, states, absmax, steps, qmaps, hyper, **kw)
    for i in range(len(sizes)):
        assert_bitwise(params[i], ref_p[i], f"params[{i}]")
        for k in range(len(stacks)):
            assert_bitwise(states[k][i], ref_s[k][i], f"state{k + 1}[{i}]")
            assert_bitwise(absmax[k][i], ref_a[k][i], f"absmax{k + 1}[{i}]")


@given(seed=st.integers(0, 2**31), sizes=st.lists(st.integers(1, 700), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES), step=st.integers(1, 50), decoupled=st.booleans(),
       wd=st.sampled_from([0.0, 0.1]), lr=st.sampled_from([1e-3, 3e-2]))
@example(seed=1, sizes=[700, 33], dtype=torch.float32, step=1, decoupled=True, wd=0.1, lr=3e-2)
def test_adam_matches_independent_reference(seed, sizes, dtype, step, decoupled, wd, lr):
    """Adam's 4-bit step against adam4bit_step_reference (pure torch, no engine call)."""
    stacks, kinds, _, _ = ALGORITHMS["adam"]
    gen = torch.Generator().manual_seed(seed)
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, dtype)
    before = [p.clone() for p in params], clone_lists(states), clone_lists(absmax)
    code1, code2 = codebooks(kinds)
    hyper = [lr, 0.9, 0.999, 1e-8, wd, 1.0 if decoupled else 0.0]
    _ops.quantized_step_("adam", params, grads, states, absmax, [torch.tensor(float(step)) for _ in sizes],
                         [code1, code2], hyper)
    for i, n in enumerate(sizes):
        p, q1, q2, a1, a2, m, v = adam4bit_step_reference(before[0][i], grads[i], before[1][0][i], before[1][1][i],
                                                          before[2][0][i], before[2][1][i], step, code1, code2, lr,
                                                          0.9, 0.999, 1e-8, wd, decoupled)
        # absmax: the block max of the same float32 moments (rtol: the reference's emulated fma may
        # double-round, one float32 ulp of the moment)
        torch.testing.assert_close(absmax[0][i], a1, rtol=2.0**-22, atol=0)
        torch.testing.assert_close(absmax[1][i], a2, rtol=2.0**-22, atol=0)
        # params: the same operations in the same order, at most one ulp of the param dtype apart
        mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
        ref = p.double()
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny)))) * 2.0**-mant
        assert ((params[i].double() - ref).abs() <= ulp).all()
        # each stored moment within half a code gap (+ float32 roundings) of the exact new moment
        for q, a, x, code in ((states[0][i], absmax[0][i], m, code1), (states[1][i], absmax[1][i], v, code2)):
            y = dequantize_4bit_reference(q, a, code, n)
            bound = quantization_error_bound_4(x, a, code)
            assert ((y - x).abs() <= bound * (1 + 1e-5)).all()
        # and the codes are the reference's but for ties within float32 rounding (none expected)
        assert (states[0][i] == q1).float().mean() > 0.99 and (states[1][i] == q2).float().mean() > 0.99


def quantization_error_bound_4(x, absmax, code):
    """quantization_error_bound (tests/reference.py) for 128-element blocks."""
    per_elem = absmax.repeat_interleave(BLOCK4)[: x.numel()]
    safe = torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))
    from pagedopt.quant import max_rounding_error
    return max_rounding_error(code, x / safe) * per_elem + 4 * 2.0**-24 * per_elem


def test_found_inf_changes_nothing():
    stacks, kinds, hyper, _ = ALGORITHMS["ademamix"]
    gen = torch.Generator().manual_seed(5)
    params, grads, states, absmax = make_states(stacks, kinds, [300, 5], gen, torch.float32)
    before = [p.clone() for p in params], clone_lists(states), clone_lists(absmax)
    steps = [torch.tensor(2.0), torch.tensor(2.0)]
    _ops.quantized_step_("ademamix", params, grads, states, absmax, steps, codebooks(kinds), hyper,
                         found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert all(torch.equal(a, b) for k in range(2) for a, b in zip(states[k], before[1][k]))
    assert all(torch.equal(a, b) for k in range(2) for a, b in zip(absmax[k], before[2][k]))
    _ops.quantized_step_("ademamix", params, grads, states, absmax, steps, codebooks(kinds), hyper)
    assert not torch.equal(params[0], before[0][0])  # the same call without found_inf steps


@pytest.mark.parametrize("bad, message", [
    ("state_numel_8bit", r"state2\[1\] has 301 elements, expected 1 x 151 \(4-bit states"),
    ("stacked_numel", r"state1\[0\] has 150 elements, expected 2 x 150"),
    ("absmax_256", r"absmax2\[0\] must have 3 elements \(1 x one per 128\), got 2"),
    ("mixed", r"qmap2 has 256 entries \(8-bit states\) but qmap1 has 16 \(4-bit states\)"),
    ("qmap_size", r"qmap1 must have 256 entries \(8-bit codes\) or 16 \(4-bit codes\), got 17"),
    ("state_dtype", r"state2\[1\] must be Byte"),
    ("absmax_dtype", r"absmax1\[1\] must be float32"),
])
def test_refusals_name_the_argument_and_change_nothing(bad, message):
    stacks, kinds, hyper, _ = ALGORITHMS["ademamix"]
    gen = torch.Generator().manual_seed(6)
    sizes = [300, 301]
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, torch.float32)
    qmaps = codebooks(kinds)
    if bad == "state_numel_8bit":
        states[1][1] = torch.zeros(301, dtype=torch.uint8)  # an 8-bit-sized state
    elif bad == "stacked_numel":
        states[0][0] = states[0][0][:150].clone()
    elif bad == "absmax_256":
        absmax[1][0] = absmax[1][0][:2].clone()
    elif bad == "mixed":
        qmaps = [qmaps[0], dynamic_codebook(False)]
    elif bad == "qmap_size":
        qmaps = [torch.cat([qmaps[0], qmaps[0][-1:] + 1]), qmaps[1]]
    elif bad == "state_dtype":
        states[1][1] = torch.zeros(packed(301))
    elif bad == "absmax_dtype":
        absmax[0][1] = absmax[0][1].double()
    before = [p.clone() for p in params], clone_lists(states), clone_lists(absmax)
    with pytest.raises(RuntimeError, match=message):
        _ops.quantized_step_("ademamix", params, grads, states, absmax, [torch.tensor(1.0)] * 2, qmaps, hyper)
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert all(torch.equal(a, b) for k in range(2) for a, b in zip(states[k], before[1][k]))
    assert all(torch.equal(a, b) for k in range(2) for a, b in zip(absmax[k], before[2][k]))


def test_held_state_list_steps_as_the_op():
    """quantized_step_list_ on a QuantizedStateList of 4-bit states is quantized_step_ bit for bit."""
    stacks, kinds, hyper, _ = ALGORITHMS["adam"]
    gen = torch.Generator().manual_seed(7)
    params, grads, states, absmax = make_states(stacks, kinds, [513, 7, 128], gen, torch.bfloat16)
    p2, s2, a2 = [p.clone() for p in params], clone_lists(states), clone_lists(absmax)
    steps = [torch.tensor(3.0) for _ in params]
    qmaps = codebooks(kinds)
    held = torch.classes.pagedopt.QuantizedStateList("adam", [t for key in states for t in key],
                                                     [t for key in absmax for t in key], steps, qmaps)
    _ops.quantized_step_list_(held, params, grads, hyper)
    _ops.quantized_step_("adam", p2, grads, s2, a2, steps, qmaps, hyper)
    for i in range(3):
        assert_bitwise(params[i], p2[i], "params")
        for k in range(2):
            assert_bitwise(states[k][i], s2[k][i], "states")
            assert_bitwise(absmax[k][i], a2[k][i], "absmax")


@pytest.mark.parametrize("algorithm", ["lars", "lamb"])
def test_update_norm_on_4bit_states(algorithm):
    """The norm pass reads the 4-bit states as the step does: the 32-bit pass on the dequantized
    states gives the same sum of the same double terms, summed in other groups (blocks of 256 vs
    128): relative difference <= n * 2^-52 (all terms >= 0)."""
    stacks, kinds, hyper, _ = ALGORITHMS[algorithm]
    gen = torch.Generator().manual_seed(8)
    sizes = [1000, 3, 129]
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, torch.float32)
    qmaps = codebooks(kinds)
    steps = [torch.tensor(2.0) for _ in sizes]
    norms = torch.zeros(len(sizes), dtype=torch.float64)
    _ops.quantized_update_norm_(algorithm, params, grads, states, absmax, steps, qmaps, hyper, norms)
    from reference_four_bit import dequantize_state
    fp32 = [[dequantize_state(states[k][i], absmax[k][i], qmaps[k], n, stacks[k]) for i, n in enumerate(sizes)]
            for k in range(len(stacks))]
    ref = torch.zeros(len(sizes), dtype=torch.float64)
    _ops.quantized_update_norm_(algorithm, params, grads, fp32, [], steps, [], hyper, ref)
    assert (norms > 0).all()
    torch.testing.assert_close(norms, ref, rtol=1000 * 2.0**-52, atol=0)


def test_step_passes_opcheck():
    """quantized_step_ on 4-bit states (its fake, schema and registrations)."""
    stacks, kinds, hyper, _ = ALGORITHMS["ademamix"]
    gen = torch.Generator().manual_seed(9)
    params, grads, states, absmax = make_states(stacks, kinds, [300, 5], gen, torch.float32)
    args = ("ademamix", params, grads, states[0] + states[1], absmax[0] + absmax[1],
            [torch.tensor(1.0), torch.tensor(1.0)], codebooks(kinds), hyper, None, None)
    torch.library.opcheck(torch.ops.pagedopt.quantized_step_, args)
