"""The CUDA 8-bit step kernel against the CPU kernel, for Adam (quantized_step_ with the Adam
functor; the other algorithms: tests/test_family_8bit.py; quantize and dequantize:
tests/test_cuda_quantize.py).

The 8-bit Adam step shares its element math (pagedopt/adam_update.h). The moments use only correctly
rounded operations (fmaf, *), so from identical inputs one step gives bit-identical codes and
absmax on both backends. The parameter goes through the GPU's approximate sqrt and division
(within 2 ulp each, subnormals flushed), so it may differ from the CPU's by
    one ulp of the parameter's dtype + 2^-19 * |update| (+ 1e-30 for the flushed subnormals),
where the update is lr / (1 - beta1^t) * m / denom, of relative error below 2^-21 on the GPU.
With decoupled decay (or none) the moments do not depend on the parameter, so codes and absmax
stay bit-identical over any number of steps; with L2 decay the parameter feeds the next gradient,
so the multi-step tests restart both backends from the CPU's state after every comparison.
The one further caveat, documented in csrc/include/pagedopt/step_power.h (pow_step): the bias
corrections use beta^t in double; glibc's pow is misrounded in about 1 of 2500 calls and the GPU's
value is the correctly rounded one, which changes a float constant only if the double lies within a
few double ulps of a float rounding boundary (< 1e-8 per tensor and step).

Every test needs a GPU and a build of pagedopt with its CUDA kernels.
"""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedopt import quant

from adam_call import adam8bit_step
from bitwise_compare import assert_bitwise, rand_nonzero
from device_params import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]

STATE_BLOCK = quant.STATE_BLOCK_SIZE
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def codebooks(device="cpu", shuffle_seed=None):
    code1, code2 = quant.dynamic_codebook(True), quant.dynamic_codebook(False)
    if shuffle_seed is not None:  # not sorted: the kernels must fall back to nearest_code itself
        g = torch.Generator().manual_seed(shuffle_seed)
        code1 = code1[torch.randperm(256, generator=g)].contiguous()
    return code1.to(device), code2.to(device)


def make_state(n: int, dtype, gen: torch.Generator):
    """One tensor's param, grad and an already-populated 8-bit state (as after some steps)."""
    blocks = (n + STATE_BLOCK - 1) // STATE_BLOCK
    return dict(
        p=rand_nonzero(n, gen, dtype, 0.5),
        g=rand_nonzero(n, gen, dtype, 1.0),
        q1=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
        q2=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
        a1=torch.rand(blocks, generator=gen) * 0.1 + 1e-4,
        a2=torch.rand(blocks, generator=gen) * 0.01 + 1e-6,
    )


STATE_KEYS = ("p", "q1", "q2", "a1", "a2")


def clone_to(tensors, device):
    return [{k: v.clone().to(device) for k, v in t.items()} for t in tensors]


def step(tensors, steps, code1, code2, h, grads=None, grad_scale=None, found_inf=None):
    dev = tensors[0]["p"].device if tensors else code1.device
    adam8bit_step(
        [t["p"] for t in tensors], grads if grads is not None else [t["g"] for t in tensors],
        [t["q1"] for t in tensors], [t["q2"] for t in tensors], [t["a1"] for t in tensors],
        [t["a2"] for t in tensors], [torch.tensor(float(s), device=dev) for s in steps], code1, code2,
        lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["wd"],
        decoupled=h["decoupled"], grad_scale=grad_scale, found_inf=found_inf)


def assert_states_equal(got, expected, what=""):
    for i, (a, b) in enumerate(zip(got, expected)):
        for k in STATE_KEYS:
            assert_bitwise(a[k], b[k], f"{what}tensor {i} {k} (numel {b['p'].numel()}, {b['p'].dtype})")


_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def assert_params_close(p_gpu, p_cpu, p_before, h, what):
    """|p_gpu - p_cpu| <= ulp(p_cpu) + 2^-19 (|update| + ulp) + 1e-30 (see the module docstring)."""
    dtype = p_cpu.dtype
    got = p_gpu.detach().cpu().double()
    exp = p_cpu.detach().cpu().double()
    decay = float(torch.tensor(1 - h["lr"] * h["wd"], dtype=torch.float32)) if h["decoupled"] else 1.0
    update = (exp - p_before.detach().cpu().double() * decay).abs()
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(exp.abs().clamp_min(tiny)))) * 2.0 ** -_MANTISSA_BITS[dtype]
    bound = ulp + 2.0 ** -19 * (update + ulp) + 1e-30
    bad = ((got - exp).abs() > bound).nonzero().reshape(-1)
    if bad.numel():
        i = bad[:5].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {exp.numel()} params beyond the bound; first at {i}: "
                             f"got {got[i].tolist()}, expected {exp[i].tolist()}, bound {bound[i].tolist()}")


