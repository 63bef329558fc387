"""The runs of bench/quality.py: a small causal LM (bench_train.py's blocks plus learned positions)
trained on the synthetic text of quality_data.py, and the teacher-forced state-fidelity run.

Every run of a seed starts from the same weights (made on the CPU from the seed, then moved) and
sees the same batches (made on the CPU from the seed), whatever the optimizer and device, so two
optimizers' runs of one seed differ only by their updates. On CUDA the kernels are chosen for
determinism (``torch.use_deterministic_algorithms``, cuBLAS workspace, TF32 off, SDPA's math
backend): fp32 AdamW run twice gives the same losses bit for bit, which quality.py checks.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic GEMMs

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_train as BT  # noqa: E402  (bench/ is on sys.path: quality.py puts it there)
import common as C  # noqa: E402
from quality_data import Language, LanguageSpec  # noqa: E402
from quality_rows import ROWS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128
    batch: int = 32
    steps: int = 600
    lr: float = 2e-3
    warmup: float = 0.05        # fraction of steps of linear warm-up
    final_lr: float = 0.0       # cosine decay to this fraction of lr
    eval_every: int = 0         # 0: steps // 20 (the tail's 3 evals then span the last 10% of training)
    eval_seqs: int = 256
    tail: int = 3               # the last `tail` evals are averaged (the per-seed figure)
    fid_every: int = 10         # fidelity: measure every this many steps (every step is teacher-forced)
    fid_steps: int = 0          # fidelity run's steps (0: as `steps`)

    @property
    def eval_period(self) -> int:
        return self.eval_every or max(1, self.steps // 20)

    def model_config(self) -> BT.ModelConfig:
        return BT.ModelConfig(d_model=self.width, layers=self.layers, heads=self.heads, mlp_ratio=4,
                              vocab=self.vocab, seq=self.seq, batch=self.batch)

    def lr_at(self, step: int, steps: Optional[int] = None) -> float:
        """Linear warm-up, then cosine from lr towards final_lr * lr (reached one step after the last)."""
        steps = steps or self.steps
        w = max(1, round(self.warmup * steps))
        if step < w:
            return self.lr * (step + 1) / w
        frac = (step - w) / max(1, steps - w)  # below 1 at the last step: its lr is small, not 0
        return self.lr * (self.final_lr + (1 - self.final_lr) * 0.5 * (1 + math.cos(math.pi * frac)))


SMOKE = Config(layers=1, width=64, heads=2, vocab=256, seq=32, batch=4, steps=12, eval_every=4, eval_seqs=8,
               tail=2, fid_every=3)


# --------------------------------------------------------------------------- model
class QualityLM(BT.CausalLM):
    """bench_train.py's CausalLM (RMSNorm, fused qkv, causal SDPA, GELU MLP, untied head) with a learned
    position embedding, GPT-2's init (N(0, 0.02), residual outputs scaled by 1/sqrt(2 layers))."""

    def __init__(self, cfg: BT.ModelConfig):
        super().__init__(cfg)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.d_model))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    continue  # norm weights keep 1
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def layer_type(name: str, p: torch.Tensor) -> str:
    """The kind of tensor, for the per-layer-type fidelity: embedding (token, position, head),
    attn_qkv, attn_out, mlp, or small (norm weights: below every row's minimum size, 32-bit states)."""
    if p.dim() == 1:
        return "small"
    if name.startswith(("embed", "head", "pos")):
        return "embedding"
    if ".qkv." in name:
        return "attn_qkv"
    if ".proj." in name:
        return "attn_out"
    if ".up." in name or ".down." in name:
        return "mlp"
    return "other"


LAYER_TYPES = ("embedding", "attn_qkv", "attn_out", "mlp", "small", "other")


def set_deterministic(device) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def build_model(cfg: Config, seed: int, device) -> QualityLM:
    torch.manual_seed(seed)
    return QualityLM(cfg.model_config()).to(device)


