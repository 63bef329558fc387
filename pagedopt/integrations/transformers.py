"""Hugging Face Trainer ``optim=`` names for pagedopt (transformers 4.57 and 5.x).

    import pagedopt             # the names are valid once transformers is imported, before or after

    args = TrainingArguments("out", optim="pagedopt_paged_adamw_8bit",
                             optim_args="min_8bit_size=16384,beta2=0.95")
    Trainer(model=model, args=args, train_dataset=ds).train()

or, on the command line of a script that imports pagedopt before it builds its parser,
``--optim pagedopt_paged_adamw_8bit --optim_args "min_8bit_size=16384,beta2=0.95"``.

Without the names (the Trainer's own, patch-free route; ``args.optim`` is then ignored):

    cls, kwargs = pagedopt_hf.optimizer_cls_and_kwargs("pagedopt_adamw_8bit", args, model)
    Trainer(model=model, args=args, train_dataset=ds, optimizer_cls_and_kwargs=(cls, kwargs))

Names: ``NAMES`` below, one per optimizer class (``pagedopt_paged_adamw_8bit`` is
``pagedopt.PagedAdamW8bit``, and so on). lr, betas, eps and weight decay come from the
TrainingArguments (``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``,
``weight_decay``; the Trainer puts no weight decay on biases and norms), as for the built-in names.

``optim_args`` ("key=value,key=value") is parsed strictly: an unknown key, a repeated key or a
bad value is a ValueError that lists the accepted keys. Accepted:

* ``beta1``, ``beta2``, ``eps``: override adam_beta1, adam_beta2, adam_epsilon (Lion takes no
  eps); the AdEMAMix names also take ``beta3`` (default 0.9999), ``alpha`` (5.0), ``t_alpha`` and
  ``t_beta3`` (warm-up lengths in steps; none by default), as transformers' own ``ademamix`` names;
* ``optim_bits`` (4, 8 or 32): only for the names whose class takes the width as an argument
  (``pagedopt_adam``, ``pagedopt_adamw``, ``pagedopt_paged_adam``, ``pagedopt_paged_adamw``, and
  the same for lion and ademamix;
  their default is 32, as in the classes);
* ``min_8bit_size`` (int) and ``embeddings_32bit`` (true/false): for the names that can keep
  8-bit or 4-bit states (not the ``*_32bit`` ones, where they would do nothing);
* ``bf16_stochastic_round`` (true/false): every name; bf16 parameters' updates are rounded to
  bf16 stochastically (README, "bf16 parameters").

Embeddings: as the Trainer does for bitsandbytes' 8-bit optimizers, every ``nn.Embedding`` of the
model keeps 32-bit states (``pagedopt.GlobalOptimManager.register_module_override(module,
"weight", {"optim_bits": 32})``) whenever the optimizer would keep 8-bit (or 4-bit) states;
``optim_args="embeddings_32bit=false"`` turns that off (an earlier override of the same module
by this module is then withdrawn). The override is applied when the optimizer is made (to the
model the Trainer hands over; with ``optimizer_cls_and_kwargs``, only if ``model`` is passed) and
takes effect when a parameter's state is created, so states restored from a checkpoint keep the
width they were saved with.

Design decisions
----------------
* Names. transformers has no public registry of optimizer names. Both 4.57 and 5.x check the name
  with ``OptimizerNames(args.optim)`` in ``TrainingArguments.__post_init__`` and offer the
  members of that enum as the ``--optim`` choices of ``HfArgumentParser`` (fixed when a parser is
  built, so a parser built before ``register()`` still refuses our names). ``register()`` adds one
  member per name to that enum the way ``enum`` itself adds members when it creates a class
  (``_member_type_.__new__``, ``_name_``/``_value_``/``__objclass__``/``_sort_order_``, then
  ``_member_names_``, ``_member_map_`` with the class attribute -- through ``EnumType._add_member_``
  where Python has it (3.13+) -- and ``_value2member_map_``), and then checks that lookup by
  value, by name, by attribute, iteration, ``in`` and pickling all see the new member; if a future
  Python breaks that, ``register()`` raises and names the patch-free route. No ``aenum``
  dependency, no rebuilt class (code that imported ``OptimizerNames`` keeps working). The insertion
  and the pickling below were checked on CPython 3.10, 3.11, 3.12 and 3.13.
* Dispatch. 4.57 maps names in the static ``Trainer.get_optimizer_cls_and_kwargs`` (an if/elif
  chain that raises for unknown names); in 5.x the same public static method, with the same
  signature, looks the name up in the private dict ``trainer_optimizer._OPTIMIZER_HANDLERS`` and
  is the only reader of that dict. ``register()`` wraps that static method (once; the original is kept as
  ``__wrapped__``) so that our names go to ``optimizer_cls_and_kwargs`` and every other name to the
  original. One route for both versions, through a public name, and our strict ``optim_args``
  parser runs before transformers' own (which in 5.x would otherwise fail first on a malformed
  entry). A Trainer subclass that overrides the method without calling ``super()`` does not see
  our names; it can use ``optimizer_cls_and_kwargs`` directly.
* ``import pagedopt`` registers, when transformers is imported (issue 34: a user who writes
  ``optim="pagedopt_..."`` has imported pagedopt, and should not need a second line). It imports
  nothing of transformers for it: ``pagedopt.integrations.import_hooks`` runs ``_on_import`` right
  after transformers' own import of ``transformers.training_args`` (the names, and the check of
  ``optim_args`` in ``TrainingArguments.__post_init__``) and of ``transformers.trainer`` (the
  dispatch), or at once for a module already imported; so the import order does not matter, and a
  process that never imports transformers is not touched. A failure there never fails the user's
  import: it is a RuntimeWarning, and ``OptimizerNames("pagedopt_...")`` then raises a ValueError
  that names ``optimizer_cls_and_kwargs`` (``_explain_missing_names``). ``PAGEDOPT_AUTO_REGISTER=0``
  turns all of it off; ``register()`` stays one explicit, idempotent, thread-safe line that does
  the same at once (and raises where the names cannot be added).
* ``optim_args`` is checked when the arguments are made: ``TrainingArguments.__post_init__`` is
  wrapped (once; subclasses call it through ``super()``), as transformers offers no hook for it; a
  value set later (``args.optim_args = ...``, ``set_optimizer``) is checked when the Trainer makes
  the optimizer.
* Unpickling. The Trainer writes ``training_args.bin`` with ``torch.save(args)``, which pickles the
  enum member; an enum member normally unpickles as ``OptimizerNames("pagedopt_...")``, which in a
  fresh process (where nobody called ``register()``) raises. Each member we add therefore pickles
  as a call of ``pagedopt.integrations.transformers._unpickle_optimizer_name(value)`` (an instance
  attribute ``__reduce_ex__`` that only our members have), which registers and returns the member.
  So ``torch.load("training_args.bin", weights_only=False)`` works in a fresh process with
  pagedopt installed, with no call first (calling ``register()`` first does no harm). That
  function's name is part of the pickle format: do not rename it.
* The ``GlobalOptimManager`` keeps the overridden embedding modules (as bitsandbytes' does) for the
  life of the process, or until ``GlobalOptimManager.get_instance().initialize()``.
"""
from __future__ import annotations

