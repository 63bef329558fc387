"""The step counters of a step plan, one tensor per device.

Every parameter keeps its own ``state["step"]`` (a float32 scalar on its device, as torch's fused
Adam), but when a step plan is built the counters of its parameters on one device become views of
one new tensor holding their values (:func:`share_step_counters`), so that a step increments them
all with one ``add_`` instead of a ``torch._foreach_add_`` over thousands of scalars (the largest
host cost of a step over many small tensors). A counter replaced by hand or by a checkpoint is a
change of the state, which rebuilds the plan and shares the counters again; ``state_dict()`` copies
each counter into a storage of its own (checkpoint.portable_param_state).
"""
from __future__ import annotations

from typing import Union

import torch

Counters = Union[torch.Tensor, list]  # one shared tensor, or the separate counters (see below)


def share_step_counters(states: list[dict], device: torch.device) -> Counters:
    """Make each state's ``step`` a view of one new float32 tensor on ``device`` that holds their
    values in this order, and return that tensor. When some counter is not a float32 scalar on
    ``device`` (nothing the optimizer makes, but a state set by hand), they stay as they are and
    the list of them is returned."""
    steps = [s["step"] for s in states]
    if not steps or not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 0
                            and t.device == device for t in steps):
        return steps
    shared = torch.stack(steps)
    for i, s in enumerate(states):
        s["step"] = shared[i]
    return shared


def add_to_counters(counters: Counters, value) -> None:
    """counters += value (a number, or a one-element tensor on their device)."""
    if isinstance(counters, torch.Tensor):
        counters.add_(value)
    else:
        torch._foreach_add_(counters, value)


def subtract_from_counters(counters: Counters, value: torch.Tensor) -> None:
    """counters -= value (a one-element tensor on their device)."""
    if isinstance(counters, torch.Tensor):
        counters.sub_(value)
    else:
        torch._foreach_sub_(counters, value)