def language(cfg: Config) -> Language:
    return Language(LanguageSpec(vocab=cfg.vocab))


def train_tokens(cfg: Config, seed: int, lang: Optional[Language] = None) -> torch.Tensor:
    """The batches of a seed, [steps * batch, seq + 1] int64 on the CPU."""
    return (lang or language(cfg)).sample(cfg.steps * cfg.batch, cfg.seq + 1, seed=1_000_003 + seed)


def eval_tokens(cfg: Config, lang: Optional[Language] = None) -> torch.Tensor:
    """The held-out set, the same for every seed and row."""
    return (lang or language(cfg)).sample(cfg.eval_seqs, cfg.seq + 1, seed=777)


def _loss(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):  # deterministic backward, and the same kernel on every device
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, vocab: int, chunk: int = 64) -> torch.Tensor:
    """Mean loss over the held-out set (a 0-d tensor on the device: no sync)."""
    total = None
    for i in range(0, tokens.shape[0], chunk):
        part = _loss(model, tokens[i:i + chunk], vocab) * tokens[i:i + chunk].shape[0]
        total = part if total is None else total + part
    return total / tokens.shape[0]


def _set_lr(opt, lr: float) -> None:
    """The schedule's lr into every group: in place where the optimizer keeps lr as a tensor (torchao
    does, so that a new value does not recompile its step)."""
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


# --------------------------------------------------------------------------- convergence
def train(make: Callable, cfg: Config, seed: int, tokens: torch.Tensor, held_out: torch.Tensor, device) -> dict:
    """One seed's run: eval losses every ``eval_period`` steps (and at the end), per-step train losses."""
    model = build_model(cfg, seed, device)
    opt = make(list(model.parameters()))
    held_out = held_out.to(device)
    evals, train_losses = [], []
    C.sync(device)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = tokens[step * cfg.batch:(step + 1) * cfg.batch].to(device, non_blocking=True)
        _set_lr(opt, cfg.lr_at(step))
        loss = _loss(model, batch, cfg.vocab)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_losses.append(loss.detach())
        if (step + 1) % cfg.eval_period == 0 or step + 1 == cfg.steps:
            evals.append((step + 1, evaluate(model, held_out, cfg.vocab)))
    C.sync(device)
    seconds = time.perf_counter() - t0
    evals = [(s, float(v)) for s, v in evals]
    train_losses = torch.stack(train_losses).float().cpu().tolist()
    tail = [v for _, v in evals[-cfg.tail:]]
    return {"seed": seed, "evals": evals, "final": evals[-1][1], "tail_mean": sum(tail) / len(tail),
            "train_losses": train_losses, "seconds": seconds, "finite": all(math.isfinite(x) for x in train_losses)}


# --------------------------------------------------------------------------- state fidelity
def _sq(x: torch.Tensor) -> torch.Tensor:
    return x.double().pow(2).sum()


