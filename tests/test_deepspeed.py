"""pagedopt under DeepSpeed: deepspeed.initialize(model=..., optimizer=pagedopt.AdamW8bit(...),
config=...) with ZeRO stages 0 to 3 trains, saves with engine.save_checkpoint and resumes with
engine.load_checkpoint exactly where the uninterrupted run is; what cannot work is refused at
initialize (pagedopt/integrations/deepspeed.py); the README's DeepSpeed snippet runs.

DeepSpeed runs on the CPU here, with its CPU accelerator (chosen by itself when no GPU is found;
DS_ACCELERATOR=cpu forces it) and gloo, in processes started by torch.multiprocessing.spawn
(tests/distributed_helpers.py): 1 rank in fp32, 2 ranks in bf16. The GPU test (marked cuda) runs
the 1-rank scenario with nccl on one GPU.

Tolerances: none. A resumed run loads copies of the saved states and fp32 master weights and then
computes what the uninterrupted run computes, bit for bit; replicas of DeepSpeed's data parallelism
apply the same averaged gradient to the same weights.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import pagedopt
from distributed_helpers import _all_equal_across_ranks, _gpus, _launch
from pagedopt.integrations import deepspeed as pagedopt_ds

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (scripts/setup_tests.sh installs it)")
HERE = os.path.dirname(os.path.abspath(__file__))


def _model(seed=0):
    torch.manual_seed(seed)
    # 64 * 128 = 8192 weights: 8-bit states under stage 0 (per tensor, >= min_8bit_size 4096); under
    # ZeRO the optimizer sees one flat partition per rank (9352 or 4676 elements): 8-bit too.
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


def _config(stage, bf16):
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}}


def _steps(engine, first, count, rank, device):
    dtype = next(engine.module.parameters()).dtype
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(100 * i + rank)  # each rank its own batch
        x, y = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x.to(device, dtype)).float(), y.to(device))
        engine.backward(loss)
        engine.step()


def _params(engine) -> list[torch.Tensor]:
    """The model's whole parameters (gathered under ZeRO stage 3, where each rank holds a part)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [p.detach().float().cpu().clone() for p in params]


def _states(opt) -> list[torch.Tensor]:
    return [v.detach().cpu().clone() for s in opt.state.values() for _, v in sorted(s.items())
            if isinstance(v, torch.Tensor)]


def _prepare(rank, world, device):
    """What every DeepSpeed worker does first: DeepSpeed's environment, and no JIT build of its CPU
    shared-memory all-reduce (DeepSpeed compiles it on its first collective set-up, 2.5 minutes on
    2 cores; it only speeds up CPU collectives, which gloo does here)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__ = {}  # DeepSpeed keeps this dict of buildable ops for edits
    from deepspeed.utils import logger

    logger.setLevel("WARNING")


def _resume_scenario(rank, world, device, ckpt_dir, stages, bf16):
    import deepspeed

    _prepare(rank, world, device)
    for stage in stages:
        model = _model().to(device)
        opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage, bf16))
        _steps(engine, 0, 3, rank, device)
        eight_bit = [s for s in opt.state.values() if s["state1"].dtype == torch.uint8]
        assert eight_bit, f"stage {stage}: no 8-bit states"
        if stage >= 1:  # the optimizer steps this rank's flat partition, not the model's tensors
            n = sum(p.numel() for p in model.parameters())
            assert [s["state1"].numel() for s in opt.state.values()] == [-(-n // world)], stage
        engine.save_checkpoint(ckpt_dir, tag=f"stage{stage}")
        _steps(engine, 3, 3, rank, device)
        expected_params, expected_states = _params(engine), _states(opt)
        _all_equal_across_ranks(expected_params, f"stage {stage}: parameters")

        # a new run: other initial weights, a new optimizer; load_checkpoint gives it the saved ones
        model2 = _model(seed=7).to(device)
        opt2 = pagedopt.AdamW8bit(model2.parameters(), lr=1e-2, weight_decay=0.01)
        engine2, _, _, _ = deepspeed.initialize(model=model2, optimizer=opt2, config=_config(stage, bf16))
        engine2.load_checkpoint(ckpt_dir, tag=f"stage{stage}")
        _steps(engine2, 3, 3, rank, device)
        for i, (a, b) in enumerate(zip(_params(engine2), expected_params)):
            assert torch.equal(a, b), f"stage {stage}: parameter {i} differs from the uninterrupted run"
        mine = _states(opt2)
        assert len(mine) == len(expected_states)
        for i, (a, b) in enumerate(zip(mine, expected_states)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"stage {stage}: state tensor {i} differs"
        dist.barrier()


def _initialize_refuses(rank, world, device, ckpt_dir):
    """deepspeed.initialize itself (wrapped by import pagedopt) refuses what cannot work, before it
    does anything, also for an optimizer given as a callable; other optimizers pass."""
    import deepspeed

    _prepare(rank, world, device)
    for stage, extra, match in ((2, {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}},
                                 "'zero_optimization.elastic_checkpoint': true"),
                                (1, {"checkpoint": {"load_universal": True}}, "'checkpoint.load_universal': true")):
        model = _model().to(device)
        config = {**_config(stage, False), **extra}
        with pytest.raises(ValueError, match=match):
            deepspeed.initialize(model=model, optimizer=pagedopt.AdamW8bit(model.parameters()), config=config)
        with pytest.raises(ValueError, match=match):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                 optimizer=lambda params: pagedopt.PagedAdamW8bit(params, lr=1e-3))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                               config=config)  # not ours: unchecked
        assert engine.optimizer is not None


def _readme_snippet(rank, world, device, ckpt_dir):
    """The README's DeepSpeed section, run as written (with a tiny model and data)."""
    from readme_snippets import section_snippets

    _prepare(rank, world, device)
    block, = section_snippets("DeepSpeed")
    data = [(torch.randn(8, 64, generator=torch.Generator().manual_seed(i)), torch.randn(8, 8)) for i in range(3)]
    ns = {"model": _model().to(device), "data": data, "loss_fn": torch.nn.functional.mse_loss}
    os.chdir(ckpt_dir)
    exec(block, ns)
    opt = ns["engine"].optimizer.optimizer  # ZeRO's wrapper around the client optimizer
    assert isinstance(opt, pagedopt.AdamW8bit)
    assert all(s["state1"].dtype == torch.uint8 for s in opt.state.values())
    assert os.path.isdir(os.path.join(ckpt_dir, "checkpoints"))


