"""Codebooks, the pure-torch reference quantizer, and the CPU quantize/dequantize ops."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedopt import _ops
from pagedopt.quant import (check_codebook, dequantize_blockwise_reference, dynamic_codebook,
                            max_rounding_error, nearest_code_reference, quantize_blockwise_reference)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
    per_elem_absmax = absmax.repeat_interleave(256)[:n]
    normalized = x / per_elem_absmax
    bound = max_rounding_error(code, normalized) * per_elem_absmax
    # fp32 slack: x/absmax and code*absmax each round once (2^-24 relative to absmax).
    slack = 4 * 2.0**-24 * per_elem_absmax
    err = (out - x).abs()
    assert (err <= bound + slack).all(), (err - bound).max()
    # each block's largest element is reproduced to within the top code's precision
    assert torch.allclose(out.abs().max(), x.abs().max(), rtol=0.01)


def test_nearest_code_ties_go_to_lower_index():
    code = dynamic_codebook(True)
    mid = (code[100] + code[101]) / 2
    q = nearest_code_reference(mid.reshape(1), code)
    q_op, _ = _ops.quantize_blockwise(torch.tensor([mid.item()] + [1.0] * 31), code, 32)
    d_lo, d_hi = (mid - code[100]).abs(), (code[101] - mid).abs()
    expected = 101 if d_hi < d_lo else 100
    assert q.item() == expected and q_op[0].item() == expected


def test_all_zero_block_and_tail():
    code = dynamic_codebook(True)
    x = torch.zeros(300)
    x[299] = 3.0
    codes, absmax = _ops.quantize_blockwise(x, code, 256)
    assert absmax.tolist() == [0.0, 3.0]
    out = _ops.dequantize_blockwise(codes, absmax, code, 256, torch.float32)
    assert torch.equal(out, x)


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
