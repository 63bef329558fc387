"""The step plan: the buckets of a set of parameters with gradients, built once and reused while
the parameters, the param groups and the state stay the same.

A bucket is one kernel call's worth of parameters: same group, device, dtype, state format
(state_format.py), codebooks and per-parameter overrides. It names its state lists by key (``lists["state1"]``,
``lists["absmax1"]``, ``lists["step"]``), and says which kernel functional updates it
(``kernel``: kernels.py). ``is_current`` is the one test of whether a plan still fits.

Making a plan makes the states of parameters that have none, as a transaction: every new state
tensor is allocated before any is stored, so that running out of memory part way (a
``torch.OutOfMemoryError``) leaves ``optimizer.state`` as it was.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import sharding
from .algorithms.spec import AlgorithmSpec
from .grad_checks import locate
from .state_format import FLOAT32, StateFormat, format_of, state_mismatch
from .state_table import StateTable
from .step_counters import share_step_counters

ENGINE, FUSED32, STATELESS = "engine", "fused32", "stateless"


class Bucket(NamedTuple):
    gi: int
    device: torch.device
    fmt: StateFormat           # the format of its states (32-, 8- or 4-bit)
    stateful: bool             # False: the parameters have no state but `step` (plain SGD)
    index: list[int]           # positions in step()'s list of parameters with gradients
    params: list[torch.Tensor]
    states: list[dict]
    lists: dict                # key -> one tensor per parameter, for each key of spec.call_keys
    held: Any                  # the same lists held by a C++ QuantizedStateList (holds_states), or None
    override: dict             # GlobalOptimManager settings over the group's (lr, betas, eps, weight_decay)
    kernel: str                # ENGINE, FUSED32 or STATELESS (kernels.py)
    sr_ids: list               # each parameter's id for stochastic rounding (sr_place)
    sr_offsets: list           # and the index of its (local) first element in the whole parameter

    def qmaps(self, spec: AlgorithmSpec) -> list:
        """The codebooks of a quantized bucket, in the order of the spec's states (empty: 32-bit)."""
        return [self.states[0][q] for q in spec.qmap_keys] if self.fmt.quantized else []


class StepPlan(NamedTuple):
    key: tuple
    buckets: list[Bucket]
    steps_by_device: dict      # device -> its parameters' step counters (step_counters.py)
    sharded: bool              # some parameter is a DTensor: kernels run on local shards
    fast: bool                 # the fast step may run the next steps (held lists over every parameter)


def plan_key(state: StateTable, version: int, params: list) -> tuple:
    return (id(state), state.version, version, tuple(map(id, params)))


def is_current(plan: Optional[StepPlan], state, version: int, param_ids: Optional[tuple] = None) -> bool:
    """Whether ``plan`` still fits the optimizer's ``state`` (same table, unchanged), its param
    groups (``version``) and, when given, the ids of the parameters with gradients in order."""
    if plan is None or not isinstance(state, StateTable):
        return False
    key = plan.key
    if key[0] != id(state) or key[1] != state.version or key[2] != version:
        return False
    return param_ids is None or key[3] == param_ids


def group_of(param_groups: list[dict], bucket: Bucket) -> dict:
    """The settings a bucket steps with: its group's, with its GlobalOptimManager overrides."""
    group = param_groups[bucket.gi]
    return {**group, **bucket.override} if bucket.override else group


def sr_place(position: int, p: torch.Tensor) -> tuple[int, int]:
    """A parameter's (id, offset) in the random bits of stochastic rounding (csrc/include/pagedopt/
    stochastic_round.h): the id is its position among the optimizer's parameters (param groups in
    order, the numbering of state_dict()), which a resumed run gives it again; a DTensor's local
    shard starts at its offset in the global tensor, or, for shardings that are not runs of whole
    rows, is numbered in the id's high 32 bits (sharding.rounding_place): shards draw different
    bits, replicas the same."""
    shard, offset = sharding.rounding_place(p)
    return position | (shard << 32), offset


def kernel_of(spec: AlgorithmSpec, quantized: bool, stateful: bool) -> str:
    if not stateful:
        return STATELESS
    return FUSED32 if spec.fused32 is not None and not quantized else ENGINE


def holds_states(kernel: str, dtype: torch.dtype) -> bool:
    """Whether a bucket of this kernel and parameter dtype can hold its states in C++ (for resident
    states without a norm pass first): the engine's, and torch's fused kernel's on fp32 parameters
    (16-bit ones go through fp32 copies, kernels.fused32_step)."""
    return kernel == ENGINE or (kernel == FUSED32 and dtype == torch.float32)


