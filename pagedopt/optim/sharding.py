"""DTensor parameters (FSDP2's fully_shard, or any Shard/Replicate DTensor): the optimizer updates
their local shards and keeps states of the local shard only; a state dict presents those states
as DTensors so that torch.distributed.checkpoint saves and loads each rank's part.

pagedopt never imports torch.distributed.tensor itself (about 0.1 s): no parameter can be a DTensor
before something else has imported it.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..quant import STATE_BLOCK_SIZE
from .state_format import BY_CODEBOOK_SIZE, CODES8, FLOAT32, StateFormat, format_of
from .state_keys import ABSMAX_LAYOUT_KEY, TORCH_MOMENT_KEYS, refuse

if TYPE_CHECKING:
    from .algorithms.spec import AlgorithmSpec


def dtensor_class():
    """torch's DTensor class if torch.distributed.tensor has been imported, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: Any) -> bool:
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(t, dtensor)


def has_dtensor(tensors) -> bool:
    dtensor = dtensor_class()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels update for ``p``: its local shard if ``p`` is a DTensor, else ``p``.
    ``_local_tensor`` is what ``DTensor.to_local()`` returns under no_grad (for a Parameter it
    returns a fresh view of it, one more object per tensor and step); FSDP2's sharded parameter
    data lives in it, so an in-place update of it updates the parameter."""
    return p._local_tensor if is_dtensor(p) else p


def rounding_place(p: torch.Tensor) -> tuple[int, int]:
    """Where the elements of ``p``'s local tensor sit, for the random bits of stochastic rounding:
    (shard, offset). A plain tensor, or a DTensor whose local shard is a run of whole rows of the
    global tensor (Shard(0) on one mesh dimension, Replicate on the others: FSDP2's fully_shard),
    is shard 0 at the index of its first element in the global tensor, so its elements draw the
    bits of an unsharded run. Other shardings (Shard(1), several sharded mesh dimensions, FSDP2
    with TP's strided shards) are numbered by the linear index of the rank's mesh coordinate over
    the sharded dimensions, offset 0. Replicas of a shard (HSDP) get the same place either way."""
    if not is_dtensor(p):
        return 0, 0
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, p.placements
    coordinate = mesh.get_coordinate()
    sharded = [dim for dim, placement in enumerate(placements) if not isinstance(placement, Replicate)]
    if coordinate is None or not sharded:
        return 0, 0
    if len(sharded) == 1 and type(placements[sharded[0]]) is Shard and placements[sharded[0]].dim == 0:
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
            return 0, int(offset[0]) * math.prod(p.shape[1:])
        except (ImportError, TypeError, ValueError):
            pass  # a torch without the helper: numbered instead
    index = 0
    for dim in sharded:
        index = index * mesh.size(dim) + coordinate[dim]
    return index, 0


def local_numel(p: torch.Tensor) -> int:
    return local(p).numel()


def local_tensors(params: list[torch.Tensor], grads: list[torch.Tensor],
                  on_mismatch: Callable[[torch.Tensor, torch.Tensor], None]):
    """(params, grads) with every DTensor replaced by its local shard. A DTensor parameter's gradient
    must be a DTensor on the same mesh with the same placements (FSDP2's reduce-scattered gradients
    are) and a plain parameter's gradient plain; ``on_mismatch(p, g)`` raises otherwise."""
    dtensor = dtensor_class()
    local_params, local_grads = [], []
    for p, g in zip(params, grads):
        p_is, g_is = isinstance(p, dtensor), isinstance(g, dtensor)
        if p_is and g_is and g._spec.placements == p._spec.placements and g._spec.mesh == p._spec.mesh:
            local_params.append(p._local_tensor)
            local_grads.append(g._local_tensor)
        elif not p_is and not g_is:
            local_params.append(p)
            local_grads.append(g)
        else:
            on_mismatch(p, g)
    return local_params, local_grads


def describe_layout(t: torch.Tensor) -> str:
    return f"a DTensor {tuple(t.placements)} on {t.device_mesh}" if is_dtensor(t) else "a plain tensor"


# A DTensor parameter (FSDP2's fully_shard, or any DTensor sharding) keeps its states on its local
# shard only: codes (or 32-bit moments) shaped like the local shard, and the absmax of the blocks of
# that shard (blocks start at the shard's first element). In a state dict they are DTensors, so that
# torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict, dcp.save/load)
# writes and reads each rank's part:
#
# * state1/state2: DTensor.from_local(local, mesh, the parameter's placements, shape and stride of
#   the parameter): exactly the layout of the parameter, like torch's exp_avg/exp_avg_sq. A state
#   holding k stacked moments (AdEMAMix's state1, shape (k, *shard)) is sharded one dimension further
#   (Shard(d) becomes Shard(d + 1)), global shape (k, *param.shape); its absmax likewise (k, slots * B).
# * absmax1/absmax2: ranks may hold different numbers of blocks (uneven shards, or shards that are
#   not multiples of 256 elements), and DTensor's Shard follows torch.chunk's sizes, not these. So each
#   rank's absmax is padded with zeros to the block count of the largest shard, B (computed from the
#   global shape and placements, the same on every rank, with no communication), and the padded
#   pieces form an even 1-D DTensor of slots * B entries: Shard(0) over each mesh dimension that
#   shards the parameter, Replicate over the others (HSDP's replicas hold equal absmax).
# * absmax_layout: int64 tensor [slots, B, kind], the same on every rank (a replicated tensor
#   for DCP). kind 1 ("aligned": every shard is a contiguous run of the flattened parameter, the
#   shards in mesh order, and exactly B * 256 elements, so no padding) means the absmax DTensor is
#   the absmax of the unsharded parameter, block for block: such a checkpoint reshards to any other
#   aligned layout (another world size) and gathers (full_state_dict) into the state of an
#   unsharded optimizer. kind 0: contiguous shards, not whole blocks. kind >= 2: shards that are not
#   contiguous runs of the flattened parameter (Shard(d) of a dimension d with larger dimensions
#   before it, e.g. fully_shard's shard_placement_fn choosing Shard(1); strided shards), whose
#   blocks group other elements than the unsharded parameter's even when every shard is whole
#   blocks; 2 + a code of the placements, so that a checkpoint of one such layout is not taken for
#   another of the same sizes. Blocks of kinds 0 and >= 2 belong to their layout, and
#   load_state_dict refuses any other one (DCP itself usually refuses first, with a size mismatch
#   of absmax1). Checkpoints written before kinds >= 2 existed say 0 or 1 for every layout.
#   A 32-bit state has [slots, 0, -1] (NO_ABSMAX): DCP loads into the tensors of the state dict it is
#   given and casts what it reads to their dtypes, so a checkpoint of 8-bit states loaded by an
#   optimizer that holds 32-bit ones (other optim_bits or min_8bit_size) would turn the codes into
#   moments without a word; its saved layout says 8-bit, and load_state_dict refuses it. (The other
#   way round DCP refuses first: the checkpoint has no absmax1.) Checkpoints written before this
#   have no absmax_layout for 32-bit states, which DCP's default planner reports as a missing key.


NO_ABSMAX = -1  # the kind of absmax_layout of a 32-bit state


def four_bit_refusal(p) -> Optional[str]:
    """Why a DTensor parameter cannot keep 4-bit states (None: it can). Its codes, two a byte along
    the last dimension (state_format.py), shard like the parameter only when every shard's last
    dimension is even: an even last dimension, not sharded, or sharded once into even chunks."""
    from torch.distributed.tensor import Shard

    if p.ndim == 0:
        return "a 0-d parameter"
    last = p.ndim - 1
    splits = [p.device_mesh.size(d) for d, x in enumerate(p.placements) if isinstance(x, Shard) and x.dim == last]
    size = p.shape[-1]
    if size % 2:
        return f"its last dimension ({size}) is odd"
    if len(splits) > 1:
        return "its last dimension is sharded over several mesh dimensions"
    if splits and -(-size // splits[0]) % 2:
        return f"its last dimension ({size}) is sharded into chunks of {-(-size // splits[0])}, an odd number"
    return None


def _absmax_layout(p, block: int = STATE_BLOCK_SIZE) -> tuple[int, int, list, int]:
    """(slots, B, absmax placements, kind) of a DTensor parameter whose states have blocks of
    ``block`` elements; see above."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, p.placements
    largest = list(p.shape)
    slots, out, code, sharded_dims = 1, [], 0, set()
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            largest[placement.dim] = -(-largest[placement.dim] // mesh.size(dim))  # torch.chunk's first piece
            slots *= mesh.size(dim)
            out.append(Shard(0))
            if mesh.size(dim) > 1:
                # a strided shard (FSDP2 with tensor parallelism on the same dimension) interleaves
                strided = int(getattr(placement, "split_factor", 1)) if type(placement) is not Shard else 0
                sharded_dims.add((placement.dim, strided))
            code += (1 + placement.dim + 16 * int(getattr(placement, "split_factor", 0))) * 256 ** dim
        elif isinstance(placement, Replicate):
            out.append(Replicate())
        else:
            raise ValueError(f"a parameter with placements {tuple(placements)}: pagedopt keeps states of "
                             "Shard or Replicate parameters only")
    blocks = -(-math.prod(largest) // block)
    # contiguous: each shard is a run of the flattened parameter, in the absmax DTensor's (mesh) order
    contiguous = not sharded_dims or (len(sharded_dims) == 1 and next(iter(sharded_dims))[1] == 0
                                      and math.prod(p.shape[:next(iter(sharded_dims))[0]]) == 1)
    if not contiguous:
        return slots, blocks, out, 2 + code
    return slots, blocks, out, int(slots * blocks * block == p.numel())


def describe_absmax_layout(slots: int, blocks: int, kind: int) -> str:
    """The words for an absmax_layout [slots, blocks, kind] in an error."""
    if kind == NO_ABSMAX:
        return f"{slots} shard{'s' if slots != 1 else ''} of 32-bit states"
    what = {1: "shards of whole blocks", 0: "shards that are not whole blocks"}.get(
        kind, "shards that are not contiguous runs of the parameter")
    return f"{slots} shard{'s' if slots != 1 else ''} of {blocks} blocks ({what})"


def _stacked(placements, moments: int) -> tuple:
    """The placements of a state of ``moments`` stacked moments (one leading dimension more)."""
    from torch.distributed.tensor import Shard

    if moments == 1:
        return tuple(placements)
    return tuple(Shard(x.dim + 1) if isinstance(x, Shard) else x for x in placements)


def sharded_param_state(state: Mapping, p, spec: "AlgorithmSpec") -> dict:
    """A DTensor parameter's state as it goes into a state dict (see above); ``state`` holds local
    tensors, with the keys of ``spec``'s states (plain SGD's states have none)."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    mesh, placements = p.device_mesh, p.placements
    present = [st for st in spec.states if st.key in state]
    fmt = format_of(state, spec.states[0].qmap_key, spec.states[0].key) if present else FLOAT32
    for st in present:
        shape = torch.Size(fmt.state_shape(st.moments, p.shape))
        out[st.key] = DTensor.from_local(state[st.key], mesh, _stacked(placements, st.moments), run_check=False,
                                         shape=shape, stride=torch.empty(shape, device="meta").stride())
    if present and fmt.quantized:
        slots, blocks, absmax_placements, kind = _absmax_layout(p, fmt.block)
        for st in present:
            local = state[st.absmax_key].reshape(st.moments, -1)
            if local.shape[1] > blocks:
                raise ValueError(f"a shard of {tuple(p.shape)} with placements {tuple(placements)} holds "
                                 f"{local.shape[1]} blocks, more than the {blocks} of the largest chunk")
            if local.shape[1] < blocks:
                local = torch.cat([local, local.new_zeros(st.moments, blocks - local.shape[1])], dim=1)
            shape = torch.Size(st.absmax_shape(slots * blocks))
            out[st.absmax_key] = DTensor.from_local(local.reshape(st.absmax_shape(blocks)), mesh,
                                                    _stacked(absmax_placements, st.moments), run_check=False,
                                                    shape=shape, stride=torch.empty(shape, device="meta").stride())
        out[ABSMAX_LAYOUT_KEY] = torch.tensor([slots, blocks, kind], dtype=torch.int64)
    elif present:
        out[ABSMAX_LAYOUT_KEY] = torch.tensor([_absmax_layout(p)[0], 0, NO_ABSMAX], dtype=torch.int64)
    return out


def _saved_layout(state: Mapping, where: str) -> tuple[int, int, int]:
    saved = state.get(ABSMAX_LAYOUT_KEY)
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.int64 or tuple(saved.shape) != (3,):
        raise refuse(f"{where} has no {ABSMAX_LAYOUT_KEY!r} (an int64 tensor [slots, blocks, kind]) "
                      "beside its sharded absmax")
    slots, blocks, kind = (int(x) for x in saved.tolist())
    return slots, blocks, kind


def _check_gathered_layout(state: Mapping, where: str) -> None:
    """A sharded 8-bit state gathered into whole tensors (get_optimizer_state_dict with
    full_state_dict=True) keeps its absmax_layout: its absmax is the unsharded parameter's, block
    for block, only when its shards were aligned (or there was one)."""
    if ABSMAX_LAYOUT_KEY not in state:
        return
    slots, blocks, kind = _saved_layout(state, where)
    if kind in (1, NO_ABSMAX) or (slots == 1 and kind == 0):
        return
    raise refuse(f"{where} absmax was saved for {describe_absmax_layout(slots, blocks, kind)}: gathered into "
                  "one tensor, its blocks are not those of the unsharded parameter; reload the sharded "
                  "checkpoint at the world size (and placements) it was saved at")


def _saved_format(state: Mapping, spec: "AlgorithmSpec") -> StateFormat:
    """The format of a saved state's moments: float32 ones, or uint8 codes of the width their
    first codebook's size says (a plain tensor in a state dict)."""
    first = state.get(spec.states[0].key)
    if not isinstance(first, torch.Tensor) or first.dtype != torch.uint8:
        return FLOAT32
    qmap = state.get(spec.states[0].qmap_key)
    return BY_CODEBOOK_SIZE.get(qmap.numel() if isinstance(qmap, torch.Tensor) else None, CODES8)


def localize_state(state: dict, p: torch.Tensor, where: str, spec: "AlgorithmSpec") -> dict:
    """A saved state with its DTensors replaced by this rank's local tensors, checked against the
    DTensor parameter ``p``: moments (and torch's exp_avg/exp_avg_sq) must have ``p``'s mesh,
    placements and shape; absmax the layout of sharded_param_state for ``p``'s sharding (or an
    aligned one, see above). A plain ``p`` takes no DTensor, a DTensor ``p`` no plain moments."""
    p_sharded = is_dtensor(p)
    for k, v in state.items():
        if is_dtensor(v) and not p_sharded:
            raise refuse(f"{where} {k!r} is a DTensor (a sharded checkpoint) but the parameter is not; "
                          "gather it first (get_optimizer_state_dict with full_state_dict=True)")
    if not p_sharded:
        _check_gathered_layout(state, where)
        return state
    out = dict(state)
    mesh, placements = p.device_mesh, tuple(p.placements)
    moments = {st.key: st.moments for st in spec.states}
    fmt = _saved_format(state, spec)
    for k in tuple(moments) + TORCH_MOMENT_KEYS:
        if k not in state:
            continue
        v = state[k]
        k_placements = _stacked(placements, moments.get(k, 1))
        k_shape = fmt.state_shape(moments[k], p.shape) if k in moments else tuple(p.shape)
        if not is_dtensor(v):
            raise refuse(f"{where} {k!r} is a plain tensor but the parameter is a DTensor with placements "
                          f"{placements}: load a sharded checkpoint (get_optimizer_state_dict / "
                          "set_optimizer_state_dict, torch.distributed.checkpoint)")
        if v.device_mesh != mesh or tuple(v.placements) != k_placements:
            raise refuse(f"{where} {k!r} is sharded as {tuple(v.placements)} on {v.device_mesh}, expected "
                          f"{k_placements} on {mesh} (the parameter's {placements})")
        if tuple(v.shape) != k_shape:
            raise refuse(f"{where} {k!r} has shape {tuple(v.shape)}, expected {k_shape}")
        out[k] = v.to_local()
    if any(st.absmax_key in state for st in spec.states):
        slots, blocks, absmax_placements, kind = _absmax_layout(p, fmt.block)
        saved_slots, saved_blocks, saved_kind = _saved_layout(state, where)
        if (saved_slots, saved_blocks, saved_kind) != (slots, blocks, kind) and not (saved_kind == kind == 1):
            raise refuse(f"{where} absmax was saved for {describe_absmax_layout(saved_slots, saved_blocks, saved_kind)}, "
                          f"this parameter has {describe_absmax_layout(slots, blocks, kind)}: 8-bit states "
                          "reload only at the world size (and mesh and placements) they were saved at, unless "
                          f"both layouts shard dimension 0 into whole {fmt.block}-element blocks")
        local_blocks = -(-local_numel(p) // fmt.block)
        for st in spec.states:
            k, v = st.absmax_key, state.get(st.absmax_key)
            if v is None:
                continue
            k_placements = _stacked(absmax_placements, st.moments)
            k_shape = tuple(st.absmax_shape(slots * blocks))
            if not is_dtensor(v) or v.device_mesh != mesh or tuple(v.placements) != k_placements \
                    or tuple(v.shape) != k_shape:
                raise refuse(f"{where} {k!r} must be a DTensor of shape {k_shape} with placements "
                              f"{k_placements} on {mesh}, got "
                              f"{tuple(v.placements) if is_dtensor(v) else 'a plain tensor'} of shape "
                              f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
            local = v.to_local()
            if local.numel() != st.moments * blocks:
                raise refuse(f"{where} {k!r} holds {local.numel()} blocks on this rank, expected "
                              f"{st.moments * blocks}")
            out[k] = local.reshape(st.moments, blocks)[:, :local_blocks].reshape(st.absmax_shape(local_blocks))
    elif ABSMAX_LAYOUT_KEY in state and _saved_layout(state, where)[2] != NO_ABSMAX:
        slots, blocks, kind = _saved_layout(state, where)
        raise refuse(f"{where} was saved with 8-bit states ({describe_absmax_layout(slots, blocks, kind)}), but "
                      "this optimizer holds 32-bit states for the parameter, into which "
                      "torch.distributed.checkpoint.load would cast the saved uint8 codes: build the optimizer "
                      "with the settings it was saved with (optim_bits, min_8bit_size, GlobalOptimManager "
                      "overrides)")
    out.pop(ABSMAX_LAYOUT_KEY, None)
    return out
