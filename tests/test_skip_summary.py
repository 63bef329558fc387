"""The closing summary groups the skipped tests by reason, a line each (tests/conftest.py)."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import conftest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def skipped(reason):
    return SimpleNamespace(skipped=True, longrepr=("file.py", 1, f"Skipped: {reason}"))


def test_reasons_counted_most_frequent_first():
    reports = [skipped("needs a CUDA GPU")] * 5 + [skipped("needs two GPUs")] * 2 + [skipped("b")] * 2
    assert conftest.skip_reasons(reports) == [(5, "needs a CUDA GPU"), (2, "b"), (2, "needs two GPUs")]


def test_summary_of_a_run(tmp_path):
    shutil.copy(os.path.join(TESTS_DIR, "conftest.py"), tmp_path / "conftest.py")
    many = "\n".join(f"def test_other_{i}():\n    pytest.skip('reason {i}')\n" for i in range(10))
    (tmp_path / "test_some.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("i", range(7))
        def test_gpu(i):
            pytest.skip("needs a CUDA GPU")

        @pytest.mark.skipif(True, reason="needs two GPUs")
        def test_two():
            pass

        def test_runs():
            pass
    """) + many)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"-+ 18 skipped, by reason -+", out), out
    assert re.search(r"^\s+7  needs a CUDA GPU$", out, re.M), out
    assert re.search(r"^\s+1  needs two GPUs$", out, re.M), out
    # 12 reasons: the 8 most frequent on a line each, the rest on one line
    assert re.search(r"^\s+4  for 4 other reasons \(pytest -rs lists each\)$", out, re.M), out
    assert out.index("by reason") < out.index("1 passed, 18 skipped")
