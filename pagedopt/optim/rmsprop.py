"""RMSprop, as torch.optim.RMSprop without momentum and not centered: one state (``state1``, the
square average; csrc/include/pagedopt/algorithms/rmsprop.h). The bitsandbytes classes' names,
signatures and state layout; momentum != 0 and centered=True are refused, as in bitsandbytes."""
from typing import Any

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer


def _check(h: dict, name) -> None:
    alpha = h.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha < 1.0:
        raise ValueError(f"Invalid {name('alpha')}: {alpha!r} (must be a float in [0, 1))")
    if h.get("momentum", 0) != 0:
        raise ValueError(f"Invalid {name('momentum')}: {h['momentum']!r} (RMSprop with momentum is not supported; "
                         "use 0)")
    if h.get("centered", False):
        raise ValueError(f"Invalid {name('centered')}: {h['centered']!r} (centered RMSprop is not supported)")


RMSPROP = AlgorithmSpec("rmsprop", states=(StateSpec("state1"),), betas=0, engine="rmsprop", check=_check,
                        hyper=lambda g: [g["lr"], g["alpha"], g["eps"], g["weight_decay"]])


class RMSpropBase(QuantizedOptimizer):
    """RMSprop with an 8-bit blockwise-quantized or 32-bit square average."""

    algorithm = RMSPROP

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False, optim_bits: int = 32, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 capturable: bool = False):
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered,
                        optim_bits=optim_bits, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         capturable=capturable)


class RMSprop(RMSpropBase):
    """RMSprop with a square average of optim_bits (32 or 8) bits."""


class RMSprop8bit(RMSpropBase):
    """RMSprop with an 8-bit blockwise-quantized square average."""

    _bits = 8

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False, args: Any = None, min_8bit_size: int = 4096,
                 percentile_clipping: int = 100, block_wise: bool = True, capturable: bool = False):
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, self._bits, args, min_8bit_size,
                         percentile_clipping, block_wise, capturable=capturable)


class RMSprop32bit(RMSprop8bit):
    """RMSprop with a 32-bit square average."""

    _bits = 32
