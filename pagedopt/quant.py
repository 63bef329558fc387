"""Dynamic 8-bit codebooks, 4-bit codebooks, and a pure-torch reference of blockwise quantization.

The codebook is the "dynamic" map: exponent plus linear fraction, 256 sorted codes in
[-1, 1] (signed, for Adam's first moment) or [0, 1] (unsigned, for the second moment).
It is the same map bitsandbytes uses, so checkpoints carry over.

4-bit states (csrc/include/pagedopt/four_bit.h) take a 16-entry codebook, two codes a byte
(element i in byte i // 2: the low nibble for an even i, the high one for an odd i) and one absmax
per STATE_BLOCK_SIZE_4 = 128 elements: normal_codebook_4bit for the first moment (states made
before 2026-12-07 carry dynamic_codebook_4bit in their qmap1, which they keep),
linear_codebook_4bit_no_zero for the second (bench/RESULTS.md, "4-bit maps", says why).

The reference functions here are what the tests hold the C++/CUDA kernels to.
"""
from __future__ import annotations

import functools

import torch

CODEBOOK_SIZE = 256
STATE_BLOCK_SIZE = 256
CODEBOOK_SIZE_4 = 16
STATE_BLOCK_SIZE_4 = 128


def _decade_means(exponent_bits: int, signed: bool) -> list[float]:
    """The dynamic map's codes but 0 and 1: decade i (of ``exponent_bits``) covers
    [10^(i-e+1) * 0.1, 10^(i-e+1)] with 2^i (signed, with their negatives) or 2^(i+1) linearly
    spaced means."""
    values: list[float] = []
    for i in range(exponent_bits):
        shift = 0 if signed else 1
        n_fraction = 2 ** (i + shift) + 1
        edges = torch.linspace(0.1, 1, n_fraction, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0) * (10 ** (-(exponent_bits - 1) + i))
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    return values


@functools.lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    values = _decade_means(7, signed) + [0.0, 1.0]
    assert len(values) == CODEBOOK_SIZE, len(values)
    code = torch.tensor(sorted(values), dtype=torch.float32)
    code.requires_grad_(False)
    return code


