"""Draw the copy timeline that ``scripts/profile_train_step.py`` prints for updates during backward
(the table "chunk in start in end grads upd start upd end back start back end"): one row per
chunk, its copy in, its update and its copy back, with the step's forward/backward marks.

    python scripts/plot_copy_timeline.py profile.txt timeline.png
"""
from __future__ import annotations

import re
import sys

HEADER = "chunk   in start"


def parse(text: str) -> tuple[dict, list]:
    """The marks line's numbers (forward, backward, step) and the rows (chunk, 7 times or None)."""
    marks = {}
    m = re.search(r"forward ([-\d.]+), backward ([-\d.]+), step ([-\d.]+)", text)
    if m:
        marks = dict(zip(("forward", "backward", "step"), map(float, m.groups())))
    rows, inside = [], False
    for line in text.splitlines():
        if HEADER in line:
            inside = True
            continue
        if inside:
            cells = line.split()
            if len(cells) != 8 or not cells[0].isdigit():
                if rows:
                    break
                continue
            rows.append((int(cells[0]), [None if c == "-" else float(c) for c in cells[1:]]))
    return marks, rows


def plot(marks: dict, rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(0.18 * len(rows) + 1.8, 4.0)))
    colors = {"copy in": "tab:blue", "update": "tab:green", "copy back": "tab:orange"}
    for k, t in rows:
        for (lo, hi), name in (((t[0], t[1]), "copy in"), ((t[3], t[4]), "update"), ((t[5], t[6]), "copy back")):
            if lo is not None and hi is not None:
                ax.barh(k, hi - lo, left=lo, height=0.8, color=colors[name])
        if t[2] is not None:
            ax.plot([t[2]], [k], "k|", markersize=6)
    for i, (name, x) in enumerate(marks.items()):
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        ax.text(x, 1.01 + 0.035 * i, f"{name} ends", fontsize=8, ha="center", va="bottom",
                transform=ax.get_xaxis_transform())  # x in ms, y above the axes
    ax.set_xlabel("ms from the step's start (negative: during the step before)")
    ax.set_ylabel("chunk (in gradient order)")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles + [plt.Line2D([], [], color="k", marker="|", linestyle="")],
              list(colors) + ["gradients ready"], loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        marks, rows = parse(f.read())
    if not rows:
        print(f"no copy timeline in {argv[0]}")
        return 1
    plot(marks, rows, argv[1])
    print(f"{len(rows)} chunks -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