import functools
import math
import sys
import threading
from typing import Any, NamedTuple, Optional

import torch

from ..optim import (LAMB, LARS, LAMB8bit, LAMB32bit, LARS8bit, LARS32bit, SGD, Adagrad, Adagrad8bit, Adagrad32bit, RMSprop, RMSprop8bit, RMSprop32bit, SGD8bit, SGD32bit,
                     AdEMAMix, AdEMAMix8bit, AdEMAMix32bit, Adam, Adam8bit, Adam32bit, AdamW, AdamW8bit, AdamW32bit,
                     GlobalOptimManager, Lion, Lion8bit, Lion32bit, PagedAdam, PagedAdam8bit, PagedAdam32bit,
                     PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, PagedAdEMAMix, PagedAdEMAMix8bit,
                     PagedAdEMAMix32bit, PagedLion, PagedLion8bit, PagedLion32bit, Adam4bit, AdamW4bit,
                     PagedAdam4bit, PagedAdamW4bit, Lion4bit, PagedLion4bit)

__all__ = ["NAMES", "register", "optimizer_cls_and_kwargs", "parse_optim_args", "accepted_optim_args"]


class OptimizerName(NamedTuple):
    cls: type
    bits: Optional[int]   # the state width the class fixes (4, 8 or 32), or None: chosen by optim_bits


