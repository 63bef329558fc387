"""Export a pagedopt checkpoint in torch.optim.Adam/AdamW's format.

Loading the other way needs nothing from here: ``pagedopt.AdamW8bit(...).load_state_dict``
takes a torch.optim.Adam/AdamW state dict directly.
"""
from __future__ import annotations

import math

import torch

from ._ops import dequantize_blockwise
from .optim.state_format import CODES4, CODES8

_PAGEDOPT_GROUP_KEYS = ("optim_bits", "min_8bit_size")


def _moment(state: dict, i: int, shape, key) -> torch.Tensor:
    codes = state[f"state{i}"]
    if codes.dtype != torch.uint8:
        return codes.detach().float().clone()
    absmax, qmap = state[f"absmax{i}"], state[f"qmap{i}"]
    fmt = CODES4 if qmap.numel() == CODES4.codebook_size else CODES8
    values = dequantize_blockwise(codes.contiguous(), absmax.float().to(codes.device),
                                  qmap.float().to(codes.device), fmt.block, torch.float32)
    if fmt is CODES8:
        return values
    if shape is None:  # 4-bit codes are flat, two a byte: the parameter's shape is not in them
        raise ValueError(f"to_torch_state_dict: 'state'[{key!r}] holds 4-bit states, whose parameter shape only "
                         "the optimizer knows: pass the optimizer itself, not its state_dict()")
    return values.reshape(-1)[:math.prod(shape)].reshape(shape).clone()


def to_torch_state_dict(state_dict) -> dict:
    """A state dict that ``torch.optim.AdamW`` / ``torch.optim.Adam`` ``.load_state_dict`` accepts.

    ``state_dict`` is a pagedopt optimizer's ``state_dict()`` (or the optimizer itself). Per
    parameter it returns ``{'step': float32 scalar tensor, 'exp_avg', 'exp_avg_sq'}``, both
    float32 and shaped like the parameter: 32-bit states are copied; 8-bit states are
    dequantized, element ``j`` being ``qmap[code[j]] * absmax[j // 256]`` (4-bit states: two codes a
    byte, ``absmax[j // 128]``; only from the optimizer itself, which knows the parameters' shapes). Param groups keep
    every key but pagedopt's own (``optim_bits``, ``min_8bit_size``); torch fills in its
    defaults for the keys it misses (``amsgrad=False`` ...; ``AdamW`` always sets its
    ``decoupled_weight_decay``). The input is not modified and shares no tensor with the output.
    """
    if isinstance(state_dict, torch.optim.Optimizer):
        from .optim import AdamBase

        if not isinstance(state_dict, AdamBase):
            raise ValueError(f"to_torch_state_dict exports Adam/AdamW checkpoints; {type(state_dict).__name__} "
                             "is not an Adam optimizer")
        shapes = {i: tuple(p.shape) for i, p in enumerate(p for g in state_dict.param_groups for p in g["params"])}
        state_dict = state_dict.state_dict()
    else:
        shapes = {}
    state = {}
    for key, s in state_dict["state"].items():
        missing = [k for k in ("step", "state1", "state2") if k not in s]
        if missing or s["state1"].numel() != s["state2"].numel():
            what = f"has no {missing[0]!r}" if missing else "has a state1 shaped unlike its state2"
            raise ValueError(f"to_torch_state_dict exports Adam/AdamW checkpoints: 'state'[{key!r}] {what} "
                             "(a checkpoint of another optimizer?)")
        step = s["step"]
        step = step.detach().reshape(()).float().cpu().clone() if isinstance(step, torch.Tensor) else \
            torch.tensor(float(step), dtype=torch.float32)
        shape = shapes.get(key)
        state[key] = {"step": step, "exp_avg": _moment(s, 1, shape, key), "exp_avg_sq": _moment(s, 2, shape, key)}
    groups = [{k: (list(v) if k == "params" else v) for k, v in g.items() if k not in _PAGEDOPT_GROUP_KEYS}
              for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
