"""Which distributions the set-up scripts must install.

    python scripts/missing_packages.py NAME...       the NAMEs not installed (one line, space-separated)
    python scripts/missing_packages.py NAME==V...    also those installed at another version
    python scripts/missing_packages.py NAME>=V...    also those installed at an older version
    python scripts/missing_packages.py --editable-build NAME...
                                                     the NAMEs, and what `pip install --no-build-isolation -e .`
                                                     needs: setuptools>=64, and wheel where setuptools < 70.1
    python scripts/missing_packages.py --installed-here pagedopt
                                                     exit 0 when pagedopt is installed, editable, from this checkout
    python scripts/missing_packages.py --where pagedopt
                                                     the checkout an editable pagedopt is installed from, if any
"""
from __future__ import annotations

import importlib.metadata as metadata
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


def _release(version: str) -> tuple:
    """The leading numbers of a version: "70.1.0.post1" -> (70, 1, 0)."""
    parts = []
    for piece in version.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits or not piece.startswith(digits):
            if digits:
                parts.append(int(digits))
            break
        parts.append(int(digits))
    return tuple(parts)


def missing(requirements: list[str]) -> list[str]:
    out = []
    for req in requirements:
        op = ">=" if ">=" in req else "=="
        name, _, version = req.partition(op)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(req)
            continue
        if version and (have != version if op == "==" else _release(have) < _release(version)):
            out.append(req)
    return out


def editable_source(name: str) -> Optional[str]:
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    info = json.loads(text or "{}")
    url = info.get("url", "")
    if not info.get("dir_info", {}).get("editable") or not url.startswith("file://"):
        return None
    return url[len("file://"):]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--installed-here"]:
        where = editable_source(argv[1])
        return 0 if where is not None and Path(where).resolve() == ROOT else 1
    if argv[:1] == ["--where"]:
        where = editable_source(argv[1])
        if where is None:
            try:
                metadata.distribution(argv[1])
                where = "a non-editable install"
            except metadata.PackageNotFoundError:
                where = ""
        print(where)
        return 0
    if argv[:1] == ["--editable-build"]:
        argv = argv[1:] + ["setuptools>=64"]
        try:  # setuptools has its own bdist_wheel since 70.1; before it, the wheel package's
            old = _release(metadata.version("setuptools")) < (70, 1)
        except metadata.PackageNotFoundError:
            old = False  # the setuptools>=64 installed then is newer
        if old:
            argv.append("wheel")
    print(" ".join(missing(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
