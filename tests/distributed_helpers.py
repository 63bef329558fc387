"""What the distributed tests share: the classes they run, a launcher that starts one process per
rank (torch.multiprocessing.spawn, a file store), and comparisons across ranks."""
from __future__ import annotations

import datetime
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pagedopt

CLASSES = ("AdamW8bit", "PagedAdamW8bit", "AdamW32bit")
# the generic engine's families: Lion (one state) and AdEMAMix (two moments stacked in state1)
FAMILY = ("Lion8bit", "AdEMAMix8bit", "AdEMAMix32bit")
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
# LARS and LAMB scale each update by whole-tensor norms, which FSDP2's shards hold only in part
LARS_LAMB = ("LARS8bit", "LAMB8bit", "LAMB32bit")
HYPERS = {"Lion8bit": dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05),
          "LARS8bit": dict(lr=0.05, momentum=0.9), "LAMB8bit": dict(lr=1e-2), "LAMB32bit": dict(lr=1e-2),
          "AdEMAMix8bit": dict(lr=1e-2, betas=(0.9, 0.99, 0.999), eps=1e-8, weight_decay=0.05),
          "AdEMAMix32bit": dict(lr=1e-2, betas=(0.9, 0.99, 0.999), eps=1e-8, weight_decay=0.05)}


def _local_state_shape(name: str, local: torch.Tensor, codes: bool = True) -> tuple:
    """state1's shape for a local shard: AdEMAMix stacks its two first moments; 4-bit codes
    (``codes``: not a small tensor's 32-bit state) halve an even last dimension (two a byte)."""
    shape = tuple(local.shape)
    if "4bit" in name and codes:
        shape = shape[:-1] + (shape[-1] // 2,)
    return ((2,) if "AdEMAMix" in name else ()) + shape


def _entry(rank: int, world: int, backend: str, init_method: str, scenario, args) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores; also one fixed CPU reduction order
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    # a collective that waits longer than this on a rank that died or hangs fails instead of waiting
    # for the stage's timeout (NCCL's default is 10 minutes, gloo's 30)
    timeout = datetime.timedelta(seconds=float(os.environ.get("PAGEDOPT_DIST_TIMEOUT_S", "300")))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    try:
        scenario(rank, world, device, *args)
        dist.barrier()  # no rank tears down while another is still in a collective (gloo aborts then)
    finally:
        dist.destroy_process_group()
    # The scenario passed. Leave without the interpreter's teardown: a C++ thread of the process group
    # or checkpoint machinery still joinable at static destruction aborts the process ("terminate
    # called without an active exception", seen once in ~20 CI runs of the DCP README scenario), which
    # would report a passed scenario as a crash. A failed scenario raised above and is reported by
    # mp.spawn as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(scenario, world: int, backend: str, *args) -> None:
    # a file store in a fresh directory: no TCP port that another process could take between
    # choosing it and binding it (a free-port probe raced with a concurrent run once)
    store = os.path.join(tempfile.mkdtemp(prefix="pagedopt-dist-"), "store")
    mp.spawn(_entry, args=(world, backend, f"file://{store}", scenario, args), nprocs=world, join=True)


def _make(name: str, params, **kw):
    import warnings

    with warnings.catch_warnings():  # Paged* on the CPU (or without concurrent managed access) warn: unpaged
        warnings.simplefilter("ignore")
        return getattr(pagedopt, name)(params, **HYPERS.get(name, HYPER), **kw)


# The classes (and pagers) of the multi-GPU agreement and resharding tests, by name: (class,
# set_pager settings; "budget": a device_budget of about half the 8-bit codes' bytes)
VARIANTS = {
    "AdamW8bit": ("AdamW8bit", None),
    "PagedAdamW8bit": ("PagedAdamW8bit", None),  # managed memory, the default
    "PagedAdamW8bit-budget": ("PagedAdamW8bit", "budget"),
    "PagedAdamW8bit-host": ("PagedAdamW8bit", {"residency": "host"}),
    "Lion8bit": ("Lion8bit", None),
    "LAMB8bit": ("LAMB8bit", None),
    "AdamW4bit": ("AdamW4bit", None),
    "PagedAdamW4bit": ("PagedAdamW4bit", None),
    "AdamW32bit": ("AdamW32bit", None),
}


def _optimizer(variant: str, params: list):
    """A VARIANTS optimizer over ``params`` (a list), its pager set before the first step."""
    from pagedopt.optim import sharding

    cls, pager = VARIANTS[variant]
    opt = _make(cls, params)
    if pager == "budget":  # 2 bytes of codes a parameter: about half of them stay, the rest streams
        opt.set_pager(device_budget=sum(sharding.local(p).numel() for p in params))
    elif pager:
        opt.set_pager(**pager)
    return opt


def _flat_state(opt) -> list[torch.Tensor]:
    """Every state tensor of ``opt`` (local ones for sharded parameters), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state[p].items()):
                if isinstance(v, torch.Tensor):
                    out.append(v.detach().cpu().clone())
    return out


def _all_equal_across_ranks(tensors: list[torch.Tensor], what: str) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [t.detach().cpu() for t in tensors])
    for r, theirs in enumerate(gathered[1:], 1):
        assert len(theirs) == len(tensors), what
        for i, (a, b) in enumerate(zip(gathered[0], theirs)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: tensor {i} differs between rank 0 and {r}"


def _gpus(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


def _ddp_model(device):
    torch.manual_seed(0)
    # 96 * 64 = 6144 weights >= min_8bit_size (4096): 8-bit states, 24 blocks; the biases keep 32-bit.
    return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(device)


def _node_model(device):
    torch.manual_seed(3)
    # Whole blocks at 1, 2, 4 and 8 ranks: the weights (128, 64), (128, 128), (128, 128) (8192 and
    # 16384 elements, >= min_8bit_size: 8-bit or 4-bit states) split by rows (FSDP2's Shard(0)) into
    # 1024 and 2048 elements at 8 ranks, whole 256-element (8-bit) and 128-element (4-bit) blocks;
    # the biases (128,) keep 32-bit states, in shards of 16 floats at 8 ranks (torch's fused CPU Adam
    # rounds a shard that is not a multiple of its 16-float vectors differently: test_fsdp2.py).
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128)).to(device)


def _ddp_steps(ddp, opt, rank, device, first, count):
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * i + rank)  # each rank its own random batch
        x = torch.randn(16, 96, generator=g).to(device)
        y = torch.randn(16, 8, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
