"""Compile a C++ check of the CUDA search tables' host half with the host compiler and run it on
codebooks (tests/test_code_table_host.py, tests/test_code_table4_host.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_host_check(tmp_path: Path, name: str, source: str, codebooks) -> subprocess.CompletedProcess:
    """Build ``source`` as ``name`` against csrc/include and csrc/cuda (-ffp-contract=off: s * inv
    rounded once, as the kernels' multiply) and run it with the step over float bit patterns (1:
    every one, with PAGEDOPT_BIG_TESTS=1; else 4099) and one float32 file per codebook. Skips
    without a host C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    exe = tmp_path / name
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{ROOT / 'csrc' / 'include'}",
                    f"-I{ROOT / 'csrc' / 'cuda'}", str(src), "-o", str(exe)], check=True)
    files = []
    for i, code in enumerate(codebooks):
        f = tmp_path / f"{name}_code_{i}.bin"
        f.write_bytes(code.numpy().tobytes())
        files.append(str(f))
    step = "1" if os.environ.get("PAGEDOPT_BIG_TESTS") == "1" else "4099"
    return subprocess.run([str(exe), step, *files], capture_output=True, text=True, timeout=1800)
