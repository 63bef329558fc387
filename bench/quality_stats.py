"""Statistics, goals, table and plot of bench/quality.py (plain Python: no scipy needed).

The paired difference of a row on a seed is d = (L_row - L_fp32) / L_fp32, L the held-out loss of
the two runs of that seed (same init, same batches). Over n seeds: mean, sample standard deviation,
standard error sd / sqrt(n) and the 95% t-interval mean +- t(0.975, n-1) * se. The interval is
"resolved" when its half-width is at most the target (0.05% by default).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

# t(0.975, df), df = 1..30 (Student's t quantiles, to 4 decimals), then 40, 60, 120 and the normal
T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
        2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
        2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423]
T975_TAIL = [(40, 2.0211), (60, 2.0003), (120, 1.9799), (math.inf, 1.9600)]


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom (beyond 30: linear in 1/df between
    the tabulated points, within 1e-3 of the exact value)."""
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    if df <= 30:
        return T975[df - 1]
    lo_df, lo_t = 30, T975[-1]
    for hi_df, hi_t in T975_TAIL:
        if df <= hi_df:
            w = (1 / lo_df - 1 / df) / (1 / lo_df - 1 / hi_df)
            return lo_t + w * (hi_t - lo_t)
        lo_df, lo_t = hi_df, hi_t
    return 1.96


