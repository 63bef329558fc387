"""torch.distributed.checkpoint (DCP) for pagedopt optimizers under FSDP2: ``save``, and a ``load``
that changes nothing unless the whole checkpoint is accepted.

torch's own route works too (README, "FSDP2 and distributed checkpoints"): ``dcp.save`` and
``dcp.load`` of ``get_optimizer_state_dict(model, opt)``, then ``set_optimizer_state_dict``. But
``dcp.load`` writes into the tensors of the state dict it is given, which are the model's parameters
and the optimizer's own states (as for every torch optimizer), before ``load_state_dict`` has looked
at them: a checkpoint that is then refused (an absmax that is negative or not finite, a layout that
does not reshard) has already overwritten the states, and a read that fails half-way (a truncated
or missing file) leaves them half-written. ``load`` here:

1. reads the checkpoint's metadata and refuses, with a ``ValueError`` that names the entry, one
   whose optimizer entries do not match this optimizer's: a missing or an extra state, another
   dtype (8-bit codes where this optimizer keeps 32-bit moments, or the reverse: other
   ``optim_bits``, ``min_8bit_size`` or overrides), another shape; then it reads the checkpoint's
   ``absmax_layout`` entries (3 integers a parameter) and refuses 8-bit states saved at a layout
   that does not reshard to this one (pagedopt/optim/sharding.py: shards that are not whole
   256-element blocks reload only at the world size and placements they were saved at);
2. loads into new tensors of the same layouts (DTensors on the same mesh), never into the model's
   or the optimizer's own;
3. hands the optimizer's part to ``set_optimizer_state_dict`` (whose ``load_state_dict`` checks
   everything before it replaces anything), and then the model's to ``set_model_state_dict``.

Any failure leaves the model and the optimizer as they were. That holds for a fresh optimizer
too: torch's ``get_optimizer_state_dict`` makes its states (one step with zero gradients and lr 0)
to learn their layout, and they are dropped again. The price is one more copy of this rank's
model shard and optimizer states while loading.

DCP has no checksums: a bit flipped inside a saved code is not detected by anyone.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..optim.sharding import NO_ABSMAX, describe_absmax_layout, is_dtensor
from ..optim.state_keys import ABSMAX_KEYS, ABSMAX_LAYOUT_KEY, QMAP_KEYS, refuse

__all__ = ["save", "load"]


def save(checkpoint_id, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, storage_writer=None,
         model_key: Optional[str] = "model", optim_key: str = "optim", options=None) -> None:
    """``dcp.save({model_key: get_model_state_dict(model), optim_key: get_optimizer_state_dict(model,
    optimizer)})``: the layout that :func:`load` (and torch's own route) reads. ``model_key=None``
    saves the optimizer only. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {optim_key: get_optimizer_state_dict(model, optimizer, options=options)}
    if model_key is not None:
        state[model_key] = get_model_state_dict(model, options=options)
    dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer)


