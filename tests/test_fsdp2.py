"""pagedopt under FSDP2 (fully_shard, DTensor parameters), and the README's distributed snippets.

Every case runs in a world of processes started by torch.multiprocessing.spawn (one per rank,
tests/distributed_helpers.py): on the CPU with gloo, and with nccl, one process per GPU, in the
tests marked cuda. A worker's failed assertion fails the test (spawn re-raises it in the parent).

Tolerances: none, except LARS/LAMB's (derived in _lars_lamb_scenario). Every other comparison is
bit for bit (torch.equal): an FSDP2 run whose shards are whole 256-element blocks computes what an
unsharded run computes; a reloaded state is a copy of the saved one.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import (CLASSES, FAMILY, LARS_LAMB, _all_equal_across_ranks, _ddp_model, _ddp_steps,
                                 _flat_state, _gpus, _launch, _local_state_shape, _make)
from pagedopt.optim.base import optimizer_state_bytes


# ----------------------------------------------------------------------------------------- FSDP2
def _aligned_model(device):
    torch.manual_seed(1)
    # With 2 ranks (and 1), every parameter with 8-bit states splits into shards of whole 256-element
    # blocks: (64, 128) -> 32 rows * 128 = 4096 = 16 blocks per rank; (128, 64) -> 64 * 64 = 4096;
    # (32, 128) -> 2048 = 8 blocks. The biases (64, 128, 32) keep 32-bit states, whose update is
    # elementwise, but torch's fused CPU Adam computes whole vectors (AVX-512: 16 floats) with vector
    # code and a remainder with scalar code, which rounds differently (a bias of 8 split 4 + 4 differs
    # from the whole in the last bit after a few steps, in 16 of 300 random trials): so every shard of
    # a 32-bit state is a multiple of 16 elements too (32, 64, 16), and the whole run is bit-identical.
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 32)).to(device)


def _uneven_model(device):
    torch.manual_seed(2)
    # With min_8bit_size=0 every tensor is 8-bit, and with 2 ranks no shard is a whole number of
    # blocks: (300, 24) -> 150 * 24 = 3600 elements (14.06 blocks); (3, 300) -> 2 rows (600, 3 blocks)
    # and 1 row (300, 2 blocks), so the absmax of rank 1 is padded; (1, 3) and the last bias leave
    # rank 1 an empty shard.
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 1)).to(device)


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _batch(i, n_in, n_out, device):
    # The same batch on every rank, so that the FSDP run and the one-process reference see the same
    # data; what each rank's loss counts for is _loss_weight's.
    w = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(5)) / n_in ** 0.5  # the map to learn
    x = torch.randn(32, n_in, generator=torch.Generator().manual_seed(7 + i))
    return x.to(device), torch.tanh(x @ w).to(device)


def _loss_weight(model) -> float:
    """What this rank's loss counts for. Under FSDP2 only rank 0's loss counts, scaled by the world
    size (a power of two: the scaling is exact): FSDP2 averages the ranks' gradients, and
    (world * g + 0 + ... + 0) / world is g exactly in any order of summation, so a sharded run at any
    world size computes the one-process gradient of the same batch. Averaging the ranks' equal
    gradients instead is exact for 2 and 4 ranks only: a sequential float32 sum of 8 equal values
    differs from 8 times the value in 44% of random cases (measured on 10^7 normal values), and NCCL's
    ring sums in sequence. A rank whose gradient FSDP2 failed to reduce would also keep its own
    (zero) gradient here, and differ. An unsharded model (the reference) counts 1."""
    from torch.distributed.tensor import DTensor

    if not isinstance(next(model.parameters()), DTensor):
        return 1.0
    return float(dist.get_world_size()) if dist.get_rank() == 0 else 0.0


def _fsdp_steps(model, opt, first, count, n_in, n_out, device):
    losses = []
    weight = _loss_weight(model)
    for i in range(first, first + count):
        x, y = _batch(i, n_in, n_out, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        (loss * weight).backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_states(opt, model) -> list[torch.Tensor]:
    """Every state of ``opt`` in its state dict's (global) form, gathered: DTensors -> full tensors."""
    from torch.distributed.tensor import DTensor

    sd = opt.state_dict()
    out = []
    for key in sorted(sd["state"]):
        for k, v in sorted(sd["state"][key].items()):
            if isinstance(v, torch.Tensor):
                out.append((v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu())
    return out


def _expected_state_bytes(opt_ref, world):
    """Per-rank state bytes of an evenly sharded optimizer: every shard tensor 1/world of the
    reference's, the float32 step scalars (one per parameter, replicated) whole."""
    steps = 4 * sum(1 for s in opt_ref.state.values())
    return (optimizer_state_bytes(opt_ref) - steps) // world + steps


def _fsdp_aligned(rank, world, device, name, report):
    from torch.distributed.tensor import DTensor

    reference = _aligned_model(device)
    model = _shard(copy.deepcopy(reference))
    opt, opt_ref = _make(name, model.parameters()), _make(name, reference.parameters())
    _fsdp_steps(model, opt, 0, 5, 128, 32, device)
    _fsdp_steps(reference, opt_ref, 0, 5, 128, 32, device)

    # Bit-identical to the unsharded run: FSDP2 all-gathers the exact parameters, so forward and
    # backward compute the reference's gradients on the same batch, and the reduce-scatter's average
    # is exactly rank 0's gradient (_loss_weight). Each rank's shard is a contiguous run of whole 256-element blocks of the
    # flattened parameter (Shard(0) of a row-major tensor, 4096 elements), so its blocks are blocks of
    # the reference, and the 8-bit kernel treats each block alone (the update is elementwise; absmax
    # and requantization are per block): same codes, same absmax, same parameters. The 32-bit states
    # go through torch's fused kernel, elementwise, on the local shard.
    for p, q in zip(model.parameters(), reference.parameters()):
        assert isinstance(p, DTensor)
        assert torch.equal(p.full_tensor(), q), f"{name}: FSDP2 parameters differ from the unsharded run {tuple(q.shape)}"
    mine, theirs = _full_states(opt, model), _full_states(opt_ref, reference)
    assert len(mine) == len(theirs) + len(opt_ref.state)
    mine = [t for t in mine if t.dtype != torch.int64]  # absmax_layout, one per parameter with states
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: state tensor {i} differs from the unsharded run"

    # States live on the local shard: each rank holds 1/world of every state tensor.
    for p in model.parameters():
        s = opt.state[p]
        assert not isinstance(s["state1"], DTensor) and s["state1"].shape == _local_state_shape(
            name, p.to_local(), s["state1"].dtype == torch.uint8)
    eight = sum(1 for s in opt.state.values() if s["state1"].dtype == torch.uint8)
    assert eight == (0 if name.endswith("32bit") else 3), name
    mine_bytes, full_bytes = optimizer_state_bytes(opt), optimizer_state_bytes(opt_ref)
    assert mine_bytes == _expected_state_bytes(opt_ref, world), (name, mine_bytes, full_bytes)
    report[name] = (mine_bytes, full_bytes)


def _fsdp_uneven(rank, world, device, name):
    from pagedopt.quant import STATE_BLOCK_SIZE

    model = _shard(_uneven_model(device))
    opt = _make(name, model.parameters(), min_8bit_size=0)
    losses = _fsdp_steps(model, opt, 0, 40, 24, 1, device)
    for p in model.parameters():
        s, local = opt.state[p], p.to_local()
        assert s["state1"].shape == _local_state_shape(name, local)
        if not name.endswith("32bit"):
            assert s["state1"].dtype == torch.uint8
            assert s["absmax1"].shape[-1] == -(-local.numel() // STATE_BLOCK_SIZE)
        assert torch.isfinite(local).all()
    # The loss goes down: the fit of a fixed random tanh map, 40 steps of lr 1e-2 from a random start.
    # Measured on the CPU (means of the first and last 3 losses): 0.487 -> 0.042 for every class, a
    # ratio of 0.09; half is a loose bound (5x margin) that fails when the update does nothing (1.0)
    # or diverges.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, (name, losses)
    if rank == 0:
        print(f"uneven {name}: loss {first:.4f} -> {last:.4f}")


def _dcp_round_trip(rank, world, device, name, ckpt_dir, build, n_in, n_out, kw):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model = _shard(build(device))
    opt = _make(name, model.parameters(), **kw)
    _fsdp_steps(model, opt, 0, 3, n_in, n_out, device)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt_dir)
    _fsdp_steps(model, opt, 3, 3, n_in, n_out, device)

    # A fresh model (other initial values) and optimizer, loaded from the checkpoint, continue exactly
    # like the uninterrupted run: the reloaded states are copies of the saved ones.
    torch.manual_seed(99)
    model2 = _shard(build(device))
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(0.5)
    opt2 = _make(name, model2.parameters(), **kw)
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    _fsdp_steps(model2, opt2, 3, 3, n_in, n_out, device)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{name}: DCP round trip diverged"
    for a, b in zip(_flat_state(opt), _flat_state(opt2)):
        assert torch.equal(a, b), f"{name}: DCP round trip: states diverged"


def _refuses_other_layout(rank, world, device):
    """An 8-bit sharded state whose absmax layout is not this one's is refused, and nothing changes."""
    model = _shard(_uneven_model(device))
    opt = _make("AdamW8bit", model.parameters(), min_8bit_size=0)
    _fsdp_steps(model, opt, 0, 1, 24, 1, device)
    sd = opt.state_dict()
    before = _flat_state(opt)
    saved = sd["state"][2]["absmax_layout"].clone()
    saved[0] *= 2  # as if saved by twice as many ranks (a fixed layout could be this world's own)
    sd["state"][2] = dict(sd["state"][2], absmax_layout=saved)
    with pytest.raises(ValueError, match="reload only at the world size"):
        opt.load_state_dict(sd)
    sd = opt.state_dict()
    sd["state"][2] = dict(sd["state"][2], state1=sd["state"][2]["state1"].full_tensor())
    with pytest.raises(ValueError, match="plain tensor but the parameter is a DTensor"):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, _flat_state(opt)))


