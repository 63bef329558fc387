"""Lion: one moment, decoupled weight decay (csrc/include/pagedopt/algorithms/lion.h), with the
bitsandbytes classes' names, signatures (the form of pagedopt's Adam classes, which keep
``percentile_clipping`` and ``block_wise``) and state layout (``state1``; 8-bit: ``absmax1``,
``qmap1``, the signed dynamic codebook; 4-bit, pagedopt's own: optimizer/state_format.py)."""
from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes

LION = AlgorithmSpec("lion", states=(StateSpec("state1"),), betas=2, has_eps=False, engine="lion",
                     hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["weight_decay"]])

FAMILY = Family(
    LION, "LionBase", "Lion with 8-bit blockwise-quantized or 32-bit states, optionally paged.",
    (("lr", 1e-4), ("betas", (0.9, 0.99)), ("weight_decay", 0), ("optim_bits", 32), ("args", None),
     ("min_8bit_size", 4096), ("percentile_clipping", 100), ("block_wise", True), ("is_paged", False),
     ("capturable", False)),
    ("lr", "betas", "weight_decay", "optim_bits", "min_8bit_size"))

_FIXED, _PAGED = ("optim_bits",), ("is_paged",)
globals().update(make_classes(FAMILY, [
    Variant("Lion", "Lion with states of optim_bits (32, 8 or 4) bits."),
    Variant("Lion8bit", "Lion with 8-bit blockwise-quantized states.", bits=8, drop=_FIXED),
    Variant("Lion32bit", "Lion with 32-bit states.", bits=32, drop=_FIXED),
    Variant("Lion4bit", "Lion with 4-bit blockwise-quantized states.", bits=4, drop=_FIXED),
    Variant("PagedLion", "Paged Lion with states of optim_bits (32, 8 or 4) bits.", paged=True, drop=_PAGED),
    Variant("PagedLion8bit", "Paged Lion with 8-bit blockwise-quantized states.", bits=8, paged=True,
            drop=_FIXED + _PAGED),
    Variant("PagedLion32bit", "Paged Lion with 32-bit states.", bits=32, paged=True, drop=_FIXED + _PAGED),
    Variant("PagedLion4bit", "Paged Lion with 4-bit blockwise-quantized states.", bits=4, paged=True,
            drop=_FIXED + _PAGED),
], __name__))