def load(checkpoint_id, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, storage_reader=None,
         model_key: Optional[str] = "model", optim_key: str = "optim", options=None) -> None:
    """Load what :func:`save` wrote into ``model`` and ``optimizer``, all or nothing (see the module's
    docstring). ``model_key=None`` loads the optimizer only. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    fresh = not any(optimizer.state.values())
    if fresh:
        # entries left empty (e.g. by reading opt.state[p] of its defaultdict) hold nothing, but would keep
        # torch's get_optimizer_state_dict from making the states whose layout the checkpoint is read into
        optimizer.state.clear()
    if fresh and any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("pagedopt.integrations.dcp.load: the optimizer has no states yet and its parameters "
                         "have gradients, so torch's get_optimizer_state_dict cannot make the states whose layout "
                         "the checkpoint is read into; call optimizer.zero_grad(set_to_none=True) first")
    if storage_reader is None:
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    try:
        current = {optim_key: get_optimizer_state_dict(model, optimizer, options=options)}
        if model_key is not None:
            current[model_key] = get_model_state_dict(model, options=options)
        metadata = storage_reader.read_metadata()
        _check_entries(current[optim_key], metadata.state_dict_metadata, optim_key)
        _check_layouts(current[optim_key], optim_key, storage_reader, checkpoint_id)
        target = _new_tensors(current)
        dcp.load(target, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
        set_optimizer_state_dict(model, optimizer, target[optim_key], options=options)
    except BaseException:
        if fresh:
            optimizer.state.clear()  # the states get_optimizer_state_dict made: a fresh optimizer again
        raise
    if model_key is not None:
        set_model_state_dict(model, target[model_key], options=options)


def _new_tensors(x: Any) -> Any:
    """``x`` with every tensor replaced by a new, uninitialized one of the same layout (a DTensor by
    one on the same mesh, with the same placements, shape and stride), in new containers."""
    if is_dtensor(x):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(torch.empty_like(x._local_tensor), x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, Mapping):
        return {k: _new_tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_new_tensors(v) for v in x)
    return x


def _width(entries: Mapping, prefix: str) -> str:
    md = entries.get(f"{prefix}.state1")
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    return {torch.uint8: "8-bit", torch.float32: "32-bit"}.get(dtype, "no pagedopt")


def _check_entries(optim_state: Mapping, entries: Mapping, optim_key: str) -> None:
    """Every tensor of this optimizer's state dict has an entry of the same dtype and shape in the
    checkpoint (``entries``: its metadata), and the checkpoint no state entry this one lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mine = set()
    for fqn, state in optim_state.get("state", {}).items():
        prefix = f"{optim_key}.state.{fqn}"
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            key = f"{prefix}.{k}"
            mine.add(key)
            md = entries.get(key)
            ours = "8-bit" if optim_state["state"][fqn].get("state1", v).dtype == torch.uint8 else "32-bit"
            if md is None:
                saved = _width(entries, prefix)
                raise refuse(f"the checkpoint has no entry {key!r}" + (
                    f": it holds {saved} states for {fqn!r}, this optimizer {ours} ones (build it with the "
                    "settings it was saved with: optim_bits, min_8bit_size, overrides)"
                    if saved != ours and (k in ABSMAX_KEYS + QMAP_KEYS + (ABSMAX_LAYOUT_KEY,)) else
                    " (saved by another optimizer or model, or by a pagedopt that wrote no absmax_layout for "
                    "32-bit states)" if k == ABSMAX_LAYOUT_KEY else " (saved by another optimizer or model)"))
            if not isinstance(md, TensorStorageMetadata):
                raise refuse(f"the checkpoint's {key!r} is not a tensor")
            if md.properties.dtype != v.dtype:
                saved = _width(entries, prefix)
                raise refuse(f"the checkpoint's {key!r} is {md.properties.dtype}, this optimizer's {v.dtype}" + (
                    f": it holds {saved} states for {fqn!r}, this optimizer {ours} ones (build it with the "
                    "settings it was saved with: optim_bits, min_8bit_size, overrides)" if saved != ours else ""))
            if k not in ABSMAX_KEYS and tuple(md.size) != tuple(v.shape):
                raise refuse(f"the checkpoint's {key!r} has shape {tuple(md.size)}, this optimizer's "
                              f"{tuple(v.shape)}")
    extra = sorted(k for k in entries if k.startswith(f"{optim_key}.state.") and k not in mine)
    if extra:
        raise refuse(f"the checkpoint has {extra[0]!r}, which this optimizer's state has no place for "
                      f"({len(extra)} such entries; saved by another optimizer, or with states for parameters "
                      "that have none here)")


def _check_layouts(optim_state: Mapping, optim_key: str, storage_reader, checkpoint_id) -> None:
    """The saved absmax layouts (read first, 3 integers a parameter) against this optimizer's: the
    same, or both aligned (sharding.py); refused otherwise, before any state is read."""
    import torch.distributed.checkpoint as dcp

    ours = {fqn: s[ABSMAX_LAYOUT_KEY] for fqn, s in optim_state.get("state", {}).items() if ABSMAX_LAYOUT_KEY in s}
    if not ours:
        return
    saved = {fqn: torch.zeros(3, dtype=torch.int64) for fqn in ours}
    dcp.load({optim_key: {"state": {fqn: {ABSMAX_LAYOUT_KEY: t} for fqn, t in saved.items()}}},
             checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    for fqn, t in saved.items():
        s_slots, s_blocks, s_kind = (int(x) for x in t.tolist())
        slots, blocks, kind = (int(x) for x in ours[fqn].tolist())
        if (s_slots, s_blocks, s_kind) != (slots, blocks, kind) and not (s_kind == kind == 1) \
                and not (s_kind == kind == NO_ABSMAX):  # 32-bit states reshard like torch's
            raise refuse(f"{optim_key}.state.{fqn}: its 8-bit states were saved for "
                          f"{describe_absmax_layout(s_slots, s_blocks, s_kind)}, this run has "
                          f"{describe_absmax_layout(slots, blocks, kind)}; 8-bit states reload only at the world "
                          "size (and mesh and placements) they were saved at, unless both layouts shard "
                          "dimension 0 into whole 256-element blocks")
