"""DDP and FSDP2 training agree with a single-process run of the same global batch, for the classes a
team moving from one GPU to a node takes: AdamW8bit, PagedAdamW8bit (managed states, a device budget,
host residency), Lion8bit, LAMB8bit, AdamW4bit, PagedAdamW4bit, and AdamW32bit beside them
(tests/distributed_helpers.VARIANTS).

The global batch (32 samples) is cut into one slice per rank, and rank r trains on slice r. Beside the
distributed model every rank keeps a plain copy of it (the reference) with an optimizer of the same
class and settings, on the same device, trained on the whole global batch as one process does it
with gradient accumulation: one backward of loss_r / world per slice, summed in rank order (the mean
loss of the global batch is the mean of the equal slices' mean losses).

Compared at every step (tests/distributed_helpers._node_model: every shard whole blocks):
* The gradients. Both are sums of the same `world` floats g_r / world: each rank's gradient of its
  slice, computed by the same kernels on the same inputs, scaled by 1 / world (DDP multiplies before
  its all-reduce, FSDP2 averages in its reduce-scatter, the reference's backward of loss_r / world
  scales every intermediate by the same power of two: all exact). With 2 ranks the sum is one
  addition, commutative: bit for bit. With more, NCCL's ring (or tree) adds them in another order
  than the reference does; every order of summing n floats x_i is within gamma_{n-1} * sum |x_i| of
  the exact sum (gamma_k = k u / (1 - k u), u = 2^-24), so the two differ by at most
  2 gamma_{world-1} * sum_r |g_r| / world, elementwise (at 8 ranks 8.3e-7 relative to that sum).
* The step: bit for bit. With 2 ranks the reference steps on its own gradient, a whole independent
  run; with more, on the distributed gradient, because an ulp of gradient can move an 8-bit code by a
  whole step of its map or flip Lion's sign, so no tight bound holds for diverging trajectories: the
  gradients are held to the bound above and every step to exactness. DDP replicas update whole
  tensors; FSDP2's shards are whole 256-element (8-bit) and 128-element (4-bit) blocks, updated as
  the unsharded run's blocks.
* LAMB8bit under FSDP2 scales each tensor's update by norms whose float64 sums of squares are
  all-reduced over the shards: its parameters are within one step's bound of
  tests/test_fsdp2._lars_lamb_scenario (2^-23 of the update's largest element plus 2^-24 of the
  parameter's), its unorm_vec within 2^-22 relative, its moments (made before the norms apply) bit
  for bit; the reference then takes the distributed parameters, so each step starts from the same
  point.

On the CPU with gloo at 2 ranks; with nccl, one process per GPU, at 2, 4 and 8 (marked cuda; a world
larger than the GPUs present is skipped).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed_helpers import VARIANTS, _all_equal_across_ranks, _flat_state, _gpus, _launch, _node_model, _optimizer
from test_fsdp2 import _shard

GLOBAL_BATCH, STEPS, U = 32, 4, 2.0**-24


def _slices(i, world, device):
    """Step i's global batch, cut into `world` slices of GLOBAL_BATCH / world samples."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) / 8  # the map to learn
    x = torch.randn(GLOBAL_BATCH, 64, generator=torch.Generator().manual_seed(100 + i))
    y = torch.tanh(x @ w)
    b = GLOBAL_BATCH // world
    return [(x[r * b:(r + 1) * b].contiguous().to(device), y[r * b:(r + 1) * b].contiguous().to(device))
            for r in range(world)]


def _reference_grads(ref, slices, world):
    """The single-process gradient of the global batch, accumulated slice by slice in rank order, and
    sum_r |g_r / world| (the bound's scale)."""
    params = list(ref.parameters())
    total = mags = None
    for x, y in slices:
        g = torch.autograd.grad(F.mse_loss(ref(x), y) / world, params)
        total = list(g) if total is None else [a + b for a, b in zip(total, g)]
        mags = [b.abs() for b in g] if mags is None else [m + b.abs() for m, b in zip(mags, g)]
    return total, mags


def _check_grads(variant, step, mine, ref, mags, world):
    gamma = (world - 1) * U / (1 - (world - 1) * U)
    for j, (a, b, m) in enumerate(zip(mine, ref, mags)):
        if world <= 2:
            assert torch.equal(a, b), (f"{variant} step {step}: gradient {j} differs from the single-process one "
                                       f"by {(a - b).abs().max().item():.3g} (2 ranks: one addition, exact)")
        else:
            excess = ((a - b).abs() - 2 * gamma * m).max().item()
            assert excess <= 0, f"{variant} step {step}: gradient {j} beyond the summation bound by {excess:.3g}"


