"""The formats a parameter's moments may be kept in, and which one a parameter gets.

* 32-bit: float32 tensors shaped like the parameter (``(k, *shape)`` for a key of k stacked moments).
* 8-bit: uint8 codes shaped likewise, one float32 absmax per 256-element block, a 256-entry
  codebook per key (``qmap1``): bitsandbytes' layout.
* 4-bit: two codes a byte (element i in byte i // 2, the low nibble for even i), shaped like the
  parameter with its last dimension halved when that is even (``(rows, cols / 2)``: the same bytes,
  and sharded like the parameter on its other dimensions), else flat ``(ceil(n / 2),)``; a key of k
  stacked moments has a leading k; one float32 absmax per 128-element block; a 16-entry
  codebook per key (the signed 4-bit dynamic map for signed moments, the linear map without zero
  for the others: pagedopt.quant).

The engine tells the quantized formats apart by their codebook's size (16 or 256 entries), so a
state's format can be read from the state itself (``format_of``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StateFormat:
    bits: int           # 32, 8 or 4
    block: int          # elements per absmax (quantized formats), 0 for 32-bit
    codebook_size: int  # entries of each key's codebook, 0 for 32-bit

    @property
    def quantized(self) -> bool:
        return self.bits < 32

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else torch.float32

    def blocks(self, numel: int) -> int:
        """Absmax entries of one moment of ``numel`` elements."""
        return -(-numel // self.block) if self.quantized else 0

    def moment_numel(self, numel: int) -> int:
        """Entries of one moment's tensor for ``numel`` elements (bytes for 4-bit codes)."""
        return -(-numel // 2) if self.bits == 4 else numel

    def state_shape(self, moments: int, param_shape) -> tuple:
        """The shape of a key holding ``moments`` moments of a parameter of ``param_shape``."""
        if self.bits == 4:
            shape = tuple(param_shape)
            packed = ((*shape[:-1], shape[-1] // 2) if shape and shape[-1] % 2 == 0
                      else (self.moment_numel(math.prod(shape)),))
            return (moments, *packed) if moments > 1 else packed
        return (moments, *param_shape) if moments > 1 else tuple(param_shape)

    def absmax_shape(self, moments: int, numel: int) -> tuple:
        blocks = self.blocks(numel)
        return (moments, blocks) if moments > 1 else (blocks,)

    def state_bytes(self, moments: int, numel: int) -> int:
        """Bytes of one key's tensors (codes or floats, and absmax) for ``numel`` elements."""
        per_moment = self.moment_numel(numel) * (1 if self.quantized else 4) + 4 * self.blocks(numel)
        return moments * per_moment

    def code_range(self, start: int, end: int) -> slice:
        """The flat range of a moment's codes (or floats) that holds elements [start, end) (start
        even for 4-bit)."""
        return slice(start // 2, -(-end // 2)) if self.bits == 4 else slice(start, end)

    def absmax_range(self, start: int, end: int) -> slice:
        """The flat range of a moment's absmax for elements [start, end) (start a block's first)."""
        return slice(start // self.block, -(-end // self.block))


FLOAT32 = StateFormat(32, 0, 0)
CODES8 = StateFormat(8, 256, 256)
CODES4 = StateFormat(4, 128, 16)
BY_BITS = {32: FLOAT32, 8: CODES8, 4: CODES4}
BY_CODEBOOK_SIZE = {f.codebook_size: f for f in (CODES8, CODES4)}


def format_for(config: dict, numel: int) -> StateFormat:
    """The format of a new state under ``config`` (its group and overrides): ``optim_bits`` (4 or
    8) for parameters of at least ``min_8bit_size`` elements, 32-bit otherwise."""
    bits = config["optim_bits"]
    return BY_BITS[bits] if bits < 32 and numel >= config["min_8bit_size"] else FLOAT32


def format_of(state: dict, qmap_key: str, first_key: str = "state1") -> Optional[StateFormat]:
    """The format of an existing state (None: it has no ``first_key``): float32 moments are
    32-bit, uint8 codes take the format of their codebook's size."""
    first = state.get(first_key)
    if first is None:
        return None
    if first.dtype != torch.uint8:
        return FLOAT32
    qmap = state.get(qmap_key)
    return BY_CODEBOOK_SIZE.get(qmap.numel() if isinstance(qmap, torch.Tensor) else None, CODES8)


def state_mismatch(state: dict, spec, local: torch.Tensor, same_device: bool) -> Optional[str]:
    """What is wrong, by their metadata alone, with the tensors of a parameter's state for the
    kernels that will read them (``spec``'s states in the format ``format_of`` reads; ``local``:
    the parameter, or a DTensor's local shard; ``same_device``: the states must be on its device,
    not streamed from the host), or None: dtypes and sizes (any shape of the right number of
    elements: a torchao 4-bit checkpoint's codes are flat), contiguity and device. The kernels
    trust these (torch's fused Adam reads a moment of the parameter's size whatever its size), so a
    state replaced by hand is checked before a step uses it."""
    first = spec.states[0]
    if first.key not in state:
        return None
    if not isinstance(state[first.key], torch.Tensor) or state[first.key].layout != torch.strided:
        return f"state[{first.key!r}] is a {type(state[first.key]).__name__}, not a dense tensor"
    if state[first.key].dtype == torch.uint8:
        qmap = state.get(first.qmap_key)
        if not isinstance(qmap, torch.Tensor) or qmap.numel() not in BY_CODEBOOK_SIZE:
            return (f"state[{first.qmap_key!r}] must be a codebook of 256 (8-bit) or 16 (4-bit) float32 entries, not "
                    + (f"{qmap.numel()} entries" if isinstance(qmap, torch.Tensor) else
                       "missing" if qmap is None else f"a {type(qmap).__name__}"))
    fmt = format_of(state, first.qmap_key, first.key)
    expected = [(s.key, fmt.dtype, fmt.state_shape(s.moments, local.shape)) for s in spec.states]
    if fmt.quantized:
        for s in spec.states:
            expected += [(s.absmax_key, torch.float32, fmt.absmax_shape(s.moments, local.numel())),
                         (s.qmap_key, torch.float32, (fmt.codebook_size,))]
    for key, dtype, shape in expected:
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return f"state[{key!r}] is " + ("missing" if t is None else f"a {type(t).__name__}, not a dense tensor")
        if t.dtype != dtype or t.numel() != math.prod(shape):  # any shape of that size (torchao's flat 4-bit codes)
            return (f"state[{key!r}] is {t.dtype} of shape {tuple(t.shape)}, but this {fmt.bits}-bit state needs "
                    f"{dtype} of {math.prod(shape)} elements (shape {tuple(shape)})")
        if not t.is_contiguous():
            return f"state[{key!r}] is not contiguous"
        if same_device and t.device != local.device:
            return f"state[{key!r}] is on {t.device}, the parameter on {local.device}"
    return None