# One line per optimizer: Trainer name -> (class, fixed state width or None).
NAMES: dict[str, OptimizerName] = {
    "pagedopt_adam": OptimizerName(Adam, None),
    "pagedopt_adamw": OptimizerName(AdamW, None),
    "pagedopt_adam_8bit": OptimizerName(Adam8bit, 8),
    "pagedopt_adamw_8bit": OptimizerName(AdamW8bit, 8),
    "pagedopt_adam_32bit": OptimizerName(Adam32bit, 32),
    "pagedopt_adamw_32bit": OptimizerName(AdamW32bit, 32),
    "pagedopt_paged_adam": OptimizerName(PagedAdam, None),
    "pagedopt_paged_adamw": OptimizerName(PagedAdamW, None),
    "pagedopt_paged_adam_8bit": OptimizerName(PagedAdam8bit, 8),
    "pagedopt_paged_adamw_8bit": OptimizerName(PagedAdamW8bit, 8),
    "pagedopt_paged_adam_32bit": OptimizerName(PagedAdam32bit, 32),
    "pagedopt_paged_adamw_32bit": OptimizerName(PagedAdamW32bit, 32),
    "pagedopt_adam_4bit": OptimizerName(Adam4bit, 4),
    "pagedopt_adamw_4bit": OptimizerName(AdamW4bit, 4),
    "pagedopt_paged_adam_4bit": OptimizerName(PagedAdam4bit, 4),
    "pagedopt_paged_adamw_4bit": OptimizerName(PagedAdamW4bit, 4),
    "pagedopt_lion": OptimizerName(Lion, None),
    "pagedopt_lion_8bit": OptimizerName(Lion8bit, 8),
    "pagedopt_lion_32bit": OptimizerName(Lion32bit, 32),
    "pagedopt_paged_lion": OptimizerName(PagedLion, None),
    "pagedopt_paged_lion_8bit": OptimizerName(PagedLion8bit, 8),
    "pagedopt_paged_lion_32bit": OptimizerName(PagedLion32bit, 32),
    "pagedopt_lion_4bit": OptimizerName(Lion4bit, 4),
    "pagedopt_paged_lion_4bit": OptimizerName(PagedLion4bit, 4),
    "pagedopt_ademamix": OptimizerName(AdEMAMix, None),
    "pagedopt_ademamix_8bit": OptimizerName(AdEMAMix8bit, 8),
    "pagedopt_ademamix_32bit": OptimizerName(AdEMAMix32bit, 32),
    "pagedopt_paged_ademamix": OptimizerName(PagedAdEMAMix, None),
    "pagedopt_paged_ademamix_8bit": OptimizerName(PagedAdEMAMix8bit, 8),
    "pagedopt_paged_ademamix_32bit": OptimizerName(PagedAdEMAMix32bit, 32),
    "pagedopt_sgd": OptimizerName(SGD, None),
    "pagedopt_sgd_8bit": OptimizerName(SGD8bit, 8),
    "pagedopt_sgd_32bit": OptimizerName(SGD32bit, 32),
    "pagedopt_rmsprop": OptimizerName(RMSprop, None),
    "pagedopt_rmsprop_8bit": OptimizerName(RMSprop8bit, 8),
    "pagedopt_rmsprop_32bit": OptimizerName(RMSprop32bit, 32),
    "pagedopt_adagrad": OptimizerName(Adagrad, None),
    "pagedopt_adagrad_8bit": OptimizerName(Adagrad8bit, 8),
    "pagedopt_adagrad_32bit": OptimizerName(Adagrad32bit, 32),
    "pagedopt_lars": OptimizerName(LARS, None),
    "pagedopt_lars_8bit": OptimizerName(LARS8bit, 8),
    "pagedopt_lars_32bit": OptimizerName(LARS32bit, 32),
    "pagedopt_lamb": OptimizerName(LAMB, None),
    "pagedopt_lamb_8bit": OptimizerName(LAMB8bit, 8),
    "pagedopt_lamb_32bit": OptimizerName(LAMB32bit, 32),
}