def paired_interval(ds: Sequence[float], target: float = 5e-4) -> dict:
    """mean, sd, se and the 95% t-interval of the paired differences ``ds`` (fractions, not %)."""
    xs = [float(d) for d in ds if d is not None and math.isfinite(d)]
    n = len(xs)
    out = {"n": n, "mean": None, "sd": None, "se": None, "half_width": None, "lo": None, "hi": None,
           "resolved": False, "target": target}
    if n == 0:
        return out
    mean = sum(xs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    se = sd / math.sqrt(n)
    hw = t975(n - 1) * se
    out.update(sd=sd, se=se, half_width=hw, lo=mean - hw, hi=mean + hw, resolved=hw <= target)
    return out


def seeds_needed(sd: float, target: float = 5e-4) -> Optional[int]:
    """The fewest seeds whose 95% t-interval half-width t(n-1) * sd / sqrt(n) is at most target."""
    if sd is None or not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    for n in range(2, 100_000):
        if t975(n - 1) * sd / math.sqrt(n) <= target:
            return n
    return None


def paired_diffs(ref_runs: dict, row_runs: dict, key: str = "tail_mean") -> dict:
    """{seed: d} over the seeds both rows ran: d = (row - ref) / ref of the runs' ``key`` loss."""
    out = {}
    for seed, r in row_runs.items():
        f = ref_runs.get(seed)
        if f is None or r.get(key) is None or f.get(key) is None:
            continue
        out[seed] = (r[key] - f[key]) / f[key]
    return out


def row_summary(ref_runs: dict, row_runs: dict, target: float) -> dict:
    """The paired statistics of a row: on the tail mean of the evals (the headline) and on the final
    eval alone."""
    tail = paired_diffs(ref_runs, row_runs, "tail_mean")
    final = paired_diffs(ref_runs, row_runs, "final")
    return {"d_tail": tail, "d_final": final, "tail": paired_interval(list(tail.values()), target),
            "final": paired_interval(list(final.values()), target)}


def between(a: dict, b: dict, target: float) -> dict:
    """The paired interval of d_a - d_b over the seeds both rows ran (rows ranked against each other)."""
    seeds = sorted(set(a) & set(b))
    return paired_interval([a[s] - b[s] for s in seeds], target)


def rankings(summaries: dict, target: float) -> list[dict]:
    """Every other row against pagedopt's row of its width (8-bit against pagedopt_8bit, 4-bit
    against pagedopt_4bit), and pagedopt_4bit against pagedopt_8bit: the paired interval of
    d_a - d_b, a = the pagedopt row. Rows of one width share most of their per-seed d (the same
    trajectories drift alike from fp32's), so this pairing resolves what the intervals against fp32
    cannot (bench/RESULTS.md, fifteenth session: 8-bit rows +-0.16% against fp32, +-0.009% against
    each other)."""
    out = []
    for name, s in summaries.items():
        if name.startswith("fp32"):
            continue
        bits = 4 if "4bit" in name else 8 if "8bit" in name else None
        base = f"pagedopt_{bits}bit" if bits else None
        pairs = [(base, name)] if base and base != name and base in summaries else []
        if name == "pagedopt_4bit" and "pagedopt_8bit" in summaries:
            pairs.append((name, "pagedopt_8bit"))
        for a, b in pairs:
            cmp = between(summaries[a]["d_tail"], summaries[b]["d_tail"], target)
            if cmp["mean"] is not None and cmp["lo"] is not None:
                out.append({"a": a, "b": b, **cmp})
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def fid_headline(fid: Optional[dict], metric: str = "update") -> Optional[float]:
    """The median over steps of a row's relative error of ``metric``, over the quantized layer types
    weighted by their element counts (small tensors, 32-bit everywhere, left out)."""
    if not fid or "by_type" not in fid:
        return None
    num = den = 0.0
    for kind, m in fid["by_type"].items():
        if kind == "small":
            continue
        med = m.get(metric, {}).get("median")
        if med is None:
            return None
        num += med * m["numel"]
        den += m["numel"]
    return num / den if den else None


def goals(summaries: dict, fids: dict) -> list[tuple[str, Optional[bool], str]]:
    """Issue 30's goals: (goal, met (None: not measurable here), the figures)."""
    out = []
    p8, b8 = summaries.get("pagedopt_8bit"), summaries.get("bnb_8bit")
    p4, t4 = summaries.get("pagedopt_4bit"), summaries.get("torchao_4bit")

    def upper(s):
        return None if not s or s["tail"]["mean"] is None else s["tail"]["mean"]

    if p8 and b8:
        cmp = between(p8["d_tail"], b8["d_tail"], 1.0)
        ok = None if cmp["mean"] is None else cmp["mean"] <= 0
        out.append(("pagedopt 8-bit d <= bitsandbytes 8-bit d", ok,
                    f"difference {_pct(cmp['mean'])} [{_pct(cmp['lo'])}, {_pct(cmp['hi'])}]"))
    else:
        out.append(("pagedopt 8-bit d <= bitsandbytes 8-bit d", None, "a row did not run"))
    out.append(("pagedopt 8-bit d <= +0.10%", None if upper(p8) is None else upper(p8) <= 1e-3,
                "-" if not p8 else f"{_pct(p8['tail']['mean'])} [{_pct(p8['tail']['lo'])}, {_pct(p8['tail']['hi'])}]"))
    out.append(("pagedopt 4-bit d <= +0.30%", None if upper(p4) is None else upper(p4) <= 3e-3,
                "-" if not p4 else f"{_pct(p4['tail']['mean'])} [{_pct(p4['tail']['lo'])}, {_pct(p4['tail']['hi'])}]"))
    if p4 and t4:
        cmp = between(p4["d_tail"], t4["d_tail"], 1.0)
        ok = None if cmp["mean"] is None else cmp["mean"] < 0
        out.append(("pagedopt 4-bit d < torchao 4-bit d", ok,
                    f"difference {_pct(cmp['mean'])} [{_pct(cmp['lo'])}, {_pct(cmp['hi'])}]"))
    else:
        out.append(("pagedopt 4-bit d < torchao 4-bit d", None, "a row did not run"))
    e4, et = fid_headline(fids.get("pagedopt_4bit")), fid_headline(fids.get("torchao_4bit"))
    out.append(("pagedopt 4-bit update error < torchao 4-bit's", None if e4 is None or et is None else e4 < et,
                f"{'-' if e4 is None else f'{e4:.4f}'} vs {'-' if et is None else f'{et:.4f}'}"))
    return out


def result_table(rows: list[dict]) -> list[list]:
    """One line per row: paired d (tail mean) with its interval, the final-eval d, seeds, and the
    fidelity headlines (median relative error of the update and of each state, quantized layers)."""
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["name"], None, None, None, None, None, None, None, None, "skipped: " + r["skipped"]])
            continue
        s = r["summary"]
        t, f = s["tail"], s["final"]
        fid = r.get("fidelity")
        pct = (lambda x: "-" if x is None else f"{100 * x:+.4f}")
        err = (lambda x: "-" if x is None else f"{x:.3g}")
        out.append([r["name"], pct(t["mean"]), pct(t["half_width"]), pct(f["mean"]), pct(f["half_width"]), t["n"],
                    err(fid_headline(fid, "update")), err(fid_headline(fid, "exp_avg")),
                    err(fid_headline(fid, "exp_avg_sq")),
                    ("resolved" if t["resolved"] else f"needs ~{seeds_needed(t['sd'], t['target'])} seeds")
                    if t["sd"] is not None else ""])
    return out


