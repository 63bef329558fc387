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
