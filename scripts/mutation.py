#!/usr/bin/env python3
"""pagedopt's own mutation check: does the test suite catch a wrong optimizer?

Each mutant of the catalog (tests/mutants.toml) replaces one exact snippet of one file with a
plausible bug. The runner applies the mutants one at a time to a scratch copy of the repository
(never to the checkout), runs the test suite there, restores the file, and reports per mutant:

* killed      some test failed (pytest -x stops at the first failure)
* survived    the whole suite passed with the bug in place
* timeout     the suite ran past --timeout (reported apart, not counted as killed)
* error       pytest could not run (usage or internal error, e.g. a hint naming no test): fix it
* stale       the snippet is not found exactly once in the file (the catalog needs updating)
* build-error a C++ mutant that does not compile, or a Python one that does not parse (an
              invalid mutant: fix the catalog)
* skipped     a CUDA mutant on a run without --device (with --device, CPU mutants that are
              selected, by --kind cpu or --only, run too: with the CUDA build and -m cuda)

score = killed / (total - stale - build-error - equivalent - skipped), over the mutants run.

The scratch copy (/tmp/mut-<pid>, or --workdir to keep and reuse it) holds the tracked files
(of HEAD with --source head, the default; of the working tree with --source worktree) and the
built extension pagedopt/_C*.so of the checkout. Python mutants need no rebuild. C++ mutants
rebuild the copy's extension (CPU only, PAGEDOPT_CUDA=0, for CPU mutants; PAGEDOPT_CUDA=1 with
--device), in place with ninja, so that after the first build only the mutated file and the
file restored before it are recompiled; the pristine extension is put back after each C++ mutant.

Tests run as ``python -m pytest -x -q -p no:cacheprovider`` with CI=true: first the mutant's
``tests`` hint (node ids or files), then every test file, hinted files first and the rest in the
order of FILE_ORDER (fast, likely killers first). With --device: ``-m cuda`` instead.

    python scripts/mutation.py                         # every CPU mutant
    python scripts/mutation.py --only adam_eps_inside_sqrt --only quant_codebook_drift
    python scripts/mutation.py --device --kind cuda    # on a GPU machine
    python scripts/mutation.py --list                  # the catalog, nothing run
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from typing import Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CATALOG = ROOT / "tests" / "mutants.toml"

# Test files in the order they are run after a mutant's hints: quick, focused tests of the
# kernels and the optimizers first, slow end-to-end ones last. Files not listed run after these,
# in name order. The mutation smoke test never runs inside a mutation run.
FILE_ORDER = [
    "tests/test_quant.py",
    "tests/test_adam_engine.py",
    "tests/test_cuda_quantize.py",
    "tests/test_optim_vs_torch.py",
    "tests/test_optim_api.py",
    "tests/test_nonfinite.py",
    "tests/test_checkpoint_corrupt.py",
    "tests/test_checkpoint_formats.py",
    "tests/test_checkpoint_stateful.py",
    "tests/test_optimizer_lifecycle.py",
    "tests/test_resume.py",
    "tests/test_code_table_host.py",
    "tests/test_paging.py",
    "tests/test_paging_cuda.py",
    "tests/test_memory.py",
    "tests/test_convergence.py",
    "tests/test_readme.py",
    "tests/test_compile.py",
    "tests/test_accelerate.py",
    "tests/test_distributed.py",
    "tests/test_fsdp2.py",
    "tests/test_bench_smoke.py",
    "tests/test_transformers_trainer.py",
]
EXCLUDED_FILES = {"tests/test_mutation_smoke.py"}

KINDS = ("cpu", "cuda")


@dataclass
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    bug: str
    kind: str
    tests: list[str] = field(default_factory=list)
    equivalent: str | None = None
    kill_hint: str | None = None  # what test would kill it, if it survives

    @property
    def is_cpp(self) -> bool:
        """A mutant of the extension's sources, which needs a rebuild (not one of Python or a document)."""
        return self.file.startswith("csrc/") or self.file.endswith((".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp"))