def assert_step_matches(got, expected, before, h, what=""):
    """One step from identical inputs: codes and absmax bit for bit, params within the bound."""
    for i, (a, b, b0) in enumerate(zip(got, expected, before)):
        where = f"{what}tensor {i} (numel {b['p'].numel()}, {b['p'].dtype})"
        for k in ("q1", "q2", "a1", "a2"):
            assert_bitwise(a[k], b[k], f"{where} {k}")
        assert_params_close(a["p"], b["p"], b0["p"], h, f"{where} p")


def step_both(cpu, gpu, steps, code1, code2, h, grads=None, **kwargs):
    """One step on both backends from the CPU's current state; compares, then resyncs the GPU."""
    before = clone_to(cpu, "cpu")
    for t, c in zip(gpu, cpu):
        for k in STATE_KEYS:
            t[k].copy_(c[k])
    step(cpu, steps, code1, code2, h, grads=grads, **{k: v.cpu() for k, v in kwargs.items()})
    step(gpu, steps, code1.to(CUDA), code2.to(CUDA), h,
         grads=None if grads is None else [g.to(CUDA) for g in grads],
         **{k: v.to(CUDA) for k, v in kwargs.items()})
    return before


hyper = st.fixed_dictionaries(dict(
    lr=st.sampled_from([1e-5, 1e-4, 1e-3, 3e-2, 0.1]),
    beta1=st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99]),
    beta2=st.sampled_from([0.9, 0.95, 0.99, 0.999, 0.9999]),
    eps=st.sampled_from([1e-8, 1e-6, 1e-12, 1e-3]),
    wd=st.sampled_from([0.0, 0.01, 0.1]),
    decoupled=st.booleans()))


# ---------------------------------------------------------------------------------------------
# (b) Adam's 8-bit step over several steps
# ---------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=5),
       dtype=st.sampled_from(DTYPES), h=hyper, first_step=st.integers(1, 3000),
       n_steps=st.integers(1, 3), sorted_codes=st.booleans())
def test_adam_step_matches_cpu(seed, sizes, dtype, h, first_step, n_steps, sorted_codes):
    gen = torch.Generator().manual_seed(seed)
    cpu = [make_state(n, dtype, gen) for n in sizes]
    gpu = clone_to(cpu, CUDA)
    code1, code2 = codebooks(shuffle_seed=None if sorted_codes else seed)
    for k in range(n_steps):
        grads = [rand_nonzero(n, gen, dtype) for n in sizes]
        steps = [first_step + k] * len(sizes)
        before = step_both(cpu, gpu, steps, code1, code2, h, grads=grads)
        assert_step_matches(gpu, cpu, before, h, f"after step {k + 1}: ")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decoupled,wd", [(True, 0.1), (False, 0.01), (True, 0.0)])
def test_adam_step_large_tensors(dtype, decoupled, wd):
    """A few large tensors (full vectorized blocks, many warps, tensors spanning warps)."""
    gen = torch.Generator().manual_seed(7)
    sizes = [1 << 20, 3 * 256 * 1000 + 17, 65536]
    cpu = [make_state(n, dtype, gen) for n in sizes]
    gpu = clone_to(cpu, CUDA)
    code1, code2 = codebooks()
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=wd, decoupled=decoupled)
    for k in range(2):
        before = step_both(cpu, gpu, [k + 1] * 3, code1, code2, h)
        assert_step_matches(gpu, cpu, before, h, f"after step {k + 1}: ")


