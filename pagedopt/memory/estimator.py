"""The estimator of pagedopt.memory: the bytes of one training configuration (weights,
gradients, optimizer states, activations), :class:`Estimate` and :func:`estimate`, and the
GPU capacities a run is checked against (:func:`gpu_capacity`).

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
  - pagedopt 4-bit, likewise: ``k*ceil(numel/2)`` (two codes a byte) ``+ 4k*ceil(numel/128)`` ``+ 4``;
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
  :func:`pagedopt.memory.memory_report` / :class:`pagedopt.integrations.callbacks.MemoryReportCallback`.
* **Constants**: ``CUDA_CONTEXT_BYTES`` for the CUDA context, kernels and cuBLAS workspace that a
  process holds outside torch's allocator; the allocator's fragmentation is not counted.

Paged optimizers (``paged_adamw_8bit``, ``paged_adamw_32bit``) keep their states in CUDA unified
memory: after ``page_out()`` (or when the driver evicts them under memory pressure) they live in
host memory during forward and backward, so they count 0 on the GPU there and their bytes appear
under host; during ``step()`` they stream back in 64 MiB chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .model import Arch, Model, Tensor
from .tables import ALIASES, DTYPE_BYTES, EXTRA_STATE_BYTES, GPUS, OPTIMIZERS

BLOCK = 256  # elements per absmax block (pagedopt.quant.STATE_BLOCK_SIZE)
BLOCK4 = 128  # elements per absmax block of 4-bit states (pagedopt.optim.state_format.CODES4)
STEP_BYTES = 4  # the fp32 scalar ``step`` of every parameter's state (pagedopt and torch alike)
# CUDA context + loaded kernels + cuBLAS/cuDNN workspaces held outside torch's caching allocator:
# a few hundred MiB with CUDA 12 lazy module loading (torch's default); measured as
# nvidia-smi's process memory minus torch.cuda.memory_reserved(). A round, conservative figure.
CUDA_CONTEXT_BYTES = 768 << 20
# pagedopt pages states in and out in chunks of about this many bytes (optim.residency.CHUNK_BYTES).
PAGED_CHUNK_BYTES = 64 << 20

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------------------
# bytes
# ------------------------------------------------------------------------------------------------
def normalize_optimizer(name: str) -> str:
    n = name.lower().replace("-", "_")
    for prefix in ("pagedopt_", "pagedopt."):
        if n.startswith(prefix):
            n = n[len(prefix):]
    n = ALIASES.get(n, n)
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
    if bits == 4 and numel >= min_8bit_size and not (embedding and embeddings_32bit):
        return moments * ((numel + 1) // 2 + 4 * ((numel + BLOCK4 - 1) // BLOCK4)) + fixed, True
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


def weight_cast_bytes(model: Model, checkpointing: bool, act_bytes: int = 2) -> int:
    """ESTIMATE of the 16-bit copies of fp32 weights alive at once under autocast: a matmul saves
    its input cast (the weight's 16-bit copy) for backward, so without checkpointing every linear
    weight's copy lives until its backward; with checkpointing (each decoder layer recomputed in
    backward) one layer's copies, plus those of the linears outside the layers (lm_head). With
    ``torch.autocast(cache_enabled=True)`` (torch's default) the forward also caches a copy of every
    weight until the autocast region ends, whatever the checkpointing: pass ``cache_enabled=False``
    with gradient checkpointing, where gradients are released, or count 2 bytes per weight more.
    0 for a model whose tensors are unknown (``--params``)."""
    import re

    if not model.exact:
        return 0
    per_layer: dict = {}
    outside = 0
    for t in model.tensors:
        if t.linear is None:
            continue
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", t.name)
        if m is None:
            outside += t.numel
        else:
            per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + t.numel
    inside = max(per_layer.values(), default=0) if checkpointing else sum(per_layer.values())
    return (inside + outside) * act_bytes


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
    largest_trainable: int = 0  # numel of the largest trainable tensor (released gradients keep it whole)
    trainable_tensors: int = 0  # how many (each has a 4-byte step counter, which host residency keeps apart)
    weight_casts: int = 0  # 16-bit copies of fp32 weights saved for backward under autocast (weight_cast_bytes)

    @property
    def forward_backward(self) -> int:
        """Peak during forward/backward: weights, gradients, GPU-resident states, activations (and the
        16-bit copies of fp32 weights that autocast saves for backward), context."""
        return (self.context + self.weights + self.gradients + self.states_gpu + (self.activations or 0)
                + self.weight_casts)

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
        elif bits is not None:
            upcast += t.numel  # pagedopt's 32-bit path
    # step temporaries: torch's foreach AdamW (its CUDA default) makes one state-sized list
    # (sqrt(exp_avg_sq)), its fused kernel (fused=True) none; pagedopt's 32-bit path upcasts 16-bit params and grads of a whole bucket to
    # fp32 (AdamBase._step_chunk: 8 bytes per param with 32-bit states; per 64 MiB chunk only when the
    # pager believes paged states are out, which it does not after a driver eviction, so counted whole).
    if bits is None:
        temps = 0 if opt == "adamw_torch_fused" else n_trainable * tb
    else:
        temps = upcast * 8 if tb != 4 else 0
    act = None
    ab = DTYPE_BYTES[act_dtype] if act_dtype else (4 if weights == "fp32" else 2)
    if model.arch is not None:
        act = activation_bytes(model.arch, batch, seq, gradient_checkpointing, attention, ab)
    casts = weight_cast_bytes(model, gradient_checkpointing, ab) if wb == 4 and ab < 4 else 0
    return Estimate(model=model, optimizer=opt, weights_dtype=weights, n_params=n_params, n_trainable=n_trainable,
                    weights=weight_bytes, gradients=grads, state_bytes=states,
                    states_gpu=0 if paged else states, states_host=states if paged else 0, params_8bit=params_8bit,
                    activations=act, step_temporaries=temps, context=context_bytes,
                    settings=dict(batch=batch, seq=seq, gradient_checkpointing=gradient_checkpointing,
                                  attention=attention, lora_rank=lora_rank, lora_mlp=lora_mlp,
                                  min_8bit_size=min_8bit_size, embeddings_32bit=embeddings_32bit, act_dtype=act_dtype),
                    largest_trainable=max((t.numel for t in trainable), default=0), trainable_tensors=len(trainable),
                    weight_casts=casts)


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
