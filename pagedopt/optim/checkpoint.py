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
get here: quantized to 8-bit (or 4-bit) codes where its group (or a GlobalOptimManager override)
says ``optim_bits=8`` (or 4) and it has at least ``min_8bit_size`` elements, float32 otherwise.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .. import _ops
from .sharding import local, localize_state
from .state_format import BY_CODEBOOK_SIZE, CODES4, CODES8, FLOAT32, StateFormat
from .state_keys import (ABSMAX_KEYS, ABSMAX_LAYOUT_KEY, BNB_NESTED_KEY, MOMENT_KEYS, QMAP_KEYS, TORCH_GROUP_FLAGS,
                         TORCH_MOMENT_KEYS, refuse)

if TYPE_CHECKING:
    from .algorithms.spec import AlgorithmSpec

def _param_name(gi: int, pi: int) -> str:
    return f"param_groups[{gi}]['params'][{pi}]"


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


# ---------------------------------------------------------------------------------- loading
def _as_mapping(x: Any, what: str) -> Mapping:
    if not isinstance(x, Mapping):
        raise refuse(f"{what} must be a dict, got {type(x).__name__}")
    return x


def read_step(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.layout != torch.strided:
            raise refuse(f"{where} 'step' must be a number or a one-element tensor, got shape "
                          f"{tuple(value.shape)} ({value.dtype})")
        value = value.detach().double().cpu().item()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(f"{where} 'step' must be a number or a one-element tensor, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise refuse(f"{where} 'step' must be finite and >= 0, got {value!r}")
    return value


def _tensor(state: Mapping, key: str, where: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if key not in state:
        raise refuse(f"{where} has no {key!r}")
    t = state[key]
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
        raise refuse(f"{where} {key!r} must be a dense tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise refuse(f"{where} {key!r} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise refuse(f"{where} {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device.type == "meta":
        raise refuse(f"{where} {key!r} is on the meta device (it holds no values)")
    return t


def _check_finite(t: torch.Tensor, key: str, where: str, *, low: float, high: float = math.inf) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise refuse(f"{where} {key!r} holds a non-finite value")
    if t.numel() and (bool((t < low).any()) or bool((t > high).any())):
        raise refuse(f"{where} {key!r} holds a value outside [{low}, {high}]")


def _check_qmap(t: torch.Tensor, key: str, where: str) -> None:
    _check_finite(t, key, where, low=-1.0, high=1.0)
    if not bool((t[1:] > t[:-1]).all()):
        raise refuse(f"{where} {key!r} must be sorted in strictly increasing order")


def _plain_moment(v: torch.Tensor, key: str, where: str) -> torch.Tensor:
    """A moment as a plain tensor: torchao's quantized optimizer states (AdamW8bit / AdamW4bit's
    OptimState8bit / OptimState4bit, tensor subclasses) dequantized by their ``dequantize()``."""
    if type(v) is torch.Tensor or isinstance(v, torch.nn.Parameter):
        return v
    dequantize = getattr(v, "dequantize", None)
    if dequantize is None:
        raise refuse(f"{where} {key!r} is a {type(v).__name__}, a tensor subclass without dequantize()")
    try:
        plain = dequantize()
    except Exception as exc:  # noqa: BLE001  (its own failure, named)
        raise refuse(f"{where} {key!r}: {type(v).__name__}.dequantize() failed ({exc})") from None
    if not isinstance(plain, torch.Tensor) or type(plain) is not torch.Tensor:
        raise refuse(f"{where} {key!r}: {type(v).__name__}.dequantize() gave no plain tensor")
    return plain.reshape(v.shape)


def _unnest(saved: Mapping, where: str) -> dict:
    """The flat form of a parameter's state (bitsandbytes >= 0.49.2 nests its tensors)."""
    flat = {k: v for k, v in saved.items() if k != BNB_NESTED_KEY}
    if BNB_NESTED_KEY in saved:
        nested = _as_mapping(saved[BNB_NESTED_KEY], f"{where} {BNB_NESTED_KEY!r}")
        for k, v in nested.items():
            if k in flat:
                raise refuse(f"{where} {k!r} is given both inside and outside {BNB_NESTED_KEY!r}")
            flat[k] = v
    return flat


def read_param_state(saved: Any, p: torch.Tensor, where: str, spec: "AlgorithmSpec") -> dict:
    """A validated parameter state in pagedopt's flat form (tensors not yet copied), with a float
    'step' and, for a torch Adam state (``spec`` Adam's), float32 'exp_avg'/'exp_avg_sq' to be
    converted. ``spec`` says which state keys, shapes and codebooks the state has. For a DTensor
    ``p`` the tensors are this rank's local ones, checked against ``p``'s local shard."""
    state = localize_state(_unnest(_as_mapping(saved, where), where), p, where, spec)
    p = local(p)
    if "step" not in state:
        raise refuse(f"{where} has no 'step'")
    out = {k: v for k, v in state.items() if k not in MOMENT_KEYS + ABSMAX_KEYS + QMAP_KEYS + TORCH_MOMENT_KEYS
           + (ABSMAX_LAYOUT_KEY,)}
    out["step"] = read_step(state["step"], where)
    if "max_exp_avg_sq" in state:
        raise refuse(f"{where} 'max_exp_avg_sq': amsgrad states are not supported")
    if spec.name == "adam" and any(k in state for k in TORCH_MOMENT_KEYS):
        if any(k in state for k in MOMENT_KEYS):
            raise refuse(f"{where} mixes torch keys ('exp_avg') with pagedopt keys ('state1')")
        # torch keeps the moments in the parameter's dtype; they become float32 here (torchao's
        # low-bit states, tensor subclasses, through their own dequantize())
        floats = {k: _plain_moment(v, k, where).float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in state.items() if k in TORCH_MOMENT_KEYS}
        for k in TORCH_MOMENT_KEYS:
            out[k] = _tensor(floats, k, where, torch.float32, p.shape)
        return out
    if spec.stateless_ok and not any(k in state for k in MOMENT_KEYS + ABSMAX_KEYS + QMAP_KEYS):
        return out  # a parameter without states (plain SGD)
    foreign = [k for k in MOMENT_KEYS + ABSMAX_KEYS + QMAP_KEYS if k in state
               and k not in spec.state_keys + spec.absmax_keys + spec.qmap_keys]
    if foreign:
        raise refuse(f"{where} {foreign[0]!r} is not a state of {spec.name} (its states: {', '.join(spec.state_keys)})")
    if "state1" not in state:
        raise refuse(f"{where} has no 'state1'" + (" (nor torch's 'exp_avg')" if spec.name == "adam" else ""))
    first = state["state1"]
    dtype = first.dtype if isinstance(first, torch.Tensor) else None
    if dtype not in (torch.uint8, torch.float32):
        raise refuse(f"{where} 'state1' must be a uint8 (8-bit) or float32 (32-bit) tensor, got "
                      f"{dtype if dtype is not None else type(first).__name__}")
    fmt = FLOAT32 if dtype == torch.float32 else _quantized_format(state, spec)
    for st in spec.states:
        out[st.key] = _tensor(state, st.key, where, dtype, fmt.state_shape(st.moments, p.shape))
    if fmt.quantized:
        for st in spec.states:
            out[st.absmax_key] = _tensor(state, st.absmax_key, where, torch.float32,
                                         fmt.absmax_shape(st.moments, p.numel()))
            _check_finite(out[st.absmax_key], st.absmax_key, where, low=0.0)
            out[st.qmap_key] = _tensor(state, st.qmap_key, where, torch.float32, (fmt.codebook_size,))
            _check_qmap(out[st.qmap_key], st.qmap_key, where)
    else:
        stray = [k for k in spec.absmax_keys + spec.qmap_keys if k in state]
        if stray:
            raise refuse(f"{where} {stray[0]!r} belongs to a quantized state, but 'state1' is float32")
    return out


def _quantized_format(state: Mapping, spec: "AlgorithmSpec") -> StateFormat:
    """The format of uint8 codes, from the size of their first codebook (16 entries: 4-bit;
    anything else is read as 8-bit, whose checks then name what is wrong)."""
    first = state.get(spec.states[0].qmap_key)
    return CODES4 if isinstance(first, torch.Tensor) and first.numel() == CODES4.codebook_size else CODES8


def read_group(opt, gi: int, saved: Any, current: dict) -> dict:
    """The param group after loading: the saved settings over the current ones (a key missing
    from the checkpoint, such as optim_bits in a torch or bitsandbytes checkpoint, keeps its value)."""
    where = f"param_groups[{gi}]"
    saved = _as_mapping(saved, where)
    for flag in ("amsgrad", "maximize"):
        if saved.get(flag):
            raise refuse(f"{where}[{flag!r}] is True, which pagedopt does not support")
    group = {k: v for k, v in current.items() if k != "params"}
    group.update({k: v for k, v in saved.items() if k not in ("params", "param_names") + TORCH_GROUP_FLAGS})
    try:
        opt.check_hyperparameters(group, where)
    except ValueError as e:
        raise refuse(str(e)) from None
    mine = current.get("lr")
    if isinstance(mine, torch.Tensor) and group["lr"] is not mine:
        # a tensor lr (capturable steps) stays a tensor of this optimizer's dtype and device, holding the saved value
        group["lr"] = torch.tensor(float(group["lr"]), dtype=mine.dtype, device=mine.device)
    group["params"] = current["params"]
    return group


def plan_load(opt, state_dict: Any) -> tuple[list[dict], dict]:
    """(new param groups, new state by parameter), checked and allocated; the optimizer is not
    touched."""
    state_dict = _as_mapping(state_dict, "the state dict")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise refuse(f"the state dict has no {key!r}")
    saved_state = _as_mapping(state_dict["state"], "'state'")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        raise refuse(f"'param_groups' must be a list, got {type(saved_groups).__name__}")
    if len(saved_groups) != len(opt.param_groups):
        raise refuse(f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
                      f"{len(opt.param_groups)}")
    params_at: dict[Any, tuple[int, int]] = {}
    new_groups = []
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        saved_params = _as_mapping(saved, f"param_groups[{gi}]").get("params")
        if not isinstance(saved_params, (list, tuple)):
            raise refuse(f"param_groups[{gi}]['params'] must be a list of ids")
        if len(saved_params) != len(group["params"]):
            raise refuse(f"param_groups[{gi}]['params'] has {len(saved_params)} entries in the checkpoint, "
                          f"{len(group['params'])} in this optimizer")
        for pi, key in enumerate(saved_params):
            try:
                hash(key)
            except TypeError:
                raise refuse(f"{_param_name(gi, pi)}: its id {key!r} is not hashable") from None
            if key in params_at:
                raise refuse(f"{_param_name(gi, pi)}: id {key!r} is also listed at "
                              f"{_param_name(*params_at[key])}")
            params_at[key] = (gi, pi)
        new_groups.append(read_group(opt, gi, saved, group))

    read = {}
    for key, saved in saved_state.items():
        if key not in params_at:
            raise refuse(f"'state' has an entry for id {key!r}, which no param group lists")
        gi, pi = params_at[key]
        p = new_groups[gi]["params"][pi]
        read[(gi, pi)] = read_param_state(saved, p, _param_name(gi, pi), opt.algorithm)

    new_state = {}
    overrides = opt.overrides(new_groups)
    for (gi, pi), fields in read.items():
        p = new_groups[gi]["params"][pi]
        if "exp_avg" in fields:
            config = {**new_groups[gi], **overrides.get((gi, pi), {})}
            fields = _from_torch(opt, fields, local(p), opt.state_format(config, p))
        new_state[p] = _materialize(opt, fields, local(p))
    return new_groups, new_state


def _from_torch(opt, fields: dict, p: torch.Tensor, fmt: StateFormat) -> dict:
    out = {k: v for k, v in fields.items() if k not in TORCH_MOMENT_KEYS}
    m, v = (fields[k].to(p.device) for k in TORCH_MOMENT_KEYS)
    if not fmt.quantized:
        out["state1"], out["state2"] = m, v
        return out
    out["qmap1"], out["qmap2"] = opt.codebooks_on(p.device, fmt)
    out["state1"], out["absmax1"] = _ops.quantize_blockwise(m.contiguous(), out["qmap1"], fmt.block)
    out["state2"], out["absmax2"] = _ops.quantize_blockwise(v.contiguous(), out["qmap2"], fmt.block)
    return out


def _materialize(opt, fields: dict, p: torch.Tensor) -> dict:
    """The parameter's new state on its device: states in fresh (paged, for a paged optimizer)
    tensors, the default codebooks shared."""
    state = {}
    for k, v in fields.items():
        if k == "step":
            state[k] = torch.tensor(v, dtype=torch.float32, device=p.device)
        elif k in QMAP_KEYS:
            default = opt.default_qmap(k, p.device, BY_CODEBOOK_SIZE.get(v.numel(), CODES8))
            state[k] = default if torch.equal(v.cpu(), default.cpu()) else v.to(p.device, copy=True)
        elif k in MOMENT_KEYS + ABSMAX_KEYS:
            state[k] = opt.state_copy(v, p.device)
        elif isinstance(v, torch.Tensor):  # e.g. LARS/LAMB's unorm_vec: on the parameter's device
            state[k] = v.to(p.device, copy=True)
        else:
            state[k] = v
    return state
