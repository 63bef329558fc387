"""Smoke test of the mutation runner (scripts/mutation.py, `make mutation`): one cheap Python
mutant that the suite must kill (its hint test fails at once, so the full suite never runs) and one
stale snippet that must be reported as stale, from a catalog written here."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CATALOG = '''
[[mutant]]
name = "smoke_beta_one_accepted"
file = "pagedopt/optim/hyperparameters.py"
find = "or not 0.0 <= b < 1.0:"
replace = "or not 0.0 <= b <= 1.0:"
bug = "beta = 1.0 accepted"
kind = "cpu"
tests = ["tests/test_optim_api.py::test_unsupported_arguments_raise"]

[[mutant]]
name = "smoke_stale"
file = "pagedopt/quant.py"
find = "this snippet is not in quant.py"
replace = "nor is this one"
bug = "a catalog entry whose code has moved on"
kind = "cpu"
'''


def test_runner_kills_a_mutant_and_reports_a_stale_one(tmp_path):
    if not list((ROOT / "pagedopt").glob("_C*.so")):
        pytest.skip("the extension is not built in place")
    catalog = tmp_path / "mutants.toml"
    catalog.write_text(CATALOG)
    out_json, out_md = tmp_path / "result.json", tmp_path / "MUTATION.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutation.py"), "--catalog", str(catalog),
         "--only", "smoke_beta_one_accepted", "--only", "smoke_stale", "--timeout", "400",
         "--source", "worktree", "--workdir", str(tmp_path / "scratch"),
         "--json", str(out_json), "--out", str(out_md), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out_json.read_text())
    status = {r["name"]: r["status"] for r in report["results"]}
    assert status == {"smoke_beta_one_accepted": "killed", "smoke_stale": "stale"}, report
    assert (report["killed"], report["counted"]) == (1, 1)
    killer = next(r for r in report["results"] if r["name"] == "smoke_beta_one_accepted")["detail"]
    assert "test_unsupported_arguments_raise" in killer
    md = out_md.read_text()
    assert "**Score: 1 / 1 killed (100%)**" in md and "| `smoke_stale` |" in md
    # the checkout itself is never mutated
    assert "b < 1.0" in (ROOT / "pagedopt" / "optim" / "hyperparameters.py").read_text()


def test_every_catalog_snippet_is_found_exactly_once():
    """The catalog grows with the code: a refactor that moves a mutant's snippet must re-point it
    (a stale mutant tests nothing). Every entry of tests/mutants.toml names a file that exists and
    a snippet that occurs exactly once in it, and no two entries share a name."""
    import tomllib

    catalog = tomllib.loads((ROOT / "tests" / "mutants.toml").read_text())["mutant"]
    assert len(catalog) >= 40
    names = [m["name"] for m in catalog]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    stale = [(m["name"], m["file"], (ROOT / m["file"]).read_text().count(m["find"]) if (ROOT / m["file"]).exists()
              else "no such file") for m in catalog]
    assert [s for s in stale if s[2] != 1] == []


def test_every_python_mutant_parses():
    """A Python mutant that does not parse is 'killed' by the import error of every test, whatever
    the suite checks: an invalid mutant. (One did: a replacement cut a comment in half, leaving its
    tail as code.) The runner reports such a mutant as build-error, by the rule checked here over the
    whole catalog: none is in it."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("mutation_runner", ROOT / "scripts" / "mutation.py")
    runner = importlib.util.module_from_spec(spec)
    sys.modules["mutation_runner"] = runner  # its dataclasses look their module up
    spec.loader.exec_module(runner)
    assert runner.python_parse_error("x.py", "a = (") is not None  # the rule can fail
    assert runner.python_parse_error("x.cpp", "a = (") is None
    catalog = tomllib.loads((ROOT / "tests" / "mutants.toml").read_text())["mutant"]
    bad = [(m["name"], why) for m in catalog
           if (why := runner.python_parse_error(m["file"], (ROOT / m["file"]).read_text().replace(m["find"], m["replace"])))
           is not None]
    assert bad == []
