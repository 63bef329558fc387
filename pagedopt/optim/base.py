"""The one optimizer base class. Concrete optimizers (adam.py) only fix defaults.

State layout per parameter follows bitsandbytes, so checkpoints carry over:

* 8-bit (``numel >= min_8bit_size``): ``state1``/``state2`` uint8 codes shaped like the
  parameter, ``absmax1``/``absmax2`` float32 with one entry per 256-element block,
  ``qmap1`` (signed codebook) / ``qmap2`` (unsigned codebook), ``step``.
* 32-bit: ``state1``/``state2`` float32 shaped like the parameter, ``step``.

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
from .hyperparameters import check_hyperparameters
from .global_manager import GlobalOptimManager
from .state_table import StateTable

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Paged steps are split into chunks of about this many state bytes, so that paging in the
# next chunk overlaps the update of the current one.
_PAGED_CHUNK_BYTES = 64 << 20
# Paged states smaller than a quarter of this share managed slabs of this size, so that paging
# a chunk in or out takes a few driver calls instead of one per tensor: on the H200 this took
# page-in from 25 to 44 GB/s for the 714 state tensors of a 1.1B-parameter model.
_PAGED_SLAB_BYTES = 64 << 20


_STATE_KEYS = {True: ("state1", "state2", "absmax1", "absmax2", "step"), False: ("state1", "state2", "step")}


class _Bucket(NamedTuple):
    gi: int
    device: torch.device
    eight_bit: bool
    index: list[int]           # positions in step()'s list of parameters with gradients
    params: list[torch.Tensor]
    states: list[dict]
    lists: tuple               # one list per key of _STATE_KEYS[eight_bit]
    held: Any                  # 8-bit: a torch.classes.pagedopt.AdamStateList of the same lists
    override: dict             # GlobalOptimManager settings over the group's (lr, betas, eps, weight_decay)


class _StepPlan(NamedTuple):
    key: tuple
    buckets: list[_Bucket]
    steps_by_device: dict
    sharded: bool              # some parameter is a DTensor: kernels run on local shards (_local_tensors)


def _run_update(optimizer: "AdamBase") -> None:
    optimizer._update()


# The update as dynamo sees it: a function it does not trace (a graph break), run eagerly even
# inside a compiled frame. torch._disable_dynamo imports dynamo lazily, at the first compiled step.
_update_outside_graph = torch._disable_dynamo(_run_update, recursive=True)


def _describe(gi: int, pi: int, p: torch.Tensor) -> str:
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, {p.dtype}, {p.device})"


class AdamBase(torch.optim.Optimizer):
    """Adam with 8-bit blockwise-quantized or 32-bit states, optionally paged.

    ``decoupled`` (a class attribute of the concrete class) selects AdamW's decoupled
    weight decay; otherwise weight decay is L2, added to the gradient, as in torch.optim.Adam.
    """

    decoupled: bool = False
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, optim_bits: int = 32, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 is_paged: bool = False):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by pagedopt optimizers")
        if args is not None:
            raise ValueError("args (a bitsandbytes GlobalOptimManager config) is not supported; "
                             "pass the settings as keyword arguments or per param group")
        if percentile_clipping != 100:
            raise ValueError(f"percentile_clipping={percentile_clipping} is not supported; "
                             "only 100 (no clipping) is; clip gradients before step() instead")
        if not block_wise:
            raise ValueError("block_wise=False is not supported: states are always quantized in blocks of 256")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        self._check_hyperparameters(defaults, "argument")
        self._start_runtime(is_paged)
        super().__init__(params, defaults)
        self.state = StateTable(self.state)

    def _start_runtime(self, is_paged: bool) -> None:
        """What an optimizer holds besides its groups and state: the pager, the codebooks and the
        cached step plan (rebuilt after a copy or unpickling)."""
        self.is_paged = bool(is_paged)
        self._pager = None
        if self.is_paged:
            from ..paging import PageManager

            self._pager = PageManager(arena_bytes=_PAGED_SLAB_BYTES)
        self._codebooks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan_version = 0  # bumped whenever param groups are replaced or added
        self._plan = None

    # ------------------------------------------------------------------ validation
    _check_hyperparameters = staticmethod(check_hyperparameters)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with the group's settings checked before it is added."""
        if isinstance(param_group, dict):
            settings = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
            self._check_hyperparameters(settings, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        self._plan_version += 1

    @staticmethod
    def _check_param(gi: int, pi: int, p: torch.Tensor) -> None:
        g = p.grad
        if (p.dtype in _SUPPORTED_DTYPES and g.layout == torch.strided and g.dtype == p.dtype
                and g.shape == p.shape and g.device == p.device):
            return  # the common case, without building any message
        where = _describe(gi, pi, p)
        if p.is_complex():
            raise ValueError(f"{where}: complex parameters are not supported")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{where}: dtype {p.dtype} is not supported (float32, bfloat16, float16 are)")
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"{where}: sparse gradients are not supported")
        if g.dtype != p.dtype:
            raise ValueError(f"{where}: gradient dtype {g.dtype} differs from the parameter's {p.dtype}")
        if g.shape != p.shape:
            raise ValueError(f"{where}: gradient shape {tuple(g.shape)} differs from the parameter's")
        raise ValueError(f"{where}: gradient is on {g.device}, the parameter on {p.device}")

    # ------------------------------------------------------------------ state
    def _codebooks_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._codebooks:
            self._codebooks[device] = (dynamic_codebook(True, device), dynamic_codebook(False, device))
        return self._codebooks[device]

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

    @staticmethod
    def _overrides(param_groups: list[dict]) -> dict[tuple[int, int], dict]:
        """GlobalOptimManager's per-parameter settings for ``param_groups``, checked."""
        found = GlobalOptimManager.get_instance().overrides_for(param_groups)
        for (gi, pi), config in found.items():
            AdamBase._check_hyperparameters({**param_groups[gi], **config},
                                            f"param_groups[{gi}] (GlobalOptimManager override of params[{pi}])")
        return found

    def _init_state(self, config: dict, p: torch.Tensor) -> dict:
        """``p``'s state, created if it has none. A DTensor parameter (FSDP2) gets states of its
        local shard only (shape and blocks of ``sharding.local(p)``); whether they are 8-bit depends on the
        global size, so that every rank, and an unsharded run, choose alike."""
        state = self.state[p]
        if len(state) != 0:
            return state
        local = sharding.local(p)
        state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        if self._uses_8bit(config, p):
            blocks = (local.numel() + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
            state["state1"] = self._state_zeros(local.shape, torch.uint8, local.device)
            state["state2"] = self._state_zeros(local.shape, torch.uint8, local.device)
            state["absmax1"] = self._state_zeros((blocks,), torch.float32, local.device)
            state["absmax2"] = self._state_zeros((blocks,), torch.float32, local.device)
            state["qmap1"], state["qmap2"] = self._codebooks_on(local.device)
        else:
            state["state1"] = self._state_zeros(local.shape, torch.float32, local.device)
            state["state2"] = self._state_zeros(local.shape, torch.float32, local.device)
        return state

    # ------------------------------------------------------------------ step
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One Adam step over every parameter with a gradient; returns ``closure()`` if given.

        Under ``torch.compile`` the update is a clean graph break: the closure is traced with the
        caller's code, the update (``_update``) runs eagerly through ``torch._disable_dynamo``, so
        compiled code (``fullgraph=False``) and ``torch.compile(opt.step)`` run the kernels of an
        eager step, bit for bit. Tracing it would gain nothing (each bucket is one fused kernel,
        opaque to inductor), would guard on every parameter and state, cannot annotate the states
        mutated inside the AdamStateList (dynamo refuses it: UnsafeScriptObjectError), and cannot
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
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    params.append(p)
                    grads.append(g)
        if not params:
            return

        # 1. Validate every gradient (one C++ call) before any state changes. DTensor parameters
        # (FSDP2) are checked, and updated, through their local shards: whether there are any is
        # decided once per plan, so a plain run pays nothing for it.
        plan = self._cached_plan(params)
        sharded = plan.sharded if plan is not None else sharding.has_dtensor(params)
        work_params, work_grads = sharding.local_tensors(params, grads, self._raise_bad_sharding) if sharded else (params, grads)
        verdict = _ops.check_grads(work_params, work_grads)
        if verdict >= 0:
            self._raise_bad_grad(params[verdict])
        if plan is None:
            plan = self._step_plan(params)
        contiguous = verdict == _ops.GRADS_CONTIGUOUS

        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for device, steps in plan.steps_by_device.items():
            torch._foreach_add_(steps, 1.0)
        if self._pager is not None:
            self._pager.begin_step()
        for bucket in plan.buckets:
            group = self.param_groups[bucket.gi]
            if bucket.override:
                group = {**group, **bucket.override}
            device = bucket.device
            scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True)
            inf = None if found_inf is None else found_inf.to(device, non_blocking=True)
            bucket_grads = [work_grads[i] for i in bucket.index]
            bucket_params = [work_params[i] for i in bucket.index] if sharded else bucket.params
            if bucket.eight_bit:
                self._step_8bit(group, bucket, bucket_params, bucket_grads, contiguous, scale, inf)
            else:
                self._step_32bit(group, bucket, bucket_params, bucket_grads, contiguous, scale, inf)

        if found_inf is not None:
            for device, steps in plan.steps_by_device.items():
                torch._foreach_sub_(steps, found_inf.to(device, non_blocking=True))

    def _raise_bad_sharding(self, p: torch.Tensor, g: torch.Tensor) -> None:
        where = next((_describe(gi, pi, p) for gi, group in enumerate(self.param_groups)
                      for pi, q in enumerate(group["params"]) if q is p), "a parameter")
        raise ValueError(f"{where}: the parameter is {sharding.describe_layout(p)}, its gradient "
                         f"{sharding.describe_layout(g)} (they must be sharded alike)")

    def _raise_bad_grad(self, p: torch.Tensor) -> None:
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    self._check_param(gi, pi, p)
        raise ValueError(f"a gradient does not match its parameter (shape {tuple(p.shape)}, {p.dtype})")

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
        for i, p in enumerate(params):
            gi, pi = index_of[id(p)]
            override = overrides.get((gi, pi), {})
            st = self._init_state({**self.param_groups[gi], **override}, p)
            eight_bit = st["state1"].dtype == torch.uint8
            codebooks = (id(st["qmap1"]), id(st["qmap2"])) if eight_bit else None
            setting = tuple(sorted((k, v) for k, v in override.items() if k not in ("optim_bits", "min_8bit_size")))
            members[(gi, p.device, p.dtype, eight_bit, codebooks, setting)].append(i)
        buckets = []
        steps_by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for (gi, device, _, eight_bit, _, setting), index in members.items():
            bucket_params = [params[i] for i in index]
            states = [state[p] for p in bucket_params]
            lists = tuple([s[k] for s in states] for k in _STATE_KEYS[eight_bit])
            held = None
            if eight_bit:  # the C++ side holds the state lists; a step then passes params and gradients
                held = torch.classes.pagedopt.AdamStateList(*lists, states[0]["qmap1"], states[0]["qmap2"])
            buckets.append(_Bucket(gi, device, eight_bit, index, bucket_params, states, lists, held, dict(setting)))
            steps_by_device[device] += [s["step"] for s in states]
        key = (id(state), state.version, self._plan_version, key[3])  # states may have been created
        self._plan = _StepPlan(key, buckets, dict(steps_by_device), sharding.has_dtensor(params))
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

    @staticmethod
    def _contiguous_views(params: list[torch.Tensor], grads: list[torch.Tensor]):
        """Kernels need contiguous tensors; a non-contiguous parameter is updated through a
        contiguous copy that is written back afterwards."""
        work_params = [p if p.is_contiguous() else p.contiguous() for p in params]
        work_grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        return work_params, work_grads

    @staticmethod
    def _write_back(params: list[torch.Tensor], work_params: list[torch.Tensor]) -> None:
        for p, w in zip(params, work_params):
            if w is not p:
                p.copy_(w)

    def _chunks(self, bucket: "_Bucket") -> list[list[int]]:
        """Positions in the bucket, in chunks: all at once unless paged states are not resident."""
        everything = [list(range(len(bucket.params)))]
        if self._pager is None or self._pager.all_resident():
            return everything
        from ..paging import split_by_bytes

        keys = ("state1", "state2", "absmax1", "absmax2")
        return split_by_bytes(everything[0], lambda j: sum(bucket.states[j][k].numel() * bucket.states[j][k].element_size()
                                                           for k in keys if k in bucket.states[j]), _PAGED_CHUNK_BYTES)

    def _paged_stages(self, bucket: "_Bucket", chunks: list[list[int]]):
        if self._pager is None or self._pager.all_resident():
            return range(len(chunks))
        keys = ("state1", "state2", "absmax1", "absmax2")
        return self._pager.stage([[bucket.states[j][k] for j in chunk for k in keys if k in bucket.states[j]]
                                  for chunk in chunks])

    def _bucket_chunks(self, bucket: "_Bucket", bucket_params: list[torch.Tensor], grads: list[torch.Tensor],
                       contiguous: bool):
        """(params, grads, state lists) per chunk, in the order the chunks are to be updated."""
        chunks = self._chunks(bucket)
        for i in self._paged_stages(bucket, chunks):
            chunk = chunks[i]
            if len(chunks) == 1:
                params, chunk_grads, lists = bucket_params, grads, bucket.lists
            else:
                params = [bucket_params[j] for j in chunk]
                chunk_grads = [grads[j] for j in chunk]
                lists = tuple([lst[j] for j in chunk] for lst in bucket.lists)
            if contiguous:
                yield params, params, chunk_grads, lists
            else:
                work_params, work_grads = self._contiguous_views(params, chunk_grads)
                yield params, work_params, work_grads, lists

    def _step_8bit(self, group: dict, bucket: "_Bucket", params, grads, contiguous: bool, grad_scale,
                   found_inf) -> None:
        """``params``/``grads``: the bucket's (local shards of DTensor parameters)."""
        beta1, beta2 = group["betas"]
        if contiguous and (self._pager is None or self._pager.all_resident()):
            _ops.ops.adam8bit_step_list_(
                bucket.held, params, grads, float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), self.decoupled, grad_scale, found_inf)
            return
        qmap1, qmap2 = bucket.states[0]["qmap1"], bucket.states[0]["qmap2"]
        for params, work_params, work_grads, (state1, state2, absmax1, absmax2, steps) in self._bucket_chunks(
                bucket, params, grads, contiguous):
            _ops.ops.adam8bit_step_(
                work_params, work_grads, state1, state2, absmax1, absmax2, steps, qmap1, qmap2,
                float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), self.decoupled, grad_scale, found_inf)
            if work_params is not params:
                self._write_back(params, work_params)

    def _step_32bit(self, group: dict, bucket: "_Bucket", params, grads, contiguous: bool, grad_scale,
                    found_inf) -> None:
        """32-bit states reuse torch's fused Adam/AdamW kernel (CPU and CUDA), on plain (local) tensors."""
        beta1, beta2 = group["betas"]
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        for params, work_params, work_grads, (state1, state2, steps) in self._bucket_chunks(bucket, params, grads,
                                                                                              contiguous):
            # torch's fused kernel wants params, grads and states of one dtype; states stay fp32.
            if work_params[0].dtype != torch.float32:
                work_params = [w.float() for w in work_params]
                work_grads = [g.float() for g in work_grads]
            fused(work_params, work_grads, state1, state2, [], steps, lr=float(group["lr"]), beta1=float(beta1),
                  beta2=float(beta2), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                  amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            if work_params is not params:
                self._write_back(params, work_params)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """torch's state_dict, with every state tensor owning its storage (paged states are
        copied out of their shared slabs), so that ``torch.save`` writes it and
        ``torch.load(weights_only=True)`` reads it back."""
        sd = super().state_dict()
        sd["state"] = {k: checkpoint.portable_param_state(v) for k, v in sd["state"].items()}
        if sharding.dtensor_class() is not None:
            # A DTensor parameter's (FSDP2) states are local shards here; in the state dict they are
            # DTensors (sharding.sharded_param_state), so that torch.distributed.checkpoint saves
            # and reloads each rank's part.
            for saved, group in zip(sd["param_groups"], self.param_groups):
                for key, p in zip(saved["params"], group["params"]):
                    if key in sd["state"] and isinstance(p, sharding.dtensor_class()):
                        sd["state"][key] = sharding.sharded_param_state(sd["state"][key], p)
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
        return {"defaults": self.defaults, "param_groups": self.param_groups, "is_paged": self.is_paged,
                "state": {p: checkpoint.portable_param_state(s) for p, s in self.state.items()}}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        is_paged = state.pop("is_paged", False)
        saved_state = state.pop("state", {})
        super().__setstate__(state)
        self._start_runtime(is_paged)
        table = StateTable()
        for p, s in saved_state.items():
            s = dict(s)
            if self._pager is not None:  # a paged optimizer's copy pages its states too
                for k in ("state1", "state2", "absmax1", "absmax2"):
                    if isinstance(s.get(k), torch.Tensor):
                        s[k] = self._state_copy(s[k], s[k].device)
            table[p] = s
        self.state = table

    # ------------------------------------------------------------------ paging
    def page_out(self) -> None:
        """Send every paged state to host memory (for example right after step(), to free
        the GPU for activations). A no-op for unpaged optimizers."""
        if self._pager is not None:
            self._pager.page_out()

    def prefetch(self) -> None:
        """Bring every paged state back to its device ahead of the next step."""
        if self._pager is not None:
            self._pager.prefetch()

    def paging_stats(self):
        return None if self._pager is None else self._pager.stats()

    def state_bytes(self) -> int:
        """Bytes held by optimizer state tensors (codes, absmax, 32-bit moments, steps)."""
        return optimizer_state_bytes(self)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by any optimizer's state tensors on this process, each storage counted once; the
    shared codebooks (qmap1/qmap2) are not counted. Under FSDP2 that is this rank's shards (a DTensor
    state, as torch's optimizers keep, counts its local tensor)."""
    seen, total = set(), 0
    for s in optimizer.state.values():
        for k, v in s.items():
            v = sharding.local(v) if isinstance(v, torch.Tensor) else v  # a DTensor state counts its local shard
            if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2") and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total
