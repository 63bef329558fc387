"""Distributed checkpoints (torch.distributed.checkpoint) of pagedopt's sharded states under FSDP2:
resharding (saved by N ranks, loaded by M: 2 -> 1, 1 -> 2, 4 -> 2 here on the CPU; 8 -> 4, 4 -> 8,
2 -> 1 on GPUs; 8-bit, 4-bit, 32-bit, paged and host-resident states), the layouts that cannot
reshard and the checkpoints that must be refused, by torch's own route (get_optimizer_state_dict,
dcp.save/load, set_optimizer_state_dict) and by pagedopt.integrations.dcp.load, which changes
nothing unless it accepts the whole checkpoint.

Every case runs in processes started by torch.multiprocessing.spawn (tests/distributed_helpers.py):
on the CPU with gloo, and with nccl, one process per GPU, in the tests marked cuda. Tolerances:
none; a reloaded state is a copy of the saved one, and shards of whole blocks compute what the
unsharded run computes (tests/test_fsdp2.py).
"""
from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import _gpus, _launch, _make, _node_model, _optimizer
from test_fsdp2 import _aligned_model, _fsdp_steps, _shard, _uneven_model


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    return dcp, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict


def _raw_save(model, opt, path):
    dcp, get_model, get_optim, _, _ = _dcp()
    dcp.save({"model": get_model(model), "optim": get_optim(model, opt)}, checkpoint_id=path)


