"""The extension build's progress, its plan and its record (used by setup.py's ``build_ext``).

torch's ``BuildExtension`` writes a ninja file for the extension's units (one object per
``.cpp``/``.cu`` source) and runs ``ninja -v``, which prints nothing a reader can follow: a
compiler command line per unit, or nothing at all under ``pip -q``. setup.py runs its builds
through :func:`run_ninja` instead (same arguments as torch's ``_run_ninja_build``), which

* asks ninja first which units are out of date (``ninja -n``) and says which it will compile, with
  how many jobs, and how long a full build takes with those jobs (:func:`estimate_seconds`, from
  the unit times measured by the last builds here, else from :data:`REFERENCE_SECONDS`);
* prints one line per compiled unit with the elapsed time, and a line every
  :data:`HEARTBEAT_S` seconds while a long unit compiles;
* keeps the compilers' own output in ``build/build.log`` (printed when a unit fails) and the
  result in ``build/pagedopt-build.json``: the units this build compiled and the time of each.

Run as a script, it prints the record of the last build:
``python scripts/build_progress.py [--json]``.
"""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "pagedopt build:"
RECORD = "pagedopt-build.json"
LOG = "build.log"
HEARTBEAT_S = 30.0

# Seconds each unit took to compile (2 jobs on the 2 cores of a machine of issue 34's kind, torch
# 2.14.1 with CUDA 13.0, one CUDA arch): the estimate before any build has been measured here.
# Units missing from the table count as the mean of the others.
REFERENCE_SECONDS = {
    "csrc/pagedopt.cpp": 24.8,
    "csrc/check_grads.cpp": 6.5,
    "csrc/copy_bytes.cpp": 14.0,
    "csrc/quantized_state_list.cpp": 48.6,
    "csrc/cpu/adam8bit.cpp": 13.6,
    "csrc/cpu/quantize.cpp": 20.1,
    "csrc/cpu/quantized_step.cpp": 56.7,
    "csrc/cuda/quantize.cu": 55.7,
    "csrc/cuda/quantized_step.cu": 71.1,
    "csrc/cuda/ops.cpp": 22.3,
    "csrc/paging/managed.cpp": 43.1,
}


def default_jobs() -> int:
    """MAX_JOBS when set, else one job per core (at least 1)."""
    env = os.environ.get("MAX_JOBS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MAX_JOBS must be a positive integer, got {env!r}")
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def makespan(durations: list[float], workers: int) -> float:
    """Wall time of units of these durations on ``workers`` parallel jobs, longest first."""
    loads = [0.0] * max(1, workers)
    for d in sorted(durations, reverse=True):
        i = loads.index(min(loads))
        loads[i] += d
    return max(loads)


