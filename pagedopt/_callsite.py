"""Warnings that name the user's line, not pagedopt's.

A warning raised deep inside a step (a state being made, a page-out falling back) should point at
the line of the user's script that led to it: ``opt.step()``, ``loss.backward()``,
``trainer.train()``. :func:`warn` walks out of the frames of pagedopt and of the libraries that
call an optimizer on the user's behalf (:data:`LIBRARIES`: torch's ``Optimizer.step`` wrapper and
autograd hooks, accelerate's wrapped optimizer, transformers' Trainer) and warns at the first frame
beyond them; where every frame is theirs (a worker thread), at the outermost one.
"""
from __future__ import annotations

import sys
import warnings

# Top-level packages whose frames are not the user's.
LIBRARIES = ("pagedopt", "torch", "accelerate", "transformers")


def _library(frame) -> bool:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in LIBRARIES


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` call, in the function that calls this
    one, name the first frame outside :data:`LIBRARIES`."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _library(frame):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line (module docstring)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
