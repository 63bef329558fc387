"""The one optimizer base class, QuantizedOptimizer: step planning, GradScaler, paging and
checkpoints for every algorithm. An algorithm declares its states and hyperparameters in an
AlgorithmSpec (algorithm.py); each public class is a short declaration (adam.py, lion.py,
ademamix.py).

State layout per parameter follows bitsandbytes, so checkpoints carry over (Adam's shown; the
spec says which keys an algorithm has):

* 8-bit (``numel >= min_8bit_size``): ``state1``/``state2`` uint8 codes shaped like the
  parameter (a state holding two stacked moments has shape ``(2, *param.shape)``),
  ``absmax1``/``absmax2`` float32 with one entry per 256-element block (per moment),
  ``qmap1`` (signed codebook) / ``qmap2`` (unsigned codebook), ``step``.
* 32-bit: ``state1``/``state2`` float32 of the same shapes, ``step``.

A DTensor parameter (FSDP2) keeps these states for its local shard only, as plain tensors; its
state dict presents them as DTensors (see sharding.sharded_param_state).

``step`` is a float32 scalar tensor on the parameter's device (as torch's fused Adam keeps
it), so that a step skipped by GradScaler needs no host synchronisation.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import _ops
from ..quant import STATE_BLOCK_SIZE, dynamic_codebook
from . import checkpoint, sharding
from .algorithm import AlgorithmSpec
from .bucket_chunks import bucket_chunks, write_back
from . import capture
from .capture import capture_check, lr_tensor
from .fast_step import fast_step, hold_params_for_fast_steps
from .byte_sizes import optimizer_state_bytes  # noqa: F401  (public here)
from .pager_control import PAGED_SLAB_BYTES as _PAGED_SLAB_BYTES, PagerControl
from .hyperparameters import check_hyperparameters
from .global_manager import GlobalOptimManager
from .grad_checks import raise_bad_grad, raise_bad_sharding
from .state_table import StateTable
from .step_counters import add_to_counters, share_step_counters, subtract_from_counters

# Paged steps are split into chunks of about this many state bytes, so that paging in the
# next chunk overlaps the update of the current one.
_PAGED_CHUNK_BYTES = 64 << 20


class _Bucket(NamedTuple):
    gi: int
    device: torch.device
    eight_bit: bool
    stateful: bool             # False: the parameters have no state but `step` (plain SGD)
    index: list[int]           # positions in step()'s list of parameters with gradients
    params: list[torch.Tensor]
    states: list[dict]
    lists: tuple               # one list per key of optimizer._bucket_keys(eight_bit)
    held: Any                  # the same lists held by a C++ state list (optimizer._hold_states), or None
    override: dict             # GlobalOptimManager settings over the group's (lr, betas, eps, weight_decay)


class _StepPlan(NamedTuple):
    key: tuple
    buckets: list[_Bucket]
    steps_by_device: dict      # device -> its parameters' step counters (step_counters.py)
    sharded: bool              # some parameter is a DTensor: kernels run on local shards (_local_tensors)
    fast: bool                 # fast_step.py may run the next steps (held lists over every parameter)


def _run_update(optimizer: "QuantizedOptimizer") -> None:
    optimizer._update()


# The update as dynamo sees it: a function it does not trace (a graph break), run eagerly even
# inside a compiled frame. torch._disable_dynamo imports dynamo lazily, at the first compiled step.
_update_outside_graph = torch._disable_dynamo(_run_update, recursive=True)


class QuantizedOptimizer(PagerControl, torch.optim.Optimizer):
    """An optimizer with 8-bit blockwise-quantized or 32-bit states, optionally paged; the
    algorithm is the class's ``algorithm`` spec. ``defaults`` holds the param-group settings
    (always ``lr``, ``betas``, ``weight_decay``, ``optim_bits``, ``min_8bit_size``)."""

    algorithm: AlgorithmSpec
    _bits: Optional[int] = None  # the state width a *8bit / *32bit class fixes (None: optim_bits decides)
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    _held_step_only = True  # every stateful bucket's step is its held list's quantized_step_ (fast_step.py)

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
        if not isinstance(capturable, bool):
            raise ValueError(f"Invalid argument 'capturable': {capturable!r} (must be True or False)")
        # the optimizer's, not a param group's: the groups keep bitsandbytes' keys (checkpoint layout)
        self.capturable = capturable
        self._check_hyperparameters(defaults, "argument")
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

            self._pager = PageManager(arena_bytes=_PAGED_SLAB_BYTES)
        self._codebooks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan_version = 0  # bumped whenever param groups are replaced or added
        self._plan = None
        self._backward_updates = None  # set_pager(..., update_in_backward=True): backward_updates.py

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
    def _check_hyperparameters(cls, h: dict, where: str) -> None:
        spec = cls.algorithm
        check_hyperparameters(h, where, spec.betas, spec.has_eps, spec.check)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with the group's settings checked before it is added."""
        if isinstance(param_group, dict):
            settings = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
            self._check_hyperparameters(settings, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        self._plan_version += 1
        if getattr(self, "_backward_updates", None) is not None:
            self._backward_updates.hook_params(self.param_groups[-1]["params"])

    # ------------------------------------------------------------------ state
    def _codebooks_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (signed, unsigned) dynamic codebooks on ``device``, shared by every parameter there."""
        if device not in self._codebooks:
            self._codebooks[device] = (dynamic_codebook(True, device), dynamic_codebook(False, device))
        return self._codebooks[device]

    def _default_qmap(self, qmap_key: str, device: torch.device) -> torch.Tensor:
        """The codebook this algorithm gives the state of ``qmap_key`` (``qmap1``...) on ``device``."""
        spec = next(s for s in self.algorithm.states if s.qmap_key == qmap_key)
        signed, unsigned = self._codebooks_on(device)
        return signed if spec.signed else unsigned

    def _bucket_keys(self, eight_bit: bool, stateful: bool = True) -> tuple[str, ...]:
        """The state keys a fused call takes, one list each: states, absmax (8-bit), step."""
        spec = self.algorithm
        if not stateful:
            return ("step",)
        return spec.state_keys + (spec.absmax_keys if eight_bit else ()) + ("step",)

    def _needs_states(self, config: dict) -> bool:
        """Whether a parameter under ``config`` keeps the algorithm's states (plain SGD does not)."""
        return True

    def _state_zeros(self, shape, dtype, device) -> torch.Tensor:
        if self._pager is not None:
            return self._pager.zeros(shape, dtype, device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def _state_copy(self, t: torch.Tensor, device) -> torch.Tensor:
        """A copy of ``t`` on ``device`` in this optimizer's own state memory (paged when it pages)."""
        out = self._state_zeros(t.shape, t.dtype, device)
        out.copy_(t)
        return out

    def _uses_8bit(self, config: dict, p: torch.Tensor) -> bool:
        """Whether a new state for ``p`` is 8-bit under ``config`` (its group and overrides)."""
        return config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]

    def _overrides(self, param_groups: list[dict]) -> dict[tuple[int, int], dict]:
        """GlobalOptimManager's per-parameter settings for ``param_groups``, checked."""
        found = GlobalOptimManager.get_instance().overrides_for(param_groups)
        for (gi, pi), config in found.items():
            self._check_hyperparameters({**param_groups[gi], **config},
                                            f"param_groups[{gi}] (GlobalOptimManager override of params[{pi}])")
        return found

    def _init_state(self, config: dict, p: torch.Tensor) -> dict:
        """``p``'s state, created if it has none. A DTensor parameter (FSDP2) gets states of its
        local shard only (shape and blocks of ``sharding.local(p)``); whether they are 8-bit depends on the
        global size, so that every rank, and an unsharded run, choose alike."""
        state = self.state[p]
        needs_states = self._needs_states(config)
        if len(state) != 0 and (not needs_states or self.algorithm.states[0].key in state):
            return state
        local = sharding.local(p)
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        if not needs_states:
            return state
        eight_bit = self._uses_8bit(config, p)
        blocks = (local.numel() + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
        for spec in self.algorithm.states:
            state[spec.key] = self._state_zeros(spec.shape(local.shape), torch.uint8 if eight_bit else torch.float32,
                                                local.device)
            if eight_bit:
                state[spec.absmax_key] = self._state_zeros(spec.absmax_shape(blocks), torch.float32, local.device)
                state[spec.qmap_key] = self._default_qmap(spec.qmap_key, local.device)
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
        """The update of step(), always eager (see step())."""
        plan = self._plan
        if plan is not None and plan.fast and fast_step(self, plan):
            return
        bwd = self._backward_updates
        if bwd is None:
            self._update_params()
        elif bwd.active(self):  # updates during backward (backward_updates.py): the rest of them
            extra = self._update_params(exclude=bwd.finish_step(self))
            bwd.end_step(self, drop=extra is not None)
        else:
            if bwd.enabled:
                bwd.refuse_grad_scaler(self)
            bwd.make_schedule(self, self._update_params())

    def _update_params(self, exclude=frozenset()) -> Optional["_StepPlan"]:
        """The ordinary step of the parameters with gradients (but those in ``exclude``, ids); its plan."""
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
            capture_check(self, plan)
        sharded = plan.sharded if plan is not None else sharding.has_dtensor(params)
        work_params, work_grads = sharding.local_tensors(params, grads, lambda p, g: raise_bad_sharding(self.param_groups, p, g)) if sharded else (params, grads)
        verdict = _ops.check_grads(work_params, work_grads)
        if verdict >= 0:
            raise_bad_grad(self.param_groups, params[verdict])
        if plan is None:
            plan = self._step_plan(params)
        contiguous = verdict == _ops.GRADS_CONTIGUOUS

        def step_bucket(i, bucket, scale, inf):
            bucket_grads = [work_grads[k] for k in bucket.index]
            bucket_params = [work_params[k] for k in bucket.index] if sharded else bucket.params
            self._step_bucket(self._group_of(bucket), bucket, bucket_params, bucket_grads, contiguous, scale, inf)

        self._count_and_step(plan, step_bucket)
        return plan

    def _group_of(self, bucket: "_Bucket") -> dict:
        """The settings a bucket steps with: its group's, with its GlobalOptimManager overrides."""
        group = self.param_groups[bucket.gi]
        return {**group, **bucket.override} if bucket.override else group

    def _count_and_step(self, plan: "_StepPlan", step_bucket: Callable) -> None:
        """What every step does around its buckets' calls (the ordinary step and fast_step.py):
        step counters + 1, the pager told that a step begins, ``step_bucket(i, bucket, grad_scale,
        found_inf)`` per bucket with GradScaler's tensors on the bucket's device, then counters -
        found_inf (a skipped step does not count)."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for steps in plan.steps_by_device.values():
            add_to_counters(steps, 1.0)
        if self._pager is not None:
            self._pager.begin_step()
        for i, bucket in enumerate(plan.buckets):
            scale = None if grad_scale is None else grad_scale.to(bucket.device, non_blocking=True)
            inf = None if found_inf is None else found_inf.to(bucket.device, non_blocking=True)
            step_bucket(i, bucket, scale, inf)
        if found_inf is not None:
            for device, steps in plan.steps_by_device.items():
                subtract_from_counters(steps, found_inf.to(device, non_blocking=True))

    def _step_plan(self, params: list[torch.Tensor]) -> "_StepPlan":
        """The buckets of this set of parameters, built once and reused while the parameters with
        gradients, the param groups and the state stay the same (any change to ``self.state`` or a
        parameter's state dict, ``load_state_dict`` and ``add_param_group`` rebuild it; a state
        tensor changed in place is used as it is). Bucket by (group, device, dtype, state width,
        codebooks, per-parameter overrides); each bucket is one fused call. Codebooks differ only
        when a checkpoint brought its own."""
        plan = self._cached_plan(params)
        if plan is not None:
            return plan
        state = self.state
        key = (id(state), state.version, self._plan_version, tuple(map(id, params)))
        index_of = {id(p): (gi, pi) for gi, group in enumerate(self.param_groups)
                    for pi, p in enumerate(group["params"])}
        overrides = self._overrides(self.param_groups)
        members: dict[tuple, list[int]] = defaultdict(list)
        streamed = getattr(self._pager, "streams_states", False)  # host-resident states: no held device lists
        for i, p in enumerate(params):
            gi, pi = index_of[id(p)]
            override = overrides.get((gi, pi), {})
            if streamed:
                self._check_fits_device_buffer({**self.param_groups[gi], **override}, p, gi, pi)
            st = self._init_state({**self.param_groups[gi], **override}, p)
            stateful = self.algorithm.states[0].key in st
            eight_bit = stateful and st[self.algorithm.states[0].key].dtype == torch.uint8
            codebooks = tuple(id(st[q]) for q in self.algorithm.qmap_keys) if eight_bit else None
            setting = tuple(sorted((k, v) for k, v in override.items() if k not in ("optim_bits", "min_8bit_size")))
            members[(gi, p.device, p.dtype, eight_bit, stateful, codebooks, setting)].append(i)
        on_device: dict[torch.device, list[dict]] = defaultdict(list)
        for (_, device, *_), index in members.items():
            on_device[device] += [state[params[i]] for i in index]
        # before the state lists are held: they take the shared counters (step_counters.py)
        steps_by_device = {device: share_step_counters(states, device) for device, states in on_device.items()}
        buckets = []
        for (gi, device, _, eight_bit, stateful, _, setting), index in members.items():
            bucket_params = [params[i] for i in index]
            states = [state[p] for p in bucket_params]
            lists = tuple([s[k] for s in states] for k in self._bucket_keys(eight_bit, stateful))
            held = self._hold_states(lists, states[0], eight_bit) if stateful and not streamed else None
            buckets.append(_Bucket(gi, device, eight_bit, stateful, index, bucket_params, states, lists, held,
                                   dict(setting)))
        key = (id(state), state.version, self._plan_version, key[3])  # states may have been created
        sharded = sharding.has_dtensor(params)
        fast = hold_params_for_fast_steps(self, buckets, params, sharded)
        self._plan = _StepPlan(key, buckets, steps_by_device, sharded, fast)
        return self._plan

    def _cached_plan(self, params: list[torch.Tensor]) -> Optional["_StepPlan"]:
        """The cached plan if it still fits these parameters, the groups and the state, else None."""
        state = self.state
        if not isinstance(state, StateTable):  # replaced by hand
            state = self.state = StateTable(state)
        plan = self._plan
        if plan is not None and plan.key == (id(state), state.version, self._plan_version, tuple(map(id, params))):
            return plan
        return None

    def _hold_states(self, lists: tuple, first_state: dict, eight_bit: bool):
        """The bucket's state lists held by the C++ side, so that a step passes only parameters
        and gradients (see quantized_state_list.h); ``first_state`` gives the codebooks."""
        spec, n_keys = self.algorithm, len(self.algorithm.states)
        return torch.classes.pagedopt.QuantizedStateList(
            spec.engine, [t for lst in lists[:n_keys] for t in lst],
            [t for lst in lists[n_keys:2 * n_keys] for t in lst] if eight_bit else [], lists[-1],
            [first_state[q] for q in spec.qmap_keys] if eight_bit else [])

    def _bucket_chunks(self, bucket: "_Bucket", bucket_params: list[torch.Tensor], grads: list[torch.Tensor],
                       contiguous: bool):
        """(params, work params, work grads, state lists) per chunk of the bucket (bucket_chunks.py)."""
        keys = self.algorithm.state_keys + self.algorithm.absmax_keys
        return bucket_chunks(self._pager, keys, bucket.states, bucket.lists, bucket_params, grads, contiguous,
                             _PAGED_CHUNK_BYTES)

    _write_back = staticmethod(write_back)

    def _step_bucket(self, group: dict, bucket: "_Bucket", params, grads, contiguous: bool, grad_scale,
                     found_inf) -> None:
        """One fused call of the generic engine on the held states (quantized_step_list_) per
        bucket, or ``_step_chunk`` per chunk of it: while paged states are not resident, and for
        buckets whose states are not held (host-resident ones; Adam's 32-bit states, which torch's
        fused kernel updates). ``params``/``grads``: the bucket's (local shards of DTensor parameters)."""
        if not bucket.stateful:
            self._step_stateless(group, params, grads, grad_scale, found_inf)
            return
        if bucket.held is not None and contiguous and (self._pager is None or self._pager.all_resident()):
            lr = lr_tensor(group, bucket.device)
            hyper = self._engine_hyper(group if lr is None else {**group, "lr": 0.0})
            _ops.quantized_step_list_(bucket.held, params, grads, hyper, grad_scale, found_inf, lr)
            return
        for params, work_params, work_grads, lists in self._bucket_chunks(bucket, params, grads, contiguous):
            self._step_chunk(group, bucket, params, work_params, work_grads, lists, grad_scale, found_inf)

    def _step_chunk(self, group: dict, bucket: "_Bucket", params, work_params, work_grads, lists: tuple, grad_scale,
                    found_inf) -> None:
        """One fused call on some of a bucket's parameters: ``lists`` holds their state tensors (or
        device views of host-resident ones), one list per key of the bucket (``bucket.lists``);
        ``work_params`` are the contiguous tensors updated in place of ``params`` (written back)."""
        spec = self.algorithm
        lr = lr_tensor(group, bucket.device)
        hyper = self._engine_hyper(group if lr is None else {**group, "lr": 0.0})
        n_keys = len(spec.states)
        qmaps = [bucket.states[0][q] for q in spec.qmap_keys] if bucket.eight_bit else []
        absmax = lists[n_keys:2 * n_keys] if bucket.eight_bit else []
        _ops.quantized_step_(spec.engine, work_params, work_grads, lists[:n_keys], absmax, lists[-1], qmaps,
                             hyper, grad_scale=grad_scale, found_inf=found_inf, lr=lr)
        if work_params is not params:
            self._write_back(params, work_params)

    def _engine_hyper(self, group: dict) -> list:
        """The op's ``hyper`` list for this group (the algorithm's, in the functor's order)."""
        return self.algorithm.hyper(group)

    def _step_stateless(self, group: dict, params, grads, grad_scale, found_inf) -> None:
        """The step of parameters without states (plain SGD overrides it)."""
        raise NotImplementedError(f"{type(self).__name__} keeps states for every parameter")

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
                "update_in_backward": None if self._backward_updates is None else self._backward_updates.enabled,
                "state": {p: checkpoint.portable_param_state(s) for p, s in self.state.items()}}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        is_paged = state.pop("is_paged", False)
        self.capturable = state.pop("capturable", False)
        budget_bytes = state.pop("budget_bytes", None)
        device_buffer_bytes = state.pop("device_buffer_bytes", None)
        update_in_backward = state.pop("update_in_backward", None)
        saved_state = state.pop("state", {})
        super().__setstate__(state)
        pager = None
        if is_paged and device_buffer_bytes is not None:  # a copy keeps host residency and its buffer
            from ..paging import HostResidentPager

            pager = HostResidentPager(device_buffer_bytes)
        elif is_paged and budget_bytes is not None:  # a copy keeps the original's device budget
            from ..paging import PageManager

            pager = PageManager(budget_bytes, arena_bytes=_PAGED_SLAB_BYTES)
        self._start_runtime(is_paged, pager)
        table = StateTable()
        for p, s in saved_state.items():
            s = dict(s)
            if self._pager is not None:  # a paged optimizer's copy pages its states too
                for k in self.algorithm.state_keys + self.algorithm.absmax_keys:
                    if isinstance(s.get(k), torch.Tensor):
                        s[k] = self._state_copy(s[k], s[k].device)
            table[p] = s
        self.state = table
        if update_in_backward is not None:  # the copy's parameters get hooks of their own (tensors' copies have none)
            self._set_backward_updates(True)
            self._backward_updates.enabled = update_in_backward
