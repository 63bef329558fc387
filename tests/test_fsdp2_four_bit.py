"""4-bit states under FSDP2 (fully_shard, DTensor parameters), two ranks on gloo: the codes, two a
byte along the last dimension, shard like the parameter; a run whose shards are whole 128-element
blocks is bit for bit the unsharded run; distributed checkpoints (DCP) resume exactly, also for
uneven shards; a parameter whose last dimension cannot be split into bytes is refused with its
name, before anything changes. Comparisons are exact (torch.equal), as in tests/test_fsdp2.py."""
from __future__ import annotations

import os

import pytest
import torch

from distributed_helpers import _gpus, _launch, _make
from test_fsdp2 import _aligned_model, _dcp_round_trip, _fsdp_aligned, _fsdp_steps, _shard


def _even_uneven_model(device):
    torch.manual_seed(3)
    # With 2 ranks and min_8bit_size=0 every tensor has 4-bit states and no shard is a whole number
    # of 128-element blocks: (300, 24) -> 150 * 24 = 3600 elements (28.1 blocks); (4, 300) -> 2 rows
    # of 300; the biases (300,) and (4,) split into 150 and 2: every last dimension, and every chunk
    # of a sharded one, even.
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4)).to(device)


def _odd_model(device):
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)).to(device)


def _four_bit_scenario(rank, world, device, ckpt_dir):
    _fsdp_aligned(rank, world, device, "AdamW4bit", {})
    _dcp_round_trip(rank, world, device, "AdamW4bit", os.path.join(ckpt_dir, "aligned"), _aligned_model, 128, 32, {})
    _dcp_round_trip(rank, world, device, "AdamW4bit", os.path.join(ckpt_dir, "uneven"), _even_uneven_model, 24, 4,
                    dict(min_8bit_size=0))
    # uneven shards train: the loss falls
    model = _shard(_even_uneven_model(device))
    opt = _make("AdamW4bit", model.parameters(), min_8bit_size=0)
    losses = _fsdp_steps(model, opt, 0, 30, 24, 4, device)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(s["state1"].dtype == torch.uint8 for s in opt.state.values())
    # Linear(64, 3)'s bias (3,) has an odd last dimension: refused, naming it, nothing made
    model = _shard(_odd_model(device))
    opt = _make("AdamW4bit", model.parameters(), min_8bit_size=0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[3\].*last dimension \(3\) is odd"):
        _fsdp_steps(model, opt, 0, 1, 24, 3, device)
    assert len(opt.state) == 0


def test_fsdp2_four_bit_gloo(tmp_path):
    _launch(_four_bit_scenario, 2, "gloo", str(tmp_path))


@pytest.mark.cuda
def test_fsdp2_four_bit_nccl(tmp_path):
    """Two GPUs only: at 4 and 8 ranks the uneven model's (4,) bias splits into shards of one element,
    which cannot hold 4-bit codes two a byte (refused, as its odd-sized shard would be); the 4-bit
    classes at 2, 4 and 8 GPUs are in tests/test_distributed_agreement.py."""
    _gpus(2)
    _launch(_four_bit_scenario, 2, "nccl", str(tmp_path))
