"""The figures and tables of bench/scale.py: the host link's floor, the estimator's error, the
markdown tables and the chart."""
from __future__ import annotations

from typing import Optional

GB = 1e9
GiB = float(1 << 30)


# --------------------------------------------------------------------------- the host link
def parse_rates(text: Optional[str]) -> Optional[dict]:
    """``--assume-link H2D,D2H,BOTH`` (GB/s) as rates; None for None."""
    if text is None:
        return None
    try:
        h2d, d2h, both = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--assume-link takes three GB/s figures H2D,D2H,BOTH, got {text!r}") from None
    if min(h2d, d2h, both) <= 0:
        raise ValueError(f"--assume-link: every rate must be > 0, got {text!r}")
    return {"h2d": h2d, "d2h": d2h, "both": both, "source": "assumed (--assume-link)"}


def rates_from(link: dict) -> Optional[dict]:
    """The slower of the measurements (before and after the configurations) of each rate: pinned
    host -> device alone, device -> host alone, and each way with both directions busy."""
    runs = [r for r in link.values() if isinstance(r, dict) and r.get("both_gbps_each_way")]
    if not runs:
        return None
    return {"h2d": min(r["h2d_gbps"] for r in runs), "d2h": min(r["d2h_gbps"] for r in runs),
            "both": min(r["both_gbps_each_way"] for r in runs), "source": "measured in this run (slower of before/after)"}


def link_floor_ms(h2d: int, d2h: int, rates: Optional[dict]) -> Optional[float]:
    """The least time the step's host-link traffic takes: with bytes both ways, the larger
    direction's at the rate each way measured with both directions busy; one way only, at that
    direction's rate alone. 0 with no traffic; None without rates."""
    if not h2d and not d2h:
        return 0.0
    if rates is None:
        return None
    if h2d and d2h:
        return 1e3 * max(h2d, d2h) / (rates["both"] * GB)
    return 1e3 * (h2d / (rates["h2d"] * GB) if h2d else d2h / (rates["d2h"] * GB))


def _ratio_error(measured, predicted) -> Optional[float]:
    if measured is None or not predicted:
        return None
    return measured / predicted - 1.0


def add_figures(rec: dict, rates: Optional[dict]) -> None:
    """A finished record's link bytes (the pager's count, else the row's arithmetic), its floor, and
    the estimator's error on each measured peak (measured / predicted - 1)."""
    if rec.get("status") != "ok":
        return
    need = rec.get("need") or {}
    if rec.get("link_source") != "pager":
        rec["link_h2d"], rec["link_d2h"] = need.get("link_h2d", 0), need.get("link_d2h", 0)
        rec["link_source"] = "arithmetic"
    floor = link_floor_ms(rec["link_h2d"], rec["link_d2h"], rates)
    rec["link_floor_ms"] = floor
    rec["link_floor_share"] = floor / rec["step_ms"] if floor is not None and rec.get("step_ms") else None
    pred = rec.get("prediction")
    if pred:
        from pagedopt.memory import CUDA_CONTEXT_BYTES
        rec["pred_error"] = {
            "max_allocated": _ratio_error(rec.get("max_allocated"), pred["allocator_peak"]),
            "max_allocated_first": _ratio_error(rec.get("max_allocated_first"), pred["allocator_first_step_peak"]),
            # the child's device figure leaves out what was in use before the model (the CUDA context)
            "device_used": _ratio_error(rec.get("device_used"), pred["peak"] - CUDA_CONTEXT_BYTES),
        }


