"""AdEMAMix: two first moments (fast and slow EMA) stacked in ``state1`` (shape ``(2, *p.shape)``,
8-bit: ``absmax1`` of shape ``(2, blocks)``, the signed codebook) and the second moment in
``state2`` (the unsigned codebook), decoupled weight decay and the paper's alpha / beta3 warm-up
when ``t_alpha`` / ``t_beta3`` are given (csrc/include/pagedopt/algorithms/ademamix.h); the
bitsandbytes classes' names, signatures and state layout."""
from typing import Any, Optional

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer


def _check(h: dict, name) -> None:
    alpha = h.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha == alpha or abs(alpha) == float("inf"):
        raise ValueError(f"Invalid {name('alpha')}: {alpha!r} (must be a finite float)")
    for key in ("t_alpha", "t_beta3"):
        v = h.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ValueError(f"Invalid {name(key)}: {v!r} (must be None or a positive number of steps)")


ADEMAMIX = AlgorithmSpec(
    "ademamix", states=(StateSpec("state1", moments=2), StateSpec("state2", signed=False)), betas=3,
    engine="ademamix", check=_check,
    hyper=lambda g: [g["lr"], *g["betas"], g["alpha"], g["eps"], g["weight_decay"], g["t_alpha"] or 0.0,
                     g["t_beta3"] or 0.0])


class AdEMAMixBase(QuantizedOptimizer):
    """AdEMAMix with 8-bit blockwise-quantized or 32-bit states, optionally paged."""

    algorithm = ADEMAMIX
    _paged: Any = None

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, optim_bits: int = 32, min_8bit_size: int = 4096, is_paged: bool = False,
                 capturable: bool = False):
        defaults = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                        weight_decay=weight_decay, optim_bits=optim_bits, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, is_paged=is_paged if self._paged is None else self._paged,
                         capturable=capturable)


class AdEMAMix(AdEMAMixBase):
    """AdEMAMix with states of optim_bits (32 or 8) bits."""


class AdEMAMix8bit(AdEMAMixBase):
    """AdEMAMix with 8-bit blockwise-quantized states."""

    _bits = 8

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, is_paged: bool = False,
                 capturable: bool = False):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 8, min_8bit_size, is_paged,
                         capturable=capturable)


class AdEMAMix32bit(AdEMAMix8bit):
    """AdEMAMix with 32-bit states."""

    _bits = 32

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, is_paged: bool = False,
                 capturable: bool = False):
        AdEMAMixBase.__init__(self, params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 32, min_8bit_size,
                              is_paged, capturable=capturable)


class PagedAdEMAMix(AdEMAMixBase):
    """Paged AdEMAMix with states of optim_bits (32 or 8) bits."""

    _paged = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, optim_bits: int = 32, min_8bit_size: int = 4096, capturable: bool = False):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, optim_bits, min_8bit_size,
                         capturable=capturable)


class PagedAdEMAMix8bit(AdEMAMixBase):
    """Paged AdEMAMix with 8-bit blockwise-quantized states."""

    _bits = 8
    _paged = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, capturable: bool = False):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 8, min_8bit_size,
                         capturable=capturable)


class PagedAdEMAMix32bit(PagedAdEMAMix8bit):
    """Paged AdEMAMix with 32-bit states."""

    _bits = 32

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: Optional[int] = None, t_beta3: Optional[int] = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, capturable: bool = False):
        AdEMAMixBase.__init__(self, params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 32, min_8bit_size,
                              capturable=capturable)
