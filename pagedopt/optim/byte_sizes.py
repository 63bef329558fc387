"""Byte counts: the bytes an optimizer's states hold, and sizes such as "4GiB" given as arguments."""
from __future__ import annotations

import torch

from . import sharding

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_bytes(value, what: str = "bytes") -> int:
    """An int of bytes, or a string such as "4GiB", "512 MiB", "1.5GB" (a ValueError naming ``what``
    otherwise)."""
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{what} must be a number of bytes >= 0 or a size such as '4GiB', got {value!r}")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by any optimizer's state tensors on this process, each storage counted once; the
    shared codebooks (qmap1/qmap2) are not counted. Under FSDP2 that is this rank's shards (a DTensor
    state, as torch's optimizers keep, counts its local tensor)."""
    seen, total = set(), 0
    for s in optimizer.state.values():
        for k, v in s.items():
            v = sharding.local(v) if isinstance(v, torch.Tensor) else v  # a DTensor state counts its local shard
            if isinstance(v, torch.Tensor) and not k.startswith("qmap") and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total
