"""Adam and AdamW (csrc/include/pagedopt/algorithms/adam.h; 32-bit states on torch's fused
Adam/AdamW kernels) with the bitsandbytes classes' names, signatures and state layout.

Adam* use L2 weight decay (added to the gradient), AdamW* decoupled decay, exactly as torch.
The *8bit classes always keep 8-bit states (their optim_bits argument is accepted for
signature compatibility, as in bitsandbytes, and must be 8 or 32); *4bit always 4-bit states
(pagedopt's own: two codes a byte, blocks of 128, optimizer/state_format.py); *32bit always
32-bit; Paged* always page their states through CUDA unified memory.
"""
from dataclasses import replace

from .spec import AlgorithmSpec, StateSpec
from .variants import Family, Variant, make_classes

# hyper: lr, beta1, beta2, eps, weight_decay, decoupled (the functor's order)
ADAM = AlgorithmSpec("adam", states=(StateSpec("state1"), StateSpec("state2", signed=False)), engine="adam",
                     fused32="_fused_adam_",
                     hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], 0.0])
ADAMW = replace(ADAM, fused32="_fused_adamw_",
                hyper=lambda g: [g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], 1.0])


def _refuse(cls, a: dict) -> None:
    if a["amsgrad"]:
        raise ValueError("amsgrad=True is not supported by pagedopt optimizers")


FAMILY = Family(
    ADAM, "AdamBase",
    """Adam with 8-bit blockwise-quantized or 32-bit states, optionally paged.

    ``decoupled`` (a class attribute of the concrete class) selects AdamW's decoupled
    weight decay; otherwise weight decay is L2, added to the gradient, as in torch.optim.Adam.
    """,
    (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("amsgrad", False),
     ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096), ("percentile_clipping", 100),
     ("block_wise", True), ("is_paged", False), ("capturable", False)),
    ("lr", "betas", "eps", "weight_decay", "optim_bits", "min_8bit_size"), _refuse)

_L2, _DECOUPLED = "weight decay is L2 (Adam)", "weight decay is decoupled (AdamW)"
_ADAM = dict(attrs={"decoupled": False})
_ADAMW = dict(spec=ADAMW, defaults={"weight_decay": 1e-2}, attrs={"decoupled": True})
_PAGED = dict(paged=True, drop=("is_paged",))

globals().update(make_classes(FAMILY, [
    Variant("Adam", f"Adam with states of optim_bits (32, 8 or 4) bits; {_L2}.", **_ADAM),
    Variant("Adam8bit", f"Adam with 8-bit blockwise-quantized states; {_L2}.", bits=8, **_ADAM),
    Variant("Adam32bit", f"Adam with 32-bit states; {_L2}.", bits=32, **_ADAM),
    Variant("Adam4bit", f"Adam with 4-bit blockwise-quantized states; {_L2}.", bits=4, **_ADAM),
    Variant("PagedAdam", f"Paged Adam with states of optim_bits (32, 8 or 4) bits; {_L2}.", **_PAGED, **_ADAM),
    Variant("PagedAdam8bit", f"Paged Adam with 8-bit blockwise-quantized states; {_L2}.", bits=8, **_PAGED, **_ADAM),
    Variant("PagedAdam32bit", f"Paged Adam with 32-bit states; {_L2}.", bits=32, **_PAGED, **_ADAM),
    Variant("PagedAdam4bit", f"Paged Adam with 4-bit blockwise-quantized states; {_L2}.", bits=4, **_PAGED, **_ADAM),
    Variant("AdamW", f"AdamW with states of optim_bits (32, 8 or 4) bits; {_DECOUPLED}.", **_ADAMW),
    Variant("AdamW8bit", f"AdamW with 8-bit blockwise-quantized states; {_DECOUPLED}.", bits=8, **_ADAMW),
    Variant("AdamW32bit", f"AdamW with 32-bit states; {_DECOUPLED}.", bits=32, **_ADAMW),
    Variant("AdamW4bit", f"AdamW with 4-bit blockwise-quantized states; {_DECOUPLED}.", bits=4, **_ADAMW),
    Variant("PagedAdamW", f"Paged AdamW with states of optim_bits (32, 8 or 4) bits; {_DECOUPLED}.", **_PAGED, **_ADAMW),
    Variant("PagedAdamW8bit", f"Paged AdamW with 8-bit blockwise-quantized states; {_DECOUPLED}.", bits=8, **_PAGED,
            **_ADAMW),
    Variant("PagedAdamW32bit", f"Paged AdamW with 32-bit states; {_DECOUPLED}.", bits=32, **_PAGED, **_ADAMW),
    Variant("PagedAdamW4bit", f"Paged AdamW with 4-bit blockwise-quantized states; {_DECOUPLED}.", bits=4, **_PAGED,
            **_ADAMW),
], __name__))