def _fsdp_scenario(rank, world, device, ckpt_dir, names):
    report = {}
    for name in names:
        _fsdp_aligned(rank, world, device, name, report)
        _fsdp_uneven(rank, world, device, name)
    _dcp_round_trip(rank, world, device, "AdamW8bit", os.path.join(ckpt_dir, "aligned"), _aligned_model, 128, 32, {})
    _dcp_round_trip(rank, world, device, "AdamW8bit", os.path.join(ckpt_dir, "uneven"), _uneven_model, 24, 1,
                    dict(min_8bit_size=0))
    _dcp_round_trip(rank, world, device, "AdamW32bit", os.path.join(ckpt_dir, "fp32"), _aligned_model, 128, 32, {})
    _refuses_other_layout(rank, world, device)
    if rank == 0:
        for name, (mine, full) in report.items():
            print(f"state bytes per rank ({world} ranks, {device.type}): {name} {mine} of {full} unsharded")


def _family_scenario(rank, world, device, ckpt_dir, names):
    """FSDP2 with the engine's families: bit-identical to the unsharded run, uneven shards train,
    and a DCP round trip (AdEMAMix8bit's stacked state1 and absmax1 as DTensors sharded one
    dimension further) continues exactly."""
    for name in names:
        _fsdp_aligned(rank, world, device, name, {})
        _fsdp_uneven(rank, world, device, name)
    for name in ("Lion8bit", "AdEMAMix8bit"):
        _dcp_round_trip(rank, world, device, name, os.path.join(ckpt_dir, f"{name}-aligned"), _aligned_model, 128,
                        32, {})
        _dcp_round_trip(rank, world, device, name, os.path.join(ckpt_dir, f"{name}-uneven"), _uneven_model, 24, 1,
                        dict(min_8bit_size=0))


