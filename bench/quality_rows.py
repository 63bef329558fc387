"""The rows of bench/quality.py: one line each, name -> how to make the optimizer, how to read its
two Adam states back as fp32 tensors (for the fidelity measure), and what it needs.

A row's class is looked up by name when the row runs, so a missing package or class (bitsandbytes,
torchao, a pagedopt class not built yet) skips that row with the reason instead of failing the run.
Every row gets the same hyperparameters (quality_train.HYPER) and the library's other defaults
(block size, minimum quantized size): the formats as users get them.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # every row (lr is set each step)
States = Optional[tuple]  # (exp_avg, exp_avg_sq) as fp32 tensors (either may be None), or None


def lookup(path: str):
    """``"pkg.mod:Attr"`` -> the attribute; ImportError / AttributeError say what is missing."""
    mod, _, attr = path.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{mod} has no {attr} (this build or version lacks it)")
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- state readers
def read_torch(opt, p) -> States:
    """torch.optim.AdamW (and pagedopt's 32-bit states): exp_avg, exp_avg_sq."""
    st = opt.state[p]
    return st["exp_avg"].float(), st["exp_avg_sq"].float()


def _block_size(n: int, blocks: int) -> int:
    """The power-of-two block size that cuts n elements into ``blocks`` blocks."""
    size = 1
    while -(-n // size) > blocks:
        size *= 2
    if -(-n // size) != blocks:
        raise ValueError(f"{n} elements do not make {blocks} blocks of a power-of-two size")
    return size


def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Two 4-bit codes a byte, element 2i in the low nibble and 2i+1 in the high one (pagedopt's 4-bit
    layout, csrc/include/pagedopt/four_bit.h), to n codes."""
    flat = packed.reshape(-1).to(torch.uint8)
    codes = torch.stack([flat & 15, flat >> 4], dim=1).reshape(-1)
    return codes[:n]


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, shape) -> torch.Tensor:
    """code[q] * absmax of q's block, for 8-bit codes (one per element) or packed 4-bit ones (16-entry
    qmap, two a byte); the block size follows from the counts."""
    n = 1
    for s in shape:
        n *= int(s)
    flat = codes.reshape(-1)
    if qmap.numel() == 16 and flat.numel() == -(-n // 2):
        flat = unpack_4bit(flat, n)
    elif flat.numel() != n:
        raise ValueError(f"{flat.numel()} codes for {n} elements with a {qmap.numel()}-entry map")
    bs = _block_size(n, absmax.numel())
    idx = torch.arange(n, device=flat.device) // bs
    return (qmap.float().to(flat.device)[flat.long()] * absmax.float().reshape(-1)[idx]).reshape(shape)


def read_blockwise(opt, p) -> States:
    """bitsandbytes' layout, which pagedopt keeps: state1/state2 codes with absmax1/2 and qmap1/2 where
    the tensor is quantized, plain fp32 state1/state2 where it is not."""
    st = opt.state[p]
    out = []
    for i in (1, 2):
        s = st[f"state{i}"]
        if s.dtype == torch.uint8:
            out.append(dequantize_blockwise(s, st[f"absmax{i}"], st[f"qmap{i}"], p.shape))
        else:
            out.append(s.float())
    return tuple(out)


def read_torchao(opt, p) -> States:
    """torchao's: exp_avg / exp_avg_sq are OptimState8bit / 4bit subclasses (``dequantize()``), or plain
    tensors where the parameter is too small to quantize."""
    st = opt.state[p]
    out = []
    for key in ("exp_avg", "exp_avg_sq"):
        s = st[key]
        s = s.dequantize() if hasattr(s, "dequantize") and type(s) is not torch.Tensor else s
        out.append(s.float().reshape(p.shape))
    return tuple(out)


# --------------------------------------------------------------------------- candidate formats
def _v_floor_map() -> list:
    """A candidate map of v: the unsigned dynamic 4-bit map with its zero code replaced by half its
    smallest positive one (bench_maps4's "de0_floor"), the 8-bit map of v made the same way."""
    from pagedopt import quant
    code = quant.dynamic_codebook_4bit(False)
    code[0] = code[1] / 2
    return code.tolist()


def _signed_map(kind: str) -> list:
    """Candidate 4-bit maps of m: "de" the signed dynamic map (-1, the 6 negative codes above
    -0.0055's place, 0, 0.0055 .. 1; the default before 2026-12-07), "normal" normal quantiles (the
    default since), and from the dynamic map: "sym" trades -1 for -0.0055 (torchao's map, symmetric
    about 0 without -1: the negative block maxima land on -0.8875), "symnz" trades 0 for -0.0055
    (symmetric, both extremes, no zero: an m of 0 is stored as +-0.0055 of its block's absmax)."""
    from pagedopt import quant
    code = quant.dynamic_codebook_4bit(True).tolist()
    smallest = min(c for c in code if c > 0)
    if kind == "de":  # the dynamic map, 4-bit states' first map before 2026-12-07
        return sorted(code)
    if kind == "normal":  # the default since (quant.normal_codebook_4bit)
        return quant.normal_codebook_4bit().tolist()
    if kind == "sym":
        code = [c for c in code if c != -1.0] + [-smallest]
    elif kind == "symnz":
        code = [c for c in code if c != 0.0] + [-smallest]
    return sorted(code)


def _adamw4bit_with_maps(name: str, m_map=None, v_map=None):
    """pagedopt's AdamW4bit with candidate 4-bit maps (functions giving 16 sorted codes; None: the
    default's), through ``codebooks_on``, the public choice of a format's maps."""
    import pagedopt

    class AdamW4bitMaps(pagedopt.AdamW4bit):
        def codebooks_on(self, device, fmt=None):
            signed, unsigned = super().codebooks_on(device, fmt) if fmt is not None else super().codebooks_on(device)
            if signed.numel() != 16:
                return signed, unsigned
            maps = self.__dict__.setdefault("_candidate_maps", {})
            if device not in maps:
                maps[device] = tuple(code if make is None else torch.tensor(make(), dtype=code.dtype, device=code.device)
                                     for code, make in ((signed, m_map), (unsigned, v_map)))
            return maps[device]

    AdamW4bitMaps.__name__ = name
    return AdamW4bitMaps


class Emulated4bitAdamW(torch.optim.Optimizer):
    """AdamW whose states are rounded through a 4-bit blockwise format after every step, in pure torch
    (pagedopt.quant's reference quantizer, block 128): a candidate format's quality before any
    kernel exists. ``store="m"`` keeps m as pagedopt's 4-bit states do (its fidelity should match
    pagedopt_4bit's); ``store="r"`` keeps r = m / (sqrt(v) + eps) instead, with the v read back,
    and m = r * (sqrt(v) + eps) when read (bench_maps4's stored_trajectory). Tensors under 4096
    elements keep fp32 states, as pagedopt's min_8bit_size does. The states are kept dequantized
    (fp32 tensors holding the values a 4-bit state would give back)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, store="m", m_map="de"):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        from pagedopt import quant
        self.store = store
        self.code_v = quant.linear_codebook_4bit_no_zero()
        self.code_m = torch.tensor(_signed_map(m_map), dtype=torch.float32)

    @staticmethod
    def _round(x, code):
        from pagedopt import quant
        flat = x.reshape(-1)
        q, a = quant.quantize_blockwise_reference(flat, code.to(x.device), 128)
        return quant.dequantize_blockwise_reference(q, a, code.to(x.device), 128).reshape(x.shape)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(g)
                    st["exp_avg_sq"] = torch.zeros_like(g)
                st["step"] += 1
                t = st["step"]
                m = b1 * st["exp_avg"] + (1 - b1) * g
                v = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
                p.mul_(1 - lr * wd)
                p.add_(-(lr / (1 - b1**t)) * m / ((v / (1 - b2**t)).sqrt() + eps))
                if p.numel() < 4096:
                    st["exp_avg"], st["exp_avg_sq"] = m, v
                    continue
                vq = self._round(v, self.code_v)
                if self.store == "m":
                    mq = self._round(m, self.code_m)
                else:
                    scale = vq.sqrt() + eps
                    mq = self._round(m / scale, self.code_m) * scale
                st["exp_avg"], st["exp_avg_sq"] = mq, vq


def _emulated(store: str, m_map: str):
    class Emulated(Emulated4bitAdamW):
        def __init__(self, params, **kw):
            super().__init__(params, store=store, m_map=m_map, **kw)

    Emulated.__name__ = f"Emulated4bit_{store}_{m_map}"
    return Emulated


def __getattr__(name: str):  # the candidate classes, made when a row looks them up (pagedopt imported then)
    if name.startswith("Emulated4bit_"):
        _, store, m_map = name.split("_")
        return _emulated(store, m_map)
    if name == "AdamW4bitVFloor":
        return _adamw4bit_with_maps(name, v_map=_v_floor_map)
    for kind in ("sym", "symnz", "de"):
        if name == f"AdamW4bitM{kind.capitalize()}":
            return _adamw4bit_with_maps(name, m_map=lambda kind=kind: _signed_map(kind))
    raise AttributeError(name)


# --------------------------------------------------------------------------- the rows
@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    cls: str                          # "module:Class", looked up when the row runs
    read_states: Optional[Callable]   # (opt, p) -> States; None: the update error only
    family: str                       # colour in the plot
    bits: int
    cuda_only: bool = False
    kwargs: tuple = ()                # extra constructor arguments, as (key, value) pairs

    def make(self, params, lr: float = 1e-3):
        return lookup(self.cls)(params, lr=lr, **{**HYPER, **dict(self.kwargs)})

    def missing(self, device) -> Optional[str]:
        """Why this row cannot run here (None: it can)."""
        if self.cuda_only and torch.device(device).type != "cuda":
            return "needs CUDA"
        try:
            lookup(self.cls)
        except (ImportError, AttributeError) as exc:
            return f"{self.cls.replace(':', '.')} not available: {type(exc).__name__}: {exc}"[:300]
        return None


ROWS = {r.name: r for r in (
    Row("fp32", "torch.optim:AdamW", read_torch, "torch", 32),            # the reference of every pair
    Row("pagedopt_8bit", "pagedopt:AdamW8bit", read_blockwise, "pagedopt", 8),
    Row("pagedopt_4bit", "pagedopt:AdamW4bit", read_blockwise, "pagedopt", 4),
    Row("bnb_8bit", "bitsandbytes.optim:AdamW8bit", read_blockwise, "bnb", 8, cuda_only=True),
    Row("torchao_8bit", "torchao.optim:AdamW8bit", read_torchao, "torchao", 8),
    Row("torchao_4bit", "torchao.optim:AdamW4bit", read_torchao, "torchao", 4),
    # not in the default set: pagedopt's 32-bit states against torch's (the same math, other kernels),
    # and the noise floor: fp32 AdamW with beta2 0.999001, a change of v by ~1e-4 relative, far
    # below any format's, whose paired d is the divergence of two nearly equal trajectories alone
    Row("pagedopt_32bit", "pagedopt:AdamW32bit", read_blockwise, "pagedopt", 32),
    Row("fp32_nudged", "torch.optim:AdamW", read_torch, "torch", 32, kwargs=(("betas", (0.9, 0.999001)),)),
    # a candidate 4-bit map of v (bench/RESULTS.md, "4-bit maps"), beside pagedopt_4bit
    Row("pagedopt_4bit_vfloor", "quality_rows:AdamW4bitVFloor", read_blockwise, "pagedopt", 4),
    # candidate 4-bit maps of m (quality_rows._signed_map), beside pagedopt_4bit
    Row("pagedopt_4bit_msym", "quality_rows:AdamW4bitMSym", read_blockwise, "pagedopt", 4),
    Row("pagedopt_4bit_msymnz", "quality_rows:AdamW4bitMSymnz", read_blockwise, "pagedopt", 4),
    Row("pagedopt_4bit_mde", "quality_rows:AdamW4bitMDe", read_blockwise, "pagedopt", 4),  # the old m map
    # 4-bit formats emulated in pure torch (Emulated4bitAdamW): m stored as itself (the control: it
    # should match pagedopt_4bit) or as r = m / (sqrt(v) + eps)
    Row("emulated_4bit_m_de", "quality_rows:Emulated4bit_m_de", read_torch, "emulated", 4),
    Row("emulated_4bit_r_de", "quality_rows:Emulated4bit_r_de", read_torch, "emulated", 4),
    Row("emulated_4bit_r_normal", "quality_rows:Emulated4bit_r_normal", read_torch, "emulated", 4),
)}
DEFAULT_ROWS = ("fp32", "fp32_nudged", "pagedopt_8bit", "pagedopt_4bit", "bnb_8bit", "torchao_8bit", "torchao_4bit")
SMOKE_ROWS = ("fp32", "pagedopt_8bit")