def hold_states(spec: AlgorithmSpec, lists: dict, first_state: dict, quantized: bool, kernel: str = ENGINE):
    """The bucket's state lists held by the C++ side, so that a step passes only parameters and
    gradients (see quantized_state_list.h); ``first_state`` gives the codebooks. A FUSED32 bucket's
    list is stepped by torch's fused op (``spec.fused32``), in the fast step."""
    return torch.classes.pagedopt.QuantizedStateList(
        spec.fused32 if kernel == FUSED32 else spec.engine, [t for k in spec.state_keys for t in lists[k]],
        [t for k in spec.absmax_keys for t in lists[k]] if quantized else [], lists["step"],
        [first_state[q] for q in spec.qmap_keys] if quantized else [])


def build_plan(spec: AlgorithmSpec, param_groups: list[dict], state: StateTable, version: int,
               params: list[torch.Tensor], overrides: dict, new_state: Callable[[dict, torch.Tensor, dict], dict],
               check_new: Optional[Callable[[dict, torch.Tensor, int, int], None]] = None,
               streamed: bool = False) -> StepPlan:
    """The plan of ``params`` (the parameters with gradients, in order). ``overrides``: (group,
    index) -> GlobalOptimManager settings; ``new_state(config, p, existing)``: ``p``'s state dict
    made complete (a new dict: ``existing`` is not changed), or None when it is; ``check_new(config,
    p, gi, pi)`` refuses a parameter before anything is made (host residency's buffer);
    ``streamed``: no bucket holds device lists (states stream from the host, or the plan runs once)."""
    index_of = {id(p): (gi, pi) for gi, group in enumerate(param_groups) for pi, p in enumerate(group["params"])}
    group_start = [0]
    for group in param_groups:
        group_start.append(group_start[-1] + len(group["params"]))
    configs = []
    for p in params:
        gi, pi = index_of[id(p)]
        override = overrides.get((gi, pi), {})
        config = {**param_groups[gi], **override} if override else param_groups[gi]
        if check_new is not None:
            check_new(config, p, gi, pi)
        configs.append((gi, override, config))
    # the transaction: every missing state is made first, every state checked, then all are stored at once
    made = {}
    for p, (_, _, config) in zip(params, configs):
        complete = new_state(config, p, state[p] if p in state else {})
        if complete is not None:
            made[p] = complete
    for p in params:  # states set by hand (a state replaced in opt.state) before a kernel reads them
        final = made[p] if p in made else state[p]
        why = state_mismatch(final, spec, sharding.local(p), not streamed)
        if why is not None:
            raise ValueError(f"{locate(param_groups, p)}: {why} (a state set by hand must keep the shape, dtype "
                             "and device the optimizer gave it)")
    for p, complete in made.items():
        state[p] = complete

    first_key = spec.states[0].key
    members: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, (gi, override, _)) in enumerate(zip(params, configs)):
        st = state[p]
        stateful = first_key in st
        fmt = format_of(st, spec.states[0].qmap_key, first_key) if stateful else FLOAT32
        codebooks = tuple(id(st[q]) for q in spec.qmap_keys) if fmt.quantized else None
        setting = tuple(sorted((k, v) for k, v in override.items() if k not in ("optim_bits", "min_8bit_size")))
        members[(gi, p.device, p.dtype, fmt, stateful, codebooks, setting)].append(i)
    on_device: dict[torch.device, list[dict]] = defaultdict(list)
    for (_, device, *_), index in members.items():
        on_device[device] += [state[params[i]] for i in index]
    # before the state lists are held: they take the shared counters (step_counters.py)
    steps_by_device = {device: share_step_counters(states, device) for device, states in on_device.items()}
    buckets = []
    for (gi, device, dtype, fmt, stateful, _, setting), index in members.items():
        bucket_params = [params[i] for i in index]
        states = [state[p] for p in bucket_params]
        lists = {k: [s[k] for s in states] for k in spec.call_keys(fmt.quantized, stateful)}
        kernel = kernel_of(spec, fmt.quantized, stateful)
        # held in C++ where one call does the whole bucket (not streamed states, nor a norm pass first)
        held = (hold_states(spec, lists, states[0], fmt.quantized, kernel)
                if holds_states(kernel, dtype) and not streamed and not spec.norm_scaled else None)
        places = [sr_place(group_start[index_of[id(p)][0]] + index_of[id(p)][1], p) for p in bucket_params]
        ids, offsets = [place[0] for place in places], [place[1] for place in places]
        if held is not None:
            held.set_sr_ids(ids, offsets)
        buckets.append(Bucket(gi, device, fmt, stateful, index, bucket_params, states, lists, held,
                              dict(setting), kernel, ids, offsets))
    return StepPlan(plan_key(state, version, params), buckets, steps_by_device, sharding.has_dtensor(params), False)
