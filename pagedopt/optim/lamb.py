"""LAMB: Adam whose update is scaled down when its norm exceeds max_unorm times the parameter's
(csrc/include/pagedopt/algorithms/lamb.h, update_norm.py); bitsandbytes' names, signatures and
state layout (``state1``/``state2``, 8-bit ``absmax*``/``qmap*`` as for Adam, ``unorm_vec``).
bitsandbytes' LAMB defaults to ``block_wise=False``; pagedopt accepts the argument and always
quantizes in blocks of 256 (its only 8-bit layout)."""
from typing import Any

from .algorithm import AlgorithmSpec, StateSpec
from .update_norm import ScaledByUpdateNorm


def _check(h: dict, name) -> None:
    v = h.get("max_unorm")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
        raise ValueError(f"Invalid {name('max_unorm')}: {v!r} (must be a finite float >= 0)")
    for key in ("bias_correction", "adam_w_mode"):
        if not isinstance(h.get(key), bool):
            raise ValueError(f"Invalid {name(key)}: {h.get(key)!r} (must be True or False)")


LAMB_SPEC = AlgorithmSpec(
    "lamb", states=(StateSpec("state1"), StateSpec("state2", signed=False)), engine="lamb", check=_check,
    hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], float(g["adam_w_mode"]),
                     float(g["bias_correction"])])


class LAMBBase(ScaledByUpdateNorm):
    """LAMB with 8-bit blockwise-quantized or 32-bit moments."""

    algorithm = LAMB_SPEC

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adam_w_mode: bool = True, optim_bits: int = 32,
                 args: Any = None, min_8bit_size: int = 4096, percentile_clipping: int = 100,
                 block_wise: bool = False, max_unorm: float = 1.0, capturable: bool = False):
        if amsgrad:
            raise ValueError(f"Invalid amsgrad: True ({type(self).__name__} does not support amsgrad)")
        if self._bits == 8 and max_unorm != 1.0:
            raise ValueError(f"Invalid max_unorm: {max_unorm!r} ({type(self).__name__} supports only 1.0, as in "
                             "bitsandbytes; LAMB32bit takes others)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, max_unorm=max_unorm, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, capturable=capturable)


class LAMB(LAMBBase):
    """LAMB with moments of optim_bits (32 or 8) bits."""


class LAMB8bit(LAMBBase):
    """LAMB with 8-bit blockwise-quantized moments."""

    _bits = 8

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adam_w_mode: bool = True, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = False,
                 max_unorm: float = 1.0, capturable: bool = False):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, self._bits, args,
                         min_8bit_size, percentile_clipping, block_wise, max_unorm, capturable=capturable)


class LAMB32bit(LAMB8bit):
    """LAMB with 32-bit moments."""

    _bits = 32
