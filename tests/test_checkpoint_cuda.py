"""Checkpoints on the GPU, as a Trainer writes them: torch.save of state_dict() for every class,
param dtype and a range of tensor sizes (the paged 8-bit states once failed to save: their codes
and absmax shared one managed slab), torch.load(weights_only=True), load into a new optimizer,
and the same next steps, bit for bit."""
import io

import pytest
import torch

import pagedopt
from pagedopt import paging

ALL_CLASSES = [pagedopt.Adam, pagedopt.AdamW, pagedopt.Adam8bit, pagedopt.AdamW8bit, pagedopt.Adam32bit,
               pagedopt.AdamW32bit, pagedopt.PagedAdam, pagedopt.PagedAdamW, pagedopt.PagedAdam8bit,
               pagedopt.PagedAdamW8bit, pagedopt.PagedAdam32bit, pagedopt.PagedAdamW32bit, pagedopt.Adam4bit,
               pagedopt.AdamW4bit, pagedopt.PagedAdam4bit, pagedopt.PagedAdamW4bit]
# 32K to 4M elements as in the report, plus one below min_8bit_size (32-bit state) and an odd size
SIZES = [(256, 128), (1000, 1000), (2048, 2048), 1000, 70001]

pytestmark = pytest.mark.cuda


def make(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=g, device="cuda").to(dtype).requires_grad_(True) for s in SIZES]


def step(opt, params, seed):
    g = torch.Generator(device="cuda").manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device="cuda").to(p.dtype)
    opt.step()


def storages_by_dtype(sd):
    """(data_ptr range, dtype) of every state tensor's storage."""
    out = []
    for s in sd["state"].values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                st = v.untyped_storage()
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes(), v.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_save_load_resume_on_cuda(cls, dtype):
    kwargs = {} if "bit" in cls.__name__ else {"optim_bits": 8}
    params = make(dtype)
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    opt = cls(params, **kwargs)
    for i in range(2):
        step(opt, params, i)
    sd = opt.state_dict()
    ranges = storages_by_dtype(sd)
    for a0, a1, da in ranges:  # no storage is viewed as two dtypes
        for b0, b1, db in ranges:
            assert da == db or a1 <= b0 or b1 <= a0
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    with torch.no_grad():
        for t, p in zip(twin, params):
            t.copy_(p)
    opt2 = cls(twin, **kwargs)
    opt2.load_state_dict(loaded)
    if opt.is_paged:
        for p in twin:
            for k in ("state1", "state2"):
                assert paging.is_managed(opt2.state[p][k]), k
    for i in range(2, 4):
        step(opt, params, i)
        step(opt2, twin, i)
    for p, t in zip(params, twin):
        assert torch.equal(p, t)
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[t][k]), k


@pytest.mark.parametrize("cls", [pagedopt.PagedAdamW8bit, pagedopt.AdamW8bit, pagedopt.PagedAdamW32bit])
def test_cuda_checkpoint_loads_on_cpu_and_back(cls):
    params = make(torch.float32)
    opt = cls(params)
    step(opt, params, 0)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    on_cpu = torch.load(buf, weights_only=True, map_location="cpu")
    cpu_params = [p.detach().cpu().requires_grad_(True) for p in params]
    cpu_opt = cls(cpu_params)
    cpu_opt.load_state_dict(on_cpu)
    for p, c in zip(params, cpu_params):
        for k, v in opt.state[p].items():
            assert torch.equal(v.cpu(), cpu_opt.state[c][k]), k
    back = [p.detach().clone().requires_grad_(True) for p in params]
    opt_back = cls(back)
    opt_back.load_state_dict(cpu_opt.state_dict())
    step(opt, params, 1)
    step(opt_back, back, 1)
    for p, b in zip(params, back):
        assert torch.equal(p, b)