def _lars_lamb_scenario(rank, world, device, ckpt_dir, names):
    """LARS and LAMB under FSDP2: each rank's shard holds part of the two norms that scale the update;
    the shards' sums of squares are all-reduced, so every rank steps with the whole tensor's scale.

    Against the unsharded run: the only difference is the order of the float64 sums of squares (the
    shards' sums all-reduced, instead of one running sum; each order within n * 2^-53 of the exact
    sum of n nonnegative terms), a relative difference below 2 n * 2^-53 (n = 8192 terms: 2e-12) at
    any world size. The float32 scale then rounds the same way except within 1e-12 of a rounding
    boundary, where it may differ by one ulp (2^-23 relative). So each step may move a parameter by
    2^-23 of its update more or less, plus one rounding of p (2^-24 |p|): over 5 steps, at most
    5 * (2^-23 * max |update| + 2^-24 * max |p|), the gradients' dependence on such differences being
    of second order. unorm_vec, float32 rounding of the norm of the same directions: 2^-22 relative."""
    for name in names:
        reference = _aligned_model(device)
        model = _shard(copy.deepcopy(reference))
        kw = dict(max_unorm=0.05) if name == "LAMB32bit" else {}  # LAMB8bit keeps bitsandbytes' 1.0
        opt, opt_ref = _make(name, model.parameters(), **kw), _make(name, reference.parameters(), **kw)
        bound, clipped = 0.0, 0
        for i in range(5):
            before = [q.detach().clone() for q in reference.parameters()]
            _fsdp_steps(model, opt, i, 1, 128, 32, device)
            _fsdp_steps(reference, opt_ref, i, 1, 128, 32, device)
            max_update = max((q - b).abs().max().item() for q, b in zip(reference.parameters(), before))
            max_p = max(b.abs().max().item() for b in before)
            bound += 2.0**-23 * max_update + 2.0**-24 * max_p
            for p, q, b in zip(model.parameters(), reference.parameters(), before):
                assert (p.full_tensor() - q).abs().max().item() <= bound, (name, i, tuple(q.shape))
                mine, ref = opt.state[p]["unorm_vec"], opt_ref.state[q]["unorm_vec"]
                assert ((mine - ref).abs() <= 2.0**-22 * ref).all(), (name, i, mine.item(), ref.item())
                # the clip binds (the scale is below 1): the step depends on both norms
                clipped += bool(mine.item() > opt.param_groups[0]["max_unorm"] * b.norm().item())
        _all_equal_across_ranks([opt.state[p]["unorm_vec"] for p in model.parameters()], f"{name} unorm_vec")
        assert clipped >= 5 * 3, (name, clipped)  # at least the three weight matrices at every step


