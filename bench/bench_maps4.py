"""Which 4-bit map and block size for Adam's states: the relative error of the first moment m, the
second moment v and of Adam's update, for a few candidate signed maps (first moment) and block
sizes, on realistic Adam moments. CPU, pure torch (pagedopt.quant's reference quantizer), no GPU.

Two sources of moments:
  * walk: an (R x C) "weight matrix" whose gradients are heavy-tailed (row scale x column scale,
    both log-normal with sigma 1, and a per-coordinate random-walk drift plus noise), T Adam steps;
  * mlp:  a small MLP (64 -> 256 -> 256 -> 10) fitted to a random teacher with torch.optim.Adam
    for T steps; its exp_avg / exp_avg_sq of every weight.
Two measurements:
  * one-shot: the fp32 moments after T steps quantized once (m with the candidate map, v with the
    unsigned no-zero linear map, the unsigned dynamic map, which has a zero, "v_map=de0", or that
    map with its zero code replaced by half its smallest positive one, "v_map=de0_floor"):
    ||deq(q(x)) - x|| / ||x|| for m and v, and for the update u = m_hat / (sqrt(v_hat) + eps)
    with m alone quantized (u_m_err) and with both (u_err);
  * normalized (both sources): the trajectory with m stored as itself or as r = m / (sqrt(v) + eps),
    whose elements all lie in about [-1, 1] whatever their gradients' scale (stored_trajectory);
  * trajectory (walk only): Adam run T steps with its states stored in 4 bits after every step
    (dequantize, update, requantize; v kept in fp32 for "v_map=fp32"), the mean over steps of
    ||u_4bit - u_fp32|| / ||u_fp32||.

    python bench/bench_maps4.py [--steps 200] [--rows 256] [--cols 256] [--out DIR]
    python bench/bench_maps4.py --smoke --out /tmp/bm4      # tiny
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))

import torch  # noqa: E402

from pagedopt.quant import (dequantize_blockwise_reference, dynamic_codebook_4bit,  # noqa: E402
                            linear_codebook_4bit_no_zero, normal_codebook_4bit, quantize_blockwise_reference)

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
BLOCKS = (64, 128, 256)


def signed_maps() -> dict[str, torch.Tensor]:
    """Candidate 16-entry signed maps, each sorted, holding 0, -1 and 1."""
    maps = {"de": dynamic_codebook_4bit(True)}
    pos = [2.0**-k for k in range(8)]  # 1 .. 2^-7
    maps["pow2"] = torch.tensor(sorted([0.0] + pos + [-x for x in pos[:7]]))
    for r in (0.6, 0.7):  # geometric maps between pow2 (r = 1/2) and linear: magnitudes r^k
        mags = [r**k for k in range(8)]
        maps[f"geo{r}"] = torch.tensor(sorted([0.0] + mags + [-x for x in mags[:7]]))
    maps["normal"] = normal_codebook_4bit()  # normal quantiles (NF4's shape): 8 positive, 7 negative, and 0
    maps["linear"] = torch.tensor(sorted([k / 7 for k in range(-7, 8)] + [1 / 14]))
    for name, code in maps.items():
        code = code.float()
        assert code.numel() == 16 and (code[1:] > code[:-1]).all(), name
        assert {0.0, -1.0, 1.0} <= set(code.tolist()), name
        maps[name] = code
    return maps


def v_maps() -> dict[str, torch.Tensor]:
    """The second moment's candidates: the no-zero linear map (the default), the unsigned dynamic
    map (with a zero: it blows the update up) and that map with its zero replaced by half its
    smallest positive code ("de0_floor", what the 8-bit map of v does)."""
    floor = dynamic_codebook_4bit(False)
    floor[0] = floor[1] / 2
    return {"linear_no_zero": linear_codebook_4bit_no_zero(), "de0": dynamic_codebook_4bit(False),
            "de0_floor": floor}


def roundtrip(x: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    q, a = quantize_blockwise_reference(x.reshape(-1), code, block)
    return dequantize_blockwise_reference(q, a, code, block).reshape(x.shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def update(m, v, t):
    return (m / (1 - BETA1**t)) / ((v / (1 - BETA2**t)).sqrt() + EPS)


# ------------------------------------------------------------------------- sources of moments
def walk_gradients(rows, cols, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(rows, 1, generator=gen)) * torch.exp(torch.randn(1, cols, generator=gen))
    drift = torch.zeros(rows, cols)
    for _ in range(steps):
        drift += 0.1 * torch.randn(rows, cols, generator=gen)
        yield (scale * (drift + torch.randn(rows, cols, generator=gen))).reshape(-1)


def walk_moments(rows, cols, steps):
    m = torch.zeros(rows * cols)
    v = torch.zeros(rows * cols)
    for g in walk_gradients(rows, cols, steps):
        m = BETA1 * m + (1 - BETA1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
    return m, v


def mlp_training(steps, seed=0):
    """A small MLP (64 -> 256 -> 256 -> 10) fitted to a random teacher with torch.optim.Adam: yields
    (model, opt) after each backward, before its step."""
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(BETA1, BETA2), eps=EPS)
    for _ in range(steps):
        x = torch.randn(128, 64)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        yield model, opt
        opt.step()


def mlp_moments(steps, seed=0):
    """The exp_avg / exp_avg_sq of every weight of mlp_training's MLP after ``steps`` steps."""
    for model, opt in mlp_training(steps, seed):  # (exhausted: the last step taken too)
        pass
    ms = [opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters() if p.dim() == 2]
    vs = [opt.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters() if p.dim() == 2]
    return torch.cat(ms), torch.cat(vs)


