"""Quality of optimizer state formats: paired convergence runs against fp32 AdamW, and the fidelity
of each format's update and states under teacher forcing.

Convergence: for each seed, every row trains the same small causal LM (quality_train.QualityLM) from
the same init on the same batches of a synthetic text-like source (quality_data.py); the per-seed
figure is d = (L_row - L_fp32) / L_fp32 of the held-out loss (the mean of the last ``tail`` evals),
reported as mean and 95% t-interval over seeds (quality_stats.py). fp32 AdamW runs the first seed a
second time in another process: the two must agree bit for bit, or the pairs carry run-to-run noise.

Fidelity: one seed's gradient stream, fp32 AdamW's trajectory, fed to each row with its parameters
reset to the reference's before every step (teacher forcing); relative error of the update and of
each state against fp32, per layer type, median and 90th percentile over steps.

    python bench/quality.py --out /tmp/q                       # every row (CUDA), ~8 min on an H100
    python bench/quality.py --rows fp32,pagedopt_8bit --seeds 4 --steps 200 --width 64 --layers 2 --device cpu
    python bench/quality.py --smoke --out /tmp/q               # tiny, CPU, seconds (CI)
    python bench/quality.py --report /tmp/q                    # the report again from the row_*.json there

Rows of one width drift from fp32 alike, seed by seed, so they are also ranked against each other
(pagedopt's row of each width minus every other row, paired over the seeds): that interval is
narrower than either row's against fp32 (bench/RESULTS.md, fifteenth session: +-0.009% against
+-0.16% for the 8-bit rows).

Each row runs in a process of its own (a library's state cannot touch another's figures); a row whose
package or class is missing is skipped with the reason. Writes quality.json, row_<name>.json,
quality.png and prints the tables.

Sizing. The interval's half-width is t(0.975, n-1) * sd_d / sqrt(n): +-0.05% needs sd_d <= 0.079%
over 12 seeds, 0.094% over 16, 0.118% over 24. Pairing removes the init and data spread between
seeds (the issue's +-0.3%); what is left is how far two runs that differ by small per-step errors
drift apart by the end, and the format's own effect where it varies by seed. The noise floor of the
method is the paired d of a row that differs from fp32 by a negligible change (row fp32_nudged,
beta2 0.999001). The table says, per row, how many seeds its measured sd_d would need. The defaults
(4 layers x 256, vocab 1024, batch 32 x 128, 600 steps, cosine to 0, 12 seeds) were sized from the
CPU pilots in bench/RESULTS.md and a FLOP count (~1e11 per step, ~5 ms on an H100 in fp32 without
TF32): about 3.5 s a run, 45 s a row of 12 seeds plus its fidelity run, ~10 s to start each process,
plus torch.compile for each torchao row: about 8 minutes for the seven default rows with --jobs 1,
about half with --jobs 2 (the small model leaves the GPU idle between launches). Not yet measured on
a GPU. The CPU pilots (bench/RESULTS.md) found the floor at ~0.3-0.9% on a source that kept the
model on a plateau for a seed-dependent time, and at 0.018% on the current source.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the repo root, after any installed pagedopt

import torch  # noqa: E402

import common as C  # noqa: E402
import quality_stats as S  # noqa: E402
import quality_train as Q  # noqa: E402
from quality_rows import DEFAULT_ROWS, ROWS, SMOKE_ROWS  # noqa: E402

TARGET = 5e-4  # the interval half-width the defaults are sized for: +-0.05%
DEFAULT_SEEDS = 12


# --------------------------------------------------------------------------- data files
def _write_seed(cfg: Q.Config, seed: int, folder: str) -> None:
    torch.set_num_threads(1)
    torch.save(Q.train_tokens(cfg, seed).to(torch.int16), os.path.join(folder, f"train_{seed}.pt"))


def write_data(cfg: Q.Config, seeds: list[int], folder: str) -> None:
    """Each seed's batches and the held-out set, as int16 tensors (the children load them); the seeds
    are made in parallel, a process each, on half the cores (the sampler is a loop over positions)."""
    torch.save(Q.eval_tokens(cfg).to(torch.int16), os.path.join(folder, "eval.pt"))
    workers = min(len(seeds), max(1, (os.cpu_count() or 2) // 2))
    if workers == 1:
        for s in seeds:
            _write_seed(cfg, s, folder)
        return
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in [pool.submit(_write_seed, cfg, s, folder) for s in seeds]:
            f.result()


def read_tokens(folder: str, name: str) -> torch.Tensor:
    return torch.load(os.path.join(folder, name)).long()


# --------------------------------------------------------------------------- one row (child)
def run_row(name: str, cfg: Q.Config, seeds: list[int], device, data: str, out_path: str,
            fidelity: bool = True) -> dict:
    """Every seed's run of a row, then its fidelity run; the record is rewritten after each part, so
    a timeout keeps what was done."""
    row = ROWS[name]
    Q.set_deterministic(device)
    rec = {"name": name, "family": row.family, "bits": row.bits, "runs": {}, "fidelity": None}
    held_out = read_tokens(data, "eval.pt")
    t0 = time.perf_counter()
    for s in seeds:
        run = Q.train(row.make, cfg, s, read_tokens(data, f"train_{s}.pt"), held_out, device)
        rec["runs"][str(s)] = run
        print(f"   [{name}] seed {s}: held-out {run['final']:.5f} (tail {run['tail_mean']:.5f}), "
              f"{1e3 * run['seconds'] / cfg.steps:.2f} ms/step", flush=True)
        C.write_json(out_path, rec)
    rec["train_seconds"] = time.perf_counter() - t0
    if fidelity:
        t1 = time.perf_counter()
        rec["fidelity"] = Q.fidelity(row.make, row.read_states, cfg, read_tokens(data, f"train_{seeds[0]}.pt"),
                                     device, seed=seeds[0])
        rec["fidelity_seconds"] = time.perf_counter() - t1
    C.write_json(out_path, rec)
    return rec


# --------------------------------------------------------------------------- the parent
def start_child(argv_base: list[str], job: dict, timeout_s: float):
    cmd = [sys.executable, os.path.abspath(__file__), *argv_base, "--child", job["row"], "--child-seeds",
           ",".join(map(str, job["seeds"])), "--child-out", job["out"]] + ([] if job["fidelity"] else ["--no-fidelity"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONHASHSEED="0")
    job["proc"] = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    job["deadline"] = time.monotonic() + timeout_s


def finish_child(job: dict) -> dict:
    """The child's record (partial after a timeout), or a skipped record with the reason."""
    proc = job["proc"]
    try:
        _, err = proc.communicate(timeout=max(1.0, job["deadline"] - time.monotonic()))
        why = None if proc.returncode == 0 else f"exit {proc.returncode}: " + " | ".join(
            (err or "").strip().splitlines()[-3:])[-300:]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        why = "timed out"
    rec = None
    if os.path.exists(job["out"]):
        with open(job["out"]) as f:
            rec = json.load(f)
    if rec is None or not rec.get("runs"):
        return {"name": job["row"], "skipped": why or "no record written"}
    if why:
        rec["incomplete"] = why
    return rec