@dataclass
class Result:
    mutant: Mutant
    status: str
    seconds: float = 0.0
    detail: str = ""


def load_catalog(path: Path) -> list[Mutant]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    mutants, seen = [], set()
    for i, entry in enumerate(data.get("mutant", [])):
        missing = [k for k in ("name", "file", "find", "replace", "bug", "kind") if k not in entry]
        if missing:
            raise SystemExit(f"{path}: mutant #{i} lacks {', '.join(missing)}")
        if entry["kind"] not in KINDS:
            raise SystemExit(f"{path}: mutant {entry['name']!r}: kind must be one of {KINDS}, got {entry['kind']!r}")
        if entry["name"] in seen:
            raise SystemExit(f"{path}: two mutants are named {entry['name']!r}")
        if entry["find"] == entry["replace"]:
            raise SystemExit(f"{path}: mutant {entry['name']!r} replaces its snippet with itself")
        seen.add(entry["name"])
        unknown = set(entry) - {"name", "file", "find", "replace", "bug", "kind", "tests", "equivalent", "kill_hint"}
        if unknown:
            raise SystemExit(f"{path}: mutant {entry['name']!r} has unknown keys {sorted(unknown)}")
        mutants.append(Mutant(entry["name"], entry["file"], entry["find"], entry["replace"], entry["bug"],
                              entry["kind"], list(entry.get("tests", [])), entry.get("equivalent"),
                              entry.get("kill_hint")))
    return mutants


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