def mlp_gradients(steps, seed=0):
    """The gradients of mlp_training's middle weight (256 x 256), one flat tensor a step."""
    for model, _ in mlp_training(steps, seed):
        yield model[2].weight.grad.reshape(-1).clone()


# ------------------------------------------------------------------------------ measurements
def one_shot(m, v, t, maps, vmaps, blocks):
    rows = []
    u = update(m, v, t)
    for vname, vcode in vmaps.items():
        for block in blocks:
            vq = roundtrip(v, vcode, block)
            for name, code in maps.items():
                mq = roundtrip(m, code, block)
                rows.append(dict(m_map=name, v_map=vname, block=block, m_err=rel(mq, m), v_err=rel(vq, v),
                                 u_m_err=rel(update(mq, v, t), u), u_err=rel(update(mq, vq, t), u)))
    return rows


def trajectory(rows_, cols, steps, code_m, code_v, block):
    """Mean over steps of the relative error of Adam's update with 4-bit states against fp32 (v kept
    in fp32 when code_v is None)."""
    n = rows_ * cols
    m32, v32, m4, v4 = (torch.zeros(n) for _ in range(4))
    errs = []
    for t, g in enumerate(walk_gradients(rows_, cols, steps), start=1):
        m32 = BETA1 * m32 + (1 - BETA1) * g
        v32 = BETA2 * v32 + (1 - BETA2) * g * g
        m4 = BETA1 * m4 + (1 - BETA1) * g
        v4 = BETA2 * v4 + (1 - BETA2) * g * g
        errs.append(rel(update(m4, v4, t), update(m32, v32, t)))
        m4 = roundtrip(m4, code_m, block)
        v4 = roundtrip(v4, code_v, block) if code_v is not None else v4
    return sum(errs) / len(errs)


