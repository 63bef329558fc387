"""Bar charts of the bench JSON files (matplotlib, Agg backend).

    python bench/plot.py bench_step.json [out.png]
    python bench/plot.py bench_quant.json [out.png]
"""
from __future__ import annotations

import json
import os
import sys

COLORS = {"pagedopt": "#1f77b4", "torch": "#7f7f7f", "bnb": "#d62728", "torchao": "#2ca02c"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(doc: dict, what: str) -> str:
    env = doc.get("env", {})
    return f"{what}: {env.get('device_name', '?')}, torch {env.get('torch', '?')}, {env.get('date', '')[:10]}"


def plot_step(doc: dict, path: str) -> None:
    plt = _plt()
    cases = [c for c in doc.get("cases", []) if c.get("median_ms")]
    groups = []  # one panel per (set, dtype)
    for c in cases:
        key = (c["set"], c["dtype"])
        if key not in groups:
            groups.append(key)
    if not groups:
        groups = [("none", "")]
    copy = (doc.get("bandwidth", {}).get("copy") or {}).get("gbps")
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 1.0 + 0.45 * max(4, len(cases) / max(1, len(groups)))
                                                       * len(groups)), squeeze=False)
    for row, (set_name, dtype) in enumerate(groups):
        sub = [c for c in cases if (c["set"], c["dtype"]) == (set_name, dtype)]
        labels = [c["name"] + (" (after page-out)" if c.get("mode") == "after_pageout" else "") for c in sub]
        colors = [COLORS.get(c.get("family"), "#999999") for c in sub]
        ys = range(len(sub))
        ax = axes[row][0]
        ax.barh(ys, [c["median_ms"] for c in sub], color=colors)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms / step (median, log)")
        n = sub[0].get("n_params") if sub else 0
        ax.set_title(f"{set_name} {dtype} ({(n or 0) / 1e6:.4g}M params)", fontsize=9)
        for y, c in zip(ys, sub):
            ax.text(c["median_ms"], y, f" {c['median_ms']:.3g}", va="center", fontsize=7)
        ax = axes[row][1]
        vals = [c.get("gbps") or 0 for c in sub]
        ax.barh(ys, vals, color=colors)
        ax.set_yticks(list(ys), [""] * len(sub))
        ax.invert_yaxis()
        ax.set_xlabel("effective GB/s at floor bytes")
        if copy:
            ax.axvline(copy, color="k", ls="--", lw=1)
            ax.text(copy, -0.6, f" copy {copy:.0f}", fontsize=7)
        for y, v in zip(ys, vals):
            if v:
                ax.text(v, y, f" {v:.0f}", va="center", fontsize=7)
    fig.suptitle(_title(doc, "optimizer step"), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quant(doc: dict, path: str) -> None:
    plt = _plt()
    cases = [c for c in doc.get("cases", []) if c.get("gbps")]
    copy = (doc.get("bandwidth", {}).get("copy") or {}).get("gbps")
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.35 * max(4, len(cases))))
    labels = [f"{c['name']} {c['dtype']}" for c in cases]
    colors = [COLORS.get(c.get("family"), "#999999") for c in cases]
    ys = range(len(cases))
    ax.barh(ys, [c["gbps"] for c in cases], color=colors)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (floor bytes / median time)")
    if copy:
        ax.axvline(copy, color="k", ls="--", lw=1)
    for y, c in zip(ys, cases):
        ax.text(c["gbps"], y, f" {c['gbps']:.0f}", va="center", fontsize=7)
    ax.set_title(_title(doc, "blockwise quantization"), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv) -> int:
    if not argv:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    out = argv[1] if len(argv) > 1 else os.path.splitext(argv[0])[0] + ".png"
    (plot_quant if doc.get("bench") == "quant" else plot_step)(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
