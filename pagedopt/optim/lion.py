"""Lion: one moment, decoupled weight decay (csrc/include/pagedopt/algorithms/lion.h), with the
bitsandbytes classes' names, signatures (the form of pagedopt's Adam classes, which keep
``percentile_clipping`` and ``block_wise``) and state layout (``state1``; 8-bit: ``absmax1``,
``qmap1``, the signed dynamic codebook)."""
from typing import Any

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer

LION = AlgorithmSpec("lion", states=(StateSpec("state1"),), betas=2, has_eps=False, engine="lion",
                     hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["weight_decay"]])


class LionBase(QuantizedOptimizer):
    """Lion with 8-bit blockwise-quantized or 32-bit states, optionally paged."""

    algorithm = LION
    _paged: Any = None  # True for the Paged* classes

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0, optim_bits: int = 32,
                 args: Any = None, min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 is_paged: bool = False, capturable: bool = False):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         is_paged=is_paged if self._paged is None else self._paged, capturable=capturable)


class Lion(LionBase):
    """Lion with states of optim_bits (32 or 8) bits."""


class Lion8bit(LionBase):
    """Lion with 8-bit blockwise-quantized states."""

    _bits = 8

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 is_paged: bool = False, capturable: bool = False):
        super().__init__(params, lr, betas, weight_decay, self._bits, args, min_8bit_size, percentile_clipping,
                         block_wise, is_paged, capturable=capturable)


class Lion32bit(Lion8bit):
    """Lion with 32-bit states."""

    _bits = 32


class PagedLion(LionBase):
    """Paged Lion with states of optim_bits (32 or 8) bits."""

    _paged = True

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0, optim_bits: int = 32,
                 args: Any = None, min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, weight_decay, optim_bits, args, min_8bit_size, percentile_clipping,
                         block_wise, capturable=capturable)


class PagedLion8bit(LionBase):
    """Paged Lion with 8-bit blockwise-quantized states."""

    _bits = 8
    _paged = True

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, weight_decay, self._bits, args, min_8bit_size, percentile_clipping,
                         block_wise, capturable=capturable)


class PagedLion32bit(PagedLion8bit):
    """Paged Lion with 32-bit states."""

    _bits = 32
