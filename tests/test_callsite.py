"""Warnings name the user's line (pagedopt/_callsite.py), once per optimizer.

A paged optimizer on the CPU works unpaged and says so with a PagingFallbackWarning: at the user's
``opt.step()``, through pagedopt's frames and torch's ``Optimizer.step`` wrapper, and once for each
optimizer. (The Trainer's case, at ``trainer.train()``, is in tests/test_transformers_trainer.py.)
"""
import inspect
import warnings

import torch

import pagedopt
from pagedopt import _callsite
from pagedopt.paging import PagingFallbackWarning

HERE = __file__


def fallback_warnings(caught):
    return [w for w in caught if issubclass(w.category, PagingFallbackWarning)]


def line_of(text: str) -> int:
    """The line of this file that holds ``text`` (once)."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()
    (found,) = [i + 1 for i, line in enumerate(lines) if text in line and "line_of(" not in line]
    return found


def step(opt, model):
    model(torch.ones(2, 64)).sum().backward()
    opt.step()  # the step of the helper


def test_fallback_warning_names_the_users_line_once_per_optimizer():
    model = torch.nn.Linear(64, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = pagedopt.PagedAdamW8bit(model.parameters(), lr=1e-3)
        b = pagedopt.PagedLion8bit(model.parameters(), lr=1e-4)
        step(a, model)
        step(a, model)
        step(b, model)
        model(torch.ones(2, 64)).sum().backward()
        b.step()  # a direct call
    ours = fallback_warnings(caught)
    assert [(w.filename, w.lineno) for w in ours] == [(HERE, line_of("opt.step()  # the step of the helper"))] * 2
    assert "not paged on cpu" in str(ours[0].message)
    # the optimizers warned once each: a's second step and b's direct step said nothing more


def test_walks_out_of_library_frames():
    # a pagedopt function called by a torch function called from here: the warning names this line
    lib = {"__name__": "pagedopt.fake", "warn": _callsite.warn}
    exec("def inner():\n    warn('from inside', UserWarning)\n", lib)
    torch_like = {"__name__": "torch.fake"}
    exec("def middle(f):\n    return f()\n", torch_like)
    user = {"__name__": "torchvision_user_code"}  # not torch: a package name is compared whole
    exec("def outer(g, f):\n    return g(f)\n", user)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_like["middle"](lib["inner"])  # named line 1
        user["outer"](torch_like["middle"], lib["inner"])
    assert [(w.filename, w.lineno) for w in caught] == [(HERE, line_of("# named line 1")), ("<string>", 2)]


def test_stacklevel_from_user_code_is_the_caller():
    assert _callsite.user_stacklevel() == 1  # called here, from a user frame: this frame
    lib = {"__name__": "pagedopt.fake", "_callsite": _callsite}
    exec("def level():\n    return _callsite.user_stacklevel()\n", lib)
    assert lib["level"]() == 2  # from a pagedopt frame: the frame above it, this one
