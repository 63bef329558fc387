"""The one optimizer base class, QuantizedOptimizer: step planning, GradScaler, paging and
checkpoints for every algorithm. An algorithm declares its states and hyperparameters in an
AlgorithmSpec (algorithms/spec.py); each public class is a line of a table (algorithms/adam.py,
algorithms/lion.py, ...).

State layout per parameter follows bitsandbytes, so checkpoints carry over (Adam's shown; the
spec says which keys an algorithm has):

* 8-bit (``numel >= min_8bit_size``): ``state1``/``state2`` uint8 codes shaped like the
  parameter (a state holding two stacked moments has shape ``(2, *param.shape)``),
  ``absmax1``/``absmax2`` float32 with one entry per 256-element block (per moment),
  ``qmap1`` (signed codebook) / ``qmap2`` (unsigned codebook), ``step``.
* 4-bit (``optim_bits=4``, pagedopt's own): two codes a byte, flat, one absmax per 128-element
  block, 16-entry codebooks (state_format.py).
* 32-bit: ``state1``/``state2`` float32 of the same shapes, ``step``.

A DTensor parameter (FSDP2) keeps these states for its local shard only, as plain tensors; its
state dict presents them as DTensors (see sharding.sharded_param_state).

``step`` is a float32 scalar tensor on the parameter's device (as torch's fused Adam keeps
it), so that a step skipped by GradScaler needs no host synchronisation.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _ops
from ..quant import dynamic_codebook, linear_codebook_4bit_no_zero, normal_codebook_4bit, second_moment_codebook
from . import capture, checkpoint, executor, sharding
from .algorithms.spec import AlgorithmSpec
from .byte_sizes import optimizer_state_bytes  # noqa: F401  (public here)
from .fast_step import fast_step, hold_params_for_fast_steps
from .global_manager import GlobalOptimManager
from .grad_checks import locate, raise_bad_grad, raise_bad_sharding
from .hyperparameters import check_hyperparameters
from .pager_control import PAGED_SLAB_BYTES, PagerControl
from .plan import StepPlan, build_plan, is_current
from .residency import streams_now, streams_states
from .state_format import CODES8, StateFormat, format_for
from .state_table import StateTable


def _run_update(optimizer: "QuantizedOptimizer") -> None:
    optimizer._update()


# The update as dynamo sees it: a function it does not trace (a graph break), run eagerly even
# inside a compiled frame. torch._disable_dynamo imports dynamo lazily, at the first compiled step.
_update_outside_graph = torch._disable_dynamo(_run_update, recursive=True)


def _same(a, b) -> bool:
    """Whether a setting is unchanged: the same object, or equal values that are not tensors (a
    tensor lr changed in place is the same object: the kernels read it where it is)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


