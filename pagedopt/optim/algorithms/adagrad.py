"""Adagrad, as torch.optim.Adagrad with lr_decay = 0 and initial_accumulator_value = 0 (others are
refused, as in bitsandbytes): one state (``state1``, the sum of squared gradients;
csrc/include/pagedopt/algorithms/adagrad.h). The bitsandbytes classes' names, signatures and
state layout."""
from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes


def _check(h: dict, name) -> None:
    if h.get("lr_decay", 0) != 0:
        raise ValueError(f"Invalid {name('lr_decay')}: {h['lr_decay']!r} (lr_decay is not supported; use 0)")
    if h.get("initial_accumulator_value", 0) != 0:
        raise ValueError(f"Invalid {name('initial_accumulator_value')}: {h['initial_accumulator_value']!r} "
                         "(only 0 is supported)")


def _refuse(cls, a: dict) -> None:
    if cls._bits is not None and a["optim_bits"] != cls._bits:
        raise ValueError(f"optim_bits={a['optim_bits']!r} is not valid for {cls.__name__} (it keeps "
                         f"{cls._bits}-bit states)")


ADAGRAD = AlgorithmSpec("adagrad", states=(StateSpec("state1"),), betas=0, engine="adagrad", check=_check,
                        hyper=lambda g: [g["lr"], g["eps"], g["weight_decay"]])

FAMILY = Family(
    ADAGRAD, "AdagradBase", "Adagrad with an 8-bit blockwise-quantized or 32-bit sum of squared gradients.",
    (("lr", 1e-2), ("lr_decay", 0), ("weight_decay", 0), ("initial_accumulator_value", 0), ("eps", 1e-10),
     ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096), ("percentile_clipping", 100), ("block_wise", True),
     ("capturable", False)),
    ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "optim_bits", "min_8bit_size"), _refuse)

globals().update(make_classes(FAMILY, [
    Variant("Adagrad", "Adagrad with a sum of squares of optim_bits (32 or 8) bits."),
    Variant("Adagrad8bit", "Adagrad with an 8-bit blockwise-quantized sum of squares.", bits=8,
            defaults={"optim_bits": 8}),
    Variant("Adagrad32bit", "Adagrad with a 32-bit sum of squares.", bits=32),
], __name__))
