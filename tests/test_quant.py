"""Codebooks, the pure-torch reference quantizer, and the CPU quantize/dequantize ops.

Independent oracles: bitsandbytes' dynamic maps (tests/data/bnb_dynamic_maps.json, made by
scripts/make_bnb_codebook_fixture.py) for the codebooks, and float64 block maxima computed from the
input alone (block_absmax_float64 in tests/reference.py) for every absmax, never the absmax of the
implementation under test.
"""
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedopt import _ops
from pagedopt.quant import (check_codebook, dequantize_blockwise_reference, dynamic_codebook,
                            max_rounding_error, nearest_code_reference, quantize_blockwise_reference)

from device_params import DEVICES
from reference import block_absmax_float64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BNB_MAPS = Path(__file__).parent / "data" / "bnb_dynamic_maps.json"


def absmax_float64(x, blocksize=256):
    """Each block's largest finite |x|, in float64, from x alone (see tests/reference.py)."""
    return block_absmax_float64(x, blocksize)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_codebook_shape(signed):
    code = dynamic_codebook(signed)
    check_codebook(code)
    assert code.max().item() == 1.0
    assert (code == 0).sum().item() == 1
    if signed:
        assert code.min().item() == pytest.approx(-0.99297, abs=1e-5)
        # symmetric apart from +1.0
        pos, neg = code[code > 0][:-1], code[code < 0]
        assert torch.equal(pos, -neg.flip(0))
    else:
        assert code.min().item() == 0.0
    # seven decades, each linearly spaced, finer towards 1
    nonzero = code[code > 0]
    assert nonzero.min().item() < 1e-6


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_codebook_equals_bitsandbytes_maps(signed):
    """Value for value, bit for bit, bitsandbytes 0.50.2's create_dynamic_map(signed=True) and the
    unsigned map (the fixture's provenance is in its "source" field): a codebook drifting by even
    one float32 ulp, let alone 0.1%, breaks checkpoint compatibility."""
    fixture = json.loads(BNB_MAPS.read_text())
    expected = torch.tensor([float.fromhex(h) for h in fixture["signed" if signed else "unsigned"]],
                            dtype=torch.float64)
    assert expected.numel() == 256 and torch.equal(expected.float().double(), expected)  # float32 values
    code = dynamic_codebook(signed)
    assert code.dtype == torch.float32
    diff = (code.double() - expected).abs()
    assert torch.equal(code.double(), expected), (int((diff > 0).sum()), float(diff.max()))


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_codebook_matches_float64_construction(signed):
    """A second, independent oracle: bitsandbytes' documented construction (seven decades
    10^-6..10^0, each split into 2^(i + signed?0:1) linear steps over [0.1, 1], codes at the step
    midpoints, mirrored when signed, plus 0 and 1), evaluated in float64. Each float32 code is
    within 4 float32 ulps of it (linspace and the scaling round a few times in float32)."""
    values = []
    for i in range(7):
        k = 2 ** (i + (0 if signed else 1))
        for j in range(k):
            mid = (0.1 + 0.9 * j / k + 0.1 + 0.9 * (j + 1) / k) / 2 * 10.0 ** (i - 6)
            values += [mid, -mid] if signed else [mid]
    values += [0.0, 1.0]
    expected = torch.tensor(sorted(values), dtype=torch.float64)
    code = dynamic_codebook(signed).double()
    assert expected.numel() == 256
    assert ((code - expected).abs() <= 4 * 2.0**-24 * expected.abs()).all(), \
        ((code - expected).abs() / expected.abs().clamp_min(1e-30)).max()


def test_check_codebook_rejects_unsorted():
    code = dynamic_codebook(True).flip(0)
    with pytest.raises(ValueError, match="sorted"):
        check_codebook(code)
    with pytest.raises(ValueError, match="256"):
        check_codebook(torch.zeros(10))


def random_tensor(seed, n, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    # heavy tails and a few exact outliers, never all zeros
    x = x * torch.exp(torch.randn(n, generator=g) * 2)
    limit = torch.finfo(dtype).max / 8  # finite in the dtype (fp16 tops out at 65504)
    return x.clamp(-limit, limit).to(dtype)


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), signed=st.booleans(),
       dtype=st.sampled_from(DTYPES), blocksize=st.sampled_from([32, 64, 256, 1024]),
       scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
