"""What bench_step.py runs: each optimizer row (a Spec: how to build it, its family, state width and
moments, how to page it out), the peers' loaders and hyperparameters, and the byte floor a step
must move per parameter."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
LION_HYPER = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2)
ADEMAMIX_HYPER = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=1e-2)
# (class, hyperparameters, moment arrays per parameter); LARS and LAMB add a norm pass over the update
FAMILY2_ROWS = (
    ("SGD8bit", dict(lr=1e-3, momentum=0.9, weight_decay=1e-2), 1),
    ("RMSprop8bit", dict(lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=1e-2), 1),
    ("Adagrad8bit", dict(lr=1e-2, eps=1e-10, weight_decay=1e-2), 1),
    ("LARS8bit", dict(lr=1e-3, momentum=0.9, weight_decay=1e-2), 1),
    ("LAMB8bit", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2), 2),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MANAGED_LIMIT = 16 * (1 << 30)


# --------------------------------------------------------------------------- peers
def _lr_on(params, hyper: dict) -> dict:
    """``hyper`` with lr a float32 tensor on the parameters' device (what a captured step reads)."""
    return {**hyper, "lr": torch.tensor(hyper["lr"], dtype=torch.float32, device=params[0].device)}


def _pagedopt():
    import pagedopt
    return pagedopt


def _bnb():
    import bitsandbytes as bnb
    return bnb


def _torchao_adamw8bit():
    from torchao.optim import AdamW8bit
    return AdamW8bit


def _torchao_adamw4bit():
    from torchao.optim import AdamW4bit
    return AdamW4bit


def _paged_bytes_pagedopt(opt) -> int:
    try:
        from pagedopt._ops import ops
        is_managed = ops.is_managed
    except Exception:
        return 0
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_cuda and v.data_ptr() not in seen:
                try:
                    if is_managed(v):
                        seen.add(v.data_ptr())
                        total += v.numel() * v.element_size()
                except Exception:
                    pass
    return total


def _page_out_pagedopt(opt) -> int:
    if not hasattr(opt, "page_out"):
        raise RuntimeError("optimizer has no page_out()")
    opt.page_out()
    return _paged_bytes_pagedopt(opt)


def _paged_bytes_bnb(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and getattr(v, "is_paged", False))


def _page_out_bnb(opt) -> int:
    import bitsandbytes.functional as F
    n = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and getattr(v, "is_paged", False):
                F.prefetch_tensor(v, to_cpu=True)
                n += v.numel() * v.element_size()
    return n


@dataclasses.dataclass
class Spec:
    name: str
    family: str
    bits: int                      # 4, 8 or 32: picks the floor bytes per param
    make: Callable                 # (params) -> optimizer
    sets: tuple = ("tinyllama", "small")
    dtypes: tuple = ("fp32", "bf16")
    page_out: Optional[Callable] = None   # (opt) -> bytes sent to host
    paged_bytes: Optional[Callable] = None
    warmup: Optional[int] = None
    repeat: Optional[int] = None
    min_budget_s: float = 0.0      # skip when less wall time than this is left
    note: str = ""
    moments: int = 2               # moment arrays per parameter (Lion 1, Adam 2, AdEMAMix 3)
    graph: bool = False            # time the step captured in a CUDA graph and replayed (CUDA only)


