"""SGD, as torch.optim.SGD: with momentum, one state (``state1``, the momentum buffer;
csrc/include/pagedopt/algorithms/sgd.h); without (momentum = 0, which bitsandbytes refuses), no
state at all but ``step`` (kernels.plain_sgd). The bitsandbytes classes' names, signatures and
state layout."""
from .spec import AlgorithmSpec, StateSpec
from .variants import REQUIRED, Family, Variant, make_classes


def check_momentum(h: dict, name) -> None:
    """The checks of SGD's momentum settings (LARS shares them)."""
    for key in ("momentum", "dampening"):
        v = h.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
            raise ValueError(f"Invalid {name(key)}: {v!r} (must be a finite float >= 0)")
    nesterov = h.get("nesterov")
    if not isinstance(nesterov, bool):
        raise ValueError(f"Invalid {name('nesterov')}: {nesterov!r} (must be True or False)")
    if nesterov and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise ValueError(f"Invalid {name('nesterov')}: Nesterov momentum needs momentum > 0 and dampening = 0 "
                         f"(got momentum={h['momentum']!r}, dampening={h['dampening']!r})")


SGD_MOMENTUM = AlgorithmSpec(
    "sgd", states=(StateSpec("state1"),), betas=0, has_eps=False, engine="sgd_momentum", check=check_momentum,
    stateless_when=lambda config: config["momentum"] == 0,
    hyper=lambda g: [g["lr"], g["momentum"], g["dampening"], g["weight_decay"], float(g["nesterov"])])

FAMILY = Family(
    SGD_MOMENTUM, "SGDBase", "SGD with 8-bit blockwise-quantized or 32-bit momentum buffers (none without momentum).",
    (("lr", REQUIRED), ("momentum", 0), ("dampening", 0), ("weight_decay", 0), ("nesterov", False),
     ("optim_bits", 32), ("args", None), ("min_8bit_size", 4096), ("percentile_clipping", 100), ("block_wise", True),
     ("capturable", False)),
    ("lr", "momentum", "dampening", "weight_decay", "nesterov", "optim_bits", "min_8bit_size"))

globals().update(make_classes(FAMILY, [
    Variant("SGD", "SGD with momentum buffers of optim_bits (32 or 8) bits."),
    Variant("SGD8bit", "SGD with 8-bit blockwise-quantized momentum buffers.", bits=8, drop=("optim_bits",)),
    Variant("SGD32bit", "SGD with 32-bit momentum buffers.", bits=32, drop=("optim_bits",)),
], __name__))
