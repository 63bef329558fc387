"""The 4-bit CUDA step kernel's own paths (csrc/cuda/four_bit_step_kernel.cuh), on a GPU: pytest -m cuda.

The kernel gives each warp tiles of 256 elements (two 128-blocks, 8 elements per lane) from a
contiguous run of the concatenated tensors: full tiles of aligned tensors take vector accesses and
the codebook's search table (code_table4.cuh); partial tiles (a tensor's last one, a lone block
past an odd number of blocks) and tensors not aligned for vectors (p, g off 16 bytes, codes off 4
bytes) go element by element with nearest_code4; a codebook that does not fit its table takes
nearest_code4 on full tiles too. Against the CPU kernel (codes and absmaxes bit for bit; the
parameters to within test_four_bit_cuda.check_params' bound, the GPU's approximate sqrt and
division), and against itself: the same inputs aligned and not aligned for vectors give the same
bits everywhere, parameters included (the vector path and the per-element path run the same
operations in the same order, so they must agree exactly)."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedopt import _ops

from reference_four_bit import ALGORITHMS, codebooks
from test_four_bit_cuda import CUDA, check_params
from test_four_bit_engine import DTYPES, assert_bitwise, make_states

pytestmark = pytest.mark.cuda
TILE = 256


def place(t, layout, state=False):
    """t on the GPU: `layout` "aligned"; "off" (a view one element into a larger buffer: p and g off
    16 bytes, codes at odd bytes); "codes2" (only the states moved, by 2 bytes: codes 2-byte but
    not 4-byte aligned, which the vector path needs)."""
    if layout == "aligned" or (layout == "codes2" and (not state or t.dtype != torch.uint8)):
        return t.to(CUDA, copy=True)  # a copy even where CUDA is the CPU (a dry run of these tests)
    shift = 1 if layout == "off" else 2
    buf = torch.empty(t.numel() + shift, dtype=t.dtype, device=CUDA)
    view = buf[shift:]
    view.copy_(t.reshape(-1))
    return view.view(t.shape)


def run_gpu(algorithm, params, grads, states, absmax, steps, qmaps, hyper, layout, kw, extra):
    gp = [place(p, layout) for p in params]
    gg = [place(g, layout) for g in grads]
    gs = [[place(t, layout, state=True) for t in key] for key in states]
    ga = [[place(t, layout, state=True) for t in key] for key in absmax]
    _ops.quantized_step_(algorithm, gp, gg, gs, ga, [s.to(CUDA, copy=True) for s in steps],
                         [q.to(CUDA) for q in qmaps], hyper, **{k: v.to(CUDA) for k, v in kw.items()}, **extra)
    return [p.cpu() for p in gp], [[t.cpu() for t in key] for key in gs], [[t.cpu() for t in key] for key in ga]


def step_both_ways(algorithm, sizes, dtype, seed, layout, sr_offsets=None, grad_scale=None, lr_tensor=False,
                   mixed=False, qmaps=None, nonfinite=False):
    """One step on the CPU and, from the same inputs, on the GPU with `layout` and aligned; checks
    CPU == GPU (states bitwise, parameters within the bound) and GPU(layout) == GPU(aligned) bitwise.
    With stochastic rounding (`sr_offsets`), some bf16 parameter of 64 elements or more must differ
    from its rounding to nearest (each element does with probability about 1/4: the bound of
    check_params, one ulp, cannot tell the two apart)."""
    stacks, kinds, hyper, takes_scales = ALGORITHMS[algorithm]
    gen = torch.Generator().manual_seed(seed)
    params, grads, states, absmax = make_states(stacks, kinds, sizes, gen, dtype, mixed)
    if nonfinite:
        for g in grads:
            if g.numel() > 2:
                g[torch.randint(0, g.numel(), (2,), generator=gen)] = torch.tensor([float("nan"), float("-inf")],
                                                                                   dtype=g.dtype)
    before = [p.clone() for p in params]
    steps = [torch.tensor(4.0) for _ in sizes]
    qmaps = codebooks(kinds) if qmaps is None else qmaps
    kw = {}
    if grad_scale is not None:
        grads = [g * grad_scale for g in grads]
        kw.update(grad_scale=torch.tensor(grad_scale), found_inf=torch.tensor(0.0))
    if lr_tensor:
        kw["lr"] = torch.tensor(hyper[0] * 3, dtype=torch.float32)
    if takes_scales:
        kw["scales"] = torch.rand(len(sizes), generator=gen) + 0.5
    extra = {}
    if sr_offsets is not None:
        extra = dict(sr_ids=list(range(7, 7 + len(sizes))), sr_offsets=list(sr_offsets), sr_seed=11)
    got = run_gpu(algorithm, params, grads, states, absmax, steps, qmaps, hyper, layout, kw, extra)
    ref_gpu = run_gpu(algorithm, params, grads, states, absmax, steps, qmaps, hyper, "aligned", kw, extra) \
        if layout != "aligned" else got
    rounded = [i for i, p in enumerate(params) if p.dtype == torch.bfloat16 and p.numel() >= 64]
    if extra and rounded:  # stochastic rounding was applied: rounding to nearest gives other bits
        nearest = run_gpu(algorithm, params, grads, states, absmax, steps, qmaps, hyper, "aligned", kw, {})[0]
        assert any(not torch.equal(got[0][i], nearest[i]) for i in rounded), "bf16 params rounded to nearest"
    _ops.quantized_step_(algorithm, params, grads, states, absmax, steps, qmaps, hyper, **kw, **extra)
    gp, gs, ga = got
    rp, rs, ra = ref_gpu
    for i, n in enumerate(sizes):
        for k in range(len(stacks)):
            assert_bitwise(gs[k][i], states[k][i], f"state{k + 1}[{i}] (n={n}, {layout})")
            assert_bitwise(ga[k][i], absmax[k][i], f"absmax{k + 1}[{i}] (n={n}, {layout})")
            assert_bitwise(gs[k][i], rs[k][i], f"state{k + 1}[{i}] (n={n}) {layout} vs aligned")
            assert_bitwise(ga[k][i], ra[k][i], f"absmax{k + 1}[{i}] (n={n}) {layout} vs aligned")
        check_params(gp[i], params[i], before[i], params[i].dtype, f"params[{i}] (n={n}, {layout})")
        assert_bitwise(gp[i], rp[i], f"params[{i}] (n={n}) {layout} vs aligned")


# Sizes around the tile and block boundaries: k tiles plus or minus a few elements, k half tiles
# (an odd number of blocks: a last tile of one block), odd sizes (a padding nibble).
near_tiles = st.builds(lambda k, d: max(1, k * TILE + d), st.integers(0, 6), st.integers(-9, 9))
near_blocks = st.builds(lambda k, d: max(1, k * (TILE // 2) + d), st.integers(1, 9), st.integers(-2, 2))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@given(seed=st.integers(0, 2**31), sizes=st.lists(st.one_of(near_tiles, near_blocks), min_size=1, max_size=5),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["aligned", "off", "codes2"]),
       sr_offset=st.sampled_from([None, 0, 1, 2, 3, 8, 1027]), grad_scale=st.sampled_from([None, 256.0]),
       lr_tensor=st.booleans(), nonfinite=st.booleans())
@example(seed=5, sizes=[256, 255, 257, 128, 384, 1, 513], dtype=torch.bfloat16, layout="off", sr_offset=3,
         grad_scale=None, lr_tensor=False, nonfinite=True)
@example(seed=6, sizes=[512, 640, 7, 1024], dtype=torch.float32, layout="codes2", sr_offset=None, grad_scale=256.0,
         lr_tensor=True, nonfinite=False)
@example(seed=7, sizes=[1536, 129, 768], dtype=torch.bfloat16, layout="aligned", sr_offset=0, grad_scale=None,
         lr_tensor=False, nonfinite=True)
def test_tiles_match_cpu_and_the_per_element_path(algorithm, seed, sizes, dtype, layout, sr_offset, grad_scale,
                                                  lr_tensor, nonfinite):
    """`sr_offset`: stochastic rounding of bf16 parameters, each tensor's first element at that index
    of its parameter (a multiple of 4 takes store8_param's shared hashes, any other one hash per
    element): the random bits are those of the element's index either way."""
    offsets = None if sr_offset is None else [sr_offset + 3 * i for i in range(len(sizes))]
    step_both_ways(algorithm, sizes, dtype, seed, layout, sr_offsets=offsets, grad_scale=grad_scale,
                   lr_tensor=lr_tensor, nonfinite=nonfinite)


