"""Optimizers on the GPU: the CUDA step agrees with the CPU step (see test_cuda_kernels for the
bound), and paged equals unpaged, bit for bit."""
import gc

import pytest
import torch

import pagedopt

pytestmark = pytest.mark.cuda


def make_params(device, dtype, seed=0, sizes=((300, 70), (5000,), (17,), (4097,), (1,), (64, 256))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_(True) for s in sizes]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))).to(p.dtype).to(
            p.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [pagedopt.AdamW8bit, pagedopt.Adam8bit])
def test_cuda_step_equals_cpu_step(cls, dtype):
    cpu = make_params("cpu", dtype)
    gpu = make_params("cuda", dtype)
    o_cpu = cls(cpu, lr=1e-2, weight_decay=0.1, min_8bit_size=256)
    o_gpu = cls(gpu, lr=1e-2, weight_decay=0.1, min_8bit_size=256)
    for s in range(4):
        set_grads(cpu, s)
        set_grads(gpu, s)
        o_cpu.step()
        o_gpu.step()
    for a, b in zip(cpu, gpu):
        sa, sb = o_cpu.state[a], o_gpu.state[b]
        if sa["state1"].dtype == torch.uint8:
            # our 8-bit kernels share their element math: the moments are computed bit for bit
            # alike, the parameter within one ulp of its dtype + 2^-19 of the update per step
            # (the GPU's approximate sqrt and division). 4 steps: 8 ulp, plus 1e-6 for the updates.
            ulp = 2.0 ** -{torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
            torch.testing.assert_close(b.detach().cpu().double(), a.detach().double(), rtol=8 * ulp, atol=1e-6)
            if cls is pagedopt.AdamW8bit:  # decoupled decay: the moments never see the parameter
                for k in ("state1", "state2", "absmax1", "absmax2"):
                    assert torch.equal(sa[k], sb[k].cpu()), k
            else:  # L2: the parameter's difference enters the next gradient as weight_decay * p
                for k in ("absmax1", "absmax2"):
                    torch.testing.assert_close(sb[k].cpu(), sa[k], rtol=4 * ulp, atol=0)
                for k in ("state1", "state2"):  # codes: at most the neighbouring code, rarely
                    diff = (sb[k].cpu().int() - sa[k].int()).abs()
                    assert diff.max() <= 1, k
                    assert (diff != 0).float().mean() <= 0.02, k
        else:
            # tensors under min_8bit_size use torch's fused Adam, whose CPU and CUDA kernels
            # round differently (the CUDA one contracts to FMA): a few fp32 ulps per step. With
            # half params, a one-ulp difference of p (2^-8 relative for bf16) enters the next
            # L2 gradient as weight_decay * p, so the states then differ by up to ~1e-3 relative.
            if dtype == torch.float32:
                p_tol, s_tol = dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-7)
            else:
                p_tol, s_tol = dict(rtol=1e-2, atol=1e-3), dict(rtol=1e-3, atol=1e-6)
            torch.testing.assert_close(a.detach(), b.detach().cpu(), **p_tol)
            for k in ("state1", "state2"):
                torch.testing.assert_close(sa[k], sb[k].cpu(), **s_tol)


@pytest.mark.parametrize("cls_pair", [(pagedopt.AdamW8bit, pagedopt.PagedAdamW8bit),
                                      (pagedopt.Adam8bit, pagedopt.PagedAdam8bit),
                                      (pagedopt.AdamW, pagedopt.PagedAdamW),
                                      (pagedopt.AdamW32bit, pagedopt.PagedAdamW32bit)])
def test_paged_equals_unpaged_with_page_out_mid_training(cls_pair):
    plain_cls, paged_cls = cls_pair
    a = make_params("cuda", torch.float32, 1)
    b = make_params("cuda", torch.float32, 1)
    oa = plain_cls(a, lr=1e-3, min_8bit_size=256)
    ob = paged_cls(b, lr=1e-3, min_8bit_size=256)
    for s in range(6):
        set_grads(a, s)
        set_grads(b, s)
        oa.step()
        ob.step()
        if s in (1, 4):
            ob.page_out()
            torch.cuda.synchronize()
            stats = ob.paging_stats()
            assert stats.host_bytes > 0 and stats.resident_bytes == 0, stats
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, b):
        for k, v in oa.state[x].items():
            assert torch.equal(v, ob.state[y][k]), k
    moments = [v for s in ob.state.values() for k, v in s.items() if k in ("state1", "state2")]
    assert all(pagedopt.paging.is_managed(v) for v in moments)
    # after a step, every paged tensor (the moments, and the 8-bit states' absmax) is back on the
    # GPU: the stats count exactly their bytes
    paged = [v for s in ob.state.values() for v in s.values()
             if torch.is_tensor(v) and v.is_cuda and pagedopt.paging.is_managed(v)]
    stats = ob.paging_stats()
    assert stats.resident_bytes == sum(v.nbytes for v in paged) and stats.host_bytes == 0, stats


def test_paged_state_dict_stays_paged():
    a = make_params("cuda", torch.float32, 2)
    o = pagedopt.PagedAdamW8bit(a, min_8bit_size=256)
    set_grads(a, 0)
    o.step()
    sd = o.state_dict()
    o2 = pagedopt.PagedAdamW8bit(a, min_8bit_size=256)
    o2.load_state_dict(sd)
    for p in a:
        for k in ("state1", "state2"):
            assert pagedopt.paging.is_managed(o2.state[p][k])
            assert torch.equal(o2.state[p][k], o.state[p][k])


def test_grad_scaler_on_cuda_skips_inf_steps_without_sync():
    params = make_params("cuda", torch.float32, 3)
    opt = pagedopt.AdamW8bit(params, min_8bit_size=256)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    loss = sum((p ** 2).sum() for p in params)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.zero_grad()
    loss = sum((p ** 2).sum() for p in params)
    scaler.scale(loss).backward()
    params[0].grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    for p, b, s in zip(params, before, states):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, s[k]), k


def test_deleting_paged_optimizers_returns_memory():
    params = make_params("cuda", torch.float32, 4, sizes=((1024, 1024),) * 4)
    set_grads(params, 0)
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    o = pagedopt.PagedAdamW8bit(params, min_8bit_size=256)  # warm up driver and allocator
    o.step()
    o.page_out()
    del o
    gc.collect()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    rss0 = rss()
    for i in range(200):
        o = pagedopt.PagedAdamW8bit(params, min_8bit_size=256)
        o.step()
        if i % 2:
            o.page_out()  # half of them end with their states in host memory
        del o
    gc.collect()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    rss1 = rss()
    # each optimizer holds ~8 MiB of states: 1.6 GiB if they leaked; allow some driver slack
    assert free0 - free1 < 64 << 20, (free0 - free1) / 2**20
    assert rss1 - rss0 < 256 << 20, (rss1 - rss0) / 2**20
