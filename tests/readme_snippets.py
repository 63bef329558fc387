"""The python snippets of a README.md section, found by its heading's title at any level (the
section runs to the next heading of the same or a higher level; lines inside code fences, such as
a snippet's comments, are no headings), for the tests that run them."""
from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def section_snippets(title: str) -> list[str]:
    with open(README) as f:
        lines = f.read().splitlines(keepends=True)
    body, level, fenced = None, 0, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"(#+) (.*?)\s*$", line)
        if heading and body is not None and len(heading.group(1)) <= level:
            break
        if heading and body is None and heading.group(2) == title:
            body, level = [], len(heading.group(1))
        elif body is not None:
            body.append(line)
    assert body is not None, f"README.md has no heading {title!r}"
    return re.findall(r"```python\n(.*?)```", "".join(body), re.S)
