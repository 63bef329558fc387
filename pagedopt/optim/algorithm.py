"""What each optimizer algorithm declares to the shared base (base.QuantizedOptimizer): its state
tensors and their codebooks, its hyperparameters and how the fused op reads them.

Adding an optimizer to the generic engine takes a functor in csrc/include/pagedopt/algorithms/,
one AlgorithmSpec here and one short class per public variant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a parameter: ``key`` (``state1``), its absmax and codebook keys
    (``absmax1``, ``qmap1``) when 8-bit. ``moments`` moments are stacked in it: shape
    ``(moments, *param.shape)`` and absmax ``(moments, blocks)`` when more than one (AdEMAMix's
    two first moments), the parameter's shape otherwise. ``signed`` picks the signed dynamic
    codebook; the unsigned one suits moments that are never negative."""

    key: str
    moments: int = 1
    signed: bool = True

    @property
    def absmax_key(self) -> str:
        return self.key.replace("state", "absmax")

    @property
    def qmap_key(self) -> str:
        return self.key.replace("state", "qmap")

    def shape(self, param_shape) -> tuple:
        return (self.moments, *param_shape) if self.moments > 1 else tuple(param_shape)

    def absmax_shape(self, blocks: int) -> tuple:
        return (self.moments, blocks) if self.moments > 1 else (blocks,)


@dataclass(frozen=True)
class AlgorithmSpec:
    """``engine``: the algorithm's name in the generic op (``quantized_step_``). ``betas``: how
    many betas it takes, ``has_eps``: whether it takes eps. ``hyper``: the op's ``hyper`` list
    from a param group (the order the functor documents; a class may override _engine_hyper
    instead, as Adam does for its decoupled flag). ``check``: checks of its
    own hyperparameters beyond the common ones (lr, betas, eps, weight_decay, optim_bits,
    min_8bit_size), raising ValueError with the message prefix it is given."""

    name: str
    states: tuple[StateSpec, ...]
    betas: int = 2
    has_eps: bool = True
    engine: Optional[str] = None
    hyper: Optional[Callable[[dict], list]] = None
    check: Optional[Callable[[dict, Callable[[str], str]], None]] = None
    stateless_ok: bool = False  # a parameter may have no state but its step (plain SGD)

    @property
    def state_keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.states)

    @property
    def absmax_keys(self) -> tuple[str, ...]:
        return tuple(s.absmax_key for s in self.states)

    @property
    def qmap_keys(self) -> tuple[str, ...]:
        return tuple(s.qmap_key for s in self.states)