def _raw_load(model, opt, path):
    dcp, get_model, get_optim, set_model, set_optim = _dcp()
    sd = {"model": get_model(model), "optim": get_optim(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model(model, sd["model"])
    set_optim(model, opt, sd["optim"])


def _full(model, opt) -> list[torch.Tensor]:
    """Parameters, then every state as the state dict's global tensor (gathered), less the
    absmax_layout records (they name the world size)."""
    from torch.distributed.tensor import DTensor

    sd = opt.state_dict()
    out = [p.full_tensor().cpu() for p in model.parameters()]
    for key in sorted(sd["state"]):
        for k, v in sorted(sd["state"][key].items()):
            if isinstance(v, torch.Tensor) and k != "absmax_layout":
                out.append((v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu())
    return out


def _snapshot(model, opt) -> list[torch.Tensor]:
    # opt.state.get: reading opt.state[p] of the defaultdict would add an empty entry
    return [p.to_local().detach().clone() for p in model.parameters()] + [
        v.detach().clone() for g in opt.param_groups for p in g["params"]
        for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]


def _unchanged(before, model, opt, what):
    after = _snapshot(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)), \
        f"{what}: a refused checkpoint changed the model or the optimizer"


def _columns(model):
    """Shard(1) (columns) for every weight: a shard of a (64, 128) weight is 64 rows of 64 columns,
    4096 elements, 16 whole blocks, but not a contiguous run of the flattened weight."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    return model


def _coincident_model(device):
    torch.manual_seed(3)
    # (3, 100): 300 elements, 2 blocks unsharded; on 2 ranks rows 2 + 1, so 2 shards of 1 block: the
    # sharded absmax has the unsharded one's size (2), but its blocks are others (elements 0-199 and
    # 200-299 instead of 0-255 and 256-299).
    return torch.nn.Sequential(torch.nn.Linear(100, 3, bias=False)).to(device)


# --------------------------------------------------------------------- N ranks -> M ranks, by class
RESHARD = ("AdamW8bit", "PagedAdamW8bit", "PagedAdamW8bit-host", "Lion8bit", "AdamW4bit", "AdamW32bit")


def _reshard_at(rank, world, device, ckpt_dir, phase, variants):
    """``save``: train 3 steps, save (torch's route; AdamW8bit by pagedopt_dcp too), train 3 more and
    keep the whole parameters and states as expected; ``load``: at another world size, a fresh
    model and optimizer load the checkpoint and train the same 3 steps. Every shard of _node_model is
    whole blocks at 1, 2, 4 and 8 ranks, so the absmax reshards exactly, and both runs are bit for
    bit the one-process run (_fsdp_steps: rank 0's gradient, exactly): the loaded run ends where the
    uninterrupted one did, at any pair of world sizes."""
    from torch.distributed.checkpoint.api import CheckpointException

    from pagedopt.integrations import dcp as pagedopt_dcp

    # Shards that are not whole blocks (_uneven_model) belong to their layout: refused at any other
    # world size, by DCP (absmax1 of another size) or by load_state_dict (another layout).
    uneven = os.path.join(ckpt_dir, "uneven")
    model = _shard(_uneven_model(device))
    opt = _make("AdamW8bit", model.parameters(), min_8bit_size=0)
    if phase == "save":
        _fsdp_steps(model, opt, 0, 1, 24, 1, device)
        _raw_save(model, opt, uneven)
    else:
        with pytest.raises((CheckpointException, ValueError), match="Size mismatch|reload only at the world size"):
            _raw_load(model, opt, uneven)
    for variant in variants:
        routes = ("raw", "helper") if variant == "AdamW8bit" else ("raw",)
        if phase == "save":
            model = _shard(_node_model(device))
            opt = _optimizer(variant, list(model.parameters()))
            _fsdp_steps(model, opt, 0, 3, 64, 128, device)
            _raw_save(model, opt, os.path.join(ckpt_dir, variant, "raw"))
            if "helper" in routes:
                pagedopt_dcp.save(os.path.join(ckpt_dir, variant, "helper"), model, opt)
            _fsdp_steps(model, opt, 3, 3, 64, 128, device)
            expected = _full(model, opt)
            if rank == 0:
                torch.save(expected, os.path.join(ckpt_dir, variant, "expected.pt"))
            continue
        expected = torch.load(os.path.join(ckpt_dir, variant, "expected.pt"), weights_only=True)
        for how in routes:
            torch.manual_seed(50)
            model = _shard(_node_model(device))  # other initial values: the checkpoint must replace them
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.25)
            opt = _optimizer(variant, list(model.parameters()))
            path = os.path.join(ckpt_dir, variant, how)
            _raw_load(model, opt, path) if how == "raw" else pagedopt_dcp.load(path, model, opt)
            _fsdp_steps(model, opt, 3, 3, 64, 128, device)
            mine = _full(model, opt)
            assert len(mine) == len(expected), (variant, how)
            for i, (a, b) in enumerate(zip(mine, expected)):
                assert a.dtype == b.dtype and torch.equal(a, b.to(a.device)), \
                    f"{variant} ({how}): tensor {i} differs from the uninterrupted run after resharding to {world} ranks"


def _reshard(tmp_path, saved_at, loaded_at, backend):
    _launch(_reshard_at, saved_at, backend, str(tmp_path), "save", RESHARD)
    _launch(_reshard_at, loaded_at, backend, str(tmp_path), "load", RESHARD)


@pytest.mark.parametrize("saved_at,loaded_at", [(2, 1), (1, 2), (4, 2)])
def test_dcp_reshard_gloo(tmp_path, saved_at, loaded_at):
    _reshard(tmp_path, saved_at, loaded_at, "gloo")


@pytest.mark.cuda
@pytest.mark.parametrize("saved_at,loaded_at", [(8, 4), (4, 8), (2, 1)])
def test_dcp_reshard_nccl(tmp_path, saved_at, loaded_at):
    _gpus(max(saved_at, loaded_at))
    _reshard(tmp_path, saved_at, loaded_at, "nccl")


# ------------------------------------------------------------------------------------- refusals
def _refusals_at_two(rank, world, device, ckpt_dir):
    from torch.distributed.checkpoint.api import CheckpointException

    from pagedopt.integrations import dcp as pagedopt_dcp

    get_optim = _dcp()[2]
    path = lambda name: os.path.join(ckpt_dir, name)  # noqa: E731

    # The helper's own round trip: a fresh model and optimizer continue like the uninterrupted run.
    model = _shard(_aligned_model(device))
    opt = _make("AdamW8bit", model.parameters())
    _fsdp_steps(model, opt, 0, 2, 128, 32, device)
    pagedopt_dcp.save(path("good"), model, opt)
    trained = (model, opt)
    torch.manual_seed(60)
    model2 = _shard(_aligned_model(device))
    opt2 = _make("AdamW8bit", model2.parameters())
    pagedopt_dcp.load(path("good"), model2, opt2)
    _fsdp_steps(model, opt, 2, 2, 128, 32, device)
    _fsdp_steps(model2, opt2, 2, 2, 128, 32, device)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), _snapshot(model2, opt2)))

    # 8-bit states into an optimizer that keeps 32-bit ones (another optim_bits): DCP alone would
    # cast the uint8 codes into the float32 moments. Refused by load_state_dict (torch's route) and
    # before anything is read (the helper); a fresh optimizer stays fresh.
    fresh_model = _shard(_aligned_model(device))
    fresh = _make("AdamW32bit", fresh_model.parameters())
    with pytest.raises(ValueError, match="saved with 8-bit states"):
        _raw_load(fresh_model, fresh, path("good"))
    fresh_model = _shard(_aligned_model(device))
    fresh = _make("AdamW32bit", fresh_model.parameters())
    before = _snapshot(fresh_model, fresh)
    with pytest.raises(ValueError, match=r"torch.uint8, this optimizer's torch.float32: it holds 8-bit states"):
        pagedopt_dcp.load(path("good"), fresh_model, fresh)
    assert not fresh.state, "a refused checkpoint left states in a fresh optimizer"
    _unchanged(before, fresh_model, fresh, "8-bit into 32-bit")
    # and the reverse: 32-bit states into an 8-bit optimizer (the checkpoint has no absmax)
    model32 = _shard(_aligned_model(device))
    opt32 = _make("AdamW32bit", model32.parameters())
    _fsdp_steps(model32, opt32, 0, 1, 128, 32, device)
    pagedopt_dcp.save(path("fp32"), model32, opt32)
    model, opt = trained
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="holds 32-bit states .* this optimizer 8-bit ones"):
        pagedopt_dcp.load(path("fp32"), model, opt)
    _unchanged(before, model, opt, "32-bit into 8-bit")

    # A corrupted absmax (negative) and a truncated file. torch's route refuses the absmax too, but
    # only after dcp.load has written it into the optimizer's own states; the helper changes nothing.
    model, opt = trained
    w = next(p for p, s in opt.state.items() if "absmax1" in s)
    good = opt.state[w]["absmax1"].clone()
    opt.state[w]["absmax1"][0] = -1.0
    pagedopt_dcp.save(path("negative"), model, opt)
    opt.state[w]["absmax1"].copy_(good)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"'absmax1' holds a value outside \[0.0, inf\]"):
        pagedopt_dcp.load(path("negative"), model, opt)
    _unchanged(before, model, opt, "negative absmax")
    pagedopt_dcp.save(path("truncated"), model, opt)
    dist.barrier()
    if rank == 0:
        for f in glob.glob(os.path.join(path("truncated"), "*.distcp")):
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
    dist.barrier()
    with pytest.raises(CheckpointException):
        pagedopt_dcp.load(path("truncated"), model, opt)
    _unchanged(before, model, opt, "truncated file")

    # Shards that are whole blocks but not contiguous runs of the flattened weight (Shard(1)): their
    # blocks are other blocks than those of a Shard(0) run of the same sizes. Refused at the same
    # world size with the other placements (and at another world size, in _refusals_at_one).
    model = _columns(_aligned_model(device))
    opt = _make("AdamW8bit", model.parameters())
    _fsdp_steps(model, opt, 0, 2, 128, 32, device)
    _raw_save(model, opt, path("columns"))
    rows = _shard(_aligned_model(device))
    opt_rows = _make("AdamW8bit", rows.parameters())
    with pytest.raises(ValueError, match="shards that are not contiguous runs of the parameter"):
        _raw_load(rows, opt_rows, path("columns"))
    rows = _shard(_aligned_model(device))
    opt_rows = _make("AdamW8bit", rows.parameters())
    with pytest.raises(ValueError, match="not contiguous runs .* this run has 2 shards of 16 blocks"):
        pagedopt_dcp.load(path("columns"), rows, opt_rows)
    assert not opt_rows.state

    # Uneven shards saved for 2 ranks, and a model whose sharded absmax has the size of the unsharded one.
    model = _shard(_uneven_model(device))
    opt = _make("AdamW8bit", model.parameters(), min_8bit_size=0)
    _fsdp_steps(model, opt, 0, 2, 24, 1, device)
    pagedopt_dcp.save(path("uneven"), model, opt)
    model = _shard(_coincident_model(device))
    opt = _make("AdamW8bit", model.parameters(), min_8bit_size=0)
    _fsdp_steps(model, opt, 0, 2, 100, 3, device)
    pagedopt_dcp.save(path("coincident"), model, opt)
    # Gathered into whole tensors (full_state_dict=True), its absmax fits the unsharded optimizer's
    # shape, but its blocks are the shards': refused.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    full = get_optim(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    plain = _coincident_model(device)
    plain_opt = _make("AdamW8bit", plain.parameters(), min_8bit_size=0)
    with pytest.raises(ValueError, match="gathered into one tensor, its blocks are not those"):
        plain_opt.load_state_dict({"state": {0: full["state"]["0.weight"]}, "param_groups": [
            dict(full["param_groups"][0], params=[0])]})
    assert not plain_opt.state


def _refusals_at_one(rank, world, device, ckpt_dir):
    from pagedopt.integrations import dcp as pagedopt_dcp

    path = lambda name: os.path.join(ckpt_dir, name)  # noqa: E731
    for name, build, kw, match in (
            ("columns", _aligned_model, {}, "2 shards of 16 blocks .shards that are not contiguous"),
            ("uneven", _uneven_model, dict(min_8bit_size=0), "2 shards of 15 blocks .shards that are not whole"),
            ("coincident", _coincident_model, dict(min_8bit_size=0), "2 shards of 1 blocks")):
        model = _shard(build(device))
        opt = _make("AdamW8bit", model.parameters(), **kw)
        before = _snapshot(model, opt)
        with pytest.raises(ValueError, match=match):
            pagedopt_dcp.load(path(name), model, opt)
        assert not opt.state, name
        _unchanged(before, model, opt, name)
        if name != "uneven":  # torch's route too (for "uneven", DCP's size check refuses first)
            with pytest.raises(ValueError, match="reload only at the world size"):
                _raw_load(model, opt, path(name))


def test_dcp_refusals_gloo(tmp_path):
    _launch(_refusals_at_two, 2, "gloo", str(tmp_path))
    _launch(_refusals_at_one, 1, "gloo", str(tmp_path))


# ---------------------------------------------------------------------------------- README snippet
def _readme_scenario(rank, world, device, ckpt_dir):
    """The README's "FSDP2 and distributed checkpoints" snippet as written: the first part builds,
    (trains,) and saves; its resume part, run after the same set-up in a new run, restores it."""
    from readme_snippets import section_snippets
    from test_fsdp2 import _Layers

    block, = section_snippets("FSDP2 and distributed checkpoints")
    first, resume = block.split("# resume", 1)
    set_up = first.split("# ... train ...")[0]
    ns = {"model": _Layers().to(device), "path": os.path.join(ckpt_dir, "readme")}
    exec(set_up, ns)
    _fsdp_steps(ns["model"], ns["opt"], 0, 2, 64, 64, device)
    exec(first.split("# ... train ...")[1], ns)  # save
    dist.barrier()
    torch.manual_seed(70)
    ns2 = {"model": _Layers().to(device), "path": ns["path"]}
    exec(set_up, ns2)
    with torch.no_grad():
        for p in ns2["model"].parameters():
            p.add_(1.0)  # other weights than the saved ones
    exec("# resume" + resume, ns2)
    for i, (a, b) in enumerate(zip(_snapshot(ns["model"], ns["opt"]), _snapshot(ns2["model"], ns2["opt"]))):
        assert torch.equal(a, b), f"README snippet: tensor {i} not restored"
    weights = [layer.weight for layer in ns2["model"].layers]  # 8192 elements each: 8-bit states
    assert all(ns2["opt"].state[w]["state1"].dtype == torch.uint8 for w in weights)


def test_readme_fsdp2_dcp_snippet_gloo(tmp_path):
    _launch(_readme_scenario, 2, "gloo", str(tmp_path))
