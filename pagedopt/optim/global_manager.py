"""Per-parameter optimizer settings, with the API of bitsandbytes' ``GlobalOptimManager``.

    mng = GlobalOptimManager.get_instance()
    mng.register_parameters(model.parameters())         # before model.to(device), if it moves
    model = model.cuda()
    opt = pagedopt.AdamW8bit(model.parameters())
    mng.override_config(model.fc1.weight, "optim_bits", 32)
    mng.register_module_override(model.emb, "weight", {"optim_bits": 32})

Overrides are found by parameter identity and, for parameters registered with
``register_parameters``, by their (group index, parameter index), which survives a
``model.to(device)`` that replaces the parameter objects. They take effect when a parameter's
state is created (its first step): ``optim_bits`` and ``min_8bit_size`` choose the kind of state,
``lr``, ``betas``, ``eps`` and ``weight_decay`` replace the group's value at every step.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

# The settings an override may change (each is a param-group key).
OVERRIDABLE_KEYS = ("optim_bits", "min_8bit_size", "lr", "betas", "eps", "weight_decay")


class GlobalOptimManager:
    """A process-wide registry of per-parameter settings (a singleton: use ``get_instance()``)."""

    _instance: Optional["GlobalOptimManager"] = None

    def __init__(self):
        raise RuntimeError("GlobalOptimManager is a singleton: call GlobalOptimManager.get_instance()")

    def initialize(self) -> None:
        """Forget every registration and override."""
        self.pid2config: dict[int, dict] = {}
        # The tensor behind each id of pid2config: an id can be reused by a new tensor once the
        # overridden one is freed, and the override must not pass to it.
        self._pid_refs: dict[int, weakref.ref] = {}
        self.index2config: dict[tuple[int, int], dict] = {}
        self.module_weight_config_triple: list[tuple[torch.nn.Module, str, dict]] = []
        self.uses_config_override = False

    @classmethod
    def get_instance(cls) -> "GlobalOptimManager":
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params: Iterable) -> None:
        """Record the (group index, param index) of parameters that already have an override, so
        that the override still applies once the parameters have been replaced (``model.to``)."""
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for gi, group in enumerate(groups):
            for pi, p in enumerate(group["params"]):
                if self._overridden(p):
                    self.index2config[(gi, pi)] = self.pid2config[id(p)]

    def _overridden(self, p: torch.Tensor) -> bool:
        ref = self._pid_refs.get(id(p))
        return id(p) in self.pid2config and (ref is None or ref() is p)

    def override_config(self, parameters, key: Optional[str] = None, value: Any = None,
                        key_value_dict: Optional[dict] = None) -> None:
        """Override ``key`` = ``value`` (or every item of ``key_value_dict``) for ``parameters``
        (a tensor or an iterable of tensors)."""
        if key is not None and key_value_dict is not None:
            raise ValueError("override_config: pass either key and value, or key_value_dict, not both")
        if key is not None:
            key_value_dict = {key: value}
        if not isinstance(key_value_dict, dict) or not key_value_dict:
            raise ValueError("override_config: nothing to override (pass key and value, or key_value_dict)")
        for k in key_value_dict:
            _check_key(k)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"override_config: expected tensors, got {type(p).__name__}")
            if not self._overridden(p):  # new, or an id left behind by a freed tensor
                self.pid2config[id(p)] = {}
                self._pid_refs[id(p)] = weakref.ref(p)
            self.pid2config[id(p)].update(key_value_dict)
        self.uses_config_override = True

    def register_module_override(self, module: torch.nn.Module, param_name: str, config: dict) -> None:
        """Override ``config`` for ``getattr(module, param_name)``, looked up when optimizers plan
        their steps (so the module may be moved first)."""
        for k in config:
            _check_key(k)
        self.module_weight_config_triple.append((module, param_name, dict(config)))
        self.uses_config_override = True

    def overrides_for(self, param_groups: list[dict]) -> dict[tuple[int, int], dict]:
        """The override of each (group index, param index) of ``param_groups`` that has one."""
        if not self.uses_config_override:
            return {}
        by_id = {pid: dict(c) for pid, c in self.pid2config.items()
                 if pid not in self._pid_refs or self._pid_refs[pid]() is not None}
        for module, name, config in self.module_weight_config_triple:
            p = getattr(module, name, None)
            if isinstance(p, torch.Tensor):
                by_id.setdefault(id(p), {}).update(config)
        found = {}
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                config = {**self.index2config.get((gi, pi), {}), **by_id.get(id(p), {})}
                if config:
                    found[(gi, pi)] = config
        return found


def _check_key(key: str) -> None:
    if key not in OVERRIDABLE_KEYS:
        raise ValueError(f"GlobalOptimManager: {key!r} cannot be overridden per parameter "
                         f"(one of {', '.join(OVERRIDABLE_KEYS)} can)")
