"""Checkpoints of pagedopt optimizers: what ``state_dict()`` hands out and how
``load_state_dict()`` reads one.

``load_state_dict`` reads pagedopt's own state dicts, bitsandbytes' (the flat form, and the form of
0.49.2 and later that nests the quantization state under ``__bnb_optimizer_quant_state__``, with an
int or tensor ``step``) and ``torch.optim.Adam``/``AdamW``'s (``exp_avg``, ``exp_avg_sq``, ``step``).
It checks the whole checkpoint and builds every new state tensor before it replaces anything, so a
refused checkpoint leaves the optimizer as it was. Every refusal is a ``ValueError`` that names the
place: ``param_groups[i]['params'][j]`` and the state key, or ``param_groups[i]['key']``.

pagedopt's and bitsandbytes' states keep their saved width (a 32-bit state in a group that says
8-bit round-trips, and the reverse). A torch state is converted to the state the parameter would
get here: quantized to 8-bit codes where its group (or a GlobalOptimManager override) says
``optim_bits=8`` and it has at least ``min_8bit_size`` elements, float32 otherwise.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .. import _ops
from ..quant import CODEBOOK_SIZE, STATE_BLOCK_SIZE

if TYPE_CHECKING:
    from .base import AdamBase

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"
MOMENT_KEYS = ("state1", "state2")
ABSMAX_KEYS = ("absmax1", "absmax2")
QMAP_KEYS = ("qmap1", "qmap2")
TORCH_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# Keys of torch.optim.Adam/AdamW param groups that mean nothing here; they are dropped on load
# (amsgrad and maximize only when False: True is refused).
TORCH_GROUP_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                     "decoupled_weight_decay")


def _param_name(gi: int, pi: int) -> str:
    return f"param_groups[{gi}]['params'][{pi}]"


def _refuse(what: str) -> ValueError:
    return ValueError(f"checkpoint refused, nothing was loaded: {what}")


# ---------------------------------------------------------------------------------- state_dict
def owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy of it when it is a view into a larger storage (paged states share
    managed slabs: saving the view would save the slab, and torch.save refuses views of one
    storage as different dtypes)."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def portable_param_state(state: Mapping) -> dict:
    """A parameter's state as a plain dict of tensors that own their storage."""
    return {k: owned(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


# ---------------------------------------------------------------------------------- sharded (FSDP2)
# A DTensor parameter (FSDP2's fully_shard, or any DTensor sharding) keeps its states on its local
# shard only: codes (or 32-bit moments) shaped like the local shard, and the absmax of the blocks of
# that shard (blocks start at the shard's first element). In a state dict they are DTensors, so that
# torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict, dcp.save/load)
# writes and reads each rank's part:
#
# * state1/state2: DTensor.from_local(local, mesh, the parameter's placements, shape and stride of
#   the parameter): exactly the layout of the parameter, like torch's exp_avg/exp_avg_sq.
# * absmax1/absmax2: ranks may hold different numbers of blocks (uneven shards, or shards that are
#   not multiples of 256 elements), and DTensor's Shard follows torch.chunk's sizes, not these. So each
#   rank's absmax is padded with zeros to the block count of the largest shard, B (computed from the
#   global shape and placements, the same on every rank, with no communication), and the padded
#   pieces form an even 1-D DTensor of slots * B entries: Shard(0) over each mesh dimension that
#   shards the parameter, Replicate over the others (HSDP's replicas hold equal absmax).
# * absmax_layout: int64 tensor [slots, B, aligned], the same on every rank (a replicated tensor
#   for DCP). ``aligned`` (every shard is exactly B * 256 elements, so no padding) means the absmax
#   DTensor is the absmax of the unsharded parameter, block for block: such a checkpoint reshards
#   to any other aligned layout (another world size) and gathers (full_state_dict) into the state
#   of an unsharded optimizer. Otherwise blocks belong to one layout, and load_state_dict refuses
#   another one (DCP itself usually refuses first, with a size mismatch of absmax1).
ABSMAX_LAYOUT_KEY = "absmax_layout"


def _absmax_layout(p) -> tuple[int, int, list, bool]:
    """(slots, B, absmax placements, aligned) of a DTensor parameter; see above."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, p.placements
    largest = list(p.shape)
    slots, out = 1, []
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            largest[placement.dim] = -(-largest[placement.dim] // mesh.size(dim))  # torch.chunk's first piece
            slots *= mesh.size(dim)
            out.append(Shard(0))
        elif isinstance(placement, Replicate):
            out.append(Replicate())
        else:
            raise ValueError(f"a parameter with placements {tuple(placements)}: pagedopt keeps states of "
                             "Shard or Replicate parameters only")
    blocks = -(-math.prod(largest) // STATE_BLOCK_SIZE)
    return slots, blocks, out, slots * blocks * STATE_BLOCK_SIZE == p.numel()


def sharded_param_state(state: Mapping, p) -> dict:
    """A DTensor parameter's state as it goes into a state dict (see above); ``state`` holds local tensors."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    mesh, placements = p.device_mesh, p.placements
    for k in MOMENT_KEYS:
        out[k] = DTensor.from_local(state[k], mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    if state["state1"].dtype == torch.uint8:
        slots, blocks, absmax_placements, aligned = _absmax_layout(p)
        for k in ABSMAX_KEYS:
            local = state[k]
            if local.numel() > blocks:
                raise ValueError(f"a shard of {tuple(p.shape)} with placements {tuple(placements)} holds "
                                 f"{local.numel()} blocks, more than the {blocks} of the largest chunk")
            if local.numel() < blocks:
                local = torch.cat([local, local.new_zeros(blocks - local.numel())])
            out[k] = DTensor.from_local(local, mesh, absmax_placements, run_check=False,
                                        shape=torch.Size((slots * blocks,)), stride=(1,))
        out[ABSMAX_LAYOUT_KEY] = torch.tensor([slots, blocks, int(aligned)], dtype=torch.int64)
    return out


def _is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _localize(state: dict, p: torch.Tensor, where: str) -> dict:
    """A saved state with its DTensors replaced by this rank's local tensors, checked against the
    DTensor parameter ``p``: moments (and torch's exp_avg/exp_avg_sq) must have ``p``'s mesh,
    placements and shape; absmax the layout of sharded_param_state for ``p``'s sharding (or an
    aligned one, see above). A plain ``p`` takes no DTensor, a DTensor ``p`` no plain moments."""
    p_sharded = _is_dtensor(p)
    for k, v in state.items():
        if _is_dtensor(v) and not p_sharded:
            raise _refuse(f"{where} {k!r} is a DTensor (a sharded checkpoint) but the parameter is not; "
                          "gather it first (get_optimizer_state_dict with full_state_dict=True)")
    if not p_sharded:
        return state
    out = dict(state)
    mesh, placements = p.device_mesh, tuple(p.placements)
    for k in MOMENT_KEYS + TORCH_MOMENT_KEYS:
        if k not in state:
            continue
        v = state[k]
        if not _is_dtensor(v):
            raise _refuse(f"{where} {k!r} is a plain tensor but the parameter is a DTensor with placements "
                          f"{placements}: load a sharded checkpoint (get_optimizer_state_dict / "
                          "set_optimizer_state_dict, torch.distributed.checkpoint)")
        if v.device_mesh != mesh or tuple(v.placements) != placements:
            raise _refuse(f"{where} {k!r} is sharded as {tuple(v.placements)} on {v.device_mesh}, the "
                          f"parameter as {placements} on {mesh}")
        if tuple(v.shape) != tuple(p.shape):
            raise _refuse(f"{where} {k!r} has shape {tuple(v.shape)}, expected {tuple(p.shape)}")
        out[k] = v.to_local()
    if any(k in state for k in ABSMAX_KEYS):
        slots, blocks, absmax_placements, aligned = _absmax_layout(p)
        saved = state.get(ABSMAX_LAYOUT_KEY)
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.int64 or tuple(saved.shape) != (3,):
            raise _refuse(f"{where} has no {ABSMAX_LAYOUT_KEY!r} (an int64 tensor [slots, blocks, aligned]) "
                          "beside its sharded absmax")
        saved_slots, saved_blocks, saved_aligned = (int(x) for x in saved.tolist())
        if (saved_slots, saved_blocks) != (slots, blocks) and not (saved_aligned and aligned):
            raise _refuse(f"{where} absmax was saved with {saved_slots} shards of {saved_blocks} blocks, this "
                          f"parameter has {slots} of {blocks}: 8-bit states of shards that are not multiples "
                          f"of {STATE_BLOCK_SIZE} elements reload only at the world size (and mesh) they were "
                          "saved at")
        local_blocks = -(-_local_numel(p) // STATE_BLOCK_SIZE)
        for k in ABSMAX_KEYS:
            v = state.get(k)
            if v is None:
                continue
            if not _is_dtensor(v) or v.device_mesh != mesh or tuple(v.placements) != tuple(absmax_placements) \
                    or tuple(v.shape) != (slots * blocks,):
                raise _refuse(f"{where} {k!r} must be a DTensor of shape ({slots * blocks},) with placements "
                              f"{tuple(absmax_placements)} on {mesh}, got "
                              f"{tuple(v.placements) if _is_dtensor(v) else 'a plain tensor'} of shape "
                              f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
            local = v.to_local()
            if local.numel() != blocks:
                raise _refuse(f"{where} {k!r} holds {local.numel()} blocks on this rank, expected {blocks}")
            out[k] = local[:local_blocks]
    out.pop(ABSMAX_LAYOUT_KEY, None)
    return out


def _local_numel(p: torch.Tensor) -> int:
    return p._local_tensor.numel() if _is_dtensor(p) else p.numel()


def _local_of(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if _is_dtensor(p) else p


# ---------------------------------------------------------------------------------- loading
def _as_mapping(x: Any, what: str) -> Mapping:
    if not isinstance(x, Mapping):
        raise _refuse(f"{what} must be a dict, got {type(x).__name__}")
    return x


def read_step(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.layout != torch.strided:
            raise _refuse(f"{where} 'step' must be a number or a one-element tensor, got shape "
                          f"{tuple(value.shape)} ({value.dtype})")
        value = value.detach().double().cpu().item()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(f"{where} 'step' must be a number or a one-element tensor, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise _refuse(f"{where} 'step' must be finite and >= 0, got {value!r}")
    return value


def _tensor(state: Mapping, key: str, where: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if key not in state:
        raise _refuse(f"{where} has no {key!r}")
    t = state[key]
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
        raise _refuse(f"{where} {key!r} must be a dense tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise _refuse(f"{where} {key!r} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise _refuse(f"{where} {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device.type == "meta":
        raise _refuse(f"{where} {key!r} is on the meta device (it holds no values)")
    return t


def _check_finite(t: torch.Tensor, key: str, where: str, *, low: float, high: float = math.inf) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise _refuse(f"{where} {key!r} holds a non-finite value")
    if t.numel() and (bool((t < low).any()) or bool((t > high).any())):
        raise _refuse(f"{where} {key!r} holds a value outside [{low}, {high}]")


def _check_qmap(t: torch.Tensor, key: str, where: str) -> None:
    _check_finite(t, key, where, low=-1.0, high=1.0)
    if not bool((t[1:] > t[:-1]).all()):
        raise _refuse(f"{where} {key!r} must be sorted in strictly increasing order")


def _unnest(saved: Mapping, where: str) -> dict:
    """The flat form of a parameter's state (bitsandbytes >= 0.49.2 nests its tensors)."""
    flat = {k: v for k, v in saved.items() if k != BNB_NESTED_KEY}
    if BNB_NESTED_KEY in saved:
        nested = _as_mapping(saved[BNB_NESTED_KEY], f"{where} {BNB_NESTED_KEY!r}")
        for k, v in nested.items():
            if k in flat:
                raise _refuse(f"{where} {k!r} is given both inside and outside {BNB_NESTED_KEY!r}")
            flat[k] = v
    return flat


def read_param_state(saved: Any, p: torch.Tensor, where: str) -> dict:
    """A validated parameter state in pagedopt's flat form (tensors not yet copied), with a float
    'step' and, for a torch state, float32 'exp_avg'/'exp_avg_sq' to be converted. For a DTensor
    ``p`` the tensors are this rank's local ones, checked against ``p``'s local shard."""
    state = _localize(_unnest(_as_mapping(saved, where), where), p, where)
    p = _local_of(p)
    if "step" not in state:
        raise _refuse(f"{where} has no 'step'")
    out = {k: v for k, v in state.items() if k not in MOMENT_KEYS + ABSMAX_KEYS + QMAP_KEYS + TORCH_MOMENT_KEYS
           + (ABSMAX_LAYOUT_KEY,)}
    out["step"] = read_step(state["step"], where)
    if "max_exp_avg_sq" in state:
        raise _refuse(f"{where} 'max_exp_avg_sq': amsgrad states are not supported")
    if any(k in state for k in TORCH_MOMENT_KEYS):
        if any(k in state for k in MOMENT_KEYS):
            raise _refuse(f"{where} mixes torch keys ('exp_avg') with pagedopt keys ('state1')")
        # torch keeps the moments in the parameter's dtype; they become float32 here
        floats = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in state.items() if k in TORCH_MOMENT_KEYS}
        for k in TORCH_MOMENT_KEYS:
            out[k] = _tensor(floats, k, where, torch.float32, p.shape)
        return out
    if "state1" not in state:
        raise _refuse(f"{where} has no 'state1' (nor torch's 'exp_avg')")
    first = state["state1"]
    dtype = first.dtype if isinstance(first, torch.Tensor) else None
    if dtype not in (torch.uint8, torch.float32):
        raise _refuse(f"{where} 'state1' must be a uint8 (8-bit) or float32 (32-bit) tensor, got "
                      f"{dtype if dtype is not None else type(first).__name__}")
    for k in MOMENT_KEYS:
        out[k] = _tensor(state, k, where, dtype, p.shape)
    if dtype == torch.uint8:
        blocks = (p.numel() + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
        for k in ABSMAX_KEYS:
            out[k] = _tensor(state, k, where, torch.float32, (blocks,))
            _check_finite(out[k], k, where, low=0.0)
        for k in QMAP_KEYS:
            out[k] = _tensor(state, k, where, torch.float32, (CODEBOOK_SIZE,))
            _check_qmap(out[k], k, where)
    else:
        stray = [k for k in ABSMAX_KEYS + QMAP_KEYS if k in state]
        if stray:
            raise _refuse(f"{where} {stray[0]!r} belongs to an 8-bit state, but 'state1' is float32")
    return out


def read_group(opt: "AdamBase", gi: int, saved: Any, current: dict) -> dict:
    """The param group after loading: the saved settings over the current ones (a key missing
    from the checkpoint, such as optim_bits in a torch or bitsandbytes checkpoint, keeps its value)."""
    where = f"param_groups[{gi}]"
    saved = _as_mapping(saved, where)
    for flag in ("amsgrad", "maximize"):
        if saved.get(flag):
            raise _refuse(f"{where}[{flag!r}] is True, which pagedopt does not support")
    group = {k: v for k, v in current.items() if k != "params"}
    group.update({k: v for k, v in saved.items() if k not in ("params", "param_names") + TORCH_GROUP_FLAGS})
    try:
        opt._check_hyperparameters(group, where)
    except ValueError as e:
        raise _refuse(str(e)) from None
    group["params"] = current["params"]
    return group


def plan_load(opt: "AdamBase", state_dict: Any) -> tuple[list[dict], dict]:
    """(new param groups, new state by parameter), checked and allocated; the optimizer is not
    touched."""
    state_dict = _as_mapping(state_dict, "the state dict")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise _refuse(f"the state dict has no {key!r}")
    saved_state = _as_mapping(state_dict["state"], "'state'")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        raise _refuse(f"'param_groups' must be a list, got {type(saved_groups).__name__}")
    if len(saved_groups) != len(opt.param_groups):
        raise _refuse(f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
                      f"{len(opt.param_groups)}")
    params_at: dict[Any, tuple[int, int]] = {}
    new_groups = []
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        saved_params = _as_mapping(saved, f"param_groups[{gi}]").get("params")
        if not isinstance(saved_params, (list, tuple)):
            raise _refuse(f"param_groups[{gi}]['params'] must be a list of ids")
        if len(saved_params) != len(group["params"]):
            raise _refuse(f"param_groups[{gi}]['params'] has {len(saved_params)} entries in the checkpoint, "
                          f"{len(group['params'])} in this optimizer")
        for pi, key in enumerate(saved_params):
            try:
                hash(key)
            except TypeError:
                raise _refuse(f"{_param_name(gi, pi)}: its id {key!r} is not hashable") from None
            if key in params_at:
                raise _refuse(f"{_param_name(gi, pi)}: id {key!r} is also listed at "
                              f"{_param_name(*params_at[key])}")
            params_at[key] = (gi, pi)
        new_groups.append(read_group(opt, gi, saved, group))

    read = {}
    for key, saved in saved_state.items():
        if key not in params_at:
            raise _refuse(f"'state' has an entry for id {key!r}, which no param group lists")
        gi, pi = params_at[key]
        p = new_groups[gi]["params"][pi]
        read[(gi, pi)] = read_param_state(saved, p, _param_name(gi, pi))

    new_state = {}
    overrides = opt._overrides(new_groups)
    for (gi, pi), fields in read.items():
        p = new_groups[gi]["params"][pi]
        if "exp_avg" in fields:
            config = {**new_groups[gi], **overrides.get((gi, pi), {})}
            fields = _from_torch(opt, fields, _local_of(p), opt._uses_8bit(config, p))
        new_state[p] = _materialize(opt, fields, _local_of(p))
    return new_groups, new_state


def _from_torch(opt: "AdamBase", fields: dict, p: torch.Tensor, eight_bit: bool) -> dict:
    out = {k: v for k, v in fields.items() if k not in TORCH_MOMENT_KEYS}
    m, v = (fields[k].to(p.device) for k in TORCH_MOMENT_KEYS)
    if not eight_bit:
        out["state1"], out["state2"] = m, v
        return out
    out["qmap1"], out["qmap2"] = opt._codebooks_on(p.device)
    out["state1"], out["absmax1"] = _ops.quantize_blockwise(m.contiguous(), out["qmap1"], STATE_BLOCK_SIZE)
    out["state2"], out["absmax2"] = _ops.quantize_blockwise(v.contiguous(), out["qmap2"], STATE_BLOCK_SIZE)
    return out


def _materialize(opt: "AdamBase", fields: dict, p: torch.Tensor) -> dict:
    """The parameter's new state on its device: states in fresh (paged, for a paged optimizer)
    tensors, the default codebooks shared."""
    state = {}
    for k, v in fields.items():
        if k == "step":
            state[k] = torch.tensor(v, dtype=torch.float32, device=p.device)
        elif k in QMAP_KEYS:
            default = opt._codebooks_on(p.device)[QMAP_KEYS.index(k)]
            state[k] = default if torch.equal(v.cpu(), default.cpu()) else v.to(p.device, copy=True)
        elif k in MOMENT_KEYS + ABSMAX_KEYS:
            t = opt._state_zeros(v.shape, v.dtype, p.device)
            t.copy_(v)
            state[k] = t
        else:
            state[k] = v
    return state
