"""The checks of an optimizer's hyperparameters, shared by the constructor, add_param_group,
load_state_dict and GlobalOptimManager overrides."""
import math

import torch

# bf16_sr_seed: an int in [0, SR_SEED_LIMIT) (the ops take it as a signed 64-bit int)
SR_SEED_LIMIT = 1 << 63


def check_hyperparameters(h: dict, where: str, n_betas: int = 2, has_eps: bool = True, extra=None) -> None:
    """Raise a ValueError naming ``where`` (``argument`` or ``param_groups[i]``) and the key.
    ``n_betas``: how many betas the algorithm takes (0: none), ``has_eps``: whether it takes eps;
    ``extra(h, name)``: its own checks."""
    def name(key):
        return f"{where}[{key!r}]" if where.startswith("param_groups") else f"{where} {key!r}"

    def number(key):
        v = h.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"Invalid {name(key)}: {v!r} (must be a float)")
        return float(v)

    for key in (("lr",) + (("betas",) if n_betas else ()) + (("eps",) if has_eps else ())
                + ("weight_decay", "optim_bits", "min_8bit_size", "bf16_stochastic_round", "bf16_sr_seed")):
        if key not in h:
            raise ValueError(f"Invalid {name(key)}: missing")
    lr = h["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Invalid {name('lr')}: a {lr.dtype} tensor of shape {tuple(lr.shape)} (must be a float "
                             "or a one-element float32 / float64 tensor)")
    elif not math.isfinite(number("lr")) or lr < 0:
        raise ValueError(f"Invalid {name('lr')}: {lr!r} (must be a finite float >= 0)")
    betas = h["betas"] if n_betas else ()
    if n_betas and not (isinstance(betas, (tuple, list)) and len(betas) == n_betas):
        what = {2: "a pair of floats", 3: "three floats"}.get(n_betas, f"{n_betas} floats")
        raise ValueError(f"Invalid {name('betas')}: {betas!r} (must be {what})")
    for i, b in enumerate(betas):
        if isinstance(b, (bool, torch.Tensor)) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid {name('betas')}: betas[{i}] = {b!r} (must be a float in [0, 1))")
    for key in ("eps", "weight_decay") if has_eps else ("weight_decay",):
        v = number(key)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"Invalid {name(key)}: {v!r} (must be a finite float >= 0)")
    if isinstance(h["optim_bits"], bool) or h["optim_bits"] not in (4, 8, 32):
        raise ValueError(f"Invalid {name('optim_bits')}: {h['optim_bits']!r} (must be 4, 8 or 32)")
    m = h["min_8bit_size"]
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ValueError(f"Invalid {name('min_8bit_size')}: {m!r} (must be an int >= 0)")
    if not isinstance(h["bf16_stochastic_round"], bool):
        raise ValueError(f"Invalid {name('bf16_stochastic_round')}: {h['bf16_stochastic_round']!r} (must be True or "
                         "False)")
    seed = h["bf16_sr_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SR_SEED_LIMIT:
        raise ValueError(f"Invalid {name('bf16_sr_seed')}: {seed!r} (must be an int in [0, 2**63))")
    if extra is not None:
        extra(h, name)
