"""A pure-torch (and pure-Python) reference of stochastic rounding to bfloat16, written from the
description in csrc/include/pagedopt/stochastic_round.h, not from its code: the random bits of
element ``index`` of parameter ``id`` at step ``step`` are 16 bits of SplitMix64's finalizer of
(stream + (index // 4 + 1) * golden), stream = mix64(key + step * golden), key = mix64(mix64(seed
+ golden) + id); a float's bits plus those 16 bits, truncated to the high 16, are its bf16 (NaN kept
NaN with the quiet bit, +-inf kept, finite values beyond the largest bf16 saturated to it).

Python ints (exact, unbounded, masked to 64 bits) for the per-tensor values; int64 torch tensors for
the per-element ones, where a product wraps modulo 2^64 like the uint64 arithmetic of the kernels
(two's complement) and a logical right shift is an arithmetic one masked."""
from __future__ import annotations

import torch

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB


def mix64_int(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * C1) & M64
    z = ((z ^ (z >> 27)) * C2) & M64
    return z ^ (z >> 31)


def key_int(seed: int, pid: int) -> int:
    return mix64_int(mix64_int((seed & M64) + GOLDEN) + (pid & M64))


def stream_int(key: int, step: float) -> int:
    return mix64_int(key + int(max(step, 0.0)) * GOLDEN)


def bits_int(stream: int, index: int) -> int:
    """The 16 random bits of one element, in Python ints (checks the tensor version)."""
    h = mix64_int(stream + ((index >> 2) + 1) * GOLDEN)
    return (h >> (16 * (index & 3))) & 0xFFFF


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 holding it."""
    c &= M64
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of the 64-bit patterns in an int64 tensor."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _signed(C1)
    z = (z ^ _srl(z, 27)) * _signed(C2)
    return z ^ _srl(z, 31)


def random_bits(seed: int, pid: int, step: float, n: int, offset: int = 0) -> torch.Tensor:
    """int64 tensor of the 16-bit random values of elements offset .. offset + n - 1."""
    stream = stream_int(key_int(seed, pid), step)
    index = torch.arange(offset, offset + n, dtype=torch.int64)
    h = mix64(((index >> 2) + 1) * _signed(GOLDEN) + _signed(stream))
    # an arithmetic shift: the 16 bits taken lie below the sign-extended ones (shifts of at most 48)
    return (h >> (16 * (index & 3))) & 0xFFFF


def round_bits(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns (int64 in [0, 2^16)) of float32 ``x`` rounded with random values ``r``."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag, sign = u & 0x7FFFFFFF, u & 0x80000000
    out = (u + r) >> 16
    out = torch.where(mag > 0x7F7F0000, (sign | 0x7F7F0000) >> 16, out)
    out = torch.where(mag == 0x7F800000, u >> 16, out)
    return torch.where(mag > 0x7F800000, (u >> 16) | 0x40, out)


def as_bf16(bits: torch.Tensor) -> torch.Tensor:
    """bf16 tensor of the given bit patterns (no float conversion, which would change NaNs)."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a bf16 tensor, as int64 in [0, 2^16)."""
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def stochastic_round(x: torch.Tensor, seed: int, pid: int, step: float, offset: int = 0) -> torch.Tensor:
    """``x`` (float32, any shape) rounded as the kernels round parameter ``pid``'s elements
    ``offset`` .. at ``step`` (row-major order)."""
    flat = x.detach().cpu().float().reshape(-1)
    r = random_bits(seed, pid, step, flat.numel(), offset)
    return as_bf16(round_bits(flat, r)).reshape(x.shape)
