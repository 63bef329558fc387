"""Adagrad, as torch.optim.Adagrad with lr_decay = 0 and initial_accumulator_value = 0 (others are
refused, as in bitsandbytes): one state (``state1``, the sum of squared gradients;
csrc/include/pagedopt/algorithms/adagrad.h). The bitsandbytes classes' names, signatures and
state layout."""
from typing import Any

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer


def _check(h: dict, name) -> None:
    if h.get("lr_decay", 0) != 0:
        raise ValueError(f"Invalid {name('lr_decay')}: {h['lr_decay']!r} (lr_decay is not supported; use 0)")
    if h.get("initial_accumulator_value", 0) != 0:
        raise ValueError(f"Invalid {name('initial_accumulator_value')}: {h['initial_accumulator_value']!r} "
                         "(only 0 is supported)")


ADAGRAD = AlgorithmSpec("adagrad", states=(StateSpec("state1"),), betas=0, engine="adagrad", check=_check,
                        hyper=lambda g: [g["lr"], g["eps"], g["weight_decay"]])


class AdagradBase(QuantizedOptimizer):
    """Adagrad with an 8-bit blockwise-quantized or 32-bit sum of squared gradients."""

    algorithm = ADAGRAD

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, optim_bits: int = 32, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 capturable: bool = False):
        if self._bits is not None and optim_bits != self._bits:
            raise ValueError(f"optim_bits={optim_bits!r} is not valid for {type(self).__name__} (it keeps "
                             f"{self._bits}-bit states)")
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         capturable=capturable)


class Adagrad(AdagradBase):
    """Adagrad with a sum of squares of optim_bits (32 or 8) bits."""


class Adagrad8bit(AdagradBase):
    """Adagrad with an 8-bit blockwise-quantized sum of squares."""

    _bits = 8

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, optim_bits: int = 8, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 capturable: bool = False):
        super().__init__(params, lr, lr_decay, weight_decay, initial_accumulator_value, eps, optim_bits, args,
                         min_8bit_size, percentile_clipping, block_wise, capturable=capturable)


class Adagrad32bit(AdagradBase):
    """Adagrad with a 32-bit sum of squares."""

    _bits = 32
