"""One build: a build compiles only what changed, and a second set-up compiles nothing.

The checks count compiled units (the record scripts/build_progress.py writes, and its progress
lines), never seconds. The mechanism (setup.py's build commands, from scripts/build_progress.py) is
tried on a throwaway two-unit extension: a first in-place build compiles both units, a second
none, and neither does the editable install (pip's PEP 660 hook, called here without installing
anything); a changed header recompiles only the unit that includes it, changed build settings
every unit. The repository's own build is checked too, when the set-up has built it here: a
second in-place build and the editable hook compile none of its units.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import build_progress  # noqa: E402

pytest.importorskip("ninja")
if not shutil.which("ninja") or not shutil.which(os.environ.get("CXX", "c++")):
    pytest.skip("needs ninja and a C++ compiler", allow_module_level=True)

SETUP = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from setuptools import setup
    from torch.utils import cpp_extension
    HERE = Path(__file__).resolve().parent
    sys.path.insert(0, {scripts!r})
    import build_progress
    flag = os.environ.get("TINY_FLAG", "0")
    ext = cpp_extension.CppExtension("tinyext._C", ["src/a.cpp", "src/b.cpp"], depends=["src/a.h"],
                                     extra_compile_args={{"cxx": ["-O0", f"-DTINY_FLAG={{flag}}"]}})
    ext.build_config = {{"flag": flag}}
    setup(name="tinyext", version="0.0", packages=["tinyext"], ext_modules=[ext],
          cmdclass=build_progress.build_commands(HERE / "build"))
""")
EDITABLE = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"


def run(cwd, *args, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def record(project: Path) -> dict:
    return json.loads((project / "build" / build_progress.RECORD).read_text())


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "tinyext").mkdir()
    (tmp_path / "tinyext" / "__init__.py").write_text("")
    (tmp_path / "src" / "a.h").write_text("inline int a_value() { return 1; }\n")
    (tmp_path / "src" / "a.cpp").write_text('#include "a.h"\nint a_fn() { return a_value(); }\n')
    (tmp_path / "src" / "b.cpp").write_text("int b_fn() { return 2; }\n")
    (tmp_path / "setup.py").write_text(SETUP.format(scripts=str(ROOT / "scripts")))
    (tmp_path / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=64"]\n'
                                             'build-backend = "setuptools.build_meta"\n')
    return tmp_path


def library(project: Path) -> Path:
    (found,) = (project / "tinyext").glob("_C*.so")
    return found


def test_second_build_and_editable_install_compile_nothing(tiny, tmp_path_factory):
    out = run(tiny, "setup.py", "-q", "build_ext", "--inplace")
    assert sorted(record(tiny)["compiled"]) == ["src/a.cpp", "src/b.cpp"]
    # it said what it compiles, then each unit with its progress and elapsed time
    assert "compiling 2 of 2 units" in out and "src/a.cpp, src/b.cpp" in out, out
    assert "[ 1/2]" in out and "[ 2/2]" in out and "elapsed" in out and "a full build takes about" in out, out
    lib = library(tiny)
    stat = lib.stat()

    out = run(tiny, "setup.py", "-q", "build_ext", "--inplace")
    assert record(tiny)["compiled"] == [], out
    assert "up to date: 0 of 2 units compiled" in out, out
    assert lib.stat().st_mtime_ns == stat.st_mtime_ns and lib.stat().st_ino == stat.st_ino  # not even relinked

    out = run(tiny, "-c", EDITABLE, str(tmp_path_factory.mktemp("wheel")))
    assert record(tiny)["compiled"] == [], out
    assert lib.stat().st_mtime_ns == stat.st_mtime_ns and lib.stat().st_ino == stat.st_ino

    # a changed header: only the unit that includes it; changed settings: every unit
    later = time.time() + 5
    os.utime(tiny / "src" / "a.h", (later, later))
    (plan,) = json.loads(run(tiny, "setup.py", "-q", "build_plan", "--json").strip().splitlines()[-1])
    assert plan["compile"] == ["src/a.cpp"] and plan["link"] is True  # what the next build compiles
    run(tiny, "setup.py", "-q", "build_ext", "--inplace")
    assert record(tiny)["compiled"] == ["src/a.cpp"]
    run(tiny, "setup.py", "-q", "build_ext", "--inplace", env={"TINY_FLAG": "1"})
    assert sorted(record(tiny)["compiled"]) == ["src/a.cpp", "src/b.cpp"]


def test_estimate_of_a_full_build():
    assert build_progress.makespan([5, 4, 3, 3, 3], 2) == 10  # longest first: 5+3, 4+3+3
    assert build_progress.makespan([6.0], 4) == 6.0
    units = list(build_progress.REFERENCE_SECONDS)
    one, basis = build_progress.estimate_seconds(units, 1)  # one job: the sum
    assert one == pytest.approx(sum(build_progress.REFERENCE_SECONDS.values())) and "reference" in basis
    measured = {u: 10.0 + i for i, u in enumerate(units)}
    wall, basis = build_progress.estimate_seconds(units, 2, measured)
    times = list(measured.values())
    assert "measured" in basis
    assert wall == pytest.approx(max(build_progress.makespan(times, min(2, build_progress.cores())),
                                     sum(times) / build_progress.cores()))


def test_second_set_up_of_this_checkout_compiles_nothing(tmp_path):
    """The repository's extension, as the set-up built it: a second in-place build and the editable
    install compile none of its units. `make test` runs this right after its set-up, with
    PAGEDOPT_EXPECT_UP_TO_DATE=1: then an out-of-date build is a failure, not a skip."""
    expect = os.environ.get("PAGEDOPT_EXPECT_UP_TO_DATE") == "1"
    if not (ROOT / "build" / "temp" / "build.ninja").exists():
        if expect:
            pytest.fail("the set-up left no build/temp/build.ninja")
        pytest.skip("the extension was not built here by the set-up (make setup)")
    if not expect:  # run by hand: only where nothing would be compiled
        (plan,) = json.loads(run(ROOT, "setup.py", "-q", "build_plan", "--json").strip().splitlines()[-1])
        if plan["compile"] or plan["link"]:
            pytest.skip(f"the build here is out of date ({plan['why']}); make setup builds it")
    out = run(ROOT, "setup.py", "-q", "build_ext", "--inplace")
    assert record(ROOT)["compiled"] == [] and "up to date: 0 of" in out, out
    out = run(ROOT, "-c", EDITABLE, str(tmp_path))
    assert record(ROOT)["compiled"] == [], out
