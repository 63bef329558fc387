"""Stochastic rounding to bfloat16 (csrc/include/pagedopt/stochastic_round.h): the op
stochastic_round_bf16 and the engine's rounding of bf16 parameters (quantized_step_ with sr_ids)
against a pure-torch reference of the same hash and truncation (tests/reference_sr.py), bit for
bit on random data; the statistics of the rounding (unbiased, not round-to-nearest, fresh bits for
each step, element, parameter and seed), each test with a stated false-failure rate; argument
checks that change nothing; CUDA against the CPU, bit for bit (@pytest.mark.cuda).

The false-failure rates. The random bits are a fixed function of (seed, id, step, index), so each
statistical test below passes or fails the same way on every run; its rate is the probability,
over the choice of the seeds it uses, that it would fail if the bits were independent uniform
draws, which is what the hash is meant to give. Each count is bounded with Bernstein's inequality
(exact for sums of independent Bernoulli variables, no normal approximation):
    P(|S - n p| >= t) <= 2 exp(-t^2 / (2 (n p (1 - p) + t / 3)))
so t = L / 3 + sqrt(L^2 / 9 + 2 L n p (1 - p)), L = ln(2 / alpha), gives false-failure rate alpha;
alpha = 1e-7 per check, and at most 10 checks per test: at most 1e-6 per test."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedopt import _ops
from pagedopt.quant import dynamic_codebook

import reference_sr as ref

ALPHA = 1e-7


def bernstein_t(n: int, p: float, alpha: float = ALPHA) -> float:
    """The deviation t of a Binomial(n, p) count from n p exceeded with probability <= alpha."""
    L = math.log(2 / alpha)
    return L / 3 + math.sqrt(L * L / 9 + 2 * L * n * p * (1 - p))


def random_floats(n: int, seed: int) -> torch.Tensor:
    """n float32 values: a third arbitrary bit patterns (every exponent: subnormals, NaN, +-inf,
    values beyond bf16's largest), a third normal values of every scale, a third exact bf16 values."""
    g = torch.Generator().manual_seed(seed)
    a = n // 3
    bits = torch.randint(-(1 << 31), 1 << 31, (a,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    normal = torch.randn(a, generator=g) * torch.exp2(torch.randint(-40, 40, (a,), generator=g).float())
    exact = torch.randn(n - 2 * a, generator=g).bfloat16().float()
    return torch.cat([bits, normal, exact])[torch.randperm(n, generator=g)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(ref.bf16_bits(a.cpu()), ref.bf16_bits(b.cpu()))


# ---------------------------------------------------------------------------------- the op
@given(n=st.integers(0, 3000), data=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**63 - 1),
       pid=st.integers(0, 2**40), step=st.integers(0, 2**24), offset=st.integers(0, 2**42))
def test_op_matches_the_reference(n, data, seed, pid, step, offset):
    x = random_floats(n, data)
    out = _ops.stochastic_round_bf16(x, torch.tensor(float(step)), seed, pid, offset)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert same_bits(out, ref.stochastic_round(x, seed, pid, step, offset))


def test_reference_bits_are_the_python_int_ones():
    """The tensor reference (wrapping int64 arithmetic) against plain Python ints, element by element."""
    for seed, pid, step, offset in ((0, 0, 1, 0), (2**63 - 1, 2**40 + 3, 2**24, 4 * 12345), (7, 1 << 33, 9, 8)):
        stream = ref.stream_int(ref.key_int(seed, pid), step)
        expected = [ref.bits_int(stream, offset + i) for i in range(41)]
        assert ref.random_bits(seed, pid, step, 41, offset).tolist() == expected


def test_special_values():
    """Exact bf16 values never move; +-inf stay; NaN stays NaN (even one whose payload is only in
    the low 16 bits, which truncation alone would make inf); finite values beyond bf16's largest
    saturate to it (round to nearest would give inf from 3.3961e38 on); +-0 stay; subnormals
    round within their sign."""
    largest = 3.3895313892515355e38  # 0x7F7F0000
    g = torch.Generator().manual_seed(0)
    parts = {
        "inf": torch.tensor([float("inf")]), "-inf": torch.tensor([float("-inf")]),
        "+0": torch.tensor([0.0]), "-0": torch.tensor([-0.0]),
        "subnormal": torch.tensor([1e-40, -1e-45]),
        "beyond": torch.tensor([3.3961e38, -3.4028e38, 3.3895317e38]),
        "nan": torch.tensor([0x7F800001, 0xFF800001, 0x7FC00000], dtype=torch.int64).to(torch.int32).view(torch.float32),
        "exact": torch.randn(64, generator=g).bfloat16().float(),
    }
    row = torch.cat(list(parts.values()))
    x = row.repeat(64)
    for step in range(1, 6):
        out = _ops.stochastic_round_bf16(x, torch.tensor(float(step)), 3, 1)
        assert same_bits(out, ref.stochastic_round(x, 3, 1, step))
        cols, at = {}, 0
        for name, t in parts.items():
            cols[name] = out.reshape(64, -1)[:, at:at + t.numel()]
            at += t.numel()
        assert (cols["inf"].float() == float("inf")).all() and (cols["-inf"].float() == float("-inf")).all()
        assert (ref.bf16_bits(cols["+0"]) == 0).all() and (ref.bf16_bits(cols["-0"]) == 0x8000).all()
        assert (cols["subnormal"][:, 0].float() >= 0).all() and (ref.bf16_bits(cols["subnormal"][:, 1]) >= 0x8000).all()
        beyond = cols["beyond"].float()
        assert (beyond[:, 0] == largest).all() and (beyond[:, 1] == -largest).all() and (beyond[:, 2] == largest).all()
        assert torch.isnan(cols["nan"].float()).all()
        assert torch.equal(cols["exact"].float(), parts["exact"].expand(64, -1))


# ---------------------------------------------------------------------------------- statistics
def up_fraction_bits(frac_bits: int, negative: bool = False, exponent: int = 0) -> torch.Tensor:
    """The float32 2^exponent * (1 + frac_bits / 2^23), i.e. between the bf16 neighbours
    2^exponent and 2^exponent (1 + 2^-7), at frac_bits / 2^16 of the way."""
    x = torch.tensor([2.0**exponent])
    u = x.view(torch.int32) + frac_bits
    return -u.view(torch.float32) if negative else u.view(torch.float32)


@pytest.mark.parametrize("frac_bits, negative, exponent", [
    (16384, False, 0), (32768, False, 0), (49152, False, 0), (655, False, 0), (64880, False, 0),
    (16384, True, 0), (40000, False, -130), (12345, True, 100), (16384, False, -20), (60000, True, -126)])
def test_unbiased(frac_bits, negative, exponent):
    """n = 2^20 draws (elements) of one value x between two bf16 neighbours a (toward zero) and b:
    each rounds away from zero with probability p = f / 2^16 (f: x's low 16 bits), so the mean of
    the rounded values is a + (b - a) p = x. The mean of the draws must be within (b - a) t / n of
    x, t = bernstein_t(n, p): false-failure rate 1e-7 per case, 1e-6 over the ten. Round to
    nearest (every draw the nearer neighbour) misses by (b - a) * min(p, 1 - p) >= 0.01 (b - a),
    far beyond (b - a) t / n (t / n < 0.0033 for these n and p)."""
    n = 1 << 20
    x = up_fraction_bits(frac_bits, negative, exponent)
    p = frac_bits / 65536
    out = _ops.stochastic_round_bf16(x.expand(n).contiguous(), torch.tensor(17.0), 5, 9).double()
    low = x.view(torch.int32).item() & ~0xFFFF  # the bits of a, the neighbour toward zero
    toward = torch.tensor([low], dtype=torch.int32).view(torch.float32).double()
    away = torch.tensor([low + 0x10000], dtype=torch.int32).view(torch.float32).double()
    assert set(out.unique().tolist()) <= {toward.item(), away.item()}
    gap = (away - toward).abs().item()
    bound = gap * bernstein_t(n, p) / n
    assert abs(out.mean().item() - x.double().item()) <= bound, (out.mean().item(), x.item(), bound)
    # the same test as counts: the fraction rounded away from zero is p within t / n
    ups = int((out == away.item()).sum())
    assert abs(ups - n * p) <= bernstein_t(n, p)


@pytest.mark.parametrize("frac_bits", [16384, 49152])
def test_not_round_to_nearest(frac_bits):
    """A value 1/4 of the way between neighbours rounds up about 25% of the time (and one at 3/4,
    75%), where round to nearest would give 0% (100%): the count of ups is within t =
    bernstein_t(n, p) of n p (false-failure rate 1e-7), and, as a plain statement of the claim,
    between 24% and 26% (76% ... 74%), which that t implies (t / n < 0.0025)."""
    n = 1 << 20
    x = up_fraction_bits(frac_bits).expand(n).contiguous()
    out = _ops.stochastic_round_bf16(x, torch.tensor(4.0), 11, 2)
    ups = int((out.float() > 1.0).sum())
    p = frac_bits / 65536
    assert abs(ups - n * p) <= bernstein_t(n, p)
    assert abs(ups / n - p) < 0.01


def _ups(seed=5, pid=9, step=17.0, offset=0, n=1 << 18):
    x = up_fraction_bits(32768).expand(n).contiguous()
    return _ops.stochastic_round_bf16(x, torch.tensor(step), seed, pid, offset).float() > 1.0


@pytest.mark.parametrize("other", ["step", "id", "seed", "element", "element_in_group", "offset"])
def test_fresh_bits_for_each_step_element_id_and_seed(other):
    """At p = 1/2, the round-up indicators of two draws that differ only in the step, the
    parameter's id, the seed or the element agree half the time when their bits are independent,
    always when a coordinate is ignored (or confused with another). Agreements of n disjoint pairs
    (independent): a Binomial(n, 1/2) count within bernstein_t(n, 1/2) of n / 2 (false-failure
    rate 1e-7); an ignored coordinate gives n, at least 30 t away. 'element_in_group': the four elements that share
    a hash (4 q .. 4 q + 3) take different bits of it; 'offset': element i of a piece starting at
    offset 5 is element i + 5 of the parameter, not element i."""
    a = _ups()
    if other == "step":
        b = _ups(step=18.0)
    elif other == "id":
        b = _ups(pid=10)
    elif other == "seed":
        b = _ups(seed=6)
    elif other == "element":  # elements 8 q and 8 q + 4: disjoint pairs, in different hashes
        a, b = a[0::8], a[4::8]
    elif other == "element_in_group":
        a, b = a[0::4], a[1::4]
    else:  # a piece starting at offset 5: its element i is the parameter's i + 5, not its i
        b = _ups(offset=5)
        assert torch.equal(b[:-5], a[5:])
        a, b = a[0::10], b[0::10]  # disjoint pairs: elements 10 q and 10 q + 5
    n = a.numel()
    agree = int((a == b).sum())
    assert abs(agree - n / 2) <= bernstein_t(n, 0.5), (agree, n)


# ---------------------------------------------------------------------------------- the engine
SGD_HYPER = [0.05, 0.9, 0.0, 0.01, 0.0]             # lr, momentum, dampening, weight_decay, nesterov
ADAM_HYPER = [1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0]    # lr, beta1, beta2, eps, weight_decay, decoupled
CASES = {"sgd_momentum": (SGD_HYPER, (True,)), "adam": (ADAM_HYPER, (True, False))}


def engine_case(algorithm, sizes, eight_bit, seed, device="cpu"):
    """Parameters with bf16 values (as bf16 and as their exact fp32 copies), bf16 gradients, and
    random states of `algorithm` (8-bit codes and absmax, or 32-bit floats; second moments >= 0)."""
    g = torch.Generator().manual_seed(seed)
    signed = CASES[algorithm][1]
    p16 = [torch.randn(n, generator=g).bfloat16().to(device) for n in sizes]
    g16 = [torch.randn(n, generator=g).bfloat16().to(device) for n in sizes]
    states, absmax = [[] for _ in signed], [[] for _ in signed]
    for n in sizes:
        for k, s in enumerate(signed):
            if eight_bit:
                states[k].append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device))
                absmax[k].append((torch.rand((n + 255) // 256, generator=g) * 0.1).to(device))
            else:
                v = torch.randn(n, generator=g) * 0.1
                states[k].append((v if s else v.abs()).to(device))
    steps = [torch.tensor(float(torch.randint(1, 1000, (), generator=g)), device=device) for _ in sizes]
    qmaps = [dynamic_codebook(s, device) for s in signed] if eight_bit else []
    return p16, g16, states, absmax if eight_bit else [], steps, qmaps


def run_engine(algorithm, case, dtype, unaligned=False, **sr):
    """One step on copies of the case's tensors (parameters and gradients as `dtype`; `unaligned`:
    each one element into its storage, so not 16-byte aligned); the new parameters and states."""
    p16, g16, states, absmax, steps, qmaps = case

    def copy(t):
        t = t.to(dtype, copy=True)
        return torch.cat([t[:1], t])[1:] if unaligned else t

    params = [copy(p) for p in p16]
    states = [[t.clone() for t in key] for key in states]
    absmax = [[t.clone() for t in key] for key in absmax]
    _ops.quantized_step_(algorithm, params, [copy(g) for g in g16], states, absmax, steps, qmaps,
                         CASES[algorithm][0], **sr)
    return params, states, absmax


@given(sizes=st.lists(st.integers(1, 1300), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1),
       sr_seed=st.integers(0, 2**63 - 1), data=st.data())
@pytest.mark.parametrize("algorithm, eight_bit", [("sgd_momentum", True), ("adam", True), ("adam", False)])
def test_engine_rounds_its_fp32_result_like_the_reference(algorithm, eight_bit, sizes, seed, sr_seed, data):
    """The engine on bf16 parameters with sr_ids stores, for each element, the reference's stochastic
    rounding of the very fp32 value it stores for the same parameters held as fp32 (the same update
    from the same inputs); the states are those of the fp32 run, bit for bit."""
    ids = data.draw(st.lists(st.integers(0, 2**40), min_size=len(sizes), max_size=len(sizes)))
    offsets = data.draw(st.lists(st.integers(0, 2**32), min_size=len(sizes), max_size=len(sizes)))
    case = engine_case(algorithm, sizes, eight_bit, seed)
    exact, states32, absmax32 = run_engine(algorithm, case, torch.float32)
    rounded, states16, absmax16 = run_engine(algorithm, case, torch.bfloat16, sr_ids=ids, sr_offsets=offsets,
                                             sr_seed=sr_seed)
    for i, (e, r) in enumerate(zip(exact, rounded)):
        assert same_bits(r, ref.stochastic_round(e, sr_seed, ids[i], case[4][i].item(), offsets[i])), i
    for a, b in zip(sum(states32 + absmax32, []), sum(states16 + absmax16, [])):
        assert torch.equal(a, b)


def test_without_sr_ids_and_for_other_dtypes_the_engine_rounds_to_nearest():
    """No sr_ids: bf16 parameters round to nearest. With sr_ids, fp32 and fp16 parameters are
    stored exactly as without them (the rounding is for bf16 only)."""
    case = engine_case("adam", (700, 33), True, 3)
    exact, _, _ = run_engine("adam", case, torch.float32)
    nearest, _, _ = run_engine("adam", case, torch.bfloat16)
    assert all(torch.equal(a, b.bfloat16()) for a, b in zip(nearest, exact))
    sr = dict(sr_ids=[0, 1], sr_seed=1)
    for dtype in (torch.float32, torch.float16):
        with_sr, _, _ = run_engine("adam", case, dtype, **sr)
        without, _, _ = run_engine("adam", case, dtype)
        assert all(torch.equal(a, b) for a, b in zip(with_sr, without))
    stochastic, _, _ = run_engine("adam", case, torch.bfloat16, **sr)
    assert not all(torch.equal(a, b) for a, b in zip(stochastic, nearest))


@pytest.mark.parametrize("bad, message", [
    (dict(sr_ids=[0]), r"sr_ids must hold one id per parameter \(2\), got 1"),
    (dict(sr_ids=[0, 1], sr_offsets=[0]), r"sr_offsets must hold one offset per parameter"),
    (dict(sr_ids=[0, 1], sr_offsets=[0, -6]), r"sr_offsets\[1\] = -6 must be >= 0"),
    (dict(sr_offsets=[0, 0]), "sr_offsets given without sr_ids"),
])
def test_bad_rounding_arguments_name_the_argument_and_change_nothing(bad, message):
    p16, g16, states, absmax, steps, qmaps = engine_case("adam", (700, 33), True, 4)
    before = [t.clone() for t in p16 + sum(states + absmax, [])]
    with pytest.raises(ValueError, match=message):
        _ops.quantized_step_("adam", p16, g16, states, absmax, steps, qmaps, ADAM_HYPER, **bad)
    assert all(torch.equal(a, b) for a, b in zip(before, p16 + sum(states + absmax, [])))
    with pytest.raises(ValueError, match="offset = -2 must be >= 0"):
        _ops.stochastic_round_bf16(torch.randn(8), torch.tensor(1.0), 0, 0, -2)
    with pytest.raises(ValueError, match="x must be float32"):
        _ops.stochastic_round_bf16(torch.randn(8).double(), torch.tensor(1.0), 0, 0)


def test_held_lists_round_with_their_ids():
    """quantized_step_list_ with sr_seed rounds with the ids and offsets set_sr_ids gave the list, as
    quantized_step_ does with them; without ids held, sr_seed is refused before anything changes."""
    case = engine_case("adam", (700, 300), True, 5)
    expected, _, _ = run_engine("adam", case, torch.bfloat16, sr_ids=[4, 9], sr_offsets=[0, 301], sr_seed=77)
    p16, g16, states, absmax, steps, qmaps = case
    held = torch.classes.pagedopt.QuantizedStateList("adam", sum(states, []), sum(absmax, []), steps, qmaps)
    params = [p.clone() for p in p16]
    with pytest.raises(ValueError, match="holds no sr_ids"):
        _ops.quantized_step_list_(held, params, g16, ADAM_HYPER, sr_seed=77)
    assert all(torch.equal(a, b) for a, b in zip(params, p16))
    with pytest.raises(ValueError, match="1 ids and 2 offsets for 2 held states"):
        held.set_sr_ids([4], [0, 301])
    with pytest.raises(ValueError, match=r"offsets\[1\] = -1 must be >= 0"):
        held.set_sr_ids([4, 9], [0, -1])
    held.set_sr_ids([4, 9], [0, 301])
    _ops.quantized_step_list_(held, params, g16, ADAM_HYPER, sr_seed=77)
    assert all(same_bits(a, b) for a, b in zip(params, expected))


def test_ops_pass_opcheck():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))  # no NaN: opcheck compares with assert_close
    torch.library.opcheck(torch.ops.pagedopt.stochastic_round_bf16, (x, torch.tensor(3.0), 5, 6, 8))
    p16, g16, states, absmax, steps, qmaps = engine_case("adam", (700, 33), True, 6)
    torch.library.opcheck(torch.ops.pagedopt.quantized_step_,
                          ("adam", p16, g16, sum(states, []), sum(absmax, []), steps, qmaps, ADAM_HYPER, None, None,
                           None, None, [3, 4], [0, 257], 12))


# ---------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@given(n=st.integers(0, 5000), data=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**63 - 1),
       pid=st.integers(0, 2**40), step=st.integers(0, 2**24), offset=st.integers(0, 2**42))
def test_op_cuda_is_the_cpu_bit_for_bit(n, data, seed, pid, step, offset):
    x = random_floats(n, data)
    cpu = _ops.stochastic_round_bf16(x, torch.tensor(float(step)), seed, pid, offset)
    gpu = _ops.stochastic_round_bf16(x.cuda(), torch.tensor(float(step), device="cuda"), seed, pid, offset)
    assert same_bits(gpu, cpu)


@pytest.mark.cuda
@given(sizes=st.lists(st.integers(1, 2000), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1),
       sr_seed=st.integers(0, 2**63 - 1), unaligned=st.booleans())
@pytest.mark.parametrize("algorithm, eight_bit", [("sgd_momentum", True), ("adam", True), ("adam", False)])
def test_engine_cuda_rounds_like_the_reference_and_the_cpu(algorithm, eight_bit, sizes, seed, sr_seed, unaligned):
    """On the GPU (vector path: full blocks of 16-byte aligned tensors; strided path: tails, and
    every block of a tensor starting one element into its storage), bf16 parameters hold the
    reference's rounding of the GPU's own fp32 result; SGD with momentum, whose update uses only
    correctly rounded operations, gives the CPU's bits exactly (Adam's parameters use the GPU's
    approximate sqrt and division, so only its states match the CPU's)."""
    ids = [3 * i + 1 for i in range(len(sizes))]
    offsets = [1024 * i + (i % 2) * 3 for i in range(len(sizes))]  # odd ones: the vector path's per-element bits
    sr = dict(sr_ids=ids, sr_offsets=offsets, sr_seed=sr_seed)
    cpu_case = engine_case(algorithm, sizes, eight_bit, seed)
    p16, g16, states, absmax, steps, qmaps = cpu_case
    gpu_case = ([p.cuda() for p in p16], [g.cuda() for g in g16], [[t.cuda() for t in k] for k in states],
                [[t.cuda() for t in k] for k in absmax], [t.cuda() for t in steps], [q.cuda() for q in qmaps])
    exact, _, _ = run_engine(algorithm, gpu_case, torch.float32, unaligned)
    rounded, states, absmax = run_engine(algorithm, gpu_case, torch.bfloat16, unaligned, **sr)
    for i, (e, r) in enumerate(zip(exact, rounded)):
        assert same_bits(r, ref.stochastic_round(e, sr_seed, ids[i], cpu_case[4][i].item(), offsets[i])), i
    on_cpu, cpu_states, cpu_absmax = run_engine(algorithm, cpu_case, torch.bfloat16, **sr)
    for a, b in zip(sum(states + absmax, []), sum(cpu_states + cpu_absmax, [])):
        assert torch.equal(a.cpu(), b)
    if algorithm == "sgd_momentum":
        assert all(same_bits(a, b) for a, b in zip(rounded, on_cpu))