@needs_deepspeed
def test_deepspeed_one_rank_fp32(tmp_path):
    _launch(_resume_scenario, 1, "gloo", str(tmp_path), (0, 1, 2, 3), False)


@needs_deepspeed
def test_deepspeed_two_ranks_bf16(tmp_path):
    _launch(_resume_scenario, 2, "gloo", str(tmp_path), (0, 1, 2, 3), True)


@needs_deepspeed
def test_deepspeed_initialize_refuses_and_readme(tmp_path):
    _launch(_initialize_refuses, 1, "gloo", str(tmp_path))
    _launch(_readme_snippet, 1, "gloo", str(tmp_path))


@needs_deepspeed
@pytest.mark.cuda
def test_deepspeed_one_gpu(tmp_path):
    _gpus(1)
    _launch(_resume_scenario, 1, "nccl", str(tmp_path), (0, 1, 2, 3), True)


# ------------------------------------------------------------------ the checks, without deepspeed
def test_check_refuses_update_in_backward():
    model = _model()
    opt = pagedopt.AdamW8bit(model.parameters())
    opt.set_pager(update_in_backward=True)
    with pytest.raises(ValueError, match=r"set_pager\(update_in_backward=True\) cannot run under DeepSpeed"):
        pagedopt_ds.check(_config(0, False), opt)
    opt.set_pager(update_in_backward=False)
    pagedopt_ds.check(_config(0, False), opt)


def test_check_reads_a_json_config_and_ignores_other_optimizers(tmp_path):
    import json

    model = _model()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**_config(2, False), "zero_optimization": {"stage": 2, "elastic_checkpoint": "true"}}))
    with pytest.raises(ValueError, match="elastic_checkpoint"):
        pagedopt_ds.check(str(path), pagedopt.AdamW8bit(model.parameters()))
    pagedopt_ds.check(str(path), torch.optim.AdamW(model.parameters()))  # not ours
    pagedopt_ds.check(str(tmp_path / "missing.json"), pagedopt.AdamW8bit(model.parameters()))  # DeepSpeed's to say


def test_check_warns_that_zero_drops_per_parameter_overrides():
    model = _model()
    mng = pagedopt.GlobalOptimManager.get_instance()
    mng.initialize()
    try:
        mng.register_module_override(model[0], "weight", {"optim_bits": 32})
        opt = pagedopt.AdamW8bit(model.parameters())
        with pytest.warns(UserWarning, match="GlobalOptimManager .* no longer apply"):
            pagedopt_ds.check(_config(2, False), opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pagedopt_ds.check(_config(0, False), opt)  # stage 0 steps the model's own tensors
    finally:
        mng.initialize()
