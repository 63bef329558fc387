"""The 32-bit Adam path on 16-bit parameters runs torch's fused fp32 kernel on fp32 copies of the
parameters and gradients, a run of at most FP32_COPY_NUMEL elements at a time (tensors cut into
flat ranges), so that the copies never cost more than a few MiB. Cutting must not change the
result: the update is elementwise."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pagedopt
from pagedopt.optim import kernels as kernels_module
from pagedopt.optim.kernels import flat_runs


@given(numels=st.lists(st.integers(0, 50), max_size=8), align=st.integers(1, 8), times=st.integers(1, 6))
def test_flat_runs_cover_every_element_once_in_order(numels, align, times):
    limit = align * times
    runs = flat_runs(numels, limit, align)
    covered = [(i, k) for run in runs for i, a, b in run for k in range(a, b)]
    assert covered == [(i, k) for i, n in enumerate(numels) for k in range(n)]
    sizes = [sum(b - a for _, a, b in run) for run in runs]
    assert all(0 < size <= limit for size in sizes)
    assert all(size > limit - align for size in sizes[:-1])  # a run closes only when nearly full
    assert all(b > a for run in runs for _, a, b in run)  # no empty ranges
    assert all(a % align == 0 for run in runs for _, a, _ in run)  # cuts at multiples of align
    with pytest.raises(ValueError, match="multiple of align"):
        flat_runs(numels, limit + 1, align + 1) if (limit + 1) % (align + 1) else flat_runs(numels, 0, align)


def _run(dtype, limit, steps=3, found_inf_at=None):
    with pytest.MonkeyPatch.context() as mp:
        return _steps(mp, dtype, limit, steps, found_inf_at)


def _steps(mp, dtype, limit, steps, found_inf_at):
    mp.setattr(kernels_module, "FP32_COPY_NUMEL", limit)  # the module's FP32_COPY_ALIGN (1024) stays
    calls = []
    fused = torch._fused_adamw_

    def counting(params, *args, **kw):
        calls.append(sum(p.numel() for p in params))
        return fused(params, *args, **kw)

    mp.setattr(torch, "_fused_adamw_", counting)
    gen = torch.Generator().manual_seed(3)
    shapes = [(37, 111), (5,), (0,), (3000,), (2, 3)]
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]
    opt = pagedopt.AdamW32bit(params, lr=1e-2, weight_decay=0.1)
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if t == found_inf_at:
            opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
        opt.step()
        if t == found_inf_at:
            del opt.grad_scale, opt.found_inf
    return params, opt, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_of_fp32_copies_give_the_same_step(dtype):
    """Runs of at most 2048 elements (7118 elements: the 4107 and the 3000 cut at multiples of 1024)
    against one run of all: parameters and states bit for bit, a skipped (found_inf) step included."""
    whole, opt_whole, calls_whole = _run(dtype, 1 << 30, found_inf_at=1)
    cut, opt_cut, calls_cut = _run(dtype, 2048, found_inf_at=1)
    assert calls_whole == [7118] * 3
    # runs: 2048 | 2048 | the last 11 + 5 + 1024 of the 3000 (room for no second 1024) | 1976 + 6
    assert calls_cut == [2048, 2048, 11 + 5 + 1024, 1976 + 6] * 3  # every copy within the limit
    for p, q in zip(whole, cut):
        assert torch.equal(p, q)
        for k in ("state1", "state2", "step"):
            assert torch.equal(opt_whole.state[p][k], opt_cut.state[q][k]), k
    assert all(float(opt_cut.state[q]["step"]) == 2.0 for q in cut)  # the found_inf step did not count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_copies_take_a_few_ops_a_run_not_a_few_a_tensor(dtype):
    """The fp32 copies of a run are filled and written back by one _foreach_copy_ each: the torch
    calls a step makes from Python (counted by a TorchFunctionMode; the metadata reads ``numel``,
    ``is_contiguous`` and attribute ``__get__`` aside, which launch nothing) are as many with 64 tensors as with 8,
    where a copy per tensor (``.float()`` of each parameter and gradient, ``copy_`` back) would add
    three a tensor."""
    from collections import Counter

    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    def calls(n):
        gen = torch.Generator().manual_seed(5)
        params = [torch.randn(50, generator=gen).to(dtype).requires_grad_(True) for _ in range(n)]
        opt = pagedopt.AdamW32bit(params, lr=1e-2)
        for p in params:
            p.grad = torch.randn(50, generator=gen).to(dtype)
        opt.step()  # the states made
        with Calls() as mode:
            opt.step()
        assert mode.names["_fused_adamw_"] == 1
        return {k: v for k, v in mode.names.items() if k not in ("numel", "is_contiguous", "__get__")}

    assert calls(8) == calls(64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_skipped_step_changes_nothing(dtype):
    """GradScaler's found_inf = 1 on 16-bit parameters with 32-bit states: parameters and states
    bit for bit as they were, the step counter not advanced (the fp32 copies' write-back then
    writes each parameter's own value back)."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in [(37, 111), (5,), (3000,)]]
    opt = pagedopt.AdamW32bit(params, lr=1e-2, weight_decay=0.1)
    for t in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if t == 2:
            before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
            opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
        opt.step()
    for p, (value, state) in zip(params, before):
        assert torch.equal(p.detach(), value)
        for k, v in state.items():
            assert torch.equal(opt.state[p][k], v), k
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_copies_take_eight_bytes_an_element_on_the_gpu(dtype):
    """A step of 16-bit parameters with 32-bit states allocates the fp32 copies of the parameters
    and gradients and nothing more: at most 8 bytes an element (3.2 MB for these 400,000 elements;
    the caching allocator rounds each of the two buffers up to 2 MiB, so 4 MiB is the bound) and at
    least the parameters' copy (1.6 MB: the buffers are made, not skipped)."""
    torch.manual_seed(0)
    params = [torch.randn(400, 1000, device="cuda").to(dtype).requires_grad_(True)]
    opt = pagedopt.AdamW32bit(params, lr=1e-2)
    for _ in range(2):  # the first step makes the states
        params[0].grad = torch.randn_like(params[0])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert 1_600_000 <= peak <= 4 << 20, peak