def build_specs(args) -> list[Spec]:
    specs = [
        Spec("pagedopt_adamw8bit", "pagedopt", 8, lambda ps: _pagedopt().AdamW8bit(ps, **HYPER)),
        Spec("pagedopt_paged_adamw8bit", "pagedopt", 8, lambda ps: _pagedopt().PagedAdamW8bit(ps, **HYPER),
             page_out=_page_out_pagedopt, paged_bytes=_paged_bytes_pagedopt),
        Spec("pagedopt_adamw4bit", "pagedopt", 4, lambda ps: _pagedopt().AdamW4bit(ps, **HYPER),
             note="4-bit states"),
        Spec("pagedopt_adamw32", "pagedopt", 32, lambda ps: _pagedopt().AdamW(ps, optim_bits=32, **HYPER),
             dtypes=("fp32",), note="32-bit states"),
        Spec("pagedopt_paged_adamw32bit", "pagedopt", 32, lambda ps: _pagedopt().PagedAdamW32bit(ps, **HYPER),
             dtypes=("fp32",), page_out=_page_out_pagedopt, paged_bytes=_paged_bytes_pagedopt,
             note="32-bit states, paged"),
        Spec("torch_adamw_fused", "torch", 32, lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
             note="states in param dtype"),
        # the step captured in a CUDA graph and replayed: capturable=True, lr a tensor on the GPU
        Spec("pagedopt_adamw8bit_graph", "pagedopt", 8,
             lambda ps: _pagedopt().AdamW8bit(ps, capturable=True, **_lr_on(ps, HYPER)), graph=True,
             note="capturable=True, CUDA graph"),
        Spec("pagedopt_adamw4bit_graph", "pagedopt", 4,
             lambda ps: _pagedopt().AdamW4bit(ps, capturable=True, **_lr_on(ps, HYPER)), graph=True,
             note="4-bit states, capturable=True, CUDA graph"),
        Spec("torch_adamw_fused_graph", "torch", 32,
             lambda ps: torch.optim.AdamW(ps, fused=True, capturable=True, **_lr_on(ps, HYPER)), graph=True,
             note="capturable=True, CUDA graph"),
        Spec("bnb_adamw8bit", "bnb", 8, lambda ps: _bnb().optim.AdamW8bit(ps, **HYPER)),
        # bitsandbytes' own page-out (prefetch_tensor to_cpu) exits the process on CUDA 13
        # ("invalid device ordinal", seen 2026-12-02 on the H200), so it is opt-in.
        Spec("bnb_paged_adamw8bit", "bnb", 8, lambda ps: _bnb().optim.PagedAdamW8bit(ps, **HYPER),
             page_out=_page_out_bnb if args.bnb_pageout else None, paged_bytes=_paged_bytes_bnb,
             note="" if args.bnb_pageout else "its page-out exits the process on CUDA 13; run with --bnb-pageout"),
        # the rest of the family, on the generic engine, against bitsandbytes' classes of the same name
        Spec("pagedopt_lion8bit", "pagedopt", 8, lambda ps: _pagedopt().Lion8bit(ps, **LION_HYPER), moments=1),
        Spec("bnb_lion8bit", "bnb", 8, lambda ps: _bnb().optim.Lion8bit(ps, **LION_HYPER), moments=1),
        Spec("pagedopt_ademamix8bit", "pagedopt", 8, lambda ps: _pagedopt().AdEMAMix8bit(ps, **ADEMAMIX_HYPER),
             moments=3),
        Spec("bnb_ademamix8bit", "bnb", 8, lambda ps: _bnb().optim.AdEMAMix8bit(ps, **ADEMAMIX_HYPER), moments=3),
    ]
    for cls, hyper, moments in FAMILY2_ROWS:  # SGD, RMSprop, Adagrad, LARS, LAMB: pagedopt, then bitsandbytes
        specs.append(Spec(f"pagedopt_{cls.lower()}", "pagedopt", 8,
                          lambda ps, c=cls, h=hyper: getattr(_pagedopt(), c)(ps, **h), moments=moments))
        specs.append(Spec(f"bnb_{cls.lower()}", "bnb", 8,
                          lambda ps, c=cls, h=hyper: getattr(_bnb().optim, c)(ps, **h), moments=moments))
    if not args.no_torchao:
        sets = ("tinyllama", "small") if args.torchao_small else ("tinyllama",)
        dtypes = ("fp32", "bf16") if args.torchao_bf16 else ("fp32",)
        specs.append(Spec("torchao_adamw8bit", "torchao", 8,
                          lambda ps: _torchao_adamw8bit()(ps, block_size=256, **HYPER), sets=sets, dtypes=dtypes,
                          warmup=args.torchao_warmup, repeat=args.torchao_repeat, min_budget_s=75,
                          note="torch.compile on first step"))
        specs.append(Spec("torchao_adamw4bit", "torchao", 4,
                          lambda ps: _torchao_adamw4bit()(ps, block_size=128, **HYPER), sets=sets, dtypes=dtypes,
                          warmup=args.torchao_warmup, repeat=args.torchao_repeat, min_budget_s=75,
                          note="torch.compile on first step"))
    return specs


def selected(spec: Spec, only: list[str]) -> bool:
    if not only:
        return True
    return any(spec.name == o or spec.name.startswith(o) or spec.family == o for o in only)


def floor_bytes_per_param(bits: int, dtype: str, moments: int = 2) -> float:
    """Bytes a step must move per parameter: the parameter read and written, the gradient read,
    and each moment read and written (1 byte as an 8-bit code, half a byte as a 4-bit one, 4 as
    fp32; absmax is under 2% of an 8-bit state, 6% of a 4-bit one). torch's fused AdamW (bits 32
    with a 16-bit dtype) keeps its moments in the parameter's dtype."""
    width = 2 if dtype == "bf16" else 4
    state = {8: 1, 4: 0.5}.get(bits, width if dtype == "bf16" else 4)
    return 3 * width + 2 * moments * state