def test_cpu_quantize_matches_reference(n, seed, signed, dtype, blocksize, scale):
    code = dynamic_codebook(signed)
    x = random_tensor(seed, n, dtype, scale)
    if not signed:
        x = x.abs()
    codes, absmax = _ops.quantize_blockwise(x, code, blocksize)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, code, blocksize)
    assert torch.equal(absmax.double(), absmax_float64(x, blocksize))
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes)
    out = _ops.dequantize_blockwise(codes, absmax, code, blocksize, torch.float32)
    assert torch.equal(out, dequantize_blockwise_reference(codes, absmax, code, blocksize))


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), signed=st.booleans(),
       scale=st.sampled_from([1e-4, 1.0, 1e4]))
def test_round_trip_error_is_at_most_half_a_code_gap(n, seed, signed, scale):
    code = dynamic_codebook(signed)
    x = random_tensor(seed, n, torch.float32, scale)
    if not signed:
        x = x.abs()
    codes, absmax = _ops.quantize_blockwise(x, code, 256)
    out = _ops.dequantize_blockwise(codes, absmax, code, 256, torch.float32)
    # the bound's absmax is the float64 reference's, not the one under test (a too small stored
    # absmax would shrink the bound with the values it fails to cover)
    ref_absmax = absmax_float64(x, 256)
    assert torch.equal(absmax.double(), ref_absmax)
    per_elem_absmax = ref_absmax.float().repeat_interleave(256)[:n]
    normalized = x / per_elem_absmax
    bound = max_rounding_error(code, normalized) * per_elem_absmax
    # fp32 slack: x/absmax and code*absmax each round once (2^-24 relative to absmax).
    slack = 4 * 2.0**-24 * per_elem_absmax
    err = (out - x).abs()
    assert (err <= bound + slack).all(), (err - bound).max()
    # each block's largest element is reproduced to within the top code's precision
    assert torch.allclose(out.abs().max(), x.abs().max(), rtol=0.01)


def exact_ties(code):
    """(i, midpoint) for adjacent codes code[i] < code[i+1] whose midpoint is an exact tie: (a+b)/2,
    computed in float64, is a float32 value, and the float32 distances to both codes, computed as
    the kernel does (fabsf(x - code[i]), fabsf(code[i+1] - x)), are exactly equal."""
    ties = []
    for i in range(code.numel() - 1):
        a, b = code[i].reshape(1), code[i + 1].reshape(1)
        mid64 = (a.double() + b.double()) / 2
        mid = mid64.float()
        if mid.double().item() != mid64.item():
            continue
        if ((mid - a).abs() == (b - mid).abs()).item():  # float32 arithmetic
            ties.append((i, mid.item()))
    return ties


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_ties_go_to_lower_index(signed):
    code = dynamic_codebook(signed)
    ties = exact_ties(code)
    assert len(ties) >= 100, len(ties)  # most adjacent float32 codes have an exact midpoint
    index = torch.tensor([i for i, _ in ties])
    mids = torch.tensor([m for _, m in ties], dtype=torch.float32)
    # reference: argmin over exactly equal distances must take the lower index
    assert torch.equal(nearest_code_reference(mids, code).long(), index)
    # CPU kernel: one block per tie whose absmax is 1.0, so the value is normalized as x * 1.0 = x
    blocks = torch.ones(len(ties), 32)
    blocks[:, 0] = mids
    codes, absmax = _ops.quantize_blockwise(blocks.reshape(-1), code, 32)
    assert torch.equal(absmax, torch.ones(len(ties)))
    assert torch.equal(codes.reshape(len(ties), 32)[:, 0].long(), index)


def test_all_zero_block_and_tail():
    code = dynamic_codebook(True)
    x = torch.zeros(300)
    x[299] = 3.0
    codes, absmax = _ops.quantize_blockwise(x, code, 256)
    assert absmax.tolist() == [0.0, 3.0]
    out = _ops.dequantize_blockwise(codes, absmax, code, 256, torch.float32)
    assert torch.equal(out, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [256, 257, 511, 1000, 1024])
