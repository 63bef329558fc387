"""Integrations of pagedopt with training frameworks.

Each submodule imports its framework only when it is imported itself; ``import pagedopt`` imports
none of them. ``pagedopt.integrations.transformers``: ``optim=`` names for the Hugging Face Trainer;
``pagedopt.integrations.callbacks``: ``MemoryReportCallback``, memory figures in the Trainer's log history;
``pagedopt.integrations.deepspeed``: the checks of ``deepspeed.initialize`` with a pagedopt optimizer;
``pagedopt.integrations.dcp``: an all-or-nothing load of torch.distributed.checkpoint checkpoints (FSDP2).

What ``import pagedopt`` does set up (:func:`set_up_on_import`): when a framework module listed in
:data:`ON_IMPORT` is imported, before or after pagedopt, the integration's ``_on_import(module)``
runs (through :mod:`.import_hooks`), so that a script that imports pagedopt can name its
optimizers there with no other call. ``PAGEDOPT_AUTO_REGISTER=0`` turns that off (then call the
integration's ``register()``).
"""
from __future__ import annotations

import importlib
import os

# integration submodule -> the framework modules whose import runs its _on_import(module)
ON_IMPORT = {"transformers": ("transformers.training_args", "transformers.trainer"),
             "deepspeed": ("deepspeed",)}
_OFF = ("0", "false", "no", "off")


def set_up_on_import() -> bool:
    """Arrange :data:`ON_IMPORT` (called once by ``import pagedopt``). False when
    PAGEDOPT_AUTO_REGISTER turns it off."""
    if os.environ.get("PAGEDOPT_AUTO_REGISTER", "1").strip().lower() in _OFF:
        return False
    from . import import_hooks

    for integration, modules in ON_IMPORT.items():
        for name in modules:
            import_hooks.when_imported(name, _setup_of(integration))
    return True


def _setup_of(integration: str):
    def setup(module) -> None:
        importlib.import_module(f"{__name__}.{integration}")._on_import(module)

    setup.__qualname__ = f"{integration}._on_import"
    return setup
