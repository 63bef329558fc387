"""pagedopt under torch.distributed: DDP replicas.

Every case runs in a world of processes started by torch.multiprocessing.spawn (one per rank,
tests/distributed_helpers.py): on the CPU with gloo, and with nccl, one process per GPU, in the
tests marked cuda. A worker's failed assertion fails the test (spawn re-raises it in the parent).

Tolerances: none. Every comparison is bit for bit (torch.equal): DDP replicas apply the same
all-reduced gradient with the same kernels; a reloaded state is a copy of the saved one.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import (CLASSES, _all_equal_across_ranks, _ddp_model, _ddp_steps, _flat_state, _gpus,
                                 _launch, _make)


# ------------------------------------------------------------------------------------------- DDP
def _ddp_scenario(rank, world, device, ckpt_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name in CLASSES:
        model = _ddp_model(device)
        if rank == 1:  # DDP broadcasts rank 0's parameters at construction: start rank 1 elsewhere
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = _make(name, ddp.parameters())
        _ddp_steps(ddp, opt, rank, device, 0, 4)
        eight_bit = [s for s in opt.state.values() if s["state1"].dtype == torch.uint8]
        assert len(eight_bit) == (0 if name == "AdamW32bit" else 1), name
        # Replicas stay bit-identical: every rank applies the same all-reduced gradient with the same
        # kernels to the same parameters and states. A rank with different data or a missed
        # all-reduce would differ here.
        _all_equal_across_ranks([p.detach() for p in model.parameters()], f"{name} params")
        _all_equal_across_ranks(_flat_state(opt), f"{name} states")

        # Rank 0's checkpoint, through torch.save and torch.load(weights_only=True), into a fresh
        # optimizer on every rank: it continues exactly like the uninterrupted one.
        path = os.path.join(ckpt_dir, f"{name}.pt")
        if rank == 0:
            torch.save(opt.state_dict(), path)
        dist.barrier()
        model2 = copy.deepcopy(model)
        ddp2 = DDP(model2, device_ids=[device.index] if device.type == "cuda" else None)
        opt2 = _make(name, ddp2.parameters())
        opt2.load_state_dict(torch.load(path, weights_only=True, map_location=device))
        _ddp_steps(ddp, opt, rank, device, 4, 3)
        _ddp_steps(ddp2, opt2, rank, device, 4, 3)
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b), f"{name}: a reloaded optimizer diverged"
        for a, b in zip(_flat_state(opt), _flat_state(opt2)):
            assert torch.equal(a, b), f"{name}: a reloaded optimizer's state diverged"
        _all_equal_across_ranks([p.detach() for p in model2.parameters()], f"{name} params after reload")
        dist.barrier()


# ----------------------------------------------------------------------------------------- tests
def test_ddp_gloo(tmp_path):
    _launch(_ddp_scenario, 2, "gloo", str(tmp_path))


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ddp_nccl(tmp_path, world):
    _gpus(world)
    _launch(_ddp_scenario, world, "nccl", str(tmp_path))