def test_absmax_is_the_float64_block_max_even_at_the_last_index(dtype, n, device):
    """Every block's largest |x| sits at its last index (255), and the tail block's at its last
    element; some blocks' maxima are negative. The stored absmax must equal the float64 block max
    exactly, and the maxima round-trip to within half a top-code gap of the reference absmax."""
    code = dynamic_codebook(True)
    g = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=g) * 2 - 1
    last = torch.cat([torch.arange(255, n, 256), torch.tensor([n - 1])]).unique()
    x[last] = torch.linspace(2.0, 3.0, last.numel()) * torch.tensor([1.0, -1.0]).repeat(last.numel())[:last.numel()]
    x = x.to(dtype)
    ref = absmax_float64(x)
    assert torch.equal(ref, x.double().abs()[last])  # the test's premise: the maxima are at `last`
    codes, absmax = _ops.quantize_blockwise(x.to(device), code.to(device), 256)
    codes, absmax = codes.cpu(), absmax.cpu()
    assert torch.equal(absmax.double(), ref), (absmax.double() - ref)
    _, ref_absmax = quantize_blockwise_reference(x, code, 256)
    assert torch.equal(ref_absmax.double(), ref)
    out = _ops.dequantize_blockwise(codes, absmax, code, 256, torch.float32).double()
    xd = x.double()
    per_elem = ref.repeat_interleave(256)[:n]
    bound = max_rounding_error(code, (xd / per_elem).float()).double() * per_elem + 4 * 2.0**-24 * per_elem
    assert ((out - xd).abs() <= bound).all()


@pytest.mark.parametrize("bad", ["blocksize", "code_dtype", "code_size", "codes_dtype", "absmax_size"])
def test_bad_arguments_raise(bad):
    code = dynamic_codebook(True)
    x = torch.randn(512)
    with pytest.raises(RuntimeError, match="blocksize|code|absmax"):
        if bad == "blocksize":
            _ops.quantize_blockwise(x, code, 100)
        elif bad == "code_dtype":
            _ops.quantize_blockwise(x, code.double(), 256)
        elif bad == "code_size":
            _ops.quantize_blockwise(x, code[:128], 256)
        elif bad == "codes_dtype":
            _ops.dequantize_blockwise(torch.zeros(512, dtype=torch.int32), torch.ones(2), code, 256, torch.float32)
        else:
            _ops.dequantize_blockwise(torch.zeros(512, dtype=torch.uint8), torch.ones(3), code, 256, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_quantize_ops(dtype):
    code = dynamic_codebook(True)
    x = random_tensor(0, 1000, dtype)
    torch.library.opcheck(torch.ops.pagedopt.quantize_blockwise, (x, code, 256))
    codes, absmax = _ops.quantize_blockwise(x, code, 256)
    torch.library.opcheck(torch.ops.pagedopt.dequantize_blockwise, (codes, absmax, code, 256, dtype))


def test_check_codebook_rejects_repeated_entries():
    """A codebook with two equal neighbours has a code that nearest-code search can never pick; it
    is refused (it must be strictly ascending)."""
    from pagedopt.quant import check_codebook

    code = dynamic_codebook(True).clone()
    code[101] = code[100]
    with pytest.raises(ValueError, match="strictly ascending"):
        check_codebook(code)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_max", [1e-39, 5e-39, 1.1e-38])
def test_block_whose_max_is_subnormal_quantizes_to_the_code_of_zero(block_max, dtype, device):
    """A block whose largest |x| is below the smallest normal float (1.17549435e-38) stores its
    absmax but codes every value as 0.0, on every backend: 1 / absmax would be inf for 1e-39 (every
    value saturating to an end code) and a huge finite scale for 5e-39, where the GPU, which flushes
    subnormals, would disagree with the CPU. The block next to it is ordinary and must be unaffected."""
    code = dynamic_codebook(True)
    zero_code = int(nearest_code_reference(torch.zeros(1), code))
    g = torch.Generator().manual_seed(7)
    tiny = (torch.rand(256, generator=g) * 2 - 1) * block_max
    tiny[17] = block_max
    normal = torch.randn(256, generator=g)
    x = torch.cat([tiny, normal]).to(dtype)
    assert x[:256].abs().max().item() < 1.17549435e-38 and x[:256].abs().max().item() > 0  # the premise
    codes, absmax = _ops.quantize_blockwise(x.to(device), code.to(device), 256)
    codes, absmax = codes.cpu(), absmax.cpu()
    assert torch.equal(absmax.double(), absmax_float64(x))
    assert (codes[:256] == zero_code).all(), codes[:256].unique()
    ref_codes, _ = quantize_blockwise_reference(x, code, 256)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [1, 254, 255])
