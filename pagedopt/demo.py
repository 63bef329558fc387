"""Train a small causal language model on synthetic data with torch's AdamW and with
pagedopt's AdamW8bit, and compare loss and optimizer-state memory.

    python -m pagedopt.demo [--steps 300] [--device cpu|cuda] [--seed 0]

Runs on the CPU when there is no GPU.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from pagedopt.optim.base import optimizer_state_bytes

VOCAB = 256


class TinyCausalLM(nn.Module):
    """A two-layer pre-norm transformer; its matrices are large enough for 8-bit states."""

    def __init__(self, vocab=VOCAB, dim=128, layers=2, heads=4, seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


class SyntheticText:
    """Sequences from a fixed random sparse Markov chain: learnable, never trivially so."""

    def __init__(self, chain_seed: int, sample_seed: int, branching: int = 4):
        g = torch.Generator().manual_seed(1000 + chain_seed)
        self.next_tokens = torch.randint(0, VOCAB, (VOCAB, branching), generator=g)
        self.probs = torch.softmax(torch.randn(VOCAB, branching, generator=g) * 2, dim=1)
        self.gen = torch.Generator().manual_seed(sample_seed)

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        out = torch.empty(batch, seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, VOCAB, (batch,), generator=self.gen)
        for i in range(seq):
            choice = torch.multinomial(self.probs[out[:, i]], 1, generator=self.gen).squeeze(1)
            out[:, i + 1] = self.next_tokens[out[:, i], choice]
        return out


def make_optimizer(name: str, params, lr: float):
    import pagedopt

    if name == "torch.AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    cls = getattr(pagedopt, name.split(".", 1)[1])
    return cls(params, lr=lr, weight_decay=0.01)


def train(optimizer: str, steps: int = 300, seed: int = 0, device: str = "cpu", batch: int = 16, seq: int = 64,
          lr: float = 3e-3, progress: bool = True) -> dict:
    """Train from a fixed init; returns final train loss, held-out loss and state bytes."""
    torch.manual_seed(seed)
    model = TinyCausalLM(seq=seq).to(device)
    data = SyntheticText(seed, seed)
    held_out = SyntheticText(seed, seed + 10_000).batch(64, seq).to(device)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    bar = tqdm(range(steps), desc=f"{optimizer:<18}", disable=not progress, leave=True)
    for _ in bar:
        tokens = data.batch(batch, seq).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if len(losses) % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.4f}")
    with torch.no_grad():
        logits = model(held_out[:, :-1])
        val = F.cross_entropy(logits.reshape(-1, VOCAB), held_out[:, 1:].reshape(-1)).item()
    n_params = sum(p.numel() for p in model.parameters())
    quantized = [p for p in model.parameters() if opt.state[p].get("state1", torch.empty(0)).dtype == torch.uint8]
    q_params = sum(p.numel() for p in quantized)
    q_bytes = sum(sum(opt.state[p][k].numel() * opt.state[p][k].element_size()
                      for k in ("state1", "state2", "absmax1", "absmax2")) for p in quantized)
    return dict(optimizer=optimizer, train_loss=sum(losses[-20:]) / 20, val_loss=val, params=n_params,
                state_bytes=optimizer_state_bytes(opt), quantized_params=q_params, quantized_state_bytes=q_bytes)


TABLE_HEADER = f"{'optimizer':<20}{'train loss':>11}{'val loss':>10}{'state bytes':>13}{'bytes/param':>13}{'time s':>8}"


def table_row(r: dict) -> str:
    """One optimizer's line of the table under :data:`TABLE_HEADER` (``r``: :func:`train`'s result and
    ``seconds``)."""
    return (f"{r['optimizer']:<20}{r['train_loss']:>11.4f}{r['val_loss']:>10.4f}{r['state_bytes']:>13,}"
            f"{r['state_bytes'] / r['params']:>13.3f}{r['seconds']:>8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"pagedopt demo: TinyCausalLM on synthetic text, {args.steps} steps on {args.device}")
    results = []
    for name in ("torch.AdamW", "pagedopt.AdamW8bit"):
        t0 = time.perf_counter()
        r = train(name, args.steps, args.seed, args.device)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
    print()
    print(TABLE_HEADER)
    for r in results:
        print(table_row(r))
    ref, ours = results
    if ours["quantized_params"]:
        print(f"\n8-bit states: {ours['quantized_state_bytes'] / ours['quantized_params']:.4f} bytes/param over "
              f"{ours['quantized_params']:,} of {ours['params']:,} params (tensors under min_8bit_size=4096 "
              f"keep fp32 states); torch AdamW: 8 bytes/param")
    print(f"validation loss, AdamW8bit vs AdamW: {100 * (ours['val_loss'] / ref['val_loss'] - 1):+.3f}%")


if __name__ == "__main__":
    main()
