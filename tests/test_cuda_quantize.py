"""The CUDA quantize and dequantize kernels against the CPU kernels and the pure-torch reference.

Both backends compute the same function (the same absmax, the same x * (1 / absmax), the same
nearest-code rule: an exact table search on the GPU, checked here around every code midpoint), so
they are compared bit for bit. Every test needs a GPU and a build of pagedopt with its CUDA kernels.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedopt import _ops, quant

from bitwise_compare import assert_bitwise, rand_nonzero
from device_params import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.device("cuda")
# Inputs of at least this many elements make quantize_blockwise use the table search.
TABLE_NUMEL = 1 << 22


# ---------------------------------------------------------------------------------------------
# (a) quantize / dequantize
# ---------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5000), dtype=st.sampled_from(DTYPES),
       blocksize=st.sampled_from([32, 64, 96, 128, 256, 512, 1024, 4096]), signed=st.booleans(),
       offset=st.sampled_from([0, 1]))
def test_quantize_dequantize_match_cpu_and_reference(seed, n, dtype, blocksize, signed, offset):
    gen = torch.Generator().manual_seed(seed)
    buf = rand_nonzero(n + offset, gen, dtype, 2.0)
    x = buf[offset:]  # offset 1: an unaligned view
    code = quant.dynamic_codebook(signed)
    q_cpu, a_cpu = _ops.quantize_blockwise(x, code, blocksize)
    q_gpu, a_gpu = _ops.quantize_blockwise(buf.to(CUDA)[offset:], code.to(CUDA), blocksize)
    assert q_gpu.device.type == "cuda" and a_gpu.device.type == "cuda"
    assert_bitwise(q_gpu, q_cpu, "codes vs CPU")
    assert_bitwise(a_gpu, a_cpu, "absmax vs CPU")
    q_ref, a_ref = quant.quantize_blockwise_reference(x, code, blocksize)
    assert_bitwise(q_gpu, q_ref, "codes vs reference")
    assert_bitwise(a_gpu, a_ref.float(), "absmax vs reference")
    for out_dtype in DTYPES:
        d_cpu = _ops.dequantize_blockwise(q_cpu, a_cpu, code, blocksize, out_dtype)
        d_gpu = _ops.dequantize_blockwise(q_gpu, a_gpu, code.to(CUDA), blocksize, out_dtype)
        assert_bitwise(d_gpu, d_cpu, f"dequantize to {out_dtype} vs CPU")
        d_ref = quant.dequantize_blockwise_reference(q_cpu, a_cpu, code, blocksize, out_dtype)
        assert_bitwise(d_gpu, d_ref, f"dequantize to {out_dtype} vs reference")


def _probe_values(code: torch.Tensor) -> torch.Tensor:
    """Normalized values at and around every midpoint of adjacent codes and every code, plus edge
    values: where a wrong rounding or tie-break of the nearest-code search would show."""
    c = code.double()
    mids = ((c[1:] + c[:-1]) / 2).float()
    vals = [mids, code.clone()]
    up, down, cu, cd = mids.clone(), mids.clone(), code.clone(), code.clone()
    for _ in range(3):
        up, down = torch.nextafter(up, torch.full_like(up, 2.0)), torch.nextafter(down, torch.full_like(down, -2.0))
        cu, cd = torch.nextafter(cu, torch.full_like(cu, 2.0)), torch.nextafter(cd, torch.full_like(cd, -2.0))
        vals += [up, down, cu, cd]
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 1e-30, -1e-30, 1e-7, -1e-7,
                         0.5, -0.5, 1.0, -1.0, 0.99999994, -0.99999994])
    vals.append(tiny)
    v = torch.cat(vals)
    return v[(v.abs() <= 1.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_table_search_at_code_midpoints(dtype, signed):
    """Large enough for the table search: every block holds a 1.0 (absmax = 1, so the normalized value
    is the input itself) and 255 probes around code midpoints (rounded to the input dtype)."""
    code = quant.dynamic_codebook(signed)
    probes = _probe_values(code).to(dtype)
    per_block = 255
    blocks = TABLE_NUMEL // 256 + 3
    reps = (blocks * per_block + probes.numel() - 1) // probes.numel()
    body = probes.repeat(reps)[: blocks * per_block].reshape(blocks, per_block)
    ones = torch.ones(blocks, 1, dtype=dtype)
    x = torch.cat([body[:, :128], ones, body[:, 128:]], dim=1).reshape(-1)[:-77]  # a partial tail block
    q_cpu, a_cpu = _ops.quantize_blockwise(x, code, 256)
    q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA), code.to(CUDA), 256)
    assert_bitwise(q_gpu, q_cpu, "codes")
    assert_bitwise(a_gpu, a_cpu, "absmax")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocksize", [256, 64, 2048])
def test_quantize_large_random(dtype, blocksize):
    gen = torch.Generator().manual_seed(blocksize)
    x = rand_nonzero(TABLE_NUMEL + 123, gen, dtype, 3.0)
    x[::1000] = x[::1000] * 1e-30  # values that normalize to subnormals or tiny numbers
    for code in (quant.dynamic_codebook(True), quant.dynamic_codebook(False)):
        q_cpu, a_cpu = _ops.quantize_blockwise(x, code, blocksize)
        q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA), code.to(CUDA), blocksize)
        assert_bitwise(q_gpu, q_cpu, "codes")
        assert_bitwise(a_gpu, a_cpu, "absmax")


@pytest.mark.parametrize("n", [1000, TABLE_NUMEL + 5])
def test_quantize_unsorted_codebook_matches_cpu(n):
    """A codebook that is not sorted disables the table search; the GPU must still agree with the CPU."""
    gen = torch.Generator().manual_seed(n)
    x = rand_nonzero(n, gen)
    code = quant.dynamic_codebook(True)[torch.randperm(256, generator=gen)].contiguous()
    q_cpu, a_cpu = _ops.quantize_blockwise(x, code, 256)
    q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA), code.to(CUDA), 256)
    assert_bitwise(q_gpu, q_cpu, "codes")
    assert_bitwise(a_gpu, a_cpu, "absmax")


def test_quantize_special_values():
    """NaN, infinities, zeros and subnormals go through the same rules as on the CPU."""
    x = torch.tensor([float("nan"), 1.0, -2.0, 0.0, -0.0, 1e-40, -1e-40, 3.0] * 40 + [float("inf")] * 8
                     + [0.0] * 256 + [1e-42, -1e-41] * 128)
    code = quant.dynamic_codebook(True)
    q_cpu, a_cpu = _ops.quantize_blockwise(x, code, 256)
    q_gpu, a_gpu = _ops.quantize_blockwise(x.to(CUDA), code.to(CUDA), 256)
    assert_bitwise(q_gpu, q_cpu, "codes")
    assert_bitwise(a_gpu, a_cpu, "absmax")


def test_quantize_empty_and_errors():
    code = quant.dynamic_codebook(True).to(CUDA)
    q, a = _ops.quantize_blockwise(torch.empty(0, device=CUDA), code, 256)
    assert q.shape == (0,) and a.shape == (0,)
    with pytest.raises(RuntimeError, match="blocksize"):
        _ops.quantize_blockwise(torch.ones(10, device=CUDA), code, 100)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.quantize_blockwise(torch.ones(10, device=CUDA, dtype=torch.float64), code, 256)
    with pytest.raises(RuntimeError, match="code"):
        _ops.quantize_blockwise(torch.ones(10, device=CUDA), code.cpu(), 256)
    with pytest.raises(RuntimeError, match="absmax"):
        _ops.dequantize_blockwise(torch.zeros(300, dtype=torch.uint8, device=CUDA), torch.ones(1, device=CUDA),
                                  code, 256)