def _gathered_states(opt) -> dict:
    """(parameter index, key) -> the state as one whole tensor (DTensors gathered), on the CPU."""
    from torch.distributed.tensor import DTensor

    sd = opt.state_dict()
    return {(i, k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for i, st in sd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and k != "absmax_layout"}


def _check_kinds(variant, opt, device):
    """The states are what the class promises: codes for the three weights (not for AdamW32bit), the
    chosen pager."""
    codes = 0 if variant.endswith("32bit") else 3
    assert sum(s["state1"].dtype == torch.uint8 for s in opt.state.values()) == codes, variant
    if device.type == "cuda" and VARIANTS[variant][1] is not None:
        from pagedopt.paging import HostResidentPager
        assert isinstance(opt.pager, HostResidentPager), (variant, type(opt.pager).__name__)


def _ddp_run(rank, world, device, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = _node_model(device)
    start = [p.detach().clone() for p in ref.parameters()]
    ddp = DDP(copy.deepcopy(ref), device_ids=[device.index] if device.type == "cuda" else None)
    opt, opt_ref = _optimizer(variant, list(ddp.parameters())), _optimizer(variant, list(ref.parameters()))
    for i in range(STEPS):
        slices = _slices(i, world, device)
        x, y = slices[rank]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        grads, mags = _reference_grads(ref, slices, world)
        mine = [p.grad for p in ddp.parameters()]
        _check_grads(variant, i, mine, grads, mags, world)
        for q, g, d in zip(ref.parameters(), grads, mine):
            q.grad = g if world <= 2 else d.clone()
        opt.step()
        opt_ref.step()
        for j, (p, q) in enumerate(zip(ddp.parameters(), ref.parameters())):
            assert torch.equal(p, q), f"DDP {variant} step {i}: parameter {j} differs from the single-process run"
    _check_kinds(variant, opt, device)
    opt.settle()
    opt_ref.settle()
    for j, (a, b) in enumerate(zip(_flat_state(opt), _flat_state(opt_ref))):
        assert a.dtype == b.dtype and torch.equal(a, b), f"DDP {variant}: state tensor {j} differs"
    assert all(not torch.equal(p, s) for p, s in zip(ref.parameters(), start)), f"{variant}: nothing trained"
    _all_equal_across_ranks(list(ddp.parameters()) + _flat_state(opt), f"DDP {variant} replicas")


def _fsdp2_run(rank, world, device, variant):
    ref = _node_model(device)
    model = _shard(copy.deepcopy(ref))
    opt, opt_ref = _optimizer(variant, list(model.parameters())), _optimizer(variant, list(ref.parameters()))
    lamb = variant == "LAMB8bit"
    for i in range(STEPS):
        slices = _slices(i, world, device)
        x, y = slices[rank]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        grads, mags = _reference_grads(ref, slices, world)
        mine = [p.grad.full_tensor() for p in model.parameters()]
        _check_grads(variant, i, mine, grads, mags, world)
        before = [q.detach().clone() for q in ref.parameters()]
        for q, g, d in zip(ref.parameters(), grads, mine):
            q.grad = g if world <= 2 else d
        opt.step()
        opt_ref.step()
        for j, (p, q, b) in enumerate(zip(model.parameters(), ref.parameters(), before)):
            full = p.full_tensor()
            if lamb:
                bound = 2.0**-23 * (q - b).abs().max().item() + 2.0**-24 * b.abs().max().item()
                diff = (full - q).abs().max().item()
                assert diff <= bound, f"FSDP2 LAMB8bit step {i}: parameter {j} off by {diff:.3g} > {bound:.3g}"
                with torch.no_grad():
                    q.copy_(full)  # the next step starts where the distributed one is
            else:
                assert torch.equal(full, q), f"FSDP2 {variant} step {i}: parameter {j} differs from the single-process run"
    _check_kinds(variant, opt, device)
    mine, theirs = _gathered_states(opt), _gathered_states(opt_ref)
    assert mine.keys() == theirs.keys(), variant
    for key, b in theirs.items():
        a = mine[key]
        if lamb and key[1] == "unorm_vec":
            assert ((a - b).abs() <= 2.0**-22 * b).all(), (variant, key, a, b)
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"FSDP2 {variant}: state {key} differs"


def _scenario(rank, world, device, wrappers, variants):
    for wrapper in wrappers:
        for variant in variants:
            (_ddp_run if wrapper == "ddp" else _fsdp2_run)(rank, world, device, variant)
            dist.barrier()


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_agreement_gloo(wrapper):
    _launch(_scenario, 2, "gloo", (wrapper,), tuple(VARIANTS))


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_agreement_nccl(world):
    _gpus(world)
    _launch(_scenario, world, "nccl", ("ddp", "fsdp2"), tuple(VARIANTS))