def test_tail_block_reads_nothing_past_the_end(tail, dtype, device):
    """x is a view of the first n elements of a longer tensor whose next element is far larger than
    any of x's. A kernel that treats a tail block of 255 (or fewer) elements as a full block of 256
    reads that element: the tail's absmax must still be the float64 max of x's own tail."""
    code = dynamic_codebook(True)
    n = 2 * 256 + tail
    g = torch.Generator().manual_seed(tail)
    big = torch.rand(n + 256, generator=g) * 2 - 1
    big[n:] = 1000.0
    x = big.to(dtype).to(device)[:n]  # offset 0: aligned, so a vector path is allowed
    codes, absmax = _ops.quantize_blockwise(x, code.to(device), 256)
    assert codes.shape == (n,)
    assert torch.equal(absmax.cpu().double(), absmax_float64(x.cpu()))
    ref_codes, _ = quantize_blockwise_reference(x.cpu(), code, 256)
    assert torch.equal(codes.cpu(), ref_codes)


def test_second_moment_codebook_has_no_zero_code():
    """The 8-bit map of v: bitsandbytes' unsigned dynamic map but its zero code, which is half the
    smallest positive one; sorted, so the kernels' nearest-code search (and the CUDA table, whose
    fit tests/test_code_table_host.py checks for the optimizers' codebooks) takes it."""
    from pagedopt.quant import dynamic_codebook, second_moment_codebook

    code, bnb = second_moment_codebook(), dynamic_codebook(False)
    assert code.dtype == torch.float32 and code.numel() == 256
    assert torch.equal(code[1:], bnb[1:]) and bnb[0] == 0 and code[0] == bnb[1] / 2
    assert bool((code[1:] > code[:-1]).all()) and bool((code > 0).all())


@pytest.mark.parametrize("cls", ["AdamW8bit", "Adam8bit", "AdEMAMix8bit"])
def test_a_tiny_second_moment_does_not_blow_up_the_update(cls):
    """A rare row: in a block whose elements all get gradients of 1, one gets 1e-5 at the first
    step and none after (an embedding row of a token seen once). Its v is 1e-10 of the block's
    absmax, below the smallest positive code (3.25e-7), while its m (1e-5 of m's absmax) is not.
    fp32 Adam moves it by at most lr a step (m-hat / sqrt(v-hat) <= 1 here). With a zero code its
    stored v is 0, and the next step moves it by m-hat / eps, about 500 x lr; with the code of
    half the smallest positive one, v is stored too large, never too small, and it moves by at
    most lr."""
    import pagedopt

    p = torch.nn.Parameter(torch.zeros(4096))
    kwargs = {"betas": (0.9, 0.999, 0.9999)} if cls == "AdEMAMix8bit" else {}
    opt = getattr(pagedopt, cls)([p], lr=1e-3, weight_decay=0.0, **kwargs)
    bound = 1e-3 * (1 + 5.0 if cls == "AdEMAMix8bit" else 1.0) * 1.01  # AdEMAMix adds alpha = 5 slow EMAs
    for step in range(4):
        g = torch.ones(4096)
        g[5] = 1e-5 if step == 0 else 0.0
        p.grad = g
        before = p.detach().clone()
        opt.step()
        moved = (p.detach() - before).abs()
        assert float(moved[5]) <= bound, (step, float(moved[5]))
        assert float(moved[0]) > 0.5e-3