def test_adam_zero_grads_and_zero_state():
    """All-zero blocks (absmax 0), zero moments next to nonzero ones, as in unused embedding rows."""
    gen = torch.Generator().manual_seed(3)
    n = 256 * 40 + 100
    cpu = [make_state(n, torch.float32, gen)]
    cpu[0]["g"][: 256 * 10] = 0
    cpu[0]["g"][256 * 20: 256 * 20 + 100] = 0
    cpu[0]["q2"][:] = 0  # code 0 of the unsigned codebook is 0.0
    cpu[0]["a1"][:10] = 0
    gpu = clone_to(cpu, CUDA)
    code1, code2 = codebooks()
    h = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, decoupled=True)
    for k in range(3):
        before = step_both(cpu, gpu, [k + 1], code1, code2, h)
        assert_step_matches(gpu, cpu, before, h, f"after step {k + 1}: ")


# ---------------------------------------------------------------------------------------------
# (c) found_inf, (d) grad_scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("found", [1.0, float("inf"), float("nan")])
def test_found_inf_skips_the_step(found):
    gen = torch.Generator().manual_seed(11)
    gpu = clone_to([make_state(n, torch.bfloat16, gen) for n in (1, 300, 5000)], CUDA)
    before = clone_to(gpu, CUDA)
    code1, code2 = codebooks(CUDA)
    h = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, decoupled=True)
    step(gpu, [5, 5, 5], code1, code2, h, found_inf=torch.tensor(found, device=CUDA),
         grad_scale=torch.tensor(2.0, device=CUDA))
    torch.cuda.synchronize()
    assert_states_equal(gpu, before)
    # found_inf == 0 steps normally
    step(gpu, [5, 5, 5], code1, code2, h, found_inf=torch.tensor(0.0, device=CUDA))
    assert not torch.equal(gpu[2]["p"], before[2]["p"])


@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, 2000), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([65536.0, 1024.0, 3.0, 0.7, 1e-20, 1e20]),
       h=hyper)
def test_grad_scale_divides_grads(seed, sizes, dtype, scale, h):
    gen = torch.Generator().manual_seed(seed)
    cpu = [make_state(n, dtype, gen) for n in sizes]
    gpu = clone_to(cpu, CUDA)
    code1, code2 = codebooks()
    before = step_both(cpu, gpu, [4] * len(sizes), code1, code2, h, grad_scale=torch.tensor(scale))
    assert_step_matches(gpu, cpu, before, h, "vs CPU: ")
    if dtype == torch.float32:  # the kernel's unscaling is g * fp32(1 / scale)
        scaled = clone_to([make_state(n, dtype, torch.Generator().manual_seed(seed)) for n in sizes], CUDA)
        unscaled = clone_to(scaled, CUDA)
        scale_d = torch.tensor(scale, device=CUDA)
        step(scaled, [4] * len(sizes), code1.to(CUDA), code2.to(CUDA), h, grad_scale=scale_d)
        step(unscaled, [4] * len(sizes), code1.to(CUDA), code2.to(CUDA), h,
             grads=[t["g"] * (1.0 / scale_d) for t in unscaled])
        assert_states_equal(scaled, unscaled, "scaled vs pre-divided grads: ")