def run_jobs(jobs: list[dict], argv_base: list[str], parallel: int, timeout_s: float) -> None:
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < max(1, parallel):
            job = pending.pop(0)
            print(f"[quality] {job['row']} ({len(job['seeds'])} seeds) ...", flush=True)
            start_child(argv_base, job, timeout_s)
            running.append(job)
        job = running.pop(0)
        job["record"] = finish_child(job)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated rows (default: " + ",".join(DEFAULT_ROWS)
                    + "; fp32 always runs, as the reference); known: " + ",".join(ROWS))
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1 (default {DEFAULT_SEEDS})")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--eval-seqs", type=int, default=None, help="held-out sequences")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--fid-steps", type=int, default=None, help="fidelity run's steps (default: --steps)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--jobs", type=int, default=1, help="rows run at once (each its own process)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each CPU child (a shared or busy "
                    "CPU runs these small matrices faster on one thread than on several)")
    ap.add_argument("--no-fidelity", action="store_true")
    ap.add_argument("--target", type=float, default=TARGET, help="interval half-width to resolve (fraction)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per row's process")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 seeds (CI)")
    ap.add_argument("--out", default=None, help="folder for quality.json, row_*.json and quality.png")
    ap.add_argument("--report", default=None, metavar="DIR",
                    help="no runs: the report (quality.json, tables, chart) of the row_*.json files in DIR, e.g. "
                    "those a run stopped from outside left (each row's file is rewritten after every seed)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-seeds", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    return ap, ap.parse_args(argv)


def make_config(args) -> Q.Config:
    cfg = Q.SMOKE if args.smoke else Q.Config()
    keys = ("steps", "width", "layers", "batch", "seq", "vocab", "heads", "eval_seqs", "lr", "fid_steps")
    over = {k: getattr(args, k) for k in keys
            if getattr(args, k) is not None}
    return dataclasses.replace(cfg, **over)


def summarize(records: dict, target: float) -> tuple[list, dict]:
    """Each row's paired summary against the fp32 record; the fp32 repeat becomes the determinism check."""
    ref = records.get("fp32", {}).get("runs", {})
    rows, check = [], {}
    for name, rec in records.items():
        if name == "fp32#repeat":
            d = S.paired_diffs(ref, rec.get("runs", {}), "final")
            check = {"seeds": sorted(d), "max_abs_d": max((abs(x) for x in d.values()), default=None),
                     "identical": bool(d) and all(x == 0 for x in d.values()), "skipped": rec.get("skipped")}
            continue
        if not rec.get("skipped"):
            rec["summary"] = S.row_summary(ref, rec["runs"], target)
        rows.append(rec)
    return rows, check


def main(argv: Optional[list[str]] = None) -> int:
    ap, args = parse_args(argv)
    cfg = make_config(args)
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    n_seeds = args.seeds or (2 if args.smoke else DEFAULT_SEEDS)
    if n_seeds < 2:
        ap.error(f"--seeds must be at least 2 (an interval needs two), got {n_seeds}")
    names = [n for n in args.rows.split(",") if n] or list(SMOKE_ROWS if args.smoke else DEFAULT_ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; known: {', '.join(ROWS)}")
    if "fp32" not in names:
        names.insert(0, "fp32")

    if args.child is not None:  # a child: one row, its seeds
        seeds = [int(s) for s in args.child_seeds.split(",")]
        if device.type == "cpu":
            torch.set_num_threads(max(1, args.threads))
        run_row(args.child, cfg, seeds, device, args.data, args.child_out, fidelity=not args.no_fidelity)
        return 0

    if args.report is not None:
        return report_from_rows(args, argv, cfg, device, names)
    out_dir = args.out or os.path.join(os.getcwd(), "bench_quality_out")
    os.makedirs(out_dir, exist_ok=True)
    seeds = list(range(n_seeds))
    data = tempfile.mkdtemp(prefix="pagedopt_quality_")
    t0 = time.perf_counter()
    try:
        write_data(cfg, seeds, data)
        data_s = time.perf_counter() - t0
        lang = Q.language(cfg)
        entropy = lang.true_nll(read_tokens(data, "eval.pt"))
        print(f"[quality] data: {n_seeds} seeds x {cfg.steps} steps x {cfg.batch} x {cfg.seq} tokens in {data_s:.1f} s;"
              f" the source's entropy on the held-out set {entropy:.4f} nats", flush=True)
        argv_base = ["--device", str(device), "--data", data, "--steps", str(cfg.steps), "--width", str(cfg.width),
                     "--layers", str(cfg.layers), "--batch", str(cfg.batch), "--seq", str(cfg.seq),
                     "--vocab", str(cfg.vocab), "--heads", str(cfg.heads), "--eval-seqs", str(cfg.eval_seqs),
                     "--lr", repr(cfg.lr), "--threads", str(args.threads)]
        argv_base += ["--smoke"] if args.smoke else []
        argv_base += ["--fid-steps", str(cfg.fid_steps)] if cfg.fid_steps else []
        records, jobs = {}, []
        for name in names:
            why = ROWS[name].missing(device)
            if why:
                print(f"[quality] {name}: skipped ({why})", flush=True)
                records[name] = {"name": name, "family": ROWS[name].family, "skipped": why}
                continue
            jobs.append({"row": name, "seeds": seeds, "fidelity": not args.no_fidelity,
                         "out": os.path.join(out_dir, f"row_{name}.json")})
            if name == "fp32":  # the determinism check: the first seed again, in another process
                jobs.append({"row": "fp32", "key": "fp32#repeat", "seeds": seeds[:1], "fidelity": False,
                             "out": os.path.join(out_dir, "row_fp32_repeat.json")})
        run_jobs(jobs, argv_base, args.jobs, args.timeout)
        for job in jobs:
            records[job.get("key", job["row"])] = job["record"]
    finally:
        shutil.rmtree(data, ignore_errors=True)
    order = {n: i for i, n in enumerate(names)}
    records = dict(sorted(records.items(), key=lambda kv: order.get(kv[0], len(order))))
    return write_report(args, argv, cfg, device, records, out_dir, seeds,
                        {"source_entropy": entropy, "data_seconds": data_s, "seconds": time.perf_counter() - t0})


def report_from_rows(args, argv, cfg: Q.Config, device, names: list[str]) -> int:
    """--report DIR: the report of the row files a run left in DIR (the rows asked for with --rows,
    else every row file there; fp32's is required), written into --out (default DIR)."""
    folder = args.report
    if not os.path.isfile(os.path.join(folder, "row_fp32.json")):
        raise SystemExit(f"--report {folder!r}: no row_fp32.json there (the reference of every pair)")
    found = sorted(f[len("row_"):-len(".json")] for f in os.listdir(folder)
                   if f.startswith("row_") and f.endswith(".json") and f != "row_fp32_repeat.json")
    known = list(ROWS)  # without --rows: every row file there, in the rows' table's order
    found.sort(key=lambda n: (known.index(n) if n in known else len(known), n))
    wanted = names if args.rows else ["fp32", *[n for n in found if n != "fp32"]]
    records = {}
    for name in wanted:
        path = os.path.join(folder, f"row_{name}.json")
        if not os.path.isfile(path):
            records[name] = {"name": name, "family": ROWS[name].family if name in ROWS else "?",
                             "skipped": f"no {os.path.basename(path)} in {folder}"}
            continue
        with open(path) as f:
            records[name] = json.load(f)
        if not records[name].get("runs"):
            records[name] = {"name": name, "family": records[name].get("family", "?"), "skipped": "no runs"}
    repeat = os.path.join(folder, "row_fp32_repeat.json")
    if os.path.isfile(repeat):
        with open(repeat) as f:
            records["fp32#repeat"] = json.load(f)
    seeds = sorted({int(s) for s in records["fp32"]["runs"]})
    return write_report(args, argv, cfg, device, records, args.out or folder, seeds, {"from_rows": folder})


def write_report(args, argv, cfg: Q.Config, device, records: dict, out_dir: str, seeds: list[int],
                 extra: dict) -> int:
    """quality.json, the printed tables and the chart, from the rows' records."""
    rows, check = summarize(records, args.target)
    fids = {r["name"]: r.get("fidelity") for r in rows if not r.get("skipped")}
    doc = {"bench": "quality", "env": C.env_info(device), "config": dataclasses.asdict(cfg), "seeds": seeds,
           "target": args.target, **extra, "determinism": check,
           "command": " ".join(["python", "bench/quality.py", *(argv if argv is not None else sys.argv[1:])]),
           "goals": [{"goal": g, "met": ok, "figures": fig} for g, ok, fig in S.goals(
               {r["name"]: r["summary"] for r in rows if "summary" in r}, fids)],
           "between": S.rankings({r["name"]: r["summary"] for r in rows if "summary" in r}, args.target),
           "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    C.write_json(os.path.join(out_dir, "quality.json"), doc)
    print_report(doc)
    png = S.plot(doc, os.path.join(out_dir, "quality.png"))
    if png:
        print(f"chart: {png}")
    return 0


def print_report(doc: dict) -> None:
    cfg = doc["config"]
    print(f"\n{cfg['layers']} layers x {cfg['width']}, vocab {cfg['vocab']}, batch {cfg['batch']} x {cfg['seq']}, "
          f"{cfg['steps']} steps, lr {cfg['lr']} (cosine to {cfg['final_lr']}), seeds {len(doc['seeds'])}, "
          + (f"on {doc['env'].get('device_name')}; source entropy {doc['source_entropy']:.4f}" if "from_rows" not in doc
             else f"(--report of the rows in {doc['from_rows']}: the model's settings are those given here)"))
    ref = next((r for r in doc["rows"] if r["name"] == "fp32" and not r.get("skipped")), None)
    if ref:
        tails = [r["tail_mean"] for r in ref["runs"].values()]
        print(f"fp32 AdamW held-out loss (tail mean): {min(tails):.4f} .. {max(tails):.4f} over seeds")
    det = doc["determinism"]
    if det:
        print("determinism: fp32 AdamW's first seed in two processes: " + (
            "identical" if det.get("identical") else f"DIFFERS (max |d| {det.get('max_abs_d')}, {det.get('skipped')})"))
    floor = next((r for r in doc["rows"] if r["name"] == "fp32_nudged" and "summary" in r), None)
    if floor and floor["summary"]["tail"]["sd"] is not None:
        sd = floor["summary"]["tail"]["sd"]
        print(f"noise floor (fp32_nudged, beta2 0.999001): sd of d over seeds {100 * sd:.3f}%: "
              f"~{S.seeds_needed(sd, doc['target'])} seeds resolve +-{100 * doc['target']:.2f}% at that spread")
    print("\npaired d = (L_row - L_fp32) / L_fp32, held-out; tail = mean of the last evals; +-95% = t-interval")
    print(C.table(S.result_table(doc["rows"]), S.TABLE_HEADERS))
    fid = [line for r in doc["rows"] for line in S.fidelity_lines(r["name"], r.get("fidelity"))]
    if fid:
        print("\nfidelity (teacher forcing, seed 0): relative error vs fp32 AdamW, median and p90 over steps")
        print(C.table(fid, S.FID_HEADERS))
        for r in doc["rows"]:
            if (r.get("fidelity") or {}).get("state_reader_error"):
                print(f"  {r['name']}: states not read ({r['fidelity']['state_reader_error']}); update error only")
    pairs = doc.get("between") or []
    if pairs:
        print("\nrows against each other, paired over the seeds both ran: d_a - d_b, mean [95% interval]")
        for p in pairs:
            print(f"  {p['a']:<22} - {p['b']:<22} {100 * p['mean']:+.4f}% [{100 * p['lo']:+.4f}%, {100 * p['hi']:+.4f}%]"
                  f"  {p['n']} seeds")
    print("\ngoals (issue 30):")
    for g in doc["goals"]:
        mark = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        print(f"  {g['goal']:<48} {mark:<13} {g['figures']}")


if __name__ == "__main__":
    sys.exit(main())