TABLE_HEADERS = ["row", "d tail %", "+-95% %", "d final %", "+-95% %", "seeds", "upd err", "m err", "v err", "note"]


def fidelity_lines(name: str, fid: Optional[dict]) -> list[list]:
    if not fid or "by_type" not in fid:
        return []
    out = []
    for kind, m in fid["by_type"].items():
        cells = []
        for key in ("update", "exp_avg", "exp_avg_sq"):
            cells += ["-" if m[key][q] is None else f"{m[key][q]:.3g}" for q in ("median", "p90")]
        peaks = [m.get(k) for k in ("peak_update_lr", "ref_peak_update_lr")]
        out.append([name, kind, m["numel"], *cells, *("-" if x is None else f"{x:.3g}" for x in peaks)])
    return out


FID_HEADERS = ["row", "layer type", "numel", "upd med", "upd p90", "m med", "m p90", "v med", "v p90",
               "max|u|/lr", "fp32 max|u|/lr"]


def plot(doc: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {"pagedopt": "#1f77b4", "torch": "#7f7f7f", "bnb": "#d62728", "torchao": "#2ca02c"}
    rows = [r for r in doc["rows"] if not r.get("skipped") and r["name"] != "fp32"]
    if not rows:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 6 + 0.5 * len(rows)))
    a = axes[0][0]
    ys = list(range(len(rows)))
    for y, r in zip(ys, rows):
        t = r["summary"]["tail"]
        c = colors.get(r.get("family"), "#999999")
        if t["mean"] is None:
            continue
        a.errorbar(100 * t["mean"], y, xerr=None if t["half_width"] is None else 100 * t["half_width"], fmt="o",
                   color=c, capsize=4)
        for d in r["summary"]["d_tail"].values():
            a.plot(100 * d, y + 0.15, ".", color=c, alpha=0.4, ms=4)
    a.axvline(0, color="k", lw=0.8)
    for x, style in ((0.10, ":"), (0.30, "--")):
        a.axvline(x, color="#999999", ls=style, lw=0.8)
    a.set_yticks(ys, [r["name"] for r in rows])
    a.set_ylim(len(rows) - 0.5, -0.5)
    a.set_xlabel("paired held-out loss difference vs fp32 (%): mean, 95% t-interval; dots: seeds", fontsize=8)
    kinds = [k for k in ("embedding", "attn_qkv", "attn_out", "mlp") if any(
        k in (r.get("fidelity") or {}).get("by_type", {}) for r in rows)]
    width = 0.8 / max(1, len(rows))
    for ax, key, what in ((axes[0][1], "update", "update"), (axes[1][0], "exp_avg", "exp_avg (m)"),
                          (axes[1][1], "exp_avg_sq", "exp_avg_sq (v)")):
        for i, r in enumerate(rows):
            by = (r.get("fidelity") or {}).get("by_type", {})
            vals = [(by.get(k, {}).get(key) or {}).get("median") for k in kinds]
            ax.bar([j + i * width for j in range(len(kinds))], [v if v else float("nan") for v in vals], width,
                   label=r["name"], color=colors.get(r.get("family"), "#999999"),
                   alpha=1.0 if r.get("bits", 8) == 8 else 0.55, hatch=None if r.get("bits", 8) == 8 else "//")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
        if any(((r.get("fidelity") or {}).get("by_type", {}).get(k, {}).get(key) or {}).get("median")
               for r in rows for k in kinds):
            ax.set_yscale("log")
        ax.set_ylabel(f"{what} rel. error vs fp32", fontsize=8)
        ax.set_title(f"teacher forcing: {what}, median over steps", fontsize=9)
        ax.legend(fontsize="x-small")
    env = doc.get("env", {})
    fig.suptitle(f"optimizer state formats: {env.get('device_name', '?')}, {doc['config']['layers']} layers x "
                 f"{doc['config']['width']}, {doc['config']['steps']} steps, {env.get('date', '')[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