class Scratch:
    """The scratch copy of the repository that mutants are applied to."""

    def __init__(self, workdir: Path | None, source: str, log):
        self.log = log
        self.keep = workdir is not None
        self.path = Path(workdir) if workdir is not None else Path(f"/tmp/mut-{os.getpid()}")
        self.source = source
        self.pristine_so: Path | None = None
        self.built_for: str | None = None  # "cpu"/"cuda" once the copy's extension was rebuilt

    def create(self) -> None:
        p = self.path
        if p.exists() and not self.keep:
            shutil.rmtree(p)
        p.mkdir(parents=True, exist_ok=True)
        # Refresh the sources (tracked files), keep build/ (incremental rebuilds across runs).
        if self.source == "head":
            archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(p)], input=archive, check=True)
        else:
            files = _git("ls-files", "-z").split("\0")
            for rel in filter(None, files):
                src = ROOT / rel
                if src.is_file():
                    dst = p / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
        sos = sorted((ROOT / "pagedopt").glob("_C*.so"))
        if not sos:
            raise SystemExit("pagedopt/_C*.so is not built in the checkout: run `make setup` first")
        for so in sos:
            if so.resolve() != (p / "pagedopt" / so.name).resolve():  # --workdir . reuses the checkout's build
                shutil.copy2(so, p / "pagedopt" / so.name)
        self.pristine_so = p / ".mutation-pristine" / sos[0].name
        self.pristine_so.parent.mkdir(exist_ok=True)
        shutil.copy2(sos[0], self.pristine_so)
        self.so = p / "pagedopt" / sos[0].name
        check = subprocess.run([sys.executable, "-c", "import pagedopt, os; print(os.path.realpath(pagedopt.__file__))"],
                               cwd=p, env=self.env(), capture_output=True, text=True)
        where = check.stdout.strip()
        if check.returncode != 0 or not where.startswith(str(p.resolve())):
            raise SystemExit(f"the scratch copy does not import its own pagedopt (got {where!r}; {check.stderr[-2000:]})")
        self.log(f"scratch copy: {p} ({self.source})")

    def env(self, cuda: bool = False) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.path) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["CI"] = "true"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if not cuda:
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        return env

    def build(self, cuda: bool, timeout: float) -> tuple[bool, str]:
        env = self.env(cuda)
        env["PAGEDOPT_CUDA"] = "1" if cuda else "0"
        env.setdefault("MAX_JOBS", "2")
        try:
            proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=self.path, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"build timed out after {timeout:.0f} s"
        self.built_for = "cuda" if cuda else "cpu"
        return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    def restore_extension(self) -> None:
        shutil.copy2(self.pristine_so, self.so)

    def cleanup(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def test_files(scratch: Path) -> list[str]:
    found = sorted(str(p.relative_to(scratch)) for p in (scratch / "tests").glob("test_*.py"))
    found = [f for f in found if f not in EXCLUDED_FILES]
    ordered = [f for f in FILE_ORDER if f in found]
    return ordered + [f for f in found if f not in ordered]


def run_pytest(args: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'timeout', output tail). Exit code 5 (nothing collected) counts as passed."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the pytest run we started, and its children
        out, _ = proc.communicate()
        return "timeout", (out or "")[-3000:]
    if proc.returncode in (0, 5):
        return "passed", out[-3000:]
    if proc.returncode in (3, 4):  # pytest's internal error, usage error (a hint naming no test): no verdict
        return "error", out[-3000:]
    return "failed", out[-3000:]  # 1: a test failed; 2: interrupted (a collection error counts: the mutant broke an import)


def _summary(output: str) -> str:
    """pytest's last line (``N passed, M skipped in T s``), as evidence that the whole suite ran."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1].strip("= ")[:200] if lines else ""


def _failing_test(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line.split(" - ")[0]
    return output.strip().splitlines()[-1] if output.strip() else ""


def python_parse_error(path: str, source: str) -> Optional[str]:
    """Why ``source``, the text of ``path``, does not parse, or None (and None for a file that is
    not Python): a Python mutant that does not parse fails every test by its import, whatever the
    suite checks, so it is an invalid mutant."""
    if not path.endswith(".py"):
        return None
    try:
        ast.parse(source, path)
    except SyntaxError as exc:
        return str(exc)
    return None


def run_mutant(m: Mutant, scratch: Scratch, device: bool, timeout: float, log, build_timeout: float = 1800.0) -> Result:
    target = scratch.path / m.file
    if not target.is_file():
        return Result(m, "stale", detail=f"{m.file} does not exist")
    original = target.read_text()
    count = original.count(m.find)
    if count != 1:
        return Result(m, "stale", detail=f"snippet found {count} times in {m.file}")
    if m.equivalent:
        return Result(m, "equivalent", detail=m.equivalent)
    if m.kind == "cuda" and not device:
        return Result(m, "skipped", detail="needs --device (a GPU)")
    start = time.monotonic()
    mutated = original.replace(m.find, m.replace)
    why = python_parse_error(m.file, mutated)
    if why is not None:
        return Result(m, "build-error", detail=f"the mutated file does not parse: {why}")
    target.write_text(mutated)
    try:
        if m.is_cpp:
            # --timeout bounds the tests; the build has its own bound (the first one in a fresh
            # scratch copy compiles everything).
            ok, out = scratch.build(cuda=device, timeout=build_timeout)
            if not ok:
                return Result(m, "build-error", time.monotonic() - start, _build_error(out))
        deadline = time.monotonic() + timeout
        env = scratch.env(cuda=device)
        marker = ["-m", "cuda"] if device else []
        files = test_files(scratch.path)
        stages = []
        if m.tests:
            stages.append(list(m.tests))
        hinted_files = [t.split("::")[0] for t in m.tests]
        stages.append([f for f in hinted_files if f in files] + [f for f in files if f not in hinted_files])
        for stage in stages:
            left = deadline - time.monotonic()
            if left <= 0:
                return Result(m, "timeout", time.monotonic() - start, "")
            status, out = run_pytest(marker + stage, scratch.path, env, left)
            if status == "failed":
                return Result(m, "killed", time.monotonic() - start, _failing_test(out))
            if status == "timeout":
                return Result(m, "timeout", time.monotonic() - start, f"not killed in {timeout:.0f} s of tests")
            if status == "error":
                return Result(m, "error", time.monotonic() - start, _summary(out))
        return Result(m, "survived", time.monotonic() - start, _summary(out))
    finally:
        target.write_text(original)  # a newer mtime: ninja recompiles it at the next build
        if m.is_cpp:
            scratch.restore_extension()


def _build_error(out: str) -> str:
    for line in out.splitlines():
        if "error" in line:
            return line.strip()[:200]
    return out.strip().splitlines()[-1][:200] if out.strip() else ""


def score(results: list[Result]) -> tuple[int, int]:
    run = [r for r in results if r.status in ("killed", "survived", "timeout")]
    return sum(r.status == "killed" for r in run), len(run)


def markdown(results: list[Result], meta: dict) -> str:
    killed, counted = score(results)
    pct = f"{100.0 * killed / counted:.0f}%" if counted else "n/a"
    by = {s: sum(r.status == s for r in results) for s in
          ("killed", "survived", "timeout", "error", "stale", "build-error", "equivalent", "skipped")}
    lines = [
        f"Mutation run of {meta['date']} at commit {meta['commit']}: `{meta['command']}`",
        "",
        f"**Score: {killed} / {counted} killed ({pct})**; " + ", ".join(f"{k} {v}" for k, v in by.items() if v),
        "",
        "| mutant | kind | file | bug it imitates | result | time (s) | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.mutant
        detail = (r.detail or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{m.name}` | {m.kind} | `{m.file}` | {m.bug.replace('|', '/')} | **{r.status}** | "
                     f"{r.seconds:.0f} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG)
    ap.add_argument("--only", action="append", default=[], help="run only this mutant (repeatable; comma lists too)")
    ap.add_argument("--kind", choices=KINDS, help="only mutants of this kind (default: cpu, or cuda with --device)")
    ap.add_argument("--device", action="store_true", help="run CUDA mutants on a GPU: PAGEDOPT_CUDA=1 builds, pytest -m cuda")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds of tests per mutant (builds not counted)")
    ap.add_argument("--build-timeout", type=float, default=1800.0, help="seconds per C++ rebuild")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (only 1 is supported: one scratch copy)")
    ap.add_argument("--workdir", type=Path, help="scratch copy to use and keep (default /tmp/mut-<pid>, removed)")
    ap.add_argument("--source", choices=("head", "worktree"), default="head",
                    help="copy HEAD's tracked files (default) or the working tree's")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.jobs != 1:
        ap.error("--jobs: only 1 is supported (the mutants share one scratch copy and its build)")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    mutants = load_catalog(args.catalog)
    only = {n for o in args.only for n in o.split(",") if n}
    unknown = only - {m.name for m in mutants}
    if unknown:
        ap.error(f"--only: no mutant named {', '.join(sorted(unknown))}")
    if only:  # in the order given
        by_name = {m.name: m for m in mutants}
        order = list(dict.fromkeys(n for o in args.only for n in o.split(",") if n))
        mutants = [by_name[n] for n in order]
    kind = args.kind or ("cuda" if args.device else None)
    if kind and not only:
        mutants = [m for m in mutants if m.kind == kind]
    if args.list:
        for m in mutants:
            print(f"{m.name:40s} {m.kind:5s} {m.file:40s} {m.bug}")
        return 0

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD").strip(),
        "command": "python scripts/mutation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    scratch = Scratch(args.workdir, args.source, log)
    scratch.create()
    results: list[Result] = []
    try:
        for i, m in enumerate(mutants, 1):
            log(f"[{i}/{len(mutants)}] {m.name} ({m.kind}, {m.file}) ...")
            r = run_mutant(m, scratch, args.device, args.timeout, log, args.build_timeout)
            results.append(r)
            log(f"    {r.status} in {r.seconds:.0f} s {r.detail}")
            if args.json:  # partial results survive an interrupted run
                _write_json(args.json, results, meta)
    finally:
        scratch.cleanup()
    report = markdown(results, meta)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        _write_json(args.json, results, meta)
    return 0


def _write_json(path: Path, results: list[Result], meta: dict) -> None:
    killed, counted = score(results)
    path.write_text(json.dumps({**meta, "killed": killed, "counted": counted, "results": [
        {"name": r.mutant.name, "kind": r.mutant.kind, "file": r.mutant.file, "bug": r.mutant.bug,
         "status": r.status, "seconds": round(r.seconds, 1), "detail": r.detail} for r in results]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