@pytest.mark.parametrize("algorithm", ["adam", "ademamix", "lion", "lamb"])
@pytest.mark.parametrize("dtype,sr", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)])
def test_many_tiles_per_warp(algorithm, dtype, sr):
    """More tiles than the grid has warps (an H100's 132 SMs x 32 warps take 4224 tiles a round): each
    warp walks a run of tiles, prefetching the next, and crosses tensor boundaries inside its run;
    tensors of a single element and empty ones sit between large ones, with every dtype in one call
    (mixed: a kernel per dtype, each with its own walk)."""
    sizes = [1_048_576 + 1000, 1, 777_777, 0, 256, 1_000_001, 129, 300_000, 3, 2_000_000 + 128]
    offsets = [0] * len(sizes) if sr else None
    step_both_ways(algorithm, sizes, dtype, seed=21, layout="aligned", sr_offsets=offsets)
    step_both_ways(algorithm, sizes[:4], dtype, seed=22, layout="off", mixed=True)


def _custom_codebooks(kind):
    """16-entry codebooks (sorted, finite, as the ops accept them) that fit the search table or not."""
    if kind == "linear":  # fits: evenly spaced from -1 to 1
        return torch.linspace(-1, 1, 16)
    if kind == "crowded":  # two thresholds within one bucket of 1/32 binade: does not fit
        code = torch.linspace(-1, 1, 16)
        code[9:12] = torch.tensor([0.5, 0.5001, 0.5002])
        return code.sort().values
    if kind == "beyond_one":  # a code above 1: a threshold in the top bucket, which holds one code
        code = torch.linspace(-1, 1, 16)
        code[-1] = 1.5
        return code
    if kind == "nonneg":  # no negative code: the search without sign, here also for signed moments
        return torch.linspace(1 / 16, 1, 16)
    if kind == "two_zeros":  # no negative code but two zeros: +0 takes code 1, x < 0 code 0: signed search
        return torch.cat([torch.zeros(2), torch.linspace(2 / 16, 1, 14)])
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["linear", "crowded", "beyond_one", "nonneg", "two_zeros"])
@pytest.mark.parametrize("algorithm", ["adam", "lion"])
def test_codebooks_that_do_or_do_not_fit_the_search_table(kind, algorithm):
    """The table search or its fallback (nearest_code4 on full tiles): the CPU's codes either way.
    The search without sign (a last key whose codebook has no negative code) sees negative values
    only where such a codebook holds a signed moment: Lion's m."""
    stacks, kinds, _, _ = ALGORITHMS[algorithm]
    code = _custom_codebooks(kind)
    qmaps = [code.clone() for _ in kinds]
    for seed, dtype in [(31, torch.float32), (32, torch.bfloat16)]:
        step_both_ways(algorithm, [4096 + 256, 1000, 128], dtype, seed, "off", qmaps=qmaps, nonfinite=True)