def stored_trajectory(grads, store: str, code_m, code_v, block: int, skip: int = 10) -> float:
    """Mean over steps (after ``skip``) of the update's relative error against fp32 Adam when the
    first moment is stored as m itself (``store="m"``) or as r = m / (sqrt(v) + eps) (``"r"``:
    every element's stored value is its own update's size, in [-1, 1] roughly, so a block's
    absmax no longer leaves its small elements a few codes; m = r * (sqrt(v) + eps) with the v
    read back). v is stored with ``code_v``; None for either code: kept in fp32."""
    m32 = v32 = mq = vq = None
    errs = []
    for t, g in enumerate(grads, start=1):
        if m32 is None:
            m32, v32, mq, vq = (torch.zeros_like(g) for _ in range(4))
        m32 = BETA1 * m32 + (1 - BETA1) * g
        v32 = BETA2 * v32 + (1 - BETA2) * g * g
        m = BETA1 * mq + (1 - BETA1) * g   # mq: m read back (from r and the v read back, for "r")
        v = BETA2 * vq + (1 - BETA2) * g * g
        if t > skip:
            errs.append(rel(update(m, v, t), update(m32, v32, t)))
        vq = roundtrip(v, code_v, block) if code_v is not None else v
        if store == "m":
            mq = roundtrip(m, code_m, block) if code_m is not None else m
        else:
            scale = vq.sqrt() + EPS
            r = m / scale
            mq = (roundtrip(r, code_m, block) if code_m is not None else r) * scale
    return sum(errs) / len(errs)


def normalized_rows(steps: int, rows_: int, cols: int, maps: dict) -> list[dict]:
    """m stored as itself against r = m / (sqrt(v) + eps), with the maps de, linear and normal
    (signed_maps), v with the no-zero linear map, block 128, on both sources (walk and the MLP's
    middle weight)."""
    out = []
    codes = {"de": maps["de"], "linear": maps["linear"], "normal": maps["normal"]}
    sources = {"walk": lambda: walk_gradients(rows_, cols, steps), "mlp": lambda: mlp_gradients(steps)}
    for src, grads in sources.items():
        for store in ("m", "r"):
            for name, code in codes.items():
                out.append(dict(source=src, stored=store, m_map=name, block=128,
                                u_err=stored_trajectory(grads(), store, code, linear_codebook_4bit_no_zero(), 128,
                                                        skip=min(10, steps // 2))))
    return out


def table(rows, keys, title):
    lines = [f"{title}", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.4f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.rows, args.cols = 4, 16, 32
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    maps, vmaps = signed_maps(), v_maps()
    results = {"config": dict(steps=args.steps, rows=args.rows, cols=args.cols, beta1=BETA1, beta2=BETA2, eps=EPS),
               "maps": {k: v.tolist() for k, v in {**maps, **vmaps}.items()}}
    m, v = walk_moments(args.rows, args.cols, args.steps)
    results["walk_one_shot"] = one_shot(m, v, args.steps, maps, vmaps, BLOCKS)
    m, v = mlp_moments(args.steps)
    results["mlp_one_shot"] = one_shot(m, v, args.steps, maps, vmaps, BLOCKS)
    traj = []
    for vname in ("fp32", "linear_no_zero", "de0_floor"):
        for block in BLOCKS:
            for name, code in maps.items():
                code_v = vmaps.get(vname)
                traj.append(dict(m_map=name, v_map=vname, block=block,
                                 u_err=trajectory(args.rows, args.cols, args.steps, code, code_v, block)))
    results["walk_trajectory"] = traj
    results["normalized_trajectory"] = normalized_rows(args.steps, args.rows, args.cols, maps)
    keys = ["m_map", "v_map", "block", "m_err", "v_err", "u_m_err", "u_err"]
    text = "\n\n".join([table(results["walk_one_shot"], keys, "walk, one-shot"),
                        table(results["mlp_one_shot"], keys, "mlp, one-shot"),
                        table(traj, ["m_map", "v_map", "block", "u_err"], "walk, trajectory (mean update error)"),
                        table(results["normalized_trajectory"], ["source", "stored", "m_map", "block", "u_err"],
                              "m stored as m or as r = m / (sqrt(v) + eps), trajectory (mean update error)")])
    print(text)
    for section in ("walk_one_shot", "mlp_one_shot", "walk_trajectory", "normalized_trajectory"):
        for r in results[section]:
            assert all(math.isfinite(r[k]) for k in r if k.endswith("_err")), r
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "maps4.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "maps4.txt"), "w") as f:
            f.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