# ---------------------------------------------------------------------------------------------
# (e) unaligned views, (f) many tensors and mixed dtypes in one call
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_unaligned_views_match_cpu(dtype, offset):
    """Params, grads and states that are views into flat buffers at odd offsets (no vector access)."""
    gen = torch.Generator().manual_seed(offset)
    sizes = [1, 255, 256, 4096 + 3, 256 * 37]
    total = sum(sizes) + offset * len(sizes)
    flat = {k: v for k, v in make_state(total, dtype, gen).items()}
    cpu = []
    pos = offset
    for n in sizes:
        blocks = (n + STATE_BLOCK - 1) // STATE_BLOCK
        t = {k: flat[k][pos:pos + n] for k in ("p", "g", "q1", "q2")}
        t["a1"] = torch.rand(blocks + 1, generator=gen)[1:] * 0.1 + 1e-4
        t["a2"] = torch.rand(blocks + 1, generator=gen)[1:] * 0.01 + 1e-6
        cpu.append(t)
        pos += n + offset
    gpu_flat = {k: v.to(CUDA, copy=True) for k, v in flat.items()}
    gpu = []
    pos = offset
    for n, t in zip(sizes, cpu):
        g = {k: gpu_flat[k][pos:pos + n] for k in ("p", "g", "q1", "q2")}
        a1 = torch.empty(t["a1"].numel() + 1, device=CUDA)[1:]
        a2 = torch.empty(t["a2"].numel() + 1, device=CUDA)[1:]
        a1.copy_(t["a1"])
        a2.copy_(t["a2"])
        g["a1"], g["a2"] = a1, a2
        gpu.append(g)
        pos += n + offset
    assert gpu[1]["p"].data_ptr() % 16 != 0
    code1, code2 = codebooks()
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, decoupled=False)
    for k in range(2):
        before = step_both(cpu, gpu, [k + 1] * len(sizes), code1, code2, h)
        assert_step_matches(gpu, cpu, before, h, f"after step {k + 1}: ")


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), h=hyper)
def test_many_tensors_mixed_dtypes_one_call(seed, h):
    """300 tiny tensors, a few big ones and empty ones, three dtypes, each with its own step count."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 700, (300,), generator=gen)] + [0, 70000, 256 * 300, 0, 1 << 17, 5]
    dtypes = [DTYPES[int(i)] for i in torch.randint(0, 3, (len(sizes),), generator=gen)]
    cpu = [make_state(n, d, gen) for n, d in zip(sizes, dtypes)]
    gpu = clone_to(cpu, CUDA)
    steps = [int(s) for s in torch.randint(1, 100000, (len(sizes),), generator=gen)]
    code1, code2 = codebooks()
    for k in range(2):
        before = step_both(cpu, gpu, [s + k for s in steps], code1, code2, h)
        assert_step_matches(gpu, cpu, before, h, f"after step {k + 1}: ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoupled_states_stay_identical_over_many_steps(dtype):
    """AdamW's moments never see the parameter: no resync, 12 steps, states still bit for bit."""
    gen = torch.Generator().manual_seed(21)
    sizes = [256 * 50 + 7, 3000, 1]
    cpu = [make_state(n, dtype, gen) for n in sizes]
    gpu = clone_to(cpu, CUDA)
    code1, code2 = codebooks()
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, decoupled=True)
    largest_update = [0.0] * len(sizes)  # the largest |change of p| in one CPU step, per tensor
    for k in range(12):
        grads = [rand_nonzero(n, gen, dtype) for n in sizes]
        before = [x["p"].double() for x in cpu]
        step(cpu, [k + 1] * 3, code1, code2, h, grads=grads)
        step(gpu, [k + 1] * 3, code1.to(CUDA), code2.to(CUDA), h, grads=[g.to(CUDA) for g in grads])
        for i, (x, b) in enumerate(zip(cpu, before)):
            if b.numel():
                largest_update[i] = max(largest_update[i], (x["p"].double() - b).abs().max().item())
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        for k in ("q1", "q2", "a1", "a2"):
            assert_bitwise(a[k], b[k], f"tensor {i} {k}")
        # The states are bit for bit equal, so the parameters differ only by rounding: per step at
        # most one ulp of p (the store in p's dtype) plus 2^-19 |update| (the update's fp32 math, a
        # few roundings and the GPU's reciprocal square root), over 12 steps: 16 ulps of |p| and
        # 12 * 2^-19 times the largest update seen on the CPU.
        torch.testing.assert_close(a["p"].cpu().double(), b["p"].double(), rtol=16 * 2.0 ** -_MANTISSA_BITS[dtype],
                                   atol=12 * 2.0**-19 * largest_update[i])


def test_empty_lists_and_empty_tensors():
    code1, code2 = codebooks(CUDA)
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, decoupled=True)
    step([], [], code1, code2, h)
    gpu = clone_to([make_state(0, torch.float32, torch.Generator())], CUDA)
    step(gpu, [1], code1, code2, h)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# (g) bad inputs raise and leave every state untouched
# ---------------------------------------------------------------------------------------------
def _bad_case(kind):
    gen = torch.Generator().manual_seed(5)
    gpu = clone_to([make_state(n, torch.float32, gen) for n in (300, 1000, 513)], CUDA)
    grads = [t["g"] for t in gpu]
    if kind == "dtype":
        grads[-1] = grads[-1].to(torch.bfloat16)
    elif kind == "state_size":
        gpu[-1]["q1"] = torch.zeros(gpu[-1]["p"].numel() + 1, dtype=torch.uint8, device=CUDA)
    elif kind == "absmax_size":
        gpu[-1]["a2"] = torch.zeros(1, device=CUDA)
    elif kind == "device":
        grads[-1] = grads[-1].cpu()
    elif kind == "state_dtype":
        gpu[-1]["q2"] = gpu[-1]["q2"].to(torch.int8)
    elif kind == "param_dtype":
        gpu[-1]["p"] = gpu[-1]["p"].double()
        grads[-1] = grads[-1].double()
    elif kind == "scale_device":
        pass
    return gpu, grads


