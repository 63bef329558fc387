"""The model of bench/scale.py: a LLaMA-shaped decoder in plain torch (nothing downloaded, no
transformers), its shapes from 1B to 30B parameters, and its estimate by pagedopt.memory.

A block: RMSNorm, q/k/v/o projections (multi-head, head dim 128, no bias), causal SDPA, RMSNorm,
SwiGLU MLP (gate, up, down); embeddings and an untied lm_head over a 32000-token vocabulary; no
positional encoding (memory and time do not depend on it). With ``checkpointing`` every block is
recomputed in backward (``torch.utils.checkpoint``, non-reentrant), so a block keeps only its input.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    inter: int        # the MLP's width (LLaMA: 8/3 of hidden, rounded up to a multiple of 256)
    heads: int
    vocab: int = 32000


def llama_inter(hidden: int) -> int:
    return 256 * math.ceil(8 * hidden / 3 / 256)


def _shape(name: str, layers: int, hidden: int, inter: Optional[int] = None) -> Shape:
    return Shape(name, layers, hidden, inter or llama_inter(hidden), hidden // 128)


# upward, about 1.5-2x apart; 7b, 13b and 30b have LLaMA's 7B, 13B and a 30B-class shape (48 x 7168)
SHAPES = {s.name: s for s in (
    _shape("1b", 16, 2048, 5632),
    _shape("3b", 26, 3200, 8640),
    _shape("7b", 32, 4096, 11008),
    _shape("10b", 36, 4608),
    _shape("13b", 40, 5120, 13824),
    _shape("20b", 44, 6144),
    _shape("30b", 48, 7168),
    # the node's (FSDP2 across its GPUs, bench/scale.py --nproc): 52B, and 78B, the 70B-shaped one of
    # LLaMA-2 (80 x 8192, MLP 28672) with multi-head attention instead of its 8 k/v heads
    _shape("50b", 64, 8192),
    _shape("70b", 80, 8192, 28672),
    # CPU smoke shapes (seconds each)
    Shape("tiny", 2, 64, 176, 4, 256),
    Shape("tiny2", 2, 96, 256, 4, 256),
    Shape("tiny3", 3, 128, 352, 4, 256),
)}
LADDER = ("1b", "3b", "7b", "10b", "13b", "20b", "30b")
NODE_LADDER = ("13b", "30b", "50b", "70b")  # the default of --nproc > 1
SMOKE_LADDER = ("tiny",)


def param_count(s: Shape) -> int:
    """Closed form: per layer q, k, v, o (h x h each), gate, up (h x I), down (I x h), two norms (h);
    embeddings and lm_head (V x h each), the final norm (h)."""
    h = s.hidden
    return s.layers * (4 * h * h + 3 * h * s.inter + 2 * h) + 2 * s.vocab * h + h


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        h = s.hidden
        self.heads = s.heads
        self.attn_norm = nn.RMSNorm(h)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.gate_proj = nn.Linear(h, s.inter, bias=False)
        self.up_proj = nn.Linear(h, s.inter, bias=False)
        self.down_proj = nn.Linear(s.inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (p(y).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, h))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Decoder(nn.Module):
    def __init__(self, s: Shape, checkpointing: bool = True):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.norm(x))


def build(s: Shape, dtype: torch.dtype, device, checkpointing: bool = True, seed: int = 0) -> Decoder:
    """The model made on the meta device and then allocated on ``device`` in ``dtype`` (no fp32
    copy of a bf16 model ever exists): matrices ~ N(0, 0.02), norms 1."""
    with torch.device("meta"):
        model = Decoder(s, checkpointing).to(dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


@functools.lru_cache(maxsize=None)
def estimator_model(s: Shape):
    """pagedopt.memory's Model of the shape: its tensors from a meta-device Decoder (exact), its
    activation shape from the shape."""
    from pagedopt.memory import Arch, Model, tensors_from_module

    with torch.device("meta"):
        model = Decoder(s)
    return Model(tensors_from_module(model), Arch(hidden=s.hidden, layers=s.layers, heads=s.heads, vocab=s.vocab),
                 f"bench/scale_model.py {s.name}", exact=True)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def estimate(s: Shape, optimizer: str, dtype: str, batch: int, seq: int, checkpointing: bool = True,
             autocast: bool = True):
    """pagedopt.memory.estimate of training the shape: activations bf16 under autocast (as
    bench/scale.py runs on CUDA), else in the parameters' dtype."""
    from pagedopt.memory import estimate as _estimate

    return _estimate(estimator_model(s), optimizer, dtype, batch=batch, seq=seq,
                     gradient_checkpointing=checkpointing, act_dtype="bf16" if autocast else None)
