"""What each optimizer algorithm declares to the step pipeline: its state tensors and their
codebooks, its hyperparameters and their checks, and which kernel functional updates it (the
generic engine's functor, torch's fused 32-bit kernel, a norm pass first, or no state at all).

Adding an optimizer takes a functor in csrc/include/pagedopt/algorithms/, one AlgorithmSpec in a
module of this package and one line per public variant in its table (variants.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a parameter: ``key`` (``state1``), its absmax and codebook keys
    (``absmax1``, ``qmap1``) when quantized. ``moments`` moments are stacked in it: shape
    ``(moments, *param.shape)`` and absmax ``(moments, blocks)`` when more than one (AdEMAMix's
    two first moments), the parameter's shape otherwise (the shapes of each format:
    state_format.py). ``signed`` picks the signed codebook; the unsigned one suits moments that
    are never negative."""

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
    from a param group (the order the functor documents). ``check``: checks of its own
    hyperparameters beyond the common ones (lr, betas, eps, weight_decay, optim_bits,
    min_8bit_size), raising ValueError with the message prefix it is given.

    How its buckets are updated (kernels.py): ``fused32`` names torch's fused kernel that updates
    its 32-bit states (``"_fused_adamw_"``; None: the generic engine's 32-bit path);
    ``stateless_when(config)`` says when a parameter keeps no state but ``step`` (plain SGD);
    ``norm_scaled``: each tensor's update is scaled by min(1, max_unorm ||p|| / ||u||), which
    needs a norm pass first (LARS, LAMB; their ``unorm_vec`` state)."""

    name: str
    states: tuple[StateSpec, ...]
    betas: int = 2
    has_eps: bool = True
    engine: Optional[str] = None
    hyper: Optional[Callable[[dict], list]] = None
    check: Optional[Callable[[dict, Callable[[str], str]], None]] = None
    fused32: Optional[str] = None
    stateless_when: Optional[Callable[[dict], bool]] = None
    norm_scaled: bool = False

    @property
    def stateless_ok(self) -> bool:
        """Whether a parameter may have no state but its step (plain SGD)."""
        return self.stateless_when is not None

    def needs_states(self, config: dict) -> bool:
        """Whether a parameter under ``config`` (its group and overrides) keeps the states."""
        return self.stateless_when is None or not self.stateless_when(config)

    def call_keys(self, quantized: bool, stateful: bool = True) -> tuple[str, ...]:
        """The state keys a fused call takes, one list each: states, absmax (8- and 4-bit), step."""
        if not stateful:
            return ("step",)
        return self.state_keys + (self.absmax_keys if quantized else ()) + ("step",) + self.extra_keys

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """States beside the moments and ``step`` (one float32 per parameter): norm-scaled
        algorithms keep the last update norm in ``unorm_vec``."""
        return ("unorm_vec",) if self.norm_scaled else ()

    @property
    def memory_keys(self) -> tuple[str, ...]:
        """The keys of the state tensors that take memory (what a pager stages or streams)."""
        return self.state_keys + self.absmax_keys

    @property
    def state_keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.states)

    @property
    def absmax_keys(self) -> tuple[str, ...]:
        return tuple(s.absmax_key for s in self.states)

    @property
    def qmap_keys(self) -> tuple[str, ...]:
        return tuple(s.qmap_key for s in self.states)