@pytest.mark.parametrize("kind, message", [
    ("dtype", r"grads\[2\] has dtype BFloat16 but params\[2\] has dtype Float"),
    ("state_size", r"state1\[2\] has 514 elements, expected 1 x 513"),
    ("absmax_size", r"absmax2\[2\] must have 3 elements"),
    ("device", r"grads\[2\] must be contiguous and on cuda"),
    ("state_dtype", r"state2\[2\] must be Byte"),
    ("param_dtype", r"params\[2\] has unsupported dtype Double"),
    ("scale_device", r"grad_scale is on cpu, params on cuda"),
    ("list_length", r"expected 3 grads, 3 steps .* got grads=2 steps=3"),
])
def test_bad_inputs_raise_and_change_nothing(kind, message):
    gpu, grads = _bad_case(kind)
    before = clone_to(gpu, CUDA)
    code1, code2 = codebooks(CUDA)
    h = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, decoupled=True)
    kwargs = {}
    if kind == "scale_device":
        kwargs["grad_scale"] = torch.tensor(2.0)  # on the CPU
    with pytest.raises(RuntimeError, match=message):
        if kind == "list_length":
            adam8bit_step([t["p"] for t in gpu], grads[:-1], [t["q1"] for t in gpu], [t["q2"] for t in gpu],
                          [t["a1"] for t in gpu], [t["a2"] for t in gpu], [torch.tensor(1.0, device=CUDA)] * 3,
                          code1, code2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
        else:
            step(gpu, [1, 1, 1], code1, code2, h, grads=grads, **kwargs)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(gpu, before)):
        for k in STATE_KEYS:
            if a[k].dtype == b[k].dtype and a[k].shape == b[k].shape:
                assert_bitwise(a[k], b[k], f"tensor {i} {k}")


# ---------------------------------------------------------------------------------------------
# int64 indexing: a tensor above 2^31 elements (about 13 GB of GPU memory; opt-in)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDOPT_BIG_TESTS") != "1", reason="set PAGEDOPT_BIG_TESTS=1 (needs ~16 GB)")
def test_tensor_above_2_31_elements():
    n = (1 << 31) + 1000
    dtype = torch.bfloat16
    blocks = (n + STATE_BLOCK - 1) // STATE_BLOCK
    p = torch.ones(n, dtype=dtype, device=CUDA)
    g = torch.full((n,), 1e-3, dtype=dtype, device=CUDA)
    g[-5:] = -2.0
    q1 = torch.full((n,), 128, dtype=torch.uint8, device=CUDA)
    q2 = torch.zeros(n, dtype=torch.uint8, device=CUDA)
    a1 = torch.full((blocks,), 0.1, device=CUDA)
    a2 = torch.full((blocks,), 0.01, device=CUDA)
    code1, code2 = codebooks(CUDA)
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, decoupled=True)
    # the CPU op on the last blocks alone gives the expected values there (blocks are independent)
    tail = 3 * STATE_BLOCK + (n % STATE_BLOCK)
    lo = n - tail
    cpu = [dict(p=p[lo:].cpu(), g=g[lo:].cpu(), q1=q1[lo:].cpu(), q2=q2[lo:].cpu(),
                a1=a1[lo // STATE_BLOCK:].cpu(), a2=a2[lo // STATE_BLOCK:].cpu())]
    before = clone_to(cpu, "cpu")
    step([dict(p=p, g=g, q1=q1, q2=q2, a1=a1, a2=a2)], [1], code1, code2, h)
    step(cpu, [1], code1.cpu(), code2.cpu(), h)
    got = [dict(p=p[lo:], q1=q1[lo:], q2=q2[lo:], a1=a1[lo // STATE_BLOCK:], a2=a2[lo // STATE_BLOCK:])]
    assert_step_matches(got, cpu, before, h)
    # the first block saw the same inputs as the last full blocks before the changed tail
    assert torch.equal(p[:STATE_BLOCK].cpu(), p[lo - STATE_BLOCK:lo].cpu())