def unit_seconds(build_dir: Path) -> dict[str, float]:
    """The measured compile time of each unit, from earlier builds' records here."""
    try:
        return {k: float(v) for k, v in json.loads((build_dir / RECORD).read_text()).get("unit_seconds", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def estimate_seconds(units: list[str], jobs: int, measured: Optional[dict[str, float]] = None) -> tuple[float, str]:
    """(seconds, basis) of compiling ``units`` with ``jobs`` jobs on this machine's cores: the unit
    times measured here when there are some for every unit, else the reference machine's."""
    measured = measured or {}
    if units and all(u in measured for u in units):
        times, basis = [measured[u] for u in units], "measured by an earlier build here"
    else:
        mean = sum(REFERENCE_SECONDS.values()) / len(REFERENCE_SECONDS)
        times = [REFERENCE_SECONDS.get(u, mean) for u in units]
        basis = "the times of a 2-core reference machine"
    parallel = min(jobs, cores())
    # with more jobs than cores the units share the cores: the total work over the cores
    wall = max(makespan(times, parallel), sum(times) / max(1, cores()))
    return wall, basis


# ------------------------------------------------------------------------------------------ ninja
_STATUS = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
_SOURCE = re.compile(r"\s-c\s+(\S+)\s+-o\s")


def _project(build_directory: str) -> Path:
    """The project's root: ``build_directory`` is its ``build/temp``."""
    return Path(build_directory).resolve().parents[1]


def _relative(path: str, base: Path) -> str:
    try:
        return Path(path).resolve().relative_to(base).as_posix()
    except ValueError:
        return path


def _unit(command: str, base: Path) -> str:
    """The source a compiler command line compiles (``-c SOURCE -o OBJECT``), relative to ``base``."""
    m = _SOURCE.search(command)
    if not m:
        return command.split()[-1] if command.split() else command
    return _relative(m.group(1).strip("'\""), base)


def all_units(build_directory: str) -> list[str]:
    """Every unit of the ninja file (the sources of its compile edges)."""
    units = []
    text = (Path(build_directory) / "build.ninja").read_text()
    for m in re.finditer(r"^build \S+?\.o: \S*compile (\S+)$", text, re.M):
        units.append(_relative(m.group(1), _project(build_directory)))
    return units


def planned_units(build_directory: str) -> list[str]:
    """The units ninja would compile now (a dry run), in its order."""
    out = subprocess.run(["ninja", "-n", "-v"], cwd=build_directory, capture_output=True, text=True)
    if out.returncode != 0:
        return all_units(build_directory)
    return [_unit(m.group(3), _project(build_directory)) for m in map(_STATUS.match, out.stdout.splitlines()) if m]


def _durations_from_log(build_directory: str, units: list[str]) -> dict[str, float]:
    """Compile seconds of the units of the latest ninja run, from ninja's own log."""
    objects = {}
    text = (Path(build_directory) / "build.ninja").read_text()
    for m in re.finditer(r"^build (\S+?\.o): \S*compile (\S+)$", text, re.M):
        objects[m.group(1)] = _relative(m.group(2), _project(build_directory))
    found: dict[str, float] = {}
    try:
        lines = (Path(build_directory) / ".ninja_log").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 4 and parts[3] in objects and objects[parts[3]] in units:
            found[objects[parts[3]]] = (int(parts[1]) - int(parts[0])) / 1000.0  # the last entry wins
    return found


def _record_path(build_directory: str) -> Path:
    return Path(build_directory).parent / RECORD


def write_record(build_directory: str, compiled: list[str], wall: float, jobs: int, units: list[str],
                 durations: dict[str, float]) -> None:
    build_dir = Path(build_directory).parent
    measured = unit_seconds(build_dir)
    measured.update(durations)
    record = {"compiled": compiled, "units": units, "wall_seconds": round(wall, 1), "jobs": jobs, "cores": cores(),
              "unit_seconds": {k: round(v, 1) for k, v in sorted(measured.items())}, "finished": time.time()}
    (build_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def record_up_to_date(build_dir: Path, units: list[str]) -> None:
    """Record a set-up that compiled nothing (the extension was up to date)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    measured = unit_seconds(build_dir)
    record = {"compiled": [], "units": units, "wall_seconds": 0.0, "jobs": 0, "cores": cores(),
              "unit_seconds": {k: round(v, 1) for k, v in sorted(measured.items())}, "finished": time.time()}
    (build_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def run_ninja(build_directory: str, verbose: bool = True, error_prefix: str = "Error compiling objects") -> None:
    """Run ninja in ``build_directory`` as torch's ``_run_ninja_build`` does, saying what it does."""
    jobs = default_jobs()
    units = all_units(build_directory)
    plan = planned_units(build_directory)
    measured = unit_seconds(Path(build_directory).parent)
    full, basis = estimate_seconds(units, jobs, measured)
    this, _ = estimate_seconds(plan, jobs, measured)
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(f"{PREFIX} compiling {len(plan)} of {len(units)} units with {jobs} parallel job{'s' * (jobs != 1)} "
        f"(MAX_JOBS) on {cores()} core{'s' * (cores() != 1)}: {', '.join(plan) or 'none'}")
    say(f"{PREFIX} a full build takes about {fmt(full)} here ({basis}); this one about {fmt(this)}. "
        f"Compiler output: {Path(build_directory).parent / LOG}")
    log_path = Path(build_directory).parent / LOG
    start = time.monotonic()
    env = os.environ.copy()
    env["NINJA_STATUS"] = "[%f/%t] "
    proc = subprocess.Popen(["ninja", "-v", "-j", str(jobs)], cwd=build_directory, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    compiled: list[str] = []
    output: list[str] = []
    last_print = start
    with open(log_path, "w") as log:
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            now = time.monotonic()
            if line is None:
                break
            m = _STATUS.match(line.rstrip("\n")) if line else None
            if m:
                unit = _unit(m.group(3), _project(build_directory))
                compiled.append(unit)
                log.write(line)
                say(f"  [{int(m.group(1)):>2}/{m.group(2)}] {unit:<34} compiled  {fmt(now - start):>7} elapsed")
                last_print = now
            elif line:
                log.write(line)
                if not line.startswith("ninja: no work to do"):
                    output.append(line)
            if now - last_print >= HEARTBEAT_S:
                left = len(plan) - len(compiled)
                say(f"  ... {left} of {len(plan)} units to go, {fmt(now - start)} elapsed "
                    f"(this build: about {fmt(this)})")
                last_print = now
    rc = proc.wait()
    wall = time.monotonic() - start
    if rc != 0:
        sys.stdout.write("".join(output[-200:]))
        raise RuntimeError(f"{error_prefix}: ninja exited with {rc} after {fmt(wall)}; the compiler output is above "
                           f"and in {log_path}")
    say(f"{PREFIX} compiled {len(compiled)} unit{'s' * (len(compiled) != 1)} in {fmt(wall)}"
        + (f" ({len(output)} lines of compiler output in {log_path})" if output else ""))
    write_record(build_directory, compiled, wall, jobs, units, _durations_from_log(build_directory, compiled))


# ------------------------------------------------------------------------------- setup.py's build_ext
def build_commands(build_dir: Path) -> dict:
    """setup.py's ``cmdclass``: ``build_ext``, torch's ``BuildExtension`` (ninja) with one persistent
    build directory, ``build_dir``, and a build that says what it does; ``build_plan``, what it would
    compile now. An extension's ``build_config`` (a dict of its build settings)
    is kept in ``build_dir/config.stamp``, rewritten only when it changes: a dependency of the
    library, so new settings rebuild it."""
    import shutil

    from setuptools import Command
    from torch.utils import cpp_extension

    build_dir = Path(build_dir).resolve()

    class BuildExt(cpp_extension.BuildExtension):
        def finalize_options(self):
            requested = self.force  # --force given (1), or not (None)
            super().finalize_options()
            # torch forces every build to run ninja and link again, because distutils' own check
            # (the sources and ext.depends against the library) does not see headers; setup.py
            # lists the headers and the settings stamp in ext.depends, so that check holds here:
            # an up-to-date extension is neither compiled nor linked.
            self.force = bool(requested)
            # pip's editable install (PEP 660) builds in a fresh temporary directory: pin the objects
            # (and, for in-place and editable builds, the linked library, which is then copied into
            # the package) to build_dir, so that nothing built before is compiled again. A regular
            # wheel build keeps its own build_lib: the library goes into the wheel from there.
            self.build_temp = str(build_dir / "temp")
            if self.inplace or getattr(self, "editable_mode", False):
                self.build_lib = str(build_dir / "lib")

        def run(self):
            build_dir.mkdir(parents=True, exist_ok=True)
            for ext in self.extensions:
                config = getattr(ext, "build_config", None)
                if config is None:
                    continue
                stamp = build_dir / "config.stamp"
                text = json.dumps(config, indent=1, sort_keys=True) + "\n"
                if not stamp.exists() or stamp.read_text() != text:
                    stamp.write_text(text)  # newer than the library: it is rebuilt with the new settings
                if str(stamp) not in ext.depends:
                    ext.depends = list(ext.depends) + [str(stamp)]
            super().run()

        def build_extension(self, ext):
            ran = []
            original = getattr(cpp_extension, "_run_ninja_build", None)

            def ninja(*args, **kwargs):
                ran.append(True)
                return run_ninja(*args, **kwargs)

            if original is None:
                print(f"{PREFIX} this torch has no _run_ninja_build; building without progress lines", flush=True)
            else:
                cpp_extension._run_ninja_build = ninja
            try:
                super().build_extension(ext)
            finally:
                if original is not None:
                    cpp_extension._run_ninja_build = original
            if not ran and original is not None:
                units = [Path(s).as_posix() for s in ext.sources]
                print(f"{PREFIX} {ext.name} is up to date: 0 of {len(units)} units compiled", flush=True)
                record_up_to_date(build_dir, units)

        def copy_file(self, infile, outfile, *args, **kwargs):
            """The in-place copy of the library: skipped when the same file is already there, else
            written beside it and renamed over it, so that a process that has the old one loaded
            keeps a whole file."""
            if not str(outfile).endswith((".so", ".pyd")):
                return super().copy_file(infile, outfile, *args, **kwargs)
            try:
                a, b = os.stat(infile), os.stat(outfile)
                if a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime):
                    return outfile, False
            except OSError:
                pass
            tmp = f"{outfile}.tmp{os.getpid()}"
            shutil.copy2(infile, tmp)
            os.replace(tmp, outfile)
            return outfile, True

    class BuildPlan(Command):
        """``python setup.py build_plan``: which units a build would compile now, compiling nothing."""

        description = "say which units `build_ext --inplace` would compile now (compiles nothing)"
        user_options = [("json", None, "print the plan as JSON")]

        def initialize_options(self):
            self.json = False

        def finalize_options(self):
            pass

        def run(self):
            build_ext = self.distribution.get_command_obj("build_ext")
            build_ext.inplace = 1
            build_ext.ensure_finalized()
            plans = [plan_extension(build_ext, ext, build_dir) for ext in build_ext.extensions]
            if self.json:
                print(json.dumps(plans))
            for p in plans if not self.json else ():
                print(f"{PREFIX} plan for {p['name']}: {len(p['compile'])} of {len(p['units'])} units to compile"
                      + (f" ({p['why']})" if p["why"] else "") + (f": {', '.join(p['compile'])}" if p["compile"] else ""))

    return {"build_ext": BuildExt.with_options(use_ninja=True), "build_plan": BuildPlan}


def plan_extension(build_ext, ext, build_dir: Path) -> dict:
    """What ``build_ext`` would do for ``ext``: {"name", "units", "compile", "link", "why"}."""
    units = [Path(s).as_posix() for s in ext.sources]
    plan = {"name": ext.name, "units": units, "compile": [], "link": False, "why": ""}
    config = getattr(ext, "build_config", None)
    stamp = build_dir / "config.stamp"
    if config is not None and (not stamp.exists()
                               or stamp.read_text() != json.dumps(config, indent=1, sort_keys=True) + "\n"):
        plan.update(compile=units, link=True, why="new build settings, or no build yet")
        return plan
    inplace, build_ext.inplace = build_ext.inplace, 0
    try:
        library = build_ext.get_ext_fullpath(ext.name)
    finally:
        build_ext.inplace = inplace
    inputs = list(ext.sources) + list(ext.depends) + ([str(stamp)] if config is not None else [])
    if os.path.exists(library) and not _newer_group(inputs, library):
        return plan
    plan["link"] = True
    ninja_dir = build_dir / "temp"
    if not (ninja_dir / "build.ninja").exists():
        plan.update(compile=units, why="no build yet")
        return plan
    plan.update(compile=planned_units(str(ninja_dir)), why="sources changed since the last build")
    return plan


def _newer_group(inputs: list[str], target: str) -> bool:
    t = os.path.getmtime(target)
    return any(not os.path.exists(i) or os.path.getmtime(i) > t for i in inputs)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="The record of the last build of pagedopt._C in ./build.")
    ap.add_argument("--build-dir", default=str(ROOT / "build"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    path = Path(a.build_dir) / RECORD
    if not path.exists():
        print(f"no build recorded in {a.build_dir} (run `make setup`)")
        return 1
    record = json.loads(path.read_text())
    if a.json:
        print(json.dumps(record, indent=1))
    else:
        print(f"last build: {len(record['compiled'])} of {len(record['units'])} units compiled in "
              f"{fmt(record['wall_seconds'])}: {', '.join(record['compiled']) or 'none (up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
