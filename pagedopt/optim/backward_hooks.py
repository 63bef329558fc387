"""The gradient hooks of updates during backward (backward_updates.py): which parameters an
optimizer updates during backward, one optimizer per parameter, and what cannot have hooks at all.

``GradHooks`` holds one ``register_post_accumulate_grad_hook`` handle per parameter, each calling
back its owner (weakly held: a dropped optimizer's hooks do nothing, then come off). Two live
optimizers hooked on the same parameter would both update it in every backward (an old optimizer
still referenced when its replacement is made, as when a notebook cell runs again): the newest one
takes the parameter over, with a warning, and the other updates it only in its own step().
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .grad_checks import locate


def refuse_unsupported(opt) -> None:
    """Raise a ValueError, before anything changes, where updates in backward cannot be right."""
    from . import sharding

    name = type(opt).__name__
    if getattr(opt, "capturable", False):
        raise ValueError(f"{name}: update_in_backward=True cannot be captured in a CUDA graph (capturable=True)")
    params = [p for g in opt.param_groups for p in g["params"]]
    if sharding.has_dtensor(params):
        raise ValueError(f"{name}: update_in_backward=True does not support DTensor (FSDP2) parameters: their "
                         "gradients are reduced after backward")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{name}: update_in_backward=True does not support a process group of several ranks "
                         "(DDP all-reduces gradients after the hooks that would update them)")


# parameter -> weakref of the GradHooks whose hook is on it (see the module)
_OWNERS = WeakIdKeyDictionary()


def _remove_handles(hooked: dict) -> None:
    for handle in hooked.values():
        handle.remove()
    hooked.clear()


class GradHooks:
    """The post-accumulate-grad hooks of one optimizer's parameters: each calls ``on_grad(p)`` of
    ``owner`` (weakly held) when ``p``'s gradient is final; ``opt()`` gives the optimizer (for
    warnings)."""

    def __init__(self, owner, on_grad: Callable, opt: Callable):
        self._owner = weakref.ref(owner)
        self._on_grad = on_grad      # on_grad(owner, p)
        self._opt = opt
        self._hooked: dict[int, object] = {}  # id(param) -> hook handle
        # a dropped optimizer's hooks come off its parameters (a model outliving many optimizers, as
        # in a sweep, would otherwise call every old one's inert hook in each backward)
        weakref.finalize(self, _remove_handles, self._hooked)

    def __bool__(self) -> bool:
        return bool(self._hooked)

    def add(self, params) -> None:
        ref, call = self._owner, self._on_grad

        def on_grad(p: torch.Tensor, ref=ref, call=call) -> None:
            owner = ref()
            if owner is not None:
                call(owner, p)

        me = weakref.ref(self)
        taken = []
        for p in params:
            if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in self._hooked:
                held = _OWNERS.get(p)
                other = held() if held is not None else None
                if other is not None and other is not self and other.unhook(p):
                    taken.append((p, other))
                self._hooked[id(p)] = p.register_post_accumulate_grad_hook(on_grad)
                _OWNERS[p] = me
        if taken:
            self._warn_taken(taken)

    def unhook(self, p: torch.Tensor) -> bool:
        """Stop updating ``p`` during backward; whether it was hooked here by a live optimizer."""
        handle = self._hooked.pop(id(p), None)
        if handle is None:
            return False
        handle.remove()
        return self._opt() is not None

    def _warn_taken(self, taken: list) -> None:
        opt = self._opt()
        p, other = taken[0]
        other_opt = other._opt()
        warnings.warn(f"{type(opt).__name__}: {locate(opt.param_groups, p)}"
                      + (f" and {len(taken) - 1} more parameters were" if len(taken) > 1 else " was")
                      + f" updated during backward by another live optimizer ({type(other_opt).__name__} at "
                      f"{id(other_opt):#x}); this one updates them during backward now, the other one only in "
                      "its own step() (drop every reference to it, or turn its update_in_backward off)",
                      stacklevel=5)

    def remove(self) -> None:
        _remove_handles(self._hooked)
        for p, held in list(_OWNERS.items()):
            if held() is self:
                del _OWNERS[p]