# ----------------------------------------------------------------------------------------- tests
def test_fsdp2_gloo(tmp_path):
    _launch(_fsdp_scenario, 2, "gloo", str(tmp_path), CLASSES)


def test_fsdp2_family_gloo(tmp_path):
    _launch(_family_scenario, 2, "gloo", str(tmp_path), FAMILY)


def test_fsdp2_lars_lamb_gloo(tmp_path):
    _launch(_lars_lamb_scenario, 2, "gloo", str(tmp_path), LARS_LAMB)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fsdp2_nccl(tmp_path, world):
    _gpus(world)
    _launch(_fsdp_scenario, world, "nccl", str(tmp_path), CLASSES)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp2_family_nccl(tmp_path, world):
    _gpus(world)
    _launch(_family_scenario, world, "nccl", str(tmp_path), FAMILY)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp2_lars_lamb_nccl(tmp_path, world):
    _gpus(world)
    _launch(_lars_lamb_scenario, world, "nccl", str(tmp_path), LARS_LAMB)


# ---------------------------------------------------------------------------------- README snippets
def _readme_blocks() -> list[str]:
    import re
    import textwrap

    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    with open(readme) as f:
        text = f.read()
    section = re.search(r"^## Distributed training.*?\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)\s*```", section, re.S)]


class _Layers(torch.nn.Module):
    """A model with .layers, as the FSDP2 snippet expects; blocks of 64 * 128 = 8192 weights
    (8-bit states), sharded into 4096-element halves: whole 256-element blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _readme_scenario(rank, world, device, ckpt_dir):
    ddp_block, fsdp_block, dcp_block = _readme_blocks()
    ns = {"model": _ddp_model(device), "device": device}
    exec(ddp_block, ns)
    _ddp_steps(ns["model"], ns["opt"], rank, device, 0, 2)
    _all_equal_across_ranks(list(ns["model"].parameters()) + _flat_state(ns["opt"]), "README DDP snippet")

    ns = {"model": _Layers().to(device)}
    exec(fsdp_block, ns)
    model, opt = ns["model"], ns["opt"]
    _fsdp_steps(model, opt, 0, 2, 64, 64, device)
    w = model.layers[0].weight
    assert opt.state[w]["state1"].dtype == torch.uint8 and opt.state[w]["state1"].numel() == w.numel() // world
    path = os.path.join(ckpt_dir, "readme_dcp")
    ns["path"] = path
    save_part, load_part = dcp_block.split("sd = ", 1)
    exec(save_part, ns)  # get_optimizer_state_dict + dcp.save
    dist.barrier()
    ns2 = {"model": _Layers().to(device), "path": path}  # a resumed run: a new model and optimizer
    exec(fsdp_block, ns2)
    exec(save_part.split("dcp.save")[0], ns2)  # the snippet's imports
    exec("sd = " + load_part, ns2)
    for p, q in zip(model.parameters(), ns2["model"].parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, ns2["opt"].state[q][k]), f"README DCP snippet: {k} not restored"


def test_readme_distributed_snippets_gloo(tmp_path):
    _launch(_readme_scenario, 2, "gloo", str(tmp_path))
