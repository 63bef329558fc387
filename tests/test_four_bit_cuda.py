"""4-bit states on CUDA against the CPU kernels (run on a GPU: pytest -m cuda tests/test_four_bit_cuda.py).

From identical inputs, one step of every algorithm gives bit-identical packed codes (padding
nibbles included) and absmaxes on both backends: the element math is the same functor and the
search the same header function (nearest_code4). The parameters agree to within one ulp of their
dtype plus 2^-19 of the update (approx_math.h: the GPU's sqrt and division are its approximate
instructions, within 2 ulp, the CPU's IEEE ones; the bound of tests/test_cuda_kernels.py). Cases:
tails (n < 128, odd n, n not a multiple of 128), stacked keys, tensors not aligned for the vector
path (every element then goes through the per-element path), NaN/inf gradients, bf16/fp16/fp32,
grad_scale, found_inf, an lr tensor, stochastic rounding, the held-states op and the norm pass."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedopt import _ops
from pagedopt.quant import dynamic_codebook_4bit, linear_codebook_4bit_no_zero

from reference_four_bit import ALGORITHMS, codebooks, packed
from test_four_bit_engine import DTYPES, assert_bitwise, make_states

pytestmark = pytest.mark.cuda
CUDA = "cuda"
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def to_cuda(t, misalign):
    """t on the GPU; `misalign`: as a view one element into a larger buffer (not 16-byte aligned,
    and an odd byte address for uint8 states: the kernel's per-element path)."""
    if not misalign:
        return t.to(CUDA)
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=CUDA)
    view = buf[1:]
    view.copy_(t.reshape(-1))
    return view.view(t.shape)


def dtype_ulp(x, dtype):
    x = x.double()
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))) * 2.0 ** -MANTISSA[dtype]


def check_params(got, exp, before, dtype, what):
    got, exp, before = got.cpu().double(), exp.double(), before.double()
    nan = torch.isnan(exp)
    assert torch.equal(torch.isnan(got), nan), what
    ulp = dtype_ulp(exp.nan_to_num(), dtype)
    bound = ulp + 2.0**-19 * ((exp - before).abs().nan_to_num() + ulp)
    bad = ~nan & ~((got - exp).abs() <= bound) & ~(got == exp)
    assert not bad.any(), f"{what}: {int(bad.sum())} params beyond the bound, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@given(seed=st.integers(0, 2**31), sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES), misalign=st.booleans(), nonfinite=st.booleans(),
       grad_scale=st.sampled_from([None, 1024.0]), lr_tensor=st.booleans(), sr=st.booleans(), mixed=st.booleans())
@example(seed=1, sizes=[1, 2, 127, 128, 129, 256, 1000, 4096 + 3], dtype=torch.float32, misalign=False,
         nonfinite=True, grad_scale=None, lr_tensor=False, sr=False, mixed=False)
@example(seed=2, sizes=[3, 128, 640], dtype=torch.bfloat16, misalign=True, nonfinite=False, grad_scale=1024.0,
         lr_tensor=True, sr=True, mixed=False)
@example(seed=3, sizes=[4096], dtype=torch.float16, misalign=False, nonfinite=False, grad_scale=None,
         lr_tensor=False, sr=False, mixed=False)
@example(seed=4, sizes=[300, 4096, 129, 7, 1024, 5], dtype=torch.float32, misalign=False, nonfinite=False,
         grad_scale=None, lr_tensor=False, sr=True, mixed=True)
def test_cuda_step_matches_cpu(algorithm, seed, sizes, dtype, misalign, nonfinite, grad_scale, lr_tensor, sr, mixed):
    """`mixed`: parameters of the three dtypes in one call (the CUDA step launches one kernel per dtype)."""
    stacks, kinds, hyper, takes_scales = ALGORITHMS[algorithm]
    gen = torch.Generator().manual_seed(seed)
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, dtype, mixed)
    if nonfinite:
        for g in grads:
            nonfinite_values = torch.tensor([float("nan"), float("inf")], dtype=g.dtype)
            g[torch.randint(0, g.numel(), (2,), generator=gen)] = nonfinite_values
    before = [p.clone() for p in params]
    steps = [torch.tensor(3.0) for _ in sizes]
    qmaps = codebooks(kinds)
    kw = {}
    if grad_scale is not None:
        grads = [g * grad_scale for g in grads]
        kw.update(grad_scale=torch.tensor(grad_scale), found_inf=torch.tensor(0.0))
    if lr_tensor:
        kw["lr"] = torch.tensor(hyper[0] * 2, dtype=torch.float32)
    if takes_scales:
        kw["scales"] = torch.rand(len(sizes), generator=gen) + 0.5
    extra = dict(sr_ids=list(range(3, 3 + len(sizes))), sr_offsets=[0] * len(sizes), sr_seed=5) if sr else {}
    m = misalign
    gp = [to_cuda(p, m) for p in params]
    gg = [to_cuda(g, m) for g in grads]
    gs = [[to_cuda(t, m) for t in key] for key in states]
    ga = [[to_cuda(t, m) for t in key] for key in absmax]
    _ops.quantized_step_(algorithm, gp, gg, gs, ga, [s.to(CUDA) for s in steps], [q.to(CUDA) for q in qmaps], hyper,
                         **{k: v.to(CUDA) for k, v in kw.items()}, **extra)
    _ops.quantized_step_(algorithm, params, grads, states, absmax, steps, qmaps, hyper, **kw, **extra)
    for i in range(len(sizes)):
        for k in range(len(stacks)):
            assert_bitwise(gs[k][i].cpu(), states[k][i], f"state{k + 1}[{i}] (n={sizes[i]})")
            assert_bitwise(ga[k][i].cpu(), absmax[k][i], f"absmax{k + 1}[{i}] (n={sizes[i]})")
        check_params(gp[i], params[i], before[i], params[i].dtype, f"params[{i}] (n={sizes[i]})")


