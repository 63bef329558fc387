"""SGD, as torch.optim.SGD: with momentum, one state (``state1``, the momentum buffer;
csrc/include/pagedopt/algorithms/sgd.h); without (momentum = 0, which bitsandbytes refuses), no
state at all but ``step``. The bitsandbytes classes' names, signatures and state layout."""
from typing import Any

import torch

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer
from .capture import lr_tensor


def _check(h: dict, name) -> None:
    for key in ("momentum", "dampening"):
        v = h.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
            raise ValueError(f"Invalid {name(key)}: {v!r} (must be a finite float >= 0)")
    nesterov = h.get("nesterov")
    if not isinstance(nesterov, bool):
        raise ValueError(f"Invalid {name('nesterov')}: {nesterov!r} (must be True or False)")
    if nesterov and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise ValueError(f"Invalid {name('nesterov')}: Nesterov momentum needs momentum > 0 and dampening = 0 "
                         f"(got momentum={h['momentum']!r}, dampening={h['dampening']!r})")


SGD_MOMENTUM = AlgorithmSpec(
    "sgd", states=(StateSpec("state1"),), betas=0, has_eps=False, engine="sgd_momentum", check=_check,
    stateless_ok=True,
    hyper=lambda g: [g["lr"], g["momentum"], g["dampening"], g["weight_decay"], float(g["nesterov"])])


class SGDBase(QuantizedOptimizer):
    """SGD with 8-bit blockwise-quantized or 32-bit momentum buffers (none without momentum)."""

    algorithm = SGD_MOMENTUM

    def __init__(self, params, lr, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, optim_bits: int = 32, args: Any = None, min_8bit_size: int = 4096,
                 percentile_clipping: int = 100, block_wise: bool = True, capturable: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        optim_bits=optim_bits, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         capturable=capturable)

    def _needs_states(self, config: dict) -> bool:
        return config["momentum"] != 0

    def _step_stateless(self, group: dict, params, grads, grad_scale, found_inf) -> None:
        """Plain SGD (torch.optim.SGD with momentum = 0): p -= lr * (g + weight_decay * p), in fp32;
        GradScaler's found_inf keeps every parameter as it was (torch.where: no host synchronisation)."""
        lr_t = lr_tensor(group, params[0].device) if params else None  # read on the device (capturable)
        lr, wd = (0.0 if lr_t is not None else float(group["lr"])), float(group["weight_decay"])
        inv_scale = None if grad_scale is None else grad_scale.reciprocal()  # exact for GradScaler's powers of two
        for p, g in zip(params, grads):
            g32 = g.float()
            if inv_scale is not None:
                g32 = g32 * inv_scale
            p32 = p.float()
            if wd != 0:
                g32 = g32.add(p32, alpha=wd)
            new = p32.add(g32, alpha=-lr) if lr_t is None else torch.addcmul(p32, g32, lr_t, value=-1)
            if found_inf is not None:
                new = torch.where(found_inf > 0, p32, new)
            p.copy_(new)


class SGD(SGDBase):
    """SGD with momentum buffers of optim_bits (32 or 8) bits."""


class SGD8bit(SGDBase):
    """SGD with 8-bit blockwise-quantized momentum buffers."""

    _bits = 8

    def __init__(self, params, lr, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, args: Any = None, min_8bit_size: int = 4096, percentile_clipping: int = 100,
                 block_wise: bool = True, capturable: bool = False):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, self._bits, args, min_8bit_size,
                         percentile_clipping, block_wise, capturable=capturable)


class SGD32bit(SGD8bit):
    """SGD with 32-bit momentum buffers."""

    _bits = 32