class QuantizedOptimizer(PagerControl, torch.optim.Optimizer):
    """An optimizer with 8-bit blockwise-quantized or 32-bit states, optionally paged; the
    algorithm is the class's ``algorithm`` spec. ``defaults`` holds the param-group settings
    (always ``lr``, ``betas``, ``weight_decay``, ``optim_bits``, ``min_8bit_size``, and
    ``bf16_stochastic_round`` with its ``bf16_sr_seed``, False and 0 unless given)."""

    algorithm: AlgorithmSpec
    _bits: Optional[int] = None  # the state width a *8bit / *32bit class fixes (None: optim_bits decides)
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init__(self, params, defaults: dict, *, args: Any = None, percentile_clipping: int = 100,
                 block_wise: bool = True, is_paged: bool = False, capturable: bool = False):
        if args is not None:
            raise ValueError("args (a bitsandbytes GlobalOptimManager config) is not supported; "
                             "pass the settings as keyword arguments or per param group")
        if percentile_clipping != 100:
            raise ValueError(f"percentile_clipping={percentile_clipping} is not supported; "
                             "only 100 (no clipping) is; clip gradients before step() instead")
        if not block_wise:
            raise ValueError("block_wise=False is not supported: states are always quantized in blocks of 256")
        defaults["optim_bits"] = self._fixed_bits(defaults["optim_bits"])
        defaults.setdefault("bf16_stochastic_round", False)
        defaults.setdefault("bf16_sr_seed", 0)  # the rounding's seed: a group setting (README, "bf16 parameters")
        if not isinstance(capturable, bool):
            raise ValueError(f"Invalid argument 'capturable': {capturable!r} (must be True or False)")
        # the optimizer's, not a param group's: the groups keep bitsandbytes' keys (checkpoint layout)
        self.capturable = capturable
        self.check_hyperparameters(defaults, "argument")
        self._start_runtime(is_paged)
        super().__init__(params, defaults)
        self.state = StateTable(self.state)

    def _start_runtime(self, is_paged: bool, pager=None) -> None:
        """What an optimizer holds besides its groups and state: the pager, the codebooks and the
        cached step plan (rebuilt after a copy or unpickling)."""
        self.is_paged = bool(is_paged)
        self._pager = pager
        if self.is_paged and pager is None:
            from ..paging import PageManager

            self._pager = PageManager(arena_bytes=PAGED_SLAB_BYTES)
        self._codebooks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, bits) -> codebooks
        self._plan_version = 0  # bumped whenever param groups are replaced or added
        self._plan = None
        self._checked_settings: list[dict] = []  # each group's settings as last checked (check_changed_settings)
        self._backward_updates = None  # set_pager(..., update_in_backward=True): backward_updates.py

    # ------------------------------------------------------------------ what the pipeline reads
    @property
    def pager(self):
        """The PageManager or HostResidentPager of this optimizer's states (None: not paged)."""
        return self._pager

    @property
    def plan_version(self) -> int:
        """Bumped whenever the param groups are replaced or added (a cached plan is then stale)."""
        return self._plan_version

    @property
    def step_plan(self) -> Optional[StepPlan]:
        """The cached step plan (plan.py), or None before the first step or after a change."""
        return self._plan

    def plan_is_current(self, plan: Optional[StepPlan]) -> bool:
        """Whether ``plan`` still fits the state and the param groups (plan.is_current)."""
        return is_current(plan, self.state, self._plan_version)

    # ------------------------------------------------------------------ validation
    def _fixed_bits(self, optim_bits):
        """The state width of a fixed-width class (``_bits``) for the ``optim_bits`` it was given:
        bitsandbytes' *8bit / *32bit classes take optim_bits and ignore it; pagedopt accepts the
        default (32) and the class's own width, and refuses anything else rather than ignore it."""
        if self._bits is None:
            return optim_bits
        if optim_bits not in (32, self._bits):
            raise ValueError(f"optim_bits={optim_bits!r} is not valid for {type(self).__name__}, a {self._bits}-bit "
                             f"optimizer (pass {self._bits} or leave the default)")
        return self._bits

    @classmethod
    def check_hyperparameters(cls, h: dict, where: str) -> None:
        """Raise a ValueError naming ``where`` and the key if a setting of ``h`` is not valid."""
        spec = cls.algorithm
        check_hyperparameters(h, where, spec.betas, spec.has_eps, spec.check)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with the group's settings checked before it is added."""
        if isinstance(param_group, dict):
            settings = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
            self.check_hyperparameters(settings, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        self._plan_version += 1
        if getattr(self, "_backward_updates", None) is not None:
            self._backward_updates.hook_params(self.param_groups[-1]["params"])

    # ------------------------------------------------------------------ state
    def codebooks_on(self, device: torch.device, fmt: StateFormat = CODES8) -> tuple[torch.Tensor, torch.Tensor]:
        """The (signed, unsigned) codebooks of quantized format ``fmt`` on ``device``, shared by
        every parameter there: the signed dynamic map and the unsigned one without its zero code
        (8-bit: quant.second_moment_codebook), the 4-bit normal-quantile map and the linear map
        without zero (4-bit)."""
        key = (device, fmt.bits)
        if key not in self._codebooks:
            self._codebooks[key] = ((dynamic_codebook(True, device), second_moment_codebook(device)) if fmt.bits == 8
                                    else (normal_codebook_4bit(device), linear_codebook_4bit_no_zero(device)))
        return self._codebooks[key]

    def default_qmap(self, qmap_key: str, device: torch.device, fmt: StateFormat = CODES8) -> torch.Tensor:
        """The codebook this algorithm gives the state of ``qmap_key`` (``qmap1``...) in format
        ``fmt`` on ``device``."""
        spec = next(s for s in self.algorithm.states if s.qmap_key == qmap_key)
        signed, unsigned = self.codebooks_on(device, fmt)
        return signed if spec.signed else unsigned

    def state_zeros(self, shape, dtype, device) -> torch.Tensor:
        """A zero tensor in this optimizer's own state memory (paged when it pages)."""
        if self._pager is not None:
            return self._pager.zeros(shape, dtype, device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def state_copy(self, t: torch.Tensor, device) -> torch.Tensor:
        """A copy of ``t`` on ``device`` in this optimizer's own state memory (paged when it pages)."""
        out = self.state_zeros(t.shape, t.dtype, device)
        out.copy_(t)
        return out

    def state_format(self, config: dict, p: torch.Tensor) -> StateFormat:
        """The format of a new state for ``p`` under ``config`` (its group and overrides):
        ``optim_bits`` (4 or 8) when it has at least ``min_8bit_size`` elements, else 32-bit."""
        return format_for(config, p.numel())

    def overrides(self, param_groups: list[dict]) -> dict[tuple[int, int], dict]:
        """GlobalOptimManager's per-parameter settings for ``param_groups``, checked."""
        found = GlobalOptimManager.get_instance().overrides_for(param_groups)
        for (gi, pi), config in found.items():
            self.check_hyperparameters({**param_groups[gi], **config},
                                       f"param_groups[{gi}] (GlobalOptimManager override of params[{pi}])")
        return found

    def complete_state(self, config: dict, p: torch.Tensor, existing: dict) -> Optional[dict]:
        """``p``'s state with everything it lacks made, as a new dict (``existing`` is left as it
        is, so that a failed allocation changes nothing), or None when it lacks nothing. A DTensor
        parameter (FSDP2) gets states of its local shard only (shape and blocks of
        ``sharding.local(p)``); whether they are 8-bit depends on the global size, so that every
        rank, and an unsharded run, choose alike."""
        spec = self.algorithm
        needs_states = spec.needs_states(config)
        if len(existing) != 0 and (not needs_states or spec.states[0].key in existing):
            return None
        local = sharding.local(p)
        state = dict(existing)
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        if not needs_states:
            return state
        fmt = self.state_format(config, p)
        refusal = sharding.four_bit_refusal(p) if fmt.bits == 4 and sharding.is_dtensor(p) else None
        if refusal is not None:
            raise ValueError(f"{locate(self.param_groups, p)}: 4-bit states cannot be sharded like this DTensor "
                             f"(FSDP2) parameter: {refusal}; use optim_bits=8 for it (a GlobalOptimManager "
                             "override) or for its group")
        for s in spec.states:
            state[s.key] = self.state_zeros(fmt.state_shape(s.moments, local.shape), fmt.dtype, local.device)
            if fmt.quantized:
                state[s.absmax_key] = self.state_zeros(fmt.absmax_shape(s.moments, local.numel()), torch.float32,
                                                       local.device)
                state[s.qmap_key] = self.default_qmap(s.qmap_key, local.device, fmt)
        for key in spec.extra_keys:
            if key not in state:
                state[key] = torch.zeros((1,), dtype=torch.float32, device=local.device)
        return state

    # ------------------------------------------------------------------ step
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimizer step over every parameter with a gradient; returns ``closure()`` if given.

        Under ``torch.compile`` the update is a clean graph break: the closure is traced with the
        caller's code, the update (``_update``) runs eagerly through ``torch._disable_dynamo``, so
        compiled code (``fullgraph=False``) and ``torch.compile(opt.step)`` run the kernels of an
        eager step, bit for bit. Tracing it would gain nothing (each bucket is one fused kernel,
        opaque to inductor), would guard on every parameter and state, cannot annotate the states
        mutated inside the C++ state list (dynamo refuses it: UnsafeScriptObjectError), and cannot
        trace the paged path's driver calls. torch's own optimizers do the same for what they
        cannot compile (``_disable_dynamo_if_unsupported``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            _update_outside_graph(self)
        else:
            self._update()
        return loss

    @torch.no_grad()
    def _update(self) -> None:
        """The update of step(), always eager (see step()): the fast step when the plan allows it,
        else the rest of updates during backward or the ordinary step."""
        self.check_changed_settings()
        plan = self._plan
        bwd = self._backward_updates
        if bwd is None:
            if plan is None or not plan.fast or not fast_step(self, plan):
                self._update_params()
            return
        try:
            self._finish_backward_updates(bwd, plan)
        except BaseException:
            bwd.step_failed()  # a repeated step() finds the progress as it was
            raise

    def _finish_backward_updates(self, bwd, plan: Optional[StepPlan]) -> None:
        """step() with updates during backward (backward_updates.py): the rest of a step of the
        schedule; or, without one, the parameters not updated during backward, then the plan of
        every parameter of the step and the schedule made from it."""
        if bwd.active(self):
            extra = self._update_params(exclude=bwd.finish_step(self), begin=not bwd.began)
            bwd.end_step(self, drop=extra is not None)
            return
        if bwd.enabled:
            bwd.refuse_grad_scaler(self)
        done = bwd.finish_first_step(self)  # ids of the parameters updated during backward
        if not done and plan is not None and plan.fast and fast_step(self, plan):
            bwd.end_step(self, drop=False)
            return
        plan = self._update_params(exclude=done, begin=not bwd.began)
        if done:
            plan = self._step_plan([p for g in self.param_groups for p in g["params"]
                                    if id(p) in done or p.grad is not None])
        bwd.make_schedule(self, plan)

    def check_changed_settings(self) -> None:
        """Settings changed in ``param_groups`` since they were last checked (by hand, a scheduler
        replacing a value) are checked before anything changes, with the constructor's messages."""
        seen = self._checked_settings
        if len(seen) != len(self.param_groups):
            seen[:] = [{} for _ in self.param_groups]
        for gi, group in enumerate(self.param_groups):
            last = seen[gi]
            if len(last) + 1 == len(group) and all(k in group and _same(v, group[k]) for k, v in last.items()):
                continue
            self.check_hyperparameters(group, f"param_groups[{gi}]")
            seen[gi] = {k: v for k, v in group.items() if k != "params"}

    def _update_params(self, exclude=frozenset(), begin: bool = True) -> Optional[StepPlan]:
        """The ordinary step of the parameters with gradients (but those in ``exclude``, ids); its
        plan (``begin``: executor.count_and_step's)."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and id(p) not in exclude:
                    params.append(p)
                    grads.append(g)
        if not params:
            return None

        # 1. Validate every gradient (one C++ call) before any state changes. DTensor parameters
        # (FSDP2) are checked, and updated, through their local shards: whether there are any is
        # decided once per plan, so a plain run pays nothing for it.
        plan = self._cached_plan(params)
        if capture.capturing(params[0]):
            capture.capture_check(self, plan)
        sharded = plan.sharded if plan is not None else sharding.has_dtensor(params)
        work_params, work_grads = (sharding.local_tensors(params, grads,
                                                          lambda p, g: raise_bad_sharding(self.param_groups, p, g))
                                   if sharded else (params, grads))
        verdict = _ops.check_grads(work_params, work_grads)
        if verdict >= 0:
            raise_bad_grad(self.param_groups, params[verdict])
        # 2. The plan (made once; new states made as a transaction), 3. the executor.
        if plan is None:
            plan = self._step_plan(params)
        executor.run(self.algorithm, self._pager, self.param_groups, plan, work_params, work_grads,
                     verdict == _ops.GRADS_CONTIGUOUS, getattr(self, "grad_scale", None),
                     getattr(self, "found_inf", None), begin)
        return plan

    def _step_plan(self, params: list[torch.Tensor]) -> StepPlan:
        """The buckets of this set of parameters (plan.py), built once and reused while the
        parameters with gradients, the param groups and the state stay the same (any change to
        ``self.state`` or a parameter's state dict, ``load_state_dict`` and ``add_param_group``
        rebuild it; a state tensor changed in place is used as it is)."""
        plan = self._cached_plan(params)
        if plan is not None:
            return plan
        streamed = streams_states(self._pager)
        overrides = self.overrides(self.param_groups)
        plan = build_plan(self.algorithm, self.param_groups, self.state, self._plan_version, params, overrides,
                          self.complete_state, self.check_fits_device_buffer if streamed else None, streamed)
        if streamed and not streams_now(self._pager):  # a hybrid pager kept every state on the device:
            plan = build_plan(self.algorithm, self.param_groups, self.state, self._plan_version, params, overrides,
                              self.complete_state, None, False)  # the resident plan (states held in C++)
        self._plan = hold_params_for_fast_steps(plan, params, self.param_groups, self._pager, self.algorithm)
        return self._plan

    def make_plan(self, params: list[torch.Tensor], overrides: dict) -> StepPlan:
        """A plan of ``params`` (parameters with gradients) run once and not cached: the states they
        lack made as one transaction, no held lists (a chunk of updates during backward without a
        schedule); ``overrides``: ``self.overrides(self.param_groups)``."""
        if not isinstance(self.state, StateTable):  # replaced by hand
            self.state = StateTable(self.state)
        streamed = streams_states(self._pager)
        return build_plan(self.algorithm, self.param_groups, self.state, self._plan_version, params, overrides,
                          self.complete_state, self.check_fits_device_buffer if streamed else None, streamed=True)

    def _cached_plan(self, params: list[torch.Tensor]) -> Optional[StepPlan]:
        """The cached plan if it still fits these parameters, the groups and the state, else None."""
        if not isinstance(self.state, StateTable):  # replaced by hand
            self.state = StateTable(self.state)
        plan = self._plan
        return plan if is_current(plan, self.state, self._plan_version, tuple(map(id, params))) else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """torch's state_dict, with every state tensor owning its storage (paged states are
        copied out of their shared slabs), so that ``torch.save`` writes it and
        ``torch.load(weights_only=True)`` reads it back."""
        if self._pager is not None:
            self._pager.settle()  # paged-out or host-resident states readable before they are copied
        sd = super().state_dict()
        sd["state"] = {k: checkpoint.portable_param_state(v) for k, v in sd["state"].items()}
        if sharding.dtensor_class() is not None:
            # A DTensor parameter's (FSDP2) states are local shards here; in the state dict they are
            # DTensors (sharding.sharded_param_state), so that torch.distributed.checkpoint saves
            # and reloads each rank's part.
            for saved, group in zip(sd["param_groups"], self.param_groups):
                for key, p in zip(saved["params"], group["params"]):
                    if key in sd["state"] and isinstance(p, sharding.dtensor_class()):
                        sd["state"][key] = sharding.sharded_param_state(sd["state"][key], p, self.algorithm)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a pagedopt, bitsandbytes or torch.optim.Adam/AdamW checkpoint (see
        pagedopt/optim/checkpoint.py). Everything is checked, and every new state tensor built,
        before anything is replaced: a refused checkpoint raises a ValueError naming the group,
        parameter and key, and leaves the optimizer unchanged. State keeps its own dtypes
        (torch would cast float32 absmax and codebooks to a bf16 parameter's dtype), and paged
        states stay paged. Pre-hooks may return a new dict; post-hooks see the loaded state."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        new_groups, new_state = checkpoint.plan_load(self, state_dict)
        for group, new in zip(self.param_groups, new_groups):
            group.clear()
            group.update(new)
        self.state = StateTable(new_state)
        self._plan_version += 1
        self._plan = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict:
        """What a copy or a pickle holds: groups, defaults and state (each tensor owning its
        storage); the pager and the step plan are rebuilt by __setstate__."""
        if self._pager is not None:
            self._pager.settle()
        return {"defaults": self.defaults, "param_groups": self.param_groups, "is_paged": self.is_paged,
                "capturable": getattr(self, "capturable", False),
                "budget_bytes": getattr(self._pager, "budget_bytes", None),
                "device_buffer_bytes": getattr(self._pager, "device_buffer_bytes", None),
                "resident_bytes": getattr(self._pager, "resident_bytes", None),
                "update_in_backward": None if self._backward_updates is None else self._backward_updates.enabled,
                "keep_grads": self._backward_updates is not None and self._backward_updates.keep_grads,
                "state": {p: checkpoint.portable_param_state(s) for p, s in self.state.items()}}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        is_paged = state.pop("is_paged", False)
        self.capturable = state.pop("capturable", False)
        budget_bytes = state.pop("budget_bytes", None)
        device_buffer_bytes = state.pop("device_buffer_bytes", None)
        resident_bytes = state.pop("resident_bytes", None)
        update_in_backward = state.pop("update_in_backward", None)
        keep_grads = state.pop("keep_grads", False)
        saved_state = state.pop("state", {})
        super().__setstate__(state)
        for settings in [self.defaults, *self.param_groups]:  # pickled before these settings existed
            settings.setdefault("bf16_stochastic_round", False)
            settings.setdefault("bf16_sr_seed", 0)
        pager = None
        if is_paged and device_buffer_bytes is not None:  # a copy keeps host residency and its buffer
            from ..paging import HostResidentPager

            pager = HostResidentPager(device_buffer_bytes, resident_bytes=resident_bytes)
        elif is_paged and budget_bytes is not None:  # a copy keeps the original's device budget
            from ..paging import PageManager

            pager = PageManager(budget_bytes, arena_bytes=PAGED_SLAB_BYTES)
        self._start_runtime(is_paged, pager)
        table = StateTable()
        for p, s in saved_state.items():
            s = dict(s)
            if self._pager is not None:  # a paged optimizer's copy pages its states too
                for k in self.algorithm.memory_keys:
                    if isinstance(s.get(k), torch.Tensor):
                        s[k] = self.state_copy(s[k], s[k].device)
            table[p] = s
        self.state = table
        if update_in_backward is not None:  # the copy's parameters get hooks of their own (tensors' copies have none)
            self._set_backward_updates(True, keep_grads)
            self._backward_updates.enabled = update_in_backward
