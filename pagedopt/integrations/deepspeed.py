"""pagedopt optimizers under DeepSpeed: ``deepspeed.initialize(model=..., optimizer=pagedopt.X(...),
config=...)``, ZeRO stages 0 to 3.

What DeepSpeed does with a client optimizer, and what follows for pagedopt's:

* Stage 0 steps the optimizer over the model's parameters (over fp32 master copies with
  ``bf16``/``fp16``), as without DeepSpeed: per-parameter states, ``min_8bit_size`` per tensor.
* Stages 1 and 2 flatten each param group into one fp32 tensor per rank (the rank's partition) and
  put it in the group in place of the parameters; stage 3 does the same per sub-group. The
  optimizer then keeps one state per partition: 8-bit when the partition has ``min_8bit_size``
  elements (small tensors such as biases get 8-bit states too, inside it), with 256-element blocks
  that run across parameter boundaries; per-parameter overrides (``GlobalOptimManager``, the Hugging
  Face Trainer's 32-bit embeddings) no longer find their parameters, and are ignored (a warning
  says so). Checkpoints (``engine.save_checkpoint``/``load_checkpoint``) hold each rank's
  ``optimizer.state_dict()`` and give it back to ``load_state_dict``, which checks it: a run resumes
  bit for bit at the same world size.
* ZeRO needs ``"zero_allow_untested_optimizer": true`` for any client optimizer, and ZeRO-Offload
  (``offload_optimizer``) also ``"zero_force_ds_cpu_optimizer": false``; DeepSpeed itself refuses
  the config without them, at ``initialize``, with a message that names the key.

What cannot work is refused when ``deepspeed.initialize`` is called, by :func:`check` (``import
pagedopt`` wraps ``deepspeed.initialize`` when deepspeed is imported, before or after it, through
:mod:`.import_hooks`; ``PAGEDOPT_AUTO_REGISTER=0`` leaves deepspeed alone, then call
:func:`check` yourself):

* ``zero_optimization.elastic_checkpoint: true`` and ``checkpoint.load_universal: true``: DeepSpeed
  then merges and re-splits every tensor of the optimizer's state as if it were an fp32 moment as
  long as the partition (codes and absmax split at other places than their blocks, codebooks cut
  short or concatenated), and without ``load_state_dict``; DeepSpeed 0.19 fails at
  ``load_checkpoint`` with a bare ``AssertionError``. Rigid checkpoints (the default) resume at the
  world size they were saved at.
* ``set_pager(update_in_backward=True)``: its hooks update each parameter as its gradient arrives,
  before DeepSpeed has averaged gradients across ranks, scaled or clipped them, and, under ZeRO or
  ``bf16``/``fp16``, on tensors that DeepSpeed does not step.
"""
from __future__ import annotations

import functools
import inspect
import json
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check", "register"]

_lock = threading.Lock()


def _is_pagedopt(optimizer: Any) -> bool:
    from ..optim.base import QuantizedOptimizer

    return isinstance(optimizer, QuantizedOptimizer)


def _read_config(config: Any) -> Mapping | None:
    """The DeepSpeed config as a dict: a dict, or the path of a JSON file; None for anything else
    (e.g. a DeepSpeedConfig object), which is then not checked."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, str):
        try:
            with open(config) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # DeepSpeed reports a config it cannot read itself
    return None


def _on(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def check(config: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse (``ValueError`` naming the config key or the setting) a DeepSpeed config under which a
    pagedopt ``optimizer`` cannot work, and warn of what DeepSpeed changes (see the module's
    docstring). ``config``: the dict or JSON path given to ``deepspeed.initialize``. Anything but a
    pagedopt optimizer passes unchecked."""
    if not _is_pagedopt(optimizer):
        return
    name = type(optimizer).__name__
    if getattr(optimizer, "update_in_backward", False):
        raise ValueError(f"pagedopt.{name} with set_pager(update_in_backward=True) cannot run under DeepSpeed: "
                         "its hooks would update each parameter during backward, before DeepSpeed averages, "
                         "scales and clips the gradients (and, under ZeRO or bf16/fp16, on tensors DeepSpeed "
                         "does not step); call set_pager(update_in_backward=False) or leave it out")
    cfg = _read_config(config)
    if cfg is None:
        return
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if isinstance(zero, Mapping) and _on(zero.get("elastic_checkpoint")):
        raise ValueError(f"DeepSpeed config 'zero_optimization.elastic_checkpoint': true cannot be used with "
                         f"pagedopt.{name}: elastic checkpoints merge and re-split every optimizer state as if it "
                         "were an fp32 moment of the partition's length, which cuts 8-bit codes and absmax at other "
                         "places than their 256-element blocks and concatenates codebooks (DeepSpeed 0.19 then "
                         "fails in load_checkpoint); leave it false (the default): rigid checkpoints resume at "
                         "the world size they were saved at")
    checkpoint = cfg.get("checkpoint") or {}
    if isinstance(checkpoint, Mapping) and _on(checkpoint.get("load_universal")):
        raise ValueError(f"DeepSpeed config 'checkpoint.load_universal': true cannot be used with pagedopt.{name}: "
                         "a universal checkpoint stores each optimizer state per parameter as fp32 slices "
                         "(exp_avg, exp_avg_sq), which 8-bit blockwise states are not; leave it false and resume "
                         "from a rigid checkpoint at the world size it was saved at")
    if isinstance(stage, int) and stage >= 1:
        from ..optim.global_manager import GlobalOptimManager

        if GlobalOptimManager.get_instance().overrides_for(optimizer.param_groups):
            warnings.warn(f"pagedopt.{name} under DeepSpeed ZeRO stage {stage}: ZeRO replaces each param group's "
                          "parameters by one flat partition, so the per-parameter settings of GlobalOptimManager "
                          "(e.g. 32-bit states for embeddings) no longer apply; optim_bits and min_8bit_size "
                          "of the param groups apply to each partition", UserWarning, stacklevel=3)


def _checked_optimizer_callable(make, config):
    """A DeepSpeed optimizer callable (DeepSpeed calls it with the parameters) whose result is checked."""
    @functools.wraps(make)
    def checked(*args, **kwargs):
        optimizer = make(*args, **kwargs)
        check(config, optimizer)
        return optimizer

    return checked


def _wrap_initialize(module) -> None:
    initialize = module.initialize
    if getattr(initialize, "_pagedopt", False):
        return
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def checked_initialize(*args, **kwargs):
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return initialize(*args, **kwargs)  # DeepSpeed reports its own usage errors
        params = bound.arguments
        config = params.get("config") or params.get("config_params")
        if config is None and params.get("args") is not None:
            config = getattr(params["args"], "deepspeed_config", None)
        optimizer = params.get("optimizer")
        if _is_pagedopt(optimizer):
            check(config, optimizer)
        elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            bound.arguments["optimizer"] = _checked_optimizer_callable(optimizer, config)
            return initialize(*bound.args, **bound.kwargs)
        return initialize(*args, **kwargs)

    checked_initialize._pagedopt = True
    module.initialize = checked_initialize


def _on_import(module) -> None:
    """``import pagedopt``'s set-up, run when deepspeed has been imported (integrations.import_hooks)."""
    with _lock:
        _wrap_initialize(module)


def register() -> None:
    """Wrap ``deepspeed.initialize`` now (idempotent; imports deepspeed): for PAGEDOPT_AUTO_REGISTER=0."""
    import deepspeed

    _on_import(deepspeed)
