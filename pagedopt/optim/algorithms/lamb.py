"""LAMB: Adam whose update is scaled down when its norm exceeds max_unorm times the parameter's
(csrc/include/pagedopt/algorithms/lamb.h, the norm pass in kernels.py); bitsandbytes' names,
signatures and state layout (``state1``/``state2``, 8-bit ``absmax*``/``qmap*`` as for Adam,
``unorm_vec``). bitsandbytes' LAMB defaults to ``block_wise=False``; pagedopt accepts the argument
and always quantizes in blocks of 256 (its only 8-bit layout)."""
from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes


def _check(h: dict, name) -> None:
    v = h.get("max_unorm")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
        raise ValueError(f"Invalid {name('max_unorm')}: {v!r} (must be a finite float >= 0)")
    for key in ("bias_correction", "adam_w_mode"):
        if not isinstance(h.get(key), bool):
            raise ValueError(f"Invalid {name(key)}: {h.get(key)!r} (must be True or False)")


def _refuse(cls, a: dict) -> None:
    if a["amsgrad"]:
        raise ValueError(f"Invalid amsgrad: True ({cls.__name__} does not support amsgrad)")
    if cls._bits == 8 and a["max_unorm"] != 1.0:
        raise ValueError(f"Invalid max_unorm: {a['max_unorm']!r} ({cls.__name__} supports only 1.0, as in "
                         "bitsandbytes; LAMB32bit takes others)")


LAMB_SPEC = AlgorithmSpec(
    "lamb", states=(StateSpec("state1"), StateSpec("state2", signed=False)), engine="lamb", check=_check,
    norm_scaled=True,
    hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], float(g["adam_w_mode"]),
                     float(g["bias_correction"])])

FAMILY = Family(
    LAMB_SPEC, "LAMBBase", "LAMB with 8-bit blockwise-quantized or 32-bit moments.",
    (("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0),
     ("amsgrad", False), ("adam_w_mode", True), ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096),
     ("percentile_clipping", 100), ("block_wise", False), ("max_unorm", 1.0), ("capturable", False)),
    ("lr", "bias_correction", "betas", "eps", "weight_decay", "adam_w_mode", "max_unorm", "optim_bits",
     "min_8bit_size"), _refuse, ignore=("block_wise",))

globals().update(make_classes(FAMILY, [
    Variant("LAMB", "LAMB with moments of optim_bits (32 or 8) bits."),
    Variant("LAMB8bit", "LAMB with 8-bit blockwise-quantized moments.", bits=8, drop=("optim_bits",)),
    Variant("LAMB32bit", "LAMB with 32-bit moments.", bits=32, drop=("optim_bits",)),
], __name__))
