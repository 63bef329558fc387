"""A step is a transaction: running out of memory while a first step makes the states leaves the
optimizer as it was, and the same step repeated once memory is free gives, bit for bit, the result
of a run that never failed. Also two behaviours the step pipeline must keep that no other test pins:
Lion's zero update where the interpolated direction is exactly zero (embedding rows no token
touched) and the counters of a plan whose parameters do not all have tensor step counters."""
import copy

import os

import pytest
import torch

import pagedopt

# (class, constructor kwargs): every kernel kind of the pipeline (engine 8-bit and 32-bit, torch's
# fused 32-bit, stateless SGD, a norm pass first, stacked moments)
CASES = [
    (pagedopt.AdamW8bit, {}),
    (pagedopt.AdamW32bit, {}),
    (pagedopt.Lion8bit, {}),
    (pagedopt.AdEMAMix8bit, {}),
    (pagedopt.SGD8bit, {"lr": 0.01, "momentum": 0.9}),
    (pagedopt.LAMB8bit, {}),
    (pagedopt.PagedAdamW8bit, {}),
]


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # two 8-bit-sized tensors and one small (32-bit states): several allocations per parameter
    shapes = [(64, 80), (100,), (4096 + 7,)]
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _snapshot(opt, params) -> tuple:
    states = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
              for i, p in enumerate(params) if p in opt.state}
    return [p.detach().clone() for p in params], states


class _OutOfMemoryAt:
    """An allocator for the optimizer's state tensors that raises torch.OutOfMemoryError at its
    ``n``-th call (as the CUDA caching allocator does when a state does not fit)."""

    def __init__(self, real, n: int):
        self.real, self.n, self.calls = real, n, 0

    def __call__(self, shape, dtype, device):
        self.calls += 1
        if self.calls == self.n:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return self.real(shape, dtype, device)


@pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
@pytest.mark.parametrize("cls,kwargs", CASES, ids=[c.__name__ for c, _ in CASES])
@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_running_out_of_memory_while_making_states_changes_nothing(cls, kwargs, fail_at):
    params = _params(0)
    opt = cls(params, **kwargs)
    twin_params = [p.detach().clone().requires_grad_(True) for p in params]
    twin = cls(twin_params, **kwargs)

    _grads(params, 0)
    before_params, before_states = _snapshot(opt, params)
    injected = _OutOfMemoryAt(opt.state_zeros, fail_at)
    opt.state_zeros = injected
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert injected.calls == fail_at  # the failure happened where it was injected
    del opt.state_zeros  # memory is free again
    after_params, after_states = _snapshot(opt, params)
    for b, a in zip(before_params, after_params):
        assert torch.equal(a, b)  # no parameter was updated
    assert after_states == before_states == {}  # no half-made state left behind
    assert all(len(opt.state[p]) == 0 for p in params)
    opt.state_dict()  # a checkpoint can still be written

    # the same step repeated, then one more: bit for bit the run that never failed
    for step in range(2):
        if step:
            _grads(params, step)
        _grads(twin_params, step)
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    for p, q in zip(params, twin_params):
        s, t = opt.state[p], twin.state[q]
        assert s.keys() == t.keys()
        for k in s:
            if isinstance(s[k], torch.Tensor):
                assert torch.equal(s[k], t[k]), k


@pytest.mark.parametrize("cls", [pagedopt.Lion8bit, pagedopt.Lion32bit, pagedopt.Lion])
def test_lion_leaves_rows_alone_whose_interpolated_update_is_exactly_zero(cls):
    """An embedding's rows that no token touched have zero gradient and, on the first step, zero
    momentum: Lion's direction sign(beta1 * m + (1 - beta1) * g) is sign(0) = 0 there, so with no
    weight decay those rows must stay bit for bit as they were (a sign taken as +-1 would move them
    by lr), while every touched row moves by exactly lr per element (|sign| = 1)."""
    torch.manual_seed(0)
    emb = torch.randn(64, 80).requires_grad_(True)  # 5120 elements: 8-bit states for Lion8bit
    lr = 1e-3
    opt = cls([emb], lr=lr, weight_decay=0.0)
    touched = torch.zeros(64, dtype=torch.bool)
    touched[::3] = True
    for step in range(3):
        before = emb.detach().clone()
        grad = torch.randn(64, 80) + 0.5  # no exact zeros in touched rows
        grad[~touched] = 0.0
        emb.grad = grad
        opt.step()
        assert torch.equal(emb.detach()[~touched], before[~touched]), f"step {step}: untouched rows moved"
        # the touched rows moved by lr per element: |p' - p| = lr up to float32 rounding of p - lr
        # (one rounding of a value |p| < 8: at most 2**-21, far below lr = 1e-3)
        moved = (emb.detach()[touched] - before[touched]).abs()
        assert torch.allclose(moved, torch.full_like(moved, lr), rtol=0, atol=2 ** -20), f"step {step}"
        if step == 0:
            # the rows stay untouched in later steps too: their momentum stayed exactly zero
            state1 = opt.state[emb]["state1"]
            if state1.dtype == torch.float32:
                assert torch.count_nonzero(state1[~touched]) == 0


@pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
def test_a_plan_over_counters_of_which_only_some_are_float32_tensors_counts_each():
    """The step counters of a plan are shared (one tensor a device) only when every counter is a
    float32 scalar tensor there; a counter set by hand to another kind (a float64 tensor) keeps the
    plan on separate counters, and each still counts its own steps: the parameters reach the same
    values as in a run whose counters were never touched."""
    params = _params(1)
    twin_params = [p.detach().clone().requires_grad_(True) for p in params]
    opt, twin = pagedopt.AdamW8bit(params), pagedopt.AdamW8bit(twin_params)
    for step in range(3):
        _grads(params, step)
        _grads(twin_params, step)
        opt.step()
        twin.step()
        if step == 0:
            # replaced by hand by a tensor of another dtype holding the same count
            opt.state[params[1]]["step"] = torch.tensor(1.0, dtype=torch.float64)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert [float(opt.state[p]["step"]) for p in params] == [3.0, 3.0, 3.0]
    assert opt.state[params[1]]["step"].dtype == torch.float64  # kept as the user set it
    assert opt.state[params[0]]["step"].dtype == opt.state[params[2]]["step"].dtype == torch.float32


@pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
def test_out_of_memory_for_the_device_buffer_changes_nothing(monkeypatch):
    """Host-resident states: a step whose device buffer cannot be allocated (the buffer is made at
    the first streamed step, e.g. after the states were loaded from a checkpoint) raises
    torch.OutOfMemoryError before any counter or parameter changes; once memory is free the same
    step gives, bit for bit, the result of a run that never failed. Two buckets (fp32 and bf16
    parameters), so that a buffer made at the first bucket's chunks would follow the counters."""
    from pagedopt.paging import HostResidentPager

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(64, 80, generator=g).requires_grad_(True),
                  torch.randn(5000, generator=g).to(torch.bfloat16).requires_grad_(True)]
        opt = pagedopt.PagedAdamW8bit(params, lr=1e-2, min_8bit_size=1024)
        opt.set_pager(residency="host", device_buffer=64 << 10)
        return params, opt

    def grads(params, step):
        g = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    ref_params, ref = make(0)
    params, opt = make(0)
    for s in range(2):
        for group in (ref_params, params):
            grads(group, s)
        ref.step()
        opt.step()
    # a copy of the optimizer: same states, a new pager whose buffer does not exist yet
    opt = copy.deepcopy(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    for group in (ref_params, params):
        grads(group, 2)
    before = _snapshot(opt, params)
    real = HostResidentPager._buffer

    def no_memory(self, device):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    monkeypatch.setattr(HostResidentPager, "_buffer", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    after = _snapshot(opt, params)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    for i, s in before[1].items():
        for k, v in s.items():
            assert torch.equal(v, after[1][i][k]) if isinstance(v, torch.Tensor) else v == after[1][i][k], k
    monkeypatch.setattr(HostResidentPager, "_buffer", real)
    opt.step()
    ref.step()
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


# (class, kwargs, parameter dtype, non-contiguous): the steps that allocate temporaries: torch's
# fused 32-bit kernel on fp32 copies of bf16 parameters, contiguous copies of a transposed
# parameter, plain SGD's fp32 values, a norm pass
TEMPORARIES = [
    (pagedopt.AdamW32bit, {}, torch.bfloat16, False),
    (pagedopt.AdamW8bit, {}, torch.float32, True),
    (pagedopt.SGD, {"lr": 0.01, "momentum": 0.0}, torch.float32, False),
    (pagedopt.LAMB8bit, {}, torch.float32, True),
    (pagedopt.PagedAdamW4bit, {}, torch.float32, True),
]


def _temporaries_case(cls, kwargs, dtype, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(64, 80, generator=g).to(dtype), torch.randn(5000, generator=g).to(dtype)]
    if transposed:
        params[0] = params[0].t()
    params = [p.requires_grad_(True) for p in params]
    return params, cls(params, **{"lr": 1e-2, "min_8bit_size": 1024, **kwargs})


@pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
@pytest.mark.parametrize("cls,kwargs,dtype,transposed", TEMPORARIES, ids=[c.__name__ for c, *_ in TEMPORARIES])
def test_out_of_memory_for_a_steps_temporaries_changes_nothing(cls, kwargs, dtype, transposed, monkeypatch):
    """A step that allocates temporaries makes sure of their memory (kernels.reserve_workspace)
    before any counter, state or parameter changes: out of memory there raises and changes
    nothing, and the repeated step is bit for bit the uninterrupted one. The second step (states
    made) fails; on the CPU the reservation is where a GPU's would run out."""
    from pagedopt.optim import kernels

    def grads(params, step):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    ref_params, ref = _temporaries_case(cls, kwargs, dtype, transposed, 0)
    params, opt = _temporaries_case(cls, kwargs, dtype, transposed, 0)
    for s in range(3):
        grads(ref_params, s)
        ref.step()
    grads(params, 0)
    opt.step()
    asked = []
    real = kernels.reserve_workspace

    def fail(device, nbytes):
        asked.append(nbytes)
        if nbytes > 0:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        real(device, nbytes)

    monkeypatch.setattr(kernels, "reserve_workspace", fail)
    grads(params, 1)
    before = _snapshot(opt, params)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert max(asked) > 0
    after = _snapshot(opt, params)
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for i in before[1]:
        for k, v in before[1][i].items():
            assert (torch.equal(v, after[1][i][k]) if isinstance(v, torch.Tensor) else v == after[1][i][k]), (i, k)
    monkeypatch.setattr(kernels, "reserve_workspace", real)
    opt.step()
    grads(params, 2)
    opt.step()
    for p, q in zip(ref_params, params):
        assert torch.equal(p, q)


@pytest.mark.cuda
@pytest.mark.parametrize("cls,kwargs,dtype,transposed", TEMPORARIES, ids=[c.__name__ for c, *_ in TEMPORARIES])
def test_a_steps_temporaries_fit_the_reserved_workspace(cls, kwargs, dtype, transposed):
    """On the GPU, what a step allocates beyond what was allocated before it is never more than
    the workspace it reserved (the reservation itself is such an allocation): an estimate below the
    real temporaries would let a step run out of memory after its counters moved."""
    from pagedopt.optim import kernels

    params, opt = _temporaries_case(cls, kwargs, dtype, transposed, 0)
    params = [torch.nn.Parameter(p.detach().cuda()) if not transposed or i else
              torch.nn.Parameter(p.detach().t().contiguous().cuda().t()) for i, p in enumerate(params)]
    opt = cls(params, **{"lr": 1e-2, "min_8bit_size": 1024, **kwargs})
    reserved = []
    real = kernels.reserve_workspace
    kernels.reserve_workspace = lambda device, nbytes: (reserved.append(nbytes), real(device, nbytes))[1]
    try:
        for s in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # requested bytes: what the step asked the caching allocator for (its allocated bytes
            # count whole cached blocks it did not split, up to 1 MiB more, by what the cache holds)
            base = torch.cuda.memory_stats()["requested_bytes.all.current"]
            opt.step()
            torch.cuda.synchronize()
            if s == 1:  # states made in the first step
                peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
                # no slack: the reservation is itself such a request, and the estimate already
                # includes the allocator's rounding of the engine's allocations
                assert peak <= max(reserved[-1:] or [0]), (peak, reserved[-1:])
    finally:
        kernels.reserve_workspace = real


def test_the_engines_own_temporaries_are_those_the_cuda_sources_bound():
    """kernels.ENGINE_BYTES_PER_TENSOR is the bound the CUDA engine's static_assert checks its
    per-tensor allocations against, and CODE_TABLE_BYTES the size of its search table (8192
    uint32 entries: kBucketEntries = 2 * kNegOffset), CODE_TABLE4_BYTES the 4-bit one's (8196)."""
    import re

    from pagedopt.optim import kernels

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda")
    step = open(os.path.join(root, "quantized_step.cu")).read()
    bound = re.search(r"sizeof\(uint64_t\) <= (\d+),\s*\"raise ENGINE_BYTES_PER_TENSOR", step)
    assert bound is not None and int(bound.group(1)) == kernels.ENGINE_BYTES_PER_TENSOR
    table = open(os.path.join(root, "code_table.cuh")).read()
    neg = re.search(r"constexpr uint32_t kNegOffset = (\d+);", table)
    assert "kBucketEntries = 2 * kNegOffset;" in table and "uint32_t entry[kBucketEntries];" in table
    assert 2 * int(neg.group(1)) * 4 == kernels.CODE_TABLE_BYTES
    # the 4-bit tables (code_table4.cuh: kBucketEntries4 = kMinusZero4 + 4, kMinusZero4 = 2 * kNegOffset4)
    table4 = open(os.path.join(root, "code_table4.cuh")).read()
    neg4 = re.search(r"constexpr uint32_t kNegOffset4 = (\d+);", table4)
    assert "kMinusZero4 = 2 * kNegOffset4;" in table4 and "kBucketEntries4 = kMinusZero4 + 4;" in table4
    assert "uint32_t entry[kBucketEntries4];" in table4
    assert (2 * int(neg4.group(1)) + 4) * 4 == kernels.CODE_TABLE4_BYTES
    assert "sizeof(CodeTable) == 8192 * 4 && sizeof(CodeTable4) == 8196 * 4" in step