def dynamic_codebook(signed: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256-entry dynamic codebook, sorted ascending, as a new float32 tensor."""
    return _dynamic_map_cpu(bool(signed)).clone().to(device if device is not None else "cpu")


def second_moment_codebook(device: torch.device | str | None = None) -> torch.Tensor:
    """The 8-bit codebook of second moments (Adam's v, ``qmap2``): the unsigned dynamic map with
    its zero code replaced by half its smallest positive code (1.6e-7), sorted, 256 entries. A v far
    below its block's absmax (the rows of rare tokens in an embedding, next to frequent ones) would
    round to 0 with the zero code, while its m does not: the update m / (sqrt(v) + eps) then
    explodes (to m / eps, 100 to 10000 times the learning rate, where fp32 Adam moves about one);
    with this code it is at most what fp32 Adam would take. Values below 3/4 of the smallest
    positive code, zero included, take this code: an element with m = 0 still moves by nothing.
    bitsandbytes' checkpoints carry their own qmap2 (with the zero code), which is kept."""
    code = _dynamic_map_cpu(False).clone()
    code[0] = code[1] / 2
    return code.to(device if device is not None else "cpu")


def check_codebook(code: torch.Tensor, name: str = "code", size: int = CODEBOOK_SIZE) -> None:
    """Raise ValueError unless `code` is a sorted float32 vector of `size` (256: 8-bit, 16: 4-bit)
    finite entries."""
    if not isinstance(code, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(code).__name__}")
    if code.dtype != torch.float32 or code.numel() != size:
        raise ValueError(f"{name} must be float32 with {size} entries, got {code.dtype} "
                         f"with {code.numel()}")
    flat = code.detach().reshape(-1).cpu()
    if not torch.isfinite(flat).all():
        raise ValueError(f"{name} has non-finite entries")
    if not (flat[1:] > flat[:-1]).all():
        raise ValueError(f"{name} must be sorted strictly ascending")


def _blocks(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, int]:
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % blocksize
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, blocksize), n


def nearest_code_reference(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """argmin_j |x - code[j]|, ties to the lower index, in fp32; NaN counts as 0.0, and values
    beyond the codebook (+-inf included) take its largest or smallest code (saturated; the clamp
    keeps fp32 rounding of huge distances from making ties). Returns uint8 codes."""
    x = x.float()
    code = code.to(x.device).float()
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    x = torch.minimum(torch.maximum(x, code.min()), code.max())
    dist = (x.reshape(-1, 1) - code.reshape(1, -1)).abs()
    return dist.argmin(dim=1).to(torch.uint8).reshape(x.shape)


def absmax_reciprocal(absmax: torch.Tensor) -> torch.Tensor:
    """1 / absmax in fp32, or 0 where absmax is zero or below the smallest normal float: values
    are normalized as x * absmax_reciprocal(absmax) (within one ulp of x / absmax)."""
    absmax = absmax.float()
    tiny = torch.finfo(torch.float32).tiny
    safe = torch.where(absmax >= tiny, absmax, torch.ones_like(absmax))
    return torch.where(absmax >= tiny, 1.0 / safe, torch.zeros_like(absmax))


def quantize_blockwise_reference(x: torch.Tensor, code: torch.Tensor, blocksize: int = STATE_BLOCK_SIZE,
                                 absmax: torch.Tensor | None = None):
    """Pure-torch blockwise quantization: (uint8 codes shaped like x, float32 absmax per block).

    A block's absmax is the max |x| over its finite values: NaN and +-inf are left out, and are
    stored saturated (NaN as the code of 0.0, +inf as the largest code, -inf as the smallest), so
    they do not change the other values' codes. A block without a finite value of at least the
    smallest normal float quantizes entirely to the code of 0.0. A given `absmax` (one per block)
    is used instead of the computed one; values beyond it saturate to the end codes."""
    blocks, n = _blocks(x, blocksize)
    if absmax is None:
        absmax = torch.where(torch.isfinite(blocks), blocks.abs(), torch.zeros_like(blocks)).amax(dim=1)
    absmax = absmax.float().to(blocks.device)
    normalized = blocks * absmax_reciprocal(absmax)[:, None]
    codes = nearest_code_reference(normalized, code).reshape(-1)[:n]
    return codes.reshape(x.shape), absmax


def dequantize_blockwise_reference(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                                   blocksize: int = STATE_BLOCK_SIZE, dtype: torch.dtype = torch.float32):
    """Pure-torch inverse of quantize_blockwise_reference: code[q] * absmax of q's block."""
    n = codes.numel()
    idx = torch.arange(n, device=codes.device) // blocksize
    values = code.to(codes.device)[codes.reshape(-1).long()] * absmax.float()[idx]
    return values.reshape(codes.shape).to(dtype)


def max_rounding_error(code: torch.Tensor, x_normalized: torch.Tensor) -> torch.Tensor:
    """The most that round-to-nearest may be off by for each normalized value, in units of
    absmax: half the gap between the two codes around it (or its distance to the nearest
    end of the codebook, for values outside it)."""
    code = code.to(x_normalized.device).float()
    hi = torch.searchsorted(code, x_normalized.float().contiguous(), right=False).clamp(1, code.numel() - 1)
    half_gap = (code[hi] - code[hi - 1]) / 2
    x = x_normalized.float()
    outside = torch.maximum(code[0] - x, x - code[-1]).clamp_min(0)
    return torch.maximum(half_gap, outside)


# ------------------------------------------------------------------------------------- 4-bit
def _dynamic_map_4bit(signed: bool) -> list[float]:
    """The 4-bit dynamic-exponent map: the construction of the 8-bit map (a decade per exponent,
    linearly spaced means inside it) with 3 exponent bits instead of 7, so the decades
    [1e-3, 1e-2], [1e-2, 1e-1], [1e-1, 1] hold 1, 2 and 4 means (signed) or 2, 4 and 8 of which
    the largest are kept (unsigned); plus 0 and the ends 1 (and -1, signed; to make room, the
    signed map drops the smallest negative mean, so its negative half is one value shorter)."""
    values = sorted(set([0.0, 1.0] + _decade_means(3, signed)))
    if signed:
        values = [-1.0] + [v for v in values if v != -min(abs(v) for v in values if v != 0.0)]
    else:
        values = values[len(values) - CODEBOOK_SIZE_4 + 1:] if len(values) > CODEBOOK_SIZE_4 else values
        values = sorted(set([0.0] + values))
    assert len(values) == CODEBOOK_SIZE_4, values
    return values


def _normal_map_4bit() -> list[float]:
    """Quantiles of the standard normal, scaled to [-1, 1] (the construction of NF4, Dettmers et
    al., "QLoRA", 2023): 0, the quantiles at 8 probabilities evenly spaced from 0.5 (excluded) to
    1 - (1/32 + 1/30) / 2 on the positive side and at 7 on the negative one, each side divided by
    its largest, so that both -1 and 1 are codes. A block's normalized first moment is spread like
    that (most values a fraction of the block's largest), and a stored m, rounded again after every
    step, keeps more of its small increments there than on the dynamic map, whose codes crowd near
    0: bench/bench_maps4.py's trajectories and bench/quality.py's fidelity, bench/RESULTS.md."""
    top = 1.0 - 0.5 * (1.0 / 32.0 + 1.0 / 30.0)
    pos = torch.special.ndtri(torch.linspace(0.5, top, 9, dtype=torch.float64)[1:])
    neg = torch.special.ndtri(torch.linspace(0.5, top, 8, dtype=torch.float64)[1:])
    return [0.0] + (pos / pos.max()).tolist() + (-neg / neg.max()).tolist()


@functools.lru_cache(maxsize=None)
def _map4_cpu(kind: str) -> torch.Tensor:
    if kind == "linear_no_zero":
        values = [(i + 1) / CODEBOOK_SIZE_4 for i in range(CODEBOOK_SIZE_4)]
    elif kind == "normal":
        values = _normal_map_4bit()
    else:
        values = _dynamic_map_4bit(kind == "signed")
    code = torch.tensor(sorted(values), dtype=torch.float32)
    return code


def dynamic_codebook_4bit(signed: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16-entry dynamic-exponent codebook, sorted ascending, as a new float32 tensor: for the
    first moment (signed: holds 0, -1 and 1). See _dynamic_map_4bit."""
    return _map4_cpu("signed" if signed else "unsigned").clone().to(device if device is not None else "cpu")


def normal_codebook_4bit(device: torch.device | str | None = None) -> torch.Tensor:
    """The first moment's 16-entry 4-bit codebook, sorted ascending, as a new float32 tensor: normal
    quantiles holding 0, -1 and 1 (see _normal_map_4bit)."""
    return _map4_cpu("normal").clone().to(device if device is not None else "cpu")


def linear_codebook_4bit_no_zero(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 values (i + 1) / 16, i = 0..15: the second moment's 4-bit codebook. It has no zero
    (Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023): a small v is stored
    as at least absmax / 16 instead of 0, which would make m / sqrt(v) blow up."""
    return _map4_cpu("linear_no_zero").clone().to(device if device is not None else "cpu")


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Codes (each < 16) of n values -> ceil(n / 2) uint8 bytes, element i in byte i // 2, the low
    nibble for an even i; an odd n's last high nibble is 0."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_4bit: the first n codes (uint8) of the packed bytes."""
    flat = packed.reshape(-1).to(torch.uint8)
    return torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)[:n]


def quantize_4bit_reference(x: torch.Tensor, code: torch.Tensor, blocksize: int = STATE_BLOCK_SIZE_4,
                            absmax: torch.Tensor | None = None):
    """quantize_blockwise_reference with a 16-entry code, the codes packed: (uint8 of shape
    (ceil(n / 2),), float32 absmax per block)."""
    codes, absmax = quantize_blockwise_reference(x.reshape(-1), code, blocksize, absmax)
    return pack_4bit(codes), absmax


def dequantize_4bit_reference(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, n: int,
                              blocksize: int = STATE_BLOCK_SIZE_4, dtype: torch.dtype = torch.float32):
    """The first n values of packed 4-bit codes: code[q] * absmax of q's block, 1-D."""
    return dequantize_blockwise_reference(unpack_4bit(packed, n), absmax, code, blocksize, dtype)