def test_cuda_found_inf_changes_nothing():
    stacks, kinds, hyper, _ = ALGORITHMS["adam"]
    gen = torch.Generator().manual_seed(4)
    params, grads, states, absmax = make_states(stacks, kinds, [300], gen, torch.float32)
    gp = [p.cuda() for p in params]
    gs, ga = [[t.cuda() for t in k] for k in states], [[t.cuda() for t in k] for k in absmax]
    _ops.quantized_step_("adam", gp, [g.cuda() for g in grads], gs, ga, [torch.tensor(1.0, device=CUDA)],
                         [q.cuda() for q in codebooks(kinds)], hyper, found_inf=torch.tensor(1.0, device=CUDA))
    assert torch.equal(gp[0].cpu(), params[0])
    for k in range(2):
        assert torch.equal(gs[k][0].cpu(), states[k][0]) and torch.equal(ga[k][0].cpu(), absmax[k][0])


@given(seed=st.integers(0, 2**31), n=st.integers(1, 5000), dtype=st.sampled_from(DTYPES),
       blocksize=st.sampled_from([32, 64, 128, 256, 4096]), signed=st.booleans())
def test_cuda_quantize_matches_cpu(seed, n, dtype, blocksize, signed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).to(dtype)
    if n > 3:
        x[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    code = dynamic_codebook_4bit(True) if signed else linear_codebook_4bit_no_zero()
    q, a = _ops.quantize_blockwise(x, code, blocksize)
    gq, ga = _ops.quantize_blockwise(x.cuda(), code.cuda(), blocksize)
    assert_bitwise(gq.cpu(), q, "codes")
    assert_bitwise(ga.cpu(), a, "absmax")
    out = _ops.dequantize_blockwise(q, a, code, blocksize, dtype)
    gout = _ops.dequantize_blockwise(gq, ga, code.cuda(), blocksize, dtype)
    assert_bitwise(gout.cpu(), out, "dequantized")


def test_cuda_held_state_list_matches_cpu():
    stacks, kinds, hyper, _ = ALGORITHMS["ademamix"]
    gen = torch.Generator().manual_seed(5)
    sizes = [1000, 7, 129]
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, torch.bfloat16)
    before = [p.clone() for p in params]
    steps = [torch.tensor(2.0) for _ in sizes]
    gp = [p.cuda() for p in params]
    gs = [[t.cuda() for t in k] for k in states]
    ga = [[t.cuda() for t in k] for k in absmax]
    held = torch.classes.pagedopt.QuantizedStateList("ademamix", [t for k in gs for t in k], [t for k in ga for t in k],
                                                     [s.cuda() for s in steps], [q.cuda() for q in codebooks(kinds)])
    _ops.quantized_step_list_(held, gp, [g.cuda() for g in grads], hyper)
    _ops.quantized_step_("ademamix", params, grads, states, absmax, steps, codebooks(kinds), hyper)
    for i in range(len(sizes)):
        for k in range(2):
            assert_bitwise(gs[k][i].cpu(), states[k][i], f"state{k + 1}[{i}]")
            assert_bitwise(ga[k][i].cpu(), absmax[k][i], f"absmax{k + 1}[{i}]")
        check_params(gp[i], params[i], before[i], torch.bfloat16, f"params[{i}]")


@pytest.mark.parametrize("algorithm", ["lars", "lamb"])
def test_cuda_update_norm_matches_cpu(algorithm):
    """The same double terms summed in another order (atomicAdd per block): relative difference
    <= n * 2^-52 (all terms >= 0), and the GPU's approximate sqrt/division in LAMB's direction
    (within 2 ulp of float32 each, so 2^-21 of each term, relatively, squared: 2^-20)."""
    stacks, kinds, hyper, _ = ALGORITHMS[algorithm]
    gen = torch.Generator().manual_seed(6)
    sizes = [1000, 3, 129]
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, torch.float32)
    steps = [torch.tensor(2.0) for _ in sizes]
    norms = torch.zeros(len(sizes), dtype=torch.float64)
    _ops.quantized_update_norm_(algorithm, params, grads, states, absmax, steps, codebooks(kinds), hyper, norms)
    gnorms = torch.zeros(len(sizes), dtype=torch.float64, device=CUDA)
    _ops.quantized_update_norm_(algorithm, [p.cuda() for p in params], [g.cuda() for g in grads],
                                [[t.cuda() for t in k] for k in states], [[t.cuda() for t in k] for k in absmax],
                                [s.cuda() for s in steps], [q.cuda() for q in codebooks(kinds)], hyper, gnorms)
    assert (norms > 0).all()
    torch.testing.assert_close(gnorms.cpu(), norms, rtol=2.0**-19, atol=0)


def test_packed_bytes_of_the_layout():
    """The layout the CUDA kernel writes is the CPU's (a sanity check of packed())."""
    assert [packed(n) for n in (1, 2, 3, 128, 129)] == [1, 1, 2, 64, 65]