# optim_args keys of each algorithm beyond the state width ones (Lion takes no eps; AdEMAMix's
# third beta, alpha and warm-up lengths come only from optim_args, as for transformers' own
# "ademamix" names: beta3=0.9999, alpha=5.0 and no warm-up unless given).
_ALGORITHM_ARGS = {"adam": ("beta1", "beta2", "eps"), "lion": ("beta1", "beta2"),
                   "ademamix": ("beta1", "beta2", "beta3", "alpha", "t_alpha", "t_beta3", "eps"),
                   "sgd": ("momentum", "dampening", "nesterov"), "rmsprop": ("alpha", "eps"), "adagrad": ("eps",),
                   "lars": ("momentum", "dampening", "nesterov", "max_unorm"),
                   "lamb": ("beta1", "beta2", "eps", "max_unorm", "bias_correction", "adam_w_mode")}
_TAKES_BETAS = ("adam", "lion", "ademamix", "lamb")  # betas from adam_beta1 / adam_beta2

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


# ---------------------------------------------------------------------------- names and optim_args
def _entry(name) -> tuple[str, OptimizerName]:
    key = getattr(name, "value", name)  # an OptimizerNames member or a plain string
    if isinstance(key, str) and key in NAMES:
        return key, NAMES[key]
    raise ValueError(f"{key!r} is not a pagedopt optimizer name (one of {', '.join(NAMES)})")


def accepted_optim_args(name) -> tuple[str, ...]:
    """The ``optim_args`` keys that ``name`` accepts."""
    _, entry = _entry(name)
    keys = list(_ALGORITHM_ARGS[entry.cls.algorithm.name])
    if entry.bits is None:
        keys.append("optim_bits")
    if entry.bits != 32:
        keys += ["min_8bit_size", "embeddings_32bit"]
    keys.append("bf16_stochastic_round")
    return tuple(keys)


def parse_optim_args(name, optim_args: Optional[str]) -> dict[str, Any]:
    """Parse ``optim_args`` ("key=value,...", spaces ignored, as transformers does) for ``name``,
    strictly: a malformed entry, an unknown or repeated key, or a bad value is a ValueError."""
    name, _ = _entry(name)
    accepted = accepted_optim_args(name)
    listing = (f"accepted keys for {name}: {', '.join(accepted)} (lr, betas, eps and weight decay also come "
               f"from TrainingArguments: learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay)")
    parsed: dict[str, Any] = {}
    if not optim_args:
        return parsed
    for entry in optim_args.replace(" ", "").split(","):
        key, sep, value = entry.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"optim_args {optim_args!r}: {entry!r} is not key=value; {listing}")
        if key not in accepted:
            raise ValueError(f"optim_args {optim_args!r}: unknown key {key!r}; {listing}")
        if key in parsed:
            raise ValueError(f"optim_args {optim_args!r}: {key!r} is given twice; {listing}")
        parsed[key] = _parse_value(key, value, optim_args)
    return parsed


