"""The messages of a refused gradient: which parameter (``param_groups[i]['params'][j]``, its shape,
dtype and device) and what is wrong with its gradient. step() validates every gradient in one C++
call (check_grads) and comes here only to explain a failure, before any state changes."""
from __future__ import annotations

import torch

from . import sharding

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def describe(gi: int, pi: int, p: torch.Tensor) -> str:
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, {p.dtype}, {p.device})"


def check_param(gi: int, pi: int, p: torch.Tensor) -> None:
    """Raise a ValueError naming ``p`` if its gradient cannot be used."""
    g = p.grad
    if (p.dtype in SUPPORTED_DTYPES and g.layout == torch.strided and g.dtype == p.dtype
            and g.shape == p.shape and g.device == p.device):
        return  # the common case, without building any message
    where = describe(gi, pi, p)
    if p.is_complex():
        raise ValueError(f"{where}: complex parameters are not supported")
    if p.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{where}: dtype {p.dtype} is not supported (float32, bfloat16, float16 are)")
    if g.is_sparse or g.layout != torch.strided:
        raise ValueError(f"{where}: sparse gradients are not supported")
    if g.dtype != p.dtype:
        raise ValueError(f"{where}: gradient dtype {g.dtype} differs from the parameter's {p.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"{where}: gradient shape {tuple(g.shape)} differs from the parameter's")
    raise ValueError(f"{where}: gradient is on {g.device}, the parameter on {p.device}")


def raise_bad_grad(param_groups: list[dict], p: torch.Tensor) -> None:
    for gi, group in enumerate(param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                check_param(gi, pi, p)
    raise ValueError(f"a gradient does not match its parameter (shape {tuple(p.shape)}, {p.dtype})")


def locate(param_groups: list[dict], p: torch.Tensor) -> str:
    """``describe`` of ``p`` at its place in the groups ("a parameter" if it has none)."""
    return next((describe(gi, pi, p) for gi, group in enumerate(param_groups)
                 for pi, q in enumerate(group["params"]) if q is p), "a parameter")


def raise_bad_sharding(param_groups: list[dict], p: torch.Tensor, g: torch.Tensor) -> None:
    where = locate(param_groups, p)
    raise ValueError(f"{where}: the parameter is {sharding.describe_layout(p)}, its gradient "
                     f"{sharding.describe_layout(g)} (they must be sharded alike)")
