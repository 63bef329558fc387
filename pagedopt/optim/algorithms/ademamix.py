"""AdEMAMix: two first moments (fast and slow EMA) stacked in ``state1`` (shape ``(2, *p.shape)``,
8-bit: ``absmax1`` of shape ``(2, blocks)``, the signed codebook) and the second moment in
``state2`` (the unsigned codebook), decoupled weight decay and the paper's alpha / beta3 warm-up
when ``t_alpha`` / ``t_beta3`` are given (csrc/include/pagedopt/algorithms/ademamix.h); the
bitsandbytes classes' names, signatures and state layout."""
from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes


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

FAMILY = Family(
    ADEMAMIX, "AdEMAMixBase", "AdEMAMix with 8-bit blockwise-quantized or 32-bit states, optionally paged.",
    (("lr", 1e-3), ("betas", (0.9, 0.999, 0.9999)), ("alpha", 5.0), ("t_alpha", None), ("t_beta3", None),
     ("eps", 1e-8), ("weight_decay", 1e-2), ("optim_bits", 32), ("min_8bit_size", 4096), ("is_paged", False),
     ("capturable", False)),
    ("lr", "betas", "alpha", "t_alpha", "t_beta3", "eps", "weight_decay", "optim_bits", "min_8bit_size"))

_FIXED, _PAGED = ("optim_bits",), ("is_paged",)
globals().update(make_classes(FAMILY, [
    Variant("AdEMAMix", "AdEMAMix with states of optim_bits (32, 8 or 4) bits."),
    Variant("AdEMAMix8bit", "AdEMAMix with 8-bit blockwise-quantized states.", bits=8, drop=_FIXED),
    Variant("AdEMAMix32bit", "AdEMAMix with 32-bit states.", bits=32, drop=_FIXED),
    Variant("PagedAdEMAMix", "Paged AdEMAMix with states of optim_bits (32, 8 or 4) bits.", paged=True, drop=_PAGED),
    Variant("PagedAdEMAMix8bit", "Paged AdEMAMix with 8-bit blockwise-quantized states.", bits=8, paged=True,
            drop=_FIXED + _PAGED),
    Variant("PagedAdEMAMix32bit", "Paged AdEMAMix with 32-bit states.", bits=32, paged=True, drop=_FIXED + _PAGED),
], __name__))