def _parse_value(key: str, value: str, optim_args: str):
    def bad(expected):
        return ValueError(f"optim_args {optim_args!r}: {key}={value!r} is not {expected}")

    if key in ("beta1", "beta2", "beta3", "eps", "alpha", "momentum", "dampening", "max_unorm"):
        try:
            v = float(value)
        except ValueError:
            raise bad("a float") from None
        if not math.isfinite(v):
            raise bad("a finite float")
        return v  # ranges are checked by the optimizer, with its own messages
    if key in ("min_8bit_size", "optim_bits", "t_alpha", "t_beta3"):
        try:
            v = int(value)
        except ValueError:
            raise bad("an integer") from None
        if key == "optim_bits" and v not in (4, 8, 32):
            raise bad("4, 8 or 32")
        if v < 0:
            raise bad("an integer >= 0")
        return v
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise bad(f"a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def optimizer_cls_and_kwargs(name, training_args, model: Optional[torch.nn.Module] = None) -> tuple[type, dict]:
    """The pagedopt class for ``name`` and its keyword arguments from ``training_args`` (lr, betas,
    eps, weight_decay; ``training_args.optim_args`` parsed by ``parse_optim_args``), for
    ``Trainer(optimizer_cls_and_kwargs=...)``. Needs no ``register()``. With ``model``, its
    embeddings keep 32-bit states (unless ``embeddings_32bit=false``) when the optimizer would keep
    8-bit ones. ``training_args.optim`` is not read."""
    name, entry = _entry(name)
    a = training_args
    opts = parse_optim_args(name, a.optim_args)
    kwargs: dict[str, Any] = {"lr": a.learning_rate, "weight_decay": a.weight_decay}
    algorithm = entry.cls.algorithm.name
    betas = (opts.get("beta1", a.adam_beta1), opts.get("beta2", a.adam_beta2))
    if algorithm in _TAKES_BETAS:
        kwargs["betas"] = betas
    if algorithm in ("adam", "ademamix", "lamb"):
        kwargs["eps"] = opts.get("eps", a.adam_epsilon)
    if algorithm == "lars":  # LARS needs momentum: 0.9 unless optim_args says otherwise
        kwargs["momentum"] = opts.get("momentum", 0.9)
    for key in ("max_unorm", "bias_correction", "adam_w_mode"):
        if algorithm in ("lars", "lamb") and key in opts:
            kwargs[key] = opts[key]
    for key in ("eps", "alpha", "momentum", "dampening", "nesterov"):  # SGD, RMSprop, Adagrad: class defaults
        if algorithm not in _TAKES_BETAS and key in opts:
            kwargs[key] = opts[key]
    if algorithm == "ademamix":
        kwargs["betas"] = betas + (opts.get("beta3", 0.9999),)
        kwargs["alpha"] = opts.get("alpha", 5.0)
        for key in ("t_alpha", "t_beta3"):
            kwargs[key] = opts.get(key)
    for key in ("optim_bits", "min_8bit_size", "bf16_stochastic_round"):
        if key in opts:
            kwargs[key] = opts[key]
    bits = entry.bits if entry.bits is not None else kwargs.get("optim_bits", 32)
    if model is not None:
        _override_embeddings(model, bits < 32 and opts.get("embeddings_32bit", True))
    return entry.cls, kwargs


# Our (module, "weight", config) entries in GlobalOptimManager.module_weight_config_triple.
_embedding_overrides: list = []


def _override_embeddings(model: torch.nn.Module, on: bool) -> None:
    manager = GlobalOptimManager.get_instance()
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    mine = {id(m) for m in embeddings}
    # Withdraw what we registered earlier for these modules (a second Trainer on the same model).
    stale = [t for t in _embedding_overrides if id(t[0]) in mine]
    manager.module_weight_config_triple[:] = [
        t for t in manager.module_weight_config_triple if not any(t is s for s in stale)]
    _embedding_overrides[:] = [t for t in _embedding_overrides if not any(t is s for s in stale)]
    if on:
        for m in embeddings:
            manager.register_module_override(m, "weight", {"optim_bits": 32})
            _embedding_overrides.append(manager.module_weight_config_triple[-1])


# ---------------------------------------------------------------------------- registration
_lock = threading.RLock()
_registration = {"names": False, "dispatch": False, "busy": False}


def register() -> None:
    """Make the names of ``NAMES`` valid ``TrainingArguments.optim`` values, ``--optim`` choices of
    parsers built afterwards, and Trainer optimizers; refuse a bad ``optim_args`` when the
    ``TrainingArguments`` are made. Idempotent; imports transformers. ``import pagedopt`` does the
    same when transformers is imported (see the module docstring), unless PAGEDOPT_AUTO_REGISTER=0."""
    with _lock:
        from transformers import trainer as hf_trainer
        from transformers import training_args as hf_training_args

        _add_names(hf_training_args)
        _wrap_get_optimizer_cls_and_kwargs(hf_trainer.Trainer)
        _registration["dispatch"] = True


def registered() -> bool:
    """True when the names are valid TrainingArguments.optim values and Trainer optimizers."""
    return _registration["names"] and _registration["dispatch"]


def _add_names(hf_training_args) -> None:
    with _lock:
        if _registration["names"]:
            return
        _registration["busy"] = True
        try:
            enum_cls = hf_training_args.OptimizerNames
            for name in NAMES:
                _add_enum_member(enum_cls, name.upper(), name)
            _wrap_post_init(hf_training_args.TrainingArguments)
            _registration["names"] = True
        finally:
            _registration["busy"] = False


def _on_import(module) -> None:
    """``import pagedopt``'s set-up, run when transformers.training_args or transformers.trainer
    has been imported (pagedopt.integrations.import_hooks): the names, or the Trainer's dispatch."""
    with _lock:
        if module.__name__ == "transformers.training_args":
            try:
                _add_names(module)
            except Exception as exc:
                _explain_missing_names(module.OptimizerNames, str(exc))
                raise  # given as a RuntimeWarning; TrainingArguments(optim="pagedopt_...") says the rest
        elif module.__name__ == "transformers.trainer":
            _wrap_get_optimizer_cls_and_kwargs(module.Trainer)
            _registration["dispatch"] = True


_ROUTE = ("Trainer(..., optimizer_cls_and_kwargs=pagedopt.integrations.transformers.optimizer_cls_and_kwargs"
          "({name!r}, args, model))")


def _explain_missing_names(enum_cls, why: str) -> None:
    """Where the names could not be added, ``OptimizerNames("pagedopt_...")`` (and so
    ``TrainingArguments(optim="pagedopt_...")``) raises a ValueError that names the route that
    needs no names, instead of transformers' list of valid names."""
    if getattr(getattr(enum_cls.__dict__.get("_missing_"), "__func__", None), "_pagedopt", False):
        return
    inherited = enum_cls._missing_  # transformers' own (ExplicitEnum's: "... please select one of [...]")

    def _missing_(cls, value):
        if isinstance(value, str) and value in NAMES:
            raise ValueError(f"{value!r} is not a TrainingArguments optim name here: {why}. Use "
                             + _ROUTE.format(name=value) + " with no optim= (or call "
                             "pagedopt.integrations.transformers.register() to see the error again)")
        return inherited(value)

    _missing_._pagedopt = True
    enum_cls._missing_ = classmethod(_missing_)


def _wrap_post_init(args_cls) -> None:
    """``TrainingArguments(optim="pagedopt_...", optim_args=...)`` refuses a bad ``optim_args``
    when the arguments are made (the Trainer checks it again when it makes the optimizer)."""
    original = args_cls.__dict__.get("__post_init__")
    if original is None or getattr(original, "_pagedopt", False):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        optim = getattr(self, "optim", None)
        if getattr(optim, "value", optim) in NAMES:
            parse_optim_args(optim, getattr(self, "optim_args", None))

    __post_init__._pagedopt = True
    args_cls.__post_init__ = __post_init__


def _unpickle_optimizer_name(value: str):
    """Pickles of our OptimizerNames members call this (so keep its name): register, return it."""
    with _lock:
        # busy: the names' own pickle check. With the names there (import pagedopt's set-up), the
        # Trainer's dispatch comes when transformers.trainer is imported, as it would anyway.
        if not (_registration["names"] or _registration["busy"]):
            register()
    from transformers.training_args import OptimizerNames

    return OptimizerNames(value)


def _reduce_member(value: str, protocol=None):
    return _unpickle_optimizer_name, (value,)


def _add_enum_member(cls, attr: str, value: str):
    """Add member ``attr`` = ``value`` to the (str, Enum) class ``cls``, as ``enum`` does."""
    existing = cls._value2member_map_.get(value)
    if existing is None:
        if attr in cls._member_map_ or attr in cls.__dict__:
            raise RuntimeError(f"pagedopt: {cls.__name__} already has an attribute {attr!r}")
        member = cls._member_type_.__new__(cls, value)
        member._value_ = value
        member._name_ = attr
        member.__objclass__ = cls
        member.__init__(value)
        member._sort_order_ = len(cls._member_names_)
        # pickles as _unpickle_optimizer_name(value), which registers in a fresh process
        object.__setattr__(member, "__reduce_ex__", functools.partial(_reduce_member, value))
        cls._member_names_.append(attr)
        if hasattr(cls, "_add_member_"):  # Python 3.13+: the enum's own (private) way
            cls._add_member_(attr, member)
        else:
            setattr(cls, attr, member)
            cls._member_map_[attr] = member
        cls._value2member_map_[value] = member
        existing = member
    _check_enum_member(cls, attr, value, existing)
    return existing


def _check_enum_member(cls, attr: str, value: str, member) -> None:
    import pickle

    checks = {
        f"{cls.__name__}({value!r})": lambda: cls(value) is member,
        f"{cls.__name__}[{attr!r}]": lambda: cls[attr] is member,
        f"{cls.__name__}.{attr}": lambda: getattr(cls, attr) is member,
        "iteration": lambda: any(m is member for m in cls) and value in [m.value for m in cls],
        "membership": lambda: member in cls,
        "name/value": lambda: member.name == attr and member.value == value and member == value,
        "pickle": lambda: pickle.loads(pickle.dumps(member)) is member,
    }
    for what, check in checks.items():
        try:
            ok = check()
        except Exception:  # noqa: BLE001 - reported below
            ok = False
        if not ok:
            raise RuntimeError(
                f"pagedopt could not add {value!r} to transformers' {cls.__name__} on Python "
                f"{sys.version.split()[0]} ({what} does not see it). Use the patch-free route instead: "
                "Trainer(optimizer_cls_and_kwargs=pagedopt.integrations.transformers.optimizer_cls_and_kwargs"
                "(name, args, model))")


def _wrap_get_optimizer_cls_and_kwargs(trainer_cls) -> None:
    current = trainer_cls.__dict__.get("get_optimizer_cls_and_kwargs")
    if not isinstance(current, staticmethod):
        raise RuntimeError(
            "pagedopt: this transformers version has no static Trainer.get_optimizer_cls_and_kwargs to "
            "extend; use Trainer(optimizer_cls_and_kwargs=pagedopt.integrations.transformers."
            "optimizer_cls_and_kwargs(name, args, model))")
    original = current.__func__
    if getattr(original, "_pagedopt", False):
        return  # already wrapped

    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        optim = getattr(args, "optim", None)
        if getattr(optim, "value", optim) in NAMES:
            return optimizer_cls_and_kwargs(optim, args, model)
        return original(args, model)

    get_optimizer_cls_and_kwargs._pagedopt = True
    trainer_cls.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)
