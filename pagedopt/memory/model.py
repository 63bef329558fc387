"""The parameter tensors of a model for the estimator (pagedopt.memory): :class:`Tensor`,
:class:`Arch`, :class:`Model`, and the ways to get them: from a config.json or a preset (by formula,
or by building the model with transformers on the meta device), from a module, or from a parameter
count alone."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from .tables import PRESETS

# Defaults of tie_word_embeddings per model type where a config.json leaves it out.
_TIE_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True, "gemma": True}


@dataclass
class Tensor:
    """One parameter tensor: its name, numel, whether it belongs to an nn.Embedding, and for an
    nn.Linear its (in_features, out_features) (what a LoRA adapter on it adds)."""

    name: str
    numel: int
    embedding: bool = False
    linear: Optional[tuple[int, int]] = None


@dataclass
class Arch:
    """What the activation estimate needs."""

    hidden: int
    layers: int
    heads: int
    vocab: int


@dataclass
class Model:
    tensors: list[Tensor]
    arch: Optional[Arch]
    source: str   # how the tensors were obtained
    exact: bool   # per-tensor shapes known

    @property
    def n_params(self) -> int:
        return sum(t.numel for t in self.tensors)


def load_config(config) -> dict:
    """A config dict from a path (config.json or a directory holding one), a preset name, a dict or
    a transformers PretrainedConfig. A multimodal config's ``text_config`` is used if it has one."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if path.lower() in PRESETS:
            config = dict(PRESETS[path.lower()])
        else:
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{config!r} is neither a config.json, a directory with one, nor a preset "
                                        f"({', '.join(PRESETS)})")
            with open(path) as f:
                config = json.load(f)
    config = dict(config)
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = dict(config["text_config"])
    return config


def _arch(cfg: dict) -> Arch:
    return Arch(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                heads=int(cfg["num_attention_heads"]), vocab=int(cfg["vocab_size"]))


def tensors_from_formula(config) -> Model:
    """The parameter tensors of a Llama-like decoder (llama, mistral, qwen2, qwen3 and the like)
    from its config, without transformers: embeddings V*h; per layer q (h -> a*d), k and v
    (h -> kv*d, kv = num_key_value_heads), o (a*d -> h), gate/up (h -> I), down (I -> h), two
    RMSNorms (h); a final norm (h); lm_head (h -> V) unless tie_word_embeddings. d = head_dim or
    h/a. Biases: attention_bias (q, k, v, o) and mlp_bias as in Llama; Qwen2 has q/k/v biases;
    Qwen3 adds RMSNorms of q and k (d each)."""
    cfg = load_config(config)
    mt = cfg.get("model_type", "llama")
    h, L, a, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
    kv = int(cfg.get("num_key_value_heads") or a)
    d = int(cfg.get("head_dim") or h // a)
    inter = int(cfg["intermediate_size"])
    attn_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attn_bias or mt == "qwen2"
    o_bias = attn_bias and mt != "qwen2"
    mlp_bias = bool(cfg.get("mlp_bias", False))
    tie = bool(cfg.get("tie_word_embeddings", _TIE_DEFAULT.get(mt, False)))

    out = [Tensor("model.embed_tokens.weight", V * h, embedding=True)]

    def linear(name, fin, fout, bias):
        out.append(Tensor(f"{name}.weight", fin * fout, linear=(fin, fout)))
        if bias:
            out.append(Tensor(f"{name}.bias", fout))

    for i in range(L):
        p = f"model.layers.{i}"
        linear(f"{p}.self_attn.q_proj", h, a * d, qkv_bias)
        linear(f"{p}.self_attn.k_proj", h, kv * d, qkv_bias)
        linear(f"{p}.self_attn.v_proj", h, kv * d, qkv_bias)
        linear(f"{p}.self_attn.o_proj", a * d, h, o_bias)
        if mt == "qwen3":
            out += [Tensor(f"{p}.self_attn.q_norm.weight", d), Tensor(f"{p}.self_attn.k_norm.weight", d)]
        linear(f"{p}.mlp.gate_proj", h, inter, mlp_bias)
        linear(f"{p}.mlp.up_proj", h, inter, mlp_bias)
        linear(f"{p}.mlp.down_proj", inter, h, mlp_bias)
        out += [Tensor(f"{p}.input_layernorm.weight", h), Tensor(f"{p}.post_attention_layernorm.weight", h)]
    out.append(Tensor("model.norm.weight", h))
    if not tie:
        out.append(Tensor("lm_head.weight", V * h, linear=(h, V)))
    return Model(out, _arch(cfg), f"formula ({mt})", exact=True)


def tensors_from_module(model) -> list[Tensor]:
    """The parameter tensors of an nn.Module (shared ones once, as model.parameters() gives them)."""
    import torch

    kind: dict[int, tuple[bool, Optional[tuple[int, int]]]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, torch.nn.Embedding):
                kind[id(p)] = (True, None)
            elif isinstance(module, torch.nn.Linear) and p is module.weight:
                kind.setdefault(id(p), (False, (module.in_features, module.out_features)))
    return [Tensor(n, p.numel(), *kind.get(id(p), (False, None))) for n, p in model.named_parameters()]


def tensors_from_transformers(config) -> Model:
    """Build the model of ``config`` on the meta device with transformers (no memory, no download)
    and take its tensors. Raises ImportError without transformers."""
    import torch
    import transformers

    cfg = load_config(config)
    d = {k: v for k, v in cfg.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(cfg.get("model_type", "llama"), **d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    arch = None
    try:
        arch = Arch(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=text.num_attention_heads,
                    vocab=text.vocab_size)
    except AttributeError:
        pass
    return Model(tensors_from_module(model), arch, f"transformers {transformers.__version__} meta-device model "
                 f"({type(model).__name__})", exact=True)


def model_from_config(config, use_transformers: bool = True) -> Model:
    """The tensors of ``config``: from a transformers meta-device model when transformers is
    installed (and knows the model), else from the Llama formula."""
    if use_transformers:
        try:
            return tensors_from_transformers(config)
        except ImportError:
            pass
        except Exception as e:  # an unknown model_type, remote code, ...: the formula may still know it
            try:
                m = tensors_from_formula(config)
            except Exception:
                raise e from None
            m.source += f"; transformers could not build it ({type(e).__name__}: {e})"
            return m
    return tensors_from_formula(config)


def model_from_params(n_params: float) -> Model:
    """A model known only by its parameter count: one large tensor (every state taken as 8-bit),
    with the activation shape of the nearest preset."""
    n = int(round(float(n_params)))
    best = min(PRESETS, key=lambda k: abs(math.log(tensors_from_formula(PRESETS[k]).n_params / max(n, 1))))
    m = Model([Tensor("all parameters", n, linear=None)], _arch(PRESETS[best]),
              f"--params (shapes unknown; activations as for {best})", exact=False)
    m.preset = best  # type: ignore[attr-defined]
    return m


