"""RMSprop, as torch.optim.RMSprop without momentum and not centered: one state (``state1``, the
square average; csrc/include/pagedopt/algorithms/rmsprop.h). The bitsandbytes classes' names,
signatures and state layout; momentum != 0 and centered=True are refused, as in bitsandbytes."""
from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes


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

FAMILY = Family(
    RMSPROP, "RMSpropBase", "RMSprop with an 8-bit blockwise-quantized or 32-bit square average.",
    (("lr", 1e-2), ("alpha", 0.99), ("eps", 1e-8), ("weight_decay", 0), ("momentum", 0), ("centered", False),
     ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096), ("percentile_clipping", 100), ("block_wise", True),
     ("capturable", False)),
    ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "optim_bits", "min_8bit_size"))

globals().update(make_classes(FAMILY, [
    Variant("RMSprop", "RMSprop with a square average of optim_bits (32 or 8) bits."),
    Variant("RMSprop8bit", "RMSprop with an 8-bit blockwise-quantized square average.", bits=8, drop=("optim_bits",)),
    Variant("RMSprop32bit", "RMSprop with a 32-bit square average.", bits=32, drop=("optim_bits",)),
], __name__))