def fidelity(make: Callable, read_states: Optional[Callable], cfg: Config, tokens: torch.Tensor, device,
             seed: int = 0) -> dict:
    """Teacher forcing: fp32 AdamW trains the model; before each of its steps the row's optimizer gets
    the reference's parameters (copied into its own tensors) and the same gradients, and steps once.
    Each optimizer keeps its own states. Every ``fid_every`` steps, per layer type: ||u_row - u_ref|| /
    ||u_ref|| of the update (u = p after - p before), and the same of each state (the row's states as
    fp32, by ``read_states``) against fp32 AdamW's exp_avg / exp_avg_sq. Returns each series and its
    median, 90th percentile and last value, and the largest |update| / lr seen (the row's and fp32's):
    where a quantized v rounds to 0 under a nonzero m, the update is m / eps, far beyond Adam's
    usual |update| <~ lr, and this shows it even when it touches a handful of elements."""
    steps = cfg.fid_steps or cfg.steps
    model = build_model(cfg, seed, device)
    named = [(n, p) for n, p in model.named_parameters()]
    ref = ROWS["fp32"].make([p for _, p in named])
    mine = [nn.Parameter(p.detach().clone()) for _, p in named]
    opt = make(mine)
    kinds = [layer_type(n, p) for n, p in named]
    series: dict = {k: {"update": [], "exp_avg": [], "exp_avg_sq": []} for k in sorted(set(kinds))}
    reader_error = None
    peaks: dict = {k: [] for k in series}  # largest |update| / lr of the row and of fp32 at each measured step
    steps_seen = []
    for step in range(steps):
        batch = tokens[step * cfg.batch:(step + 1) * cfg.batch].to(device, non_blocking=True)
        lr = cfg.lr_at(step, steps)
        _set_lr(ref, lr)
        _set_lr(opt, lr)
        loss = _loss(model, batch, cfg.vocab)
        loss.backward()
        before = [p.detach().clone() for _, p in named]
        with torch.no_grad():
            for q, p, b in zip(mine, (p for _, p in named), before):
                q.copy_(b)
                q.grad = p.grad.detach().clone()
        opt.step()
        ref.step()
        measure = (step + 1) % cfg.fid_every == 0 or step + 1 == steps
        if measure:
            steps_seen.append(step + 1)
            acc = {k: {m: [torch.zeros((), dtype=torch.float64, device=device)] * 2 for m in series[k]}
                   for k in series}
            peak = {k: [torch.zeros((), device=device)] * 2 for k in series}
            for (name, p), q, b, kind in zip(named, mine, before, kinds):
                u_ref, u_row = p.detach() - b, q.detach() - b
                _add(acc[kind]["update"], u_row - u_ref, u_ref)
                peak[kind] = [torch.maximum(peak[kind][0], u_row.abs().max()),
                              torch.maximum(peak[kind][1], u_ref.abs().max())]
                got = None
                if read_states is not None:
                    try:
                        got = read_states(opt, q)
                    except Exception as exc:  # noqa: BLE001 - a layout this reader does not know: update error only
                        reader_error = f"{name}: {C.short_error(exc)}"
                        read_states = None
                want = ROWS["fp32"].read_states(ref, p)
                for i, key in enumerate(("exp_avg", "exp_avg_sq")):
                    if got is None or got[i] is None:
                        acc[kind][key] = None
                    elif acc[kind][key] is not None:
                        _add(acc[kind][key], got[i].float().reshape(p.shape) - want[i], want[i])
            for kind, metrics in acc.items():
                for key, pair in metrics.items():
                    series[kind][key].append(None if pair is None else float((pair[0] / pair[1]).sqrt()))
                peaks[kind].append((float(peak[kind][0]) / lr, float(peak[kind][1]) / lr))
        model.zero_grad(set_to_none=True)
        for q in mine:
            q.grad = None
    out = {"steps": steps_seen, "by_type": {}, "state_reader_error": reader_error}
    for kind, metrics in series.items():
        out["by_type"][kind] = {key: summarize_series(vals) for key, vals in metrics.items()}
        out["by_type"][kind]["numel"] = sum(p.numel() for (_, p), k in zip(named, kinds) if k == kind)
        out["by_type"][kind]["peak_update_lr"] = max(r for r, _ in peaks[kind])
        out["by_type"][kind]["ref_peak_update_lr"] = max(f for _, f in peaks[kind])
    return out


def _add(pair: list, diff: torch.Tensor, ref: torch.Tensor) -> None:
    pair[0] = pair[0] + _sq(diff)
    pair[1] = pair[1] + _sq(ref)


def summarize_series(vals: list) -> dict:
    """median, 90th percentile (nearest rank) and last value of a series, over its finite values (a
    step whose reference update is 0 gives NaN); all None where a value is None (states not readable)."""
    xs = [v for v in vals if v is not None and math.isfinite(v)]
    if not xs or any(v is None for v in vals):
        return {"median": None, "p90": None, "last": None, "series": vals}
    s = sorted(xs)
    return {"median": s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2]),
            "p90": s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)], "last": xs[-1], "series": vals}
