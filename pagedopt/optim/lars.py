"""LARS: SGD with momentum whose update is scaled down when its norm exceeds max_unorm times the
parameter's (csrc/include/pagedopt/algorithms/lars.h, update_norm.py); bitsandbytes' names,
signatures and state layout (``state1``, ``unorm_vec``). Momentum is required, as in bitsandbytes."""
from typing import Any

from .algorithm import AlgorithmSpec, StateSpec
from .sgd import _check as _check_sgd
from .update_norm import ScaledByUpdateNorm


def _check(h: dict, name) -> None:
    _check_sgd(h, name)
    if h["momentum"] == 0:
        raise ValueError(f"Invalid {name('momentum')}: 0 (LARS needs momentum > 0, as in bitsandbytes)")
    v = h.get("max_unorm")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
        raise ValueError(f"Invalid {name('max_unorm')}: {v!r} (must be a finite float >= 0)")


LARS_SPEC = AlgorithmSpec(
    "lars", states=(StateSpec("state1"),), betas=0, has_eps=False, engine="lars", check=_check,
    hyper=lambda g: [g["lr"], g["momentum"], g["dampening"], g["weight_decay"], float(g["nesterov"])])


class LARSBase(ScaledByUpdateNorm):
    """LARS with an 8-bit blockwise-quantized or 32-bit momentum buffer."""

    algorithm = LARS_SPEC

    def __init__(self, params, lr, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, optim_bits: int = 32, args: Any = None, min_8bit_size: int = 4096,
                 percentile_clipping: int = 100, max_unorm: float = 0.02, capturable: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        max_unorm=max_unorm, optim_bits=optim_bits, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, capturable=capturable)


class LARS(LARSBase):
    """LARS with a momentum buffer of optim_bits (32 or 8) bits."""


class LARS8bit(LARSBase):
    """LARS with an 8-bit blockwise-quantized momentum buffer."""

    _bits = 8

    def __init__(self, params, lr, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, args: Any = None, min_8bit_size: int = 4096, percentile_clipping: int = 100,
                 max_unorm: float = 0.02, capturable: bool = False):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, self._bits, args, min_8bit_size,
                         percentile_clipping, max_unorm, capturable=capturable)


class LARS32bit(LARS8bit):
    """LARS with a 32-bit momentum buffer."""

    _bits = 32
