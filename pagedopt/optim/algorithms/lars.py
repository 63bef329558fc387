"""LARS: SGD with momentum whose update is scaled down when its norm exceeds max_unorm times the
parameter's (csrc/include/pagedopt/algorithms/lars.h, the norm pass in kernels.py); bitsandbytes'
names, signatures and state layout (``state1``, ``unorm_vec``). Momentum is required, as in
bitsandbytes."""
from .sgd import check_momentum
from .spec import AlgorithmSpec, StateSpec
from .variants import REQUIRED, Family, Variant, make_classes


def _check(h: dict, name) -> None:
    check_momentum(h, name)
    if h["momentum"] == 0:
        raise ValueError(f"Invalid {name('momentum')}: 0 (LARS needs momentum > 0, as in bitsandbytes)")
    v = h.get("max_unorm")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
        raise ValueError(f"Invalid {name('max_unorm')}: {v!r} (must be a finite float >= 0)")


LARS_SPEC = AlgorithmSpec(
    "lars", states=(StateSpec("state1"),), betas=0, has_eps=False, engine="lars", check=_check, norm_scaled=True,
    hyper=lambda g: [g["lr"], g["momentum"], g["dampening"], g["weight_decay"], float(g["nesterov"])])

FAMILY = Family(
    LARS_SPEC, "LARSBase", "LARS with an 8-bit blockwise-quantized or 32-bit momentum buffer.",
    (("lr", REQUIRED), ("momentum", 0), ("dampening", 0), ("weight_decay", 0), ("nesterov", False),
     ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096), ("percentile_clipping", 100), ("max_unorm", 0.02),
     ("capturable", False)),
    ("lr", "momentum", "dampening", "weight_decay", "nesterov", "max_unorm", "optim_bits", "min_8bit_size"))

globals().update(make_classes(FAMILY, [
    Variant("LARS", "LARS with a momentum buffer of optim_bits (32 or 8) bits."),
    Variant("LARS8bit", "LARS with an 8-bit blockwise-quantized momentum buffer.", bits=8, drop=("optim_bits",)),
    Variant("LARS32bit", "LARS with a 32-bit momentum buffer.", bits=32, drop=("optim_bits",)),
], __name__))
