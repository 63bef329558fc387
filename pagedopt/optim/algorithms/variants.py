"""The public classes, made from tables: one ``Family`` per algorithm (its spec, its constructor's
arguments with bitsandbytes' names, order and defaults, which of them are param-group settings)
and one ``Variant`` line per public class (``AdamW8bit``: 8-bit states, not paged, AdamW's
spec and defaults). ``make_classes`` turns a family and its lines into classes whose
``__init__`` has exactly the variant's signature (``inspect.signature`` shows it) and hands the
bound arguments to QuantizedOptimizer."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..base import QuantizedOptimizer
from .spec import AlgorithmSpec

REQUIRED = inspect.Parameter.empty  # an argument without a default (SGD's lr)

# The annotations the signatures show, by argument name (those without one show none).
_ANNOTATIONS = {"lr": float, "eps": float, "weight_decay": float, "alpha": float, "t_alpha": Optional[int],
                "t_beta3": Optional[int], "optim_bits": int, "args": Any, "min_8bit_size": int,
                "percentile_clipping": int, "block_wise": bool, "is_paged": bool, "capturable": bool,
                "amsgrad": bool, "momentum": float, "dampening": float, "nesterov": bool, "centered": bool,
                "lr_decay": float, "initial_accumulator_value": float, "bias_correction": bool,
                "adam_w_mode": bool, "max_unorm": float, "bf16_stochastic_round": bool}

# The constructor arguments every family takes that are not param-group settings: QuantizedOptimizer's own.
_OPTIONS = ("args", "percentile_clipping", "block_wise", "is_paged", "capturable")

# The param-group settings every class takes after its family's arguments: bf16_stochastic_round
# (torchao's name): the updates of bf16 parameters are rounded to bf16 stochastically (README,
# "bf16 parameters"); ignored for other dtypes.
COMMON_ARGUMENTS = (("bf16_stochastic_round", False),)
COMMON_GROUP_KEYS = tuple(name for name, _ in COMMON_ARGUMENTS)


@dataclass(frozen=True)
class Family:
    """An algorithm's public classes have these constructor ``arguments`` ((name, default), in
    order, after ``params``); ``group_keys`` of them are param-group settings (``defaults``, in
    this order), the others QuantizedOptimizer's options or ones ``refuse`` consumes.
    ``refuse(cls, arguments)`` raises a ValueError for arguments the family does not support
    (``amsgrad=True``) before anything is made; ``ignore``: options accepted and ignored (LAMB's
    ``block_wise``, whose only layout here is blockwise)."""

    spec: AlgorithmSpec
    base_name: str
    base_doc: str
    arguments: tuple[tuple[str, Any], ...]
    group_keys: tuple[str, ...]
    refuse: Optional[Callable[[type, dict], None]] = None
    ignore: tuple[str, ...] = ()


@dataclass(frozen=True)
class Variant:
    """One public class: its ``name`` and docstring; ``bits`` fixes the state width (None:
    ``optim_bits`` chooses); ``paged`` fixes paging (None: ``is_paged`` chooses); ``drop``: the
    family's arguments its signature lacks; ``defaults``: its own defaults; ``spec``: another spec
    than the family's (AdamW's decoupled decay); ``attrs``: class attributes."""

    name: str
    doc: str
    bits: Optional[int] = None
    paged: Optional[bool] = None
    drop: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)
    spec: Optional[AlgorithmSpec] = None
    attrs: dict = field(default_factory=dict)


def _signature(family: Family, variant: Optional[Variant]) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    drop = () if variant is None else variant.drop
    own = {} if variant is None else variant.defaults
    parameters = [inspect.Parameter("self", kind), inspect.Parameter("params", kind)]
    for name, default in family.arguments + COMMON_ARGUMENTS:
        if name not in drop:
            default = own.get(name, default)
            annotation = _ANNOTATIONS.get(name, inspect.Parameter.empty) if default is not REQUIRED else REQUIRED
            parameters.append(inspect.Parameter(name, kind, default=default, annotation=annotation))
    return inspect.Signature(parameters)


def _init(family: Family, signature: inspect.Signature, bits: Optional[int], paged: Optional[bool]):
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__}(): {exc}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"]
        params = values.pop("params")
        if "optim_bits" not in values:  # a fixed-width class without the argument
            values["optim_bits"] = bits
        if family.refuse is not None:
            family.refuse(type(self), values)
        defaults = {k: values[k] for k in family.group_keys + COMMON_GROUP_KEYS}
        options = {k: values[k] for k in _OPTIONS if k in values and k not in family.ignore}
        if paged is not None:
            options["is_paged"] = paged
        QuantizedOptimizer.__init__(self, params, defaults, **options)

    __init__.__signature__ = signature
    return __init__


def make_classes(family: Family, variants: list[Variant], module: str) -> dict[str, type]:
    """The family's base class (``family.base_name``) and one subclass of it per variant, by name."""
    base = type(family.base_name, (QuantizedOptimizer,), {
        "__doc__": family.base_doc, "__module__": module, "algorithm": family.spec,
        "__init__": _init(family, _signature(family, None), None, None)})
    classes = {family.base_name: base}
    for v in variants:
        attrs = {"__doc__": v.doc, "__module__": module, "_bits": v.bits,
                 "__init__": _init(family, _signature(family, v), v.bits, v.paged), **v.attrs}
        if v.spec is not None:
            attrs["algorithm"] = v.spec
        classes[v.name] = type(v.name, (base,), attrs)
    return classes
