"""What fits: GPU memory of a training run (weights + gradients + optimizer states + activations).

Command line (``python -m pagedopt.memory`` or ``pagedopt-mem``)::

    pagedopt-mem --config path/to/config.json --optimizer paged_adamw_8bit --gpu 24
    pagedopt-mem --config llama3-8b --lora 16 --gradient-checkpointing --batch 4 --seq 2048 --gpu H200
    pagedopt-mem --params 7e9 --weights bf16 --optimizer adamw_torch --gpu A100-80

prints a table in GiB and says whether the run fits on the GPU, and the largest batch that does.

What is exact and what is not
-----------------------------
* **Exact** (equal, byte for byte, to what a real model and optimizer hold; tests/test_memory.py
  checks it against a real model): the parameter count, the weight and gradient bytes and the
  optimizer-state bytes, once the model is given by a ``config.json`` (or a preset name). With
  transformers installed the model is built on the meta device (no memory, no download) and every
  parameter tensor is counted; without it a formula for Llama-like decoders gives the same tensors
  (embeddings, attention q/k/v/o with ``num_key_value_heads``, gated MLP, RMSNorms, ``lm_head``
  unless ``tie_word_embeddings``; the q/k/v biases of Qwen2, the q/k norms of Qwen3).
  Optimizer states, per parameter tensor (``pagedopt.optim.base._init_state``):

  - pagedopt 8-bit, ``numel >= min_8bit_size``: ``k*numel`` (uint8 codes of the k moments: Adam's m
    and v, k = 2; Lion, SGD, RMSprop, Adagrad k = 1; AdEMAMix k = 3) ``+ 4k*ceil(numel/256)`` (one fp32
    absmax per moment and 256-element block) ``+ 4`` (fp32 ``step``);
  - pagedopt 32-bit, or below ``min_8bit_size``: ``4k*numel + 4``;
  - ``torch.optim.AdamW``: ``2*numel*sizeof(param dtype) + 4`` (``exp_avg``/``exp_avg_sq`` take the
    parameter's dtype: bf16 weights get bf16 states).

  With ``--params N`` alone the per-tensor shapes are unknown and every tensor is taken as large
  (8-bit): then the state figure is approximate.
* **Estimate**: activations. Per transformer layer, in bytes, for 16-bit activations (Korthikanti
  et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. (1), no tensor
  parallelism)::

      s*b*h*(34 + 5*a*s/h)

  s sequence length, b batch, h hidden size, a attention heads. The ``5*a*s/h`` term is the
  s x s attention scores, softmax and dropout; PyTorch SDPA / FlashAttention (transformers'
  default ``attn_implementation="sdpa"``) never store them, so it is dropped unless
  ``--attention eager``. With gradient checkpointing (transformers checkpoints each decoder layer)
  a layer keeps only its 16-bit input, ``2*s*b*h`` (the paper's full recomputation), and one layer's
  full activations exist again while it is recomputed in the backward pass. The output layer adds
  ``s*b*V*(2 + 4 + 4)`` bytes (V the vocabulary): the 16-bit logits, their fp32 copy for the loss
  (the paper's ``4*s*b*V``) and the fp32 log-softmax that cross-entropy keeps for its backward.
  The formula was derived for GPT (4h GeLU MLP, LayerNorm, dropout), not for Llama's gated MLP
  and GQA; it is a guide, not a measurement: leave a margin, and measure with
  :func:`memory_report` / :class:`pagedopt.integrations.callbacks.MemoryReportCallback`.
* **Constants**: ``CUDA_CONTEXT_BYTES`` for the CUDA context, kernels and cuBLAS workspace that a
  process holds outside torch's allocator; the allocator's fragmentation is not counted.

Paged optimizers (``paged_adamw_8bit``, ``paged_adamw_32bit``) keep their states in CUDA unified
memory: after ``page_out()`` (or when the driver evicts them under memory pressure) they live in
host memory during forward and backward, so they count 0 on the GPU there and their bytes appear
under host; during ``step()`` they stream back in 64 MiB chunks.

Plain loops and the Trainer: :func:`memory_report` and :func:`log_memory` here,
``pagedopt.integrations.callbacks.MemoryReportCallback`` for the Hugging Face Trainer.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Optional

BLOCK = 256  # elements per absmax block (pagedopt.quant.STATE_BLOCK_SIZE)
STEP_BYTES = 4  # the fp32 scalar ``step`` of every parameter's state (pagedopt and torch alike)
# CUDA context + loaded kernels + cuBLAS/cuDNN workspaces held outside torch's caching allocator:
# a few hundred MiB with CUDA 12 lazy module loading (torch's default); measured as
# nvidia-smi's process memory minus torch.cuda.memory_reserved(). A round, conservative figure.
CUDA_CONTEXT_BYTES = 768 << 20
# pagedopt pages states in and out in chunks of about this many bytes (optim.residency.CHUNK_BYTES).
PAGED_CHUNK_BYTES = 64 << 20

from .memory_report import log_memory, memory_report, report_gib  # noqa: F401  (re-exported)
from .memory_tables import _ALIASES, DTYPE_BYTES, EXTRA_STATE_BYTES, GIB, GPUS, OPTIMIZERS, PRESETS  # noqa: F401

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

from .memory_model import (_TIE_DEFAULT, Arch, Model, Tensor, _arch, load_config, model_from_config,  # noqa: F401
                           model_from_params, tensors_from_formula, tensors_from_module, tensors_from_transformers)


# ------------------------------------------------------------------------------------------------
# bytes
# ------------------------------------------------------------------------------------------------
def normalize_optimizer(name: str) -> str:
    n = name.lower().replace("-", "_")
    for prefix in ("pagedopt_", "pagedopt."):
        if n.startswith(prefix):
            n = n[len(prefix):]
    n = _ALIASES.get(n, n)
    if n not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return n


def state_bytes_of_tensor(numel: int, optimizer: str, param_bytes: int, min_8bit_size: int = 4096,
                          embedding: bool = False, embeddings_32bit: bool = False) -> tuple[int, bool]:
    """(state bytes, 8-bit?) of one parameter tensor of ``numel`` elements (see the module docstring)."""
    name = normalize_optimizer(optimizer)
    label, bits, _, moments = OPTIMIZERS[name]
    fixed = STEP_BYTES + EXTRA_STATE_BYTES.get(name, 0)
    if bits is None:  # torch.optim.AdamW: exp_avg, exp_avg_sq like the parameter, fp32 step
        return moments * numel * param_bytes + fixed, False
    if bits == 8 and numel >= min_8bit_size and not (embedding and embeddings_32bit):
        return moments * (numel + 4 * ((numel + BLOCK - 1) // BLOCK)) + fixed, True
    return 4 * moments * numel + fixed, False


def lora_tensors(model: Model, rank: int, mlp: bool = False) -> list[Tensor]:
    """The LoRA adapters of rank ``rank`` on the attention projections q, k, v, o (and, with
    ``mlp``, gate, up, down): per adapted nn.Linear (in -> out), A (rank x in) and B (out x rank),
    r*(in+out) parameters."""
    targets = ATTENTION_TARGETS + (MLP_TARGETS if mlp else ())
    out = []
    for t in model.tensors:
        if t.linear is None:
            continue
        module = t.name.rsplit(".", 2)[-2] if t.name.count(".") >= 1 else t.name
        if module in targets:
            fin, fout = t.linear
            base = t.name[: -len(".weight")]
            out += [Tensor(f"{base}.lora_A.weight", rank * fin), Tensor(f"{base}.lora_B.weight", fout * rank)]
    if not out:
        raise ValueError("LoRA needs the model's linear layers: give --config (a config.json or preset), not --params")
    return out


def activation_bytes(arch: Arch, batch: int, seq: int, checkpointing: bool, attention: str = "sdpa",
                     act_bytes: int = 2) -> int:
    """ESTIMATE of the activation memory of one forward/backward (see the module docstring)."""
    s, b, h, a, L, V = seq, batch, arch.hidden, arch.heads, arch.layers, arch.vocab
    scale = act_bytes / 2  # the formula counts 16-bit activations (and 1-byte dropout masks)
    # Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) = 34*s*b*h + 5*a*s^2*b per layer.
    per_layer = 34 * s * b * h + (5 * a * s * s * b if attention == "eager" else 0)
    if checkpointing:
        layers = L * 2 * s * b * h + per_layer  # kept layer inputs + the layer being recomputed
    else:
        layers = L * per_layer
    logits = s * b * V * (act_bytes + 4 + 4)
    return int(layers * scale + logits)


@dataclass
class Estimate:
    """Bytes of one training configuration. ``state_bytes`` = ``states_gpu + states_host``."""

    model: Model
    optimizer: str
    weights_dtype: str
    n_params: int
    n_trainable: int
    weights: int
    gradients: int
    state_bytes: int
    states_gpu: int
    states_host: int
    params_8bit: int
    activations: Optional[int]
    step_temporaries: int
    context: int
    settings: dict = field(default_factory=dict)

    @property
    def forward_backward(self) -> int:
        """Peak during forward/backward: weights, gradients, GPU-resident states, activations, context."""
        return self.context + self.weights + self.gradients + self.states_gpu + (self.activations or 0)

    @property
    def optimizer_step(self) -> int:
        """Peak during step(): activations freed; states (paged ones stream in chunks) and the
        step's temporaries."""
        states = self.states_gpu if not OPTIMIZERS[self.optimizer][2] else min(self.states_host, PAGED_CHUNK_BYTES * 2)
        return self.context + self.weights + self.gradients + states + self.step_temporaries

    @property
    def peak(self) -> int:
        return max(self.forward_backward, self.optimizer_step)

    def max_batch(self, capacity_bytes: int) -> int:
        """The largest batch (at this sequence length) whose peak fits in ``capacity_bytes`` (0: none)."""
        if self.activations is None or self.settings.get("batch", 0) <= 0:
            return 0
        if self.optimizer_step > capacity_bytes:
            return 0
        per_sample = self.activations / self.settings["batch"]  # every term is linear in the batch
        fixed = self.forward_backward - self.activations
        return max(0, int((capacity_bytes - fixed) // per_sample)) if per_sample > 0 else 0


def estimate(model: Model, optimizer: str = "adamw_8bit", weights: str = "bf16", lora_rank: int = 0,
             lora_mlp: bool = False, lora_dtype: str = "fp32", batch: int = 1, seq: int = 2048,
             gradient_checkpointing: bool = False, attention: str = "sdpa", min_8bit_size: int = 4096,
             embeddings_32bit: bool = False, act_dtype: Optional[str] = None,
             context_bytes: int = CUDA_CONTEXT_BYTES) -> Estimate:
    """Memory of training ``model`` (from :func:`model_from_config` or :func:`model_from_params`).

    weights: the dtype the parameters are kept in (fp32, bf16, fp16); gradients take it too.
    LoRA (``lora_rank > 0``): the base weights are frozen (no gradients, no states); the adapters
    are trainable, in ``lora_dtype`` (fp32: PEFT's default ``autocast_adapter_dtype=True``).
    act_dtype: of the activations (default: 16-bit unless the weights are fp32; pass bf16 for fp32
    weights under autocast). ``embeddings_32bit``: embeddings keep 32-bit states, as
    ``pagedopt.integrations.transformers`` does by default in the Trainer.
    """
    opt = normalize_optimizer(optimizer)
    _, bits, paged, _ = OPTIMIZERS[opt]
    wb = DTYPE_BYTES[weights]
    n_params = model.n_params
    weight_bytes = n_params * wb
    if lora_rank > 0:
        trainable = lora_tensors(model, lora_rank, lora_mlp)
        tb = DTYPE_BYTES[lora_dtype]
        weight_bytes += sum(t.numel for t in trainable) * tb
    else:
        trainable, tb = model.tensors, wb
    n_trainable = sum(t.numel for t in trainable)
    grads = n_trainable * tb
    states, params_8bit, upcast = 0, 0, 0
    for t in trainable:
        sb, eight = state_bytes_of_tensor(t.numel, opt, tb, min_8bit_size, t.embedding, embeddings_32bit)
        states += sb
        if eight:
            params_8bit += t.numel
        elif bits == 32 or bits == 8:
            upcast += t.numel  # pagedopt's 32-bit path
    # step temporaries: torch's foreach AdamW (its CUDA default) makes one state-sized list
    # (sqrt(exp_avg_sq)); pagedopt's 32-bit path upcasts 16-bit params and grads of a whole bucket to
    # fp32 (AdamBase._step_chunk: 8 bytes per param with 32-bit states; per 64 MiB chunk only when the
    # pager believes paged states are out, which it does not after a driver eviction, so counted whole).
    if bits is None:
        temps = n_trainable * tb
    else:
        temps = upcast * 8 if tb != 4 else 0
    act = None
    if model.arch is not None:
        ab = DTYPE_BYTES[act_dtype] if act_dtype else (4 if weights == "fp32" else 2)
        act = activation_bytes(model.arch, batch, seq, gradient_checkpointing, attention, ab)
    return Estimate(model=model, optimizer=opt, weights_dtype=weights, n_params=n_params, n_trainable=n_trainable,
                    weights=weight_bytes, gradients=grads, state_bytes=states,
                    states_gpu=0 if paged else states, states_host=states if paged else 0, params_8bit=params_8bit,
                    activations=act, step_temporaries=temps, context=context_bytes,
                    settings=dict(batch=batch, seq=seq, gradient_checkpointing=gradient_checkpointing,
                                  attention=attention, lora_rank=lora_rank, lora_mlp=lora_mlp,
                                  min_8bit_size=min_8bit_size, embeddings_32bit=embeddings_32bit, act_dtype=act_dtype))


def gpu_capacity(gpu) -> tuple[str, float]:
    """(label, GiB) from a number of GiB or a name of the GPUS table (case and '-'/'_' ignored)."""
    try:
        gib = float(gpu)
        return f"{gib:g} GiB GPU", gib
    except (TypeError, ValueError):
        pass
    key = str(gpu).upper().replace("_", "-").replace(" ", "")
    table = {k.upper(): (k, v) for k, v in GPUS.items()}
    table.update({k.upper().replace("-", ""): (k, v) for k, v in GPUS.items()})
    if key in table or key.replace("-", "") in table:
        name, gib = table.get(key) or table[key.replace("-", "")]
        return f"{name} ({gib:g} GiB)", float(gib)
    raise ValueError(f"unknown GPU {gpu!r}: give GiB (e.g. 24) or one of {', '.join(GPUS)}")


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------
def _g(nbytes: Optional[int]) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GIB:9.2f}"


def format_estimate(e: Estimate, gpu=None, compare: bool = True) -> str:
    s = e.settings
    mode = (f"LoRA r={s['lora_rank']} on q,k,v,o{',gate,up,down' if s['lora_mlp'] else ''}" if s["lora_rank"]
            else "full fine-tuning")
    label, bits, paged, _ = OPTIMIZERS[e.optimizer]
    lines = [f"model: {e.n_params:,} parameters ({e.model.source}); trainable: {e.n_trainable:,}",
             f"{mode}; weights {e.weights_dtype}; optimizer {e.optimizer} ({label}"
             + (f", min_8bit_size={s['min_8bit_size']}" if bits == 8 else "") + ")"
             + f"; batch {s['batch']} x seq {s['seq']}; gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
             + f"; attention {s['attention']}", ""]
    if bits == 8:
        states_note = (f"8-bit for {e.params_8bit:,} of {e.n_trainable:,} trainable params"
                       + ("" if e.model.exact else " (approximate: shapes unknown)"))
    elif bits == 32:
        states_note = "fp32 m and v: 8 bytes/param"
    else:
        states_note = "exp_avg, exp_avg_sq in the params' dtype"
    rows = [("weights", e.weights, 0, ""),
            ("gradients", e.gradients, 0, "trainable params only"),
            ("optimizer states" + (" (paged)" if paged else ""), e.states_gpu, e.states_host,
             states_note + ("; on host during fwd/bwd" if paged else "")),
            ("activations (ESTIMATE)", e.activations, 0,
             "Korthikanti et al. 2022, per layer s*b*h*(34+5as/h)" + ("" if s["attention"] == "eager" else ", no 5as/h (sdpa)")),
            ("CUDA context (constant)", e.context, 0, "outside torch's allocator"),
            ]
    width = 26
    lines.append(f"{'':{width}} {'GPU GiB':>9}  {'host GiB':>9}  note")
    for name, gpu_b, host_b, note in rows:
        lines.append(f"{name:{width}} {_g(gpu_b)}  {_g(host_b) if host_b else ' ' * 9}  {note}")
    lines.append("-" * (width + 24))
    lines.append(f"{'peak, forward/backward':{width}} {_g(e.forward_backward)}")
    lines.append(f"{'peak, optimizer step':{width}} {_g(e.optimizer_step)}  {' ' * 9}  "
                 f"incl. {e.step_temporaries / GIB:.2f} GiB step temporaries"
                 + ("; paged states stream in 64 MiB chunks" if paged else ""))
    lines.append(f"{'PEAK (estimate)':{width}} {_g(e.peak)}")
    if e.activations is None:
        lines.append("activations unknown (no architecture): the peak excludes them")
    if gpu is not None:
        name, gib = gpu_capacity(gpu)
        cap = int(gib * GIB)
        verdict = ("fits" if e.peak <= cap else "does NOT fit") + f": needs {e.peak / GIB:.1f} GiB of {gib:g} GiB"
        mb = e.max_batch(cap)
        lines += ["", f"on {name}: {verdict}"
                  + (f"; largest batch at seq {s['seq']}: {mb or 'none'}" if e.activations is not None else "")]
        if compare:
            lines.append("same run with each optimizer:")
            for opt in OPTIMIZERS:
                other = estimate(e.model, opt, e.weights_dtype, lora_rank=s["lora_rank"], lora_mlp=s["lora_mlp"],
                                 batch=s["batch"], seq=s["seq"], gradient_checkpointing=s["gradient_checkpointing"],
                                 attention=s["attention"], min_8bit_size=s["min_8bit_size"],
                                 embeddings_32bit=s["embeddings_32bit"], act_dtype=s.get("act_dtype"),
                                 context_bytes=e.context)
                lines.append(f"  {opt:18} states {other.state_bytes / GIB:8.2f} GiB  peak {other.peak / GIB:8.2f} GiB  "
                             + ("fits" if other.peak <= cap else "does not fit")
                             + (f", largest batch {other.max_batch(cap) or 'none'}" if other.activations is not None else ""))
    lines.append("Weights, gradients and optimizer states are exact for the given shapes; activations are an "
                 "estimate (measure with pagedopt.memory.memory_report).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pagedopt-mem", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (optimizer states then approximate)")
    src.add_argument("--config", help=f"config.json (or its directory) of a transformers model, or a preset: "
                                       f"{', '.join(PRESETS)}")
    p.add_argument("--no-transformers", action="store_true", help="count with the Llama formula, not a meta model")
    p.add_argument("--weights", choices=list(DTYPE_BYTES), default="bf16", help="dtype of the weights (and gradients)")
    p.add_argument("--activations", choices=list(DTYPE_BYTES), default=None, dest="act_dtype",
                   help="dtype of activations (default: that of the weights; bf16 for fp32 weights under autocast)")
    p.add_argument("--optimizer", default="paged_adamw_8bit",
                   help=f"{', '.join(OPTIMIZERS)} (Trainer names such as pagedopt_adamw_8bit work too)")
    p.add_argument("--min-8bit-size", type=int, default=4096)
    p.add_argument("--embeddings-32bit", action="store_true",
                   help="embeddings keep 32-bit states (what the pagedopt Trainer names do by default)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora-mlp", action="store_true", help="LoRA on the MLP projections too")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--gpu", help="GPU memory in GiB or a name: " + ", ".join(GPUS))
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes)")
    a = p.parse_args(argv)
    try:
        model = (model_from_params(a.params) if a.params is not None
                 else model_from_config(a.config, use_transformers=not a.no_transformers))
        e = estimate(model, a.optimizer, a.weights, lora_rank=a.lora, lora_mlp=a.lora_mlp, batch=a.batch, seq=a.seq,
                     gradient_checkpointing=a.gradient_checkpointing, attention=a.attention,
                     min_8bit_size=a.min_8bit_size, embeddings_32bit=a.embeddings_32bit, act_dtype=a.act_dtype)
        if a.gpu is not None:
            gpu_capacity(a.gpu)
    except (ValueError, FileNotFoundError, KeyError) as err:
        p.error(str(err))
    if a.json:
        out = {k: getattr(e, k) for k in ("n_params", "n_trainable", "weights", "gradients", "state_bytes", "states_gpu",
                                          "states_host", "activations", "step_temporaries", "context")}
        out.update(forward_backward=e.forward_backward, optimizer_step=e.optimizer_step, peak=e.peak,
                   source=e.model.source, optimizer=e.optimizer)
        if a.gpu is not None:
            out["max_batch"] = e.max_batch(int(gpu_capacity(a.gpu)[1] * GIB))
        print(json.dumps(out, indent=1))
    else:
        print(format_estimate(e, a.gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
