"""Run a function when a module is imported, or at once when it already is: how an integration
sets itself up when its framework is used, whichever of the two the user imports first, without
importing the framework itself.

``when_imported("transformers.training_args", setup)`` calls ``setup(module)`` right after that
module has run its body (under the import lock, before the importer sees it), or now when it is
already imported. A finder at the head of ``sys.meta_path`` notices the import; it finds the module
with the finders after it and wraps only its loader's ``exec_module`` for that one load: the module
keeps its own loader and spec, and the finder leaves ``sys.meta_path`` when nothing is awaited.
An exception of ``setup`` never fails the import: it is given as a ``RuntimeWarning``.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from typing import Callable

_lock = threading.RLock()
_awaited: dict[str, list[Callable]] = {}


def when_imported(name: str, setup: Callable) -> None:
    """Call ``setup(module)`` when the module ``name`` has been imported (now, if it has been)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            _awaited.setdefault(name, []).append(setup)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _run(name, module, [setup])


def awaited() -> dict[str, int]:
    """{module name: how many functions wait for its import} (for tests)."""
    with _lock:
        return {k: len(v) for k, v in _awaited.items()}


def _run(name: str, module, setups: list[Callable]) -> None:
    for setup in setups:
        try:
            setup(module)
        except Exception as exc:  # noqa: BLE001 - never fail the user's import
            warnings.warn(f"pagedopt: setting up its integration when {name} was imported failed: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _awaited:
                return None
        spec = None
        after = False
        for finder in list(sys.meta_path):
            if finder is self:
                after = True
                continue
            find = getattr(finder, "find_spec", None)
            if not after or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Loader(loader)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, and the awaited functions after its ``exec_module``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # the module runs, and stays, with its own loader
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        name = module.__spec__.name if module.__spec__ is not None else module.__name__
        with _lock:
            setups = _awaited.pop(name, [])
            if not _awaited:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        _run(name, module, setups)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ... of the module's loader
        if attr == "loader":
            raise AttributeError(attr)
        return getattr(self.loader, attr)