# --------------------------------------------------------------------------- text
def _g(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def one_line(rec: dict) -> str:
    st = rec.get("status")
    if st != "ok":
        where = f" at {rec['phase']}" if rec.get("phase") else ""
        return f"{st}{where}: {rec.get('reason') or rec.get('error') or ''}"[:300]
    pred = rec.get("prediction") or {}
    return (f"ok: {rec['step_ms']:.1f} ms/step (first {rec['first_step_ms']:.1f}), max allocated "
            f"{_g(rec.get('max_allocated'))} GiB (predicted {_g(pred.get('allocator_peak'))}), first step "
            f"{_g(rec.get('max_allocated_first'))} GiB (predicted {_g(pred.get('allocator_first_step_peak'))})")


def config_table(records: list[dict]) -> str:
    head = ("| row | dtype | shape | params (B) | status | step ms | first step ms | max alloc GiB (pred, err) "
            "| max reserved GiB | first step alloc GiB (pred, err) | device used GiB (err) | link GB each way "
            "| link floor ms | note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r.get("shape") is None:
            lines.append(f"| {r['row']} | - | - | - | {r['status']} | | | | | | | | | {r.get('reason', '')} |")
            continue
        pred, err = r.get("prediction") or {}, r.get("pred_error") or {}
        note = r.get("reason") or r.get("error") if r.get("status") != "ok" else ""
        if r.get("status") in ("oom", "error") and r.get("phase"):
            note = f"at {r['phase']}: {note}"
        link = r.get("link_h2d")
        lines.append(
            f"| {r['row']} | {r['dtype']} | {r['shape']} | {r.get('params', 0) / 1e9:.2f} | {r['status']} "
            f"| {_ms(r.get('step_ms'))} | {_ms(r.get('first_step_ms'))} "
            f"| {_g(r.get('max_allocated'))} ({_g(pred.get('allocator_peak'))}, {_pct(err.get('max_allocated'))}) "
            f"| {_g(r.get('max_reserved'))} "
            f"| {_g(r.get('max_allocated_first'))} ({_g(pred.get('allocator_first_step_peak'))}, "
            f"{_pct(err.get('max_allocated_first'))}) "
            f"| {_g(r.get('device_used'))} ({_pct(err.get('device_used'))}) "
            f"| {'-' if link is None else f'{link / GB:.2f}'} | {_ms(r.get('link_floor_ms'))} "
            f"| {str(note or '')[:120].replace('|', '/')} |")
    return "\n".join(lines)


def largest_table(records: list[dict]) -> str:
    """Per row and dtype: the largest shape that trained, and what stopped the row."""
    order, best, stop = [], {}, {}
    for r in records:
        if r.get("shape") is None:
            continue
        key = (r["row"], r["dtype"])
        if key not in order:
            order.append(key)
        if r["status"] == "ok" and r.get("params", 0) >= best.get(key, {}).get("params", -1):
            best[key] = r
        elif r["status"] not in ("ok", "not_run") and key not in stop:
            stop[key] = f"{r['shape']}: {r['status']}"
    lines = ["| row | dtype | largest trained | params (B) | step ms | max alloc GiB | link floor ms | stopped by |",
             "|---|---|---|---|---|---|---|---|"]
    for key in order:
        b = best.get(key)
        lines.append(f"| {key[0]} | {key[1]} | {b['shape'] if b else 'none'} | "
                     f"{(b['params'] / 1e9 if b else 0):.2f} | {_ms(b.get('step_ms') if b else None)} | "
                     f"{_g(b.get('max_allocated') if b else None)} | {_ms(b.get('link_floor_ms') if b else None)} "
                     f"| {stop.get(key, '-')} |")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    env, rates = doc.get("env", {}), doc.get("rates")
    s = doc.get("settings", {})
    out = [f"# bench/scale.py on {env.get('device_name')} ({env.get('date')}, torch {env.get('torch')})", "",
           f"`{doc.get('command')}`; batch {s.get('batch')} x {s.get('seq')}, {s.get('steps')} steps, gradient "
           f"checkpointing {'on' if s.get('checkpointing') else 'off'}; budget row: {s.get('budget')} of the states.", ""]
    if (s.get("nproc") or 1) > 1:
        out += [f"FSDP2 across {s['nproc']} GPUs (one process each, batch and sequence per GPU): step ms is the "
                "slowest rank's, each peak the largest rank's, link bytes and floor one rank's (at each GPU's rate "
                "with every GPU copying at once); no prediction (the estimator models one GPU).", ""]
    if rates:
        out += [f"Host link ({rates['source']}): host->device {rates['h2d']:.1f} GB/s, device->host "
                f"{rates['d2h']:.1f} GB/s, each way with both busy {rates['both']:.1f} GB/s.", ""]
    out += ["## Largest model per row", "", largest_table(doc["records"]), "", "## Every configuration", "",
            config_table(doc["records"]), "",
            "max alloc: `torch.cuda.max_memory_allocated` over the steps after the first (which does not see "
            "managed memory); pred: pagedopt.memory.modes' prediction; err: measured / predicted - 1 (`pred_error` in scale.json).", ""]
    return "\n".join(out)


def plot(records: list[dict], path: str) -> Optional[str]:
    """Step time against model size, a line per row, a panel per dtype."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = [r for r in records if r.get("status") == "ok"]
    if not done:
        return None
    dtypes = sorted({r["dtype"] for r in done})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        rows = []
        for r in records:
            if r.get("dtype") == dt and r["row"] not in rows:
                rows.append(r["row"])
        for name in rows:
            pts = sorted((r["params"] / 1e9, r["step_ms"]) for r in done if r["row"] == name and r["dtype"] == dt)
            stop = next((r["shape"] for r in records if r["row"] == name and r.get("dtype") == dt
                         and r["status"] not in ("ok", "not_run")), None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name + (f" (stops at {stop})" if stop else ""))
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("median training step (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{dt} parameters")
        ax.legend(fontsize="x-small")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
