"""The loops of one kernel in a SASS listing, with their instruction counts: what a kernel's inner
loop costs each lane per iteration, and whether it spills (LDL/STL), read from
``cuobjdump -sass`` without running the kernel. Needs no GPU: cuobjdump reads a cubin built here.

    nvcc -cubin -arch=sm_90a ... csrc/cuda/quantized_step.cu -o /tmp/qs.cubin   # setup.py's flags
    cuobjdump -sass /tmp/qs.cubin > /tmp/qs.sass
    python scripts/sass_loops.py /tmp/qs.sass four_bit_step_kernel Adam BFloat16

Where the toolkit has no cuobjdump, the package registry's ``nvidia-cuda-cuobjdump`` wheel holds one
(``pip download --no-deps nvidia-cuda-cuobjdump``, unzip it: ``nvidia/cu13/bin/cuobjdump``).

Each backward branch (not a ``BRA.DIV`` divergence fallback) closes a loop: its body is every
instruction from the branch's target to the branch, so the count is an upper bound of one
iteration's path (branches not taken, such as a slow path's call, are counted too).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)", re.M)
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BRANCH = re.compile(r"\bBRA(?!\.DIV)(?:\.\w+)*\s+(?:U?!?P\w+,\s*)?(0x[0-9a-f]+)")


@dataclass
class Loop:
    start: int  # address of the branch's target
    end: int    # address of the backward branch
    instructions: int
    spill_loads: int
    spill_stores: int
    calls: int


def functions(listing: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's (address, instruction) list, by mangled name."""
    marks = list(_FUNCTION.finditer(listing))
    out = {}
    for k, mark in enumerate(marks):
        body = listing[mark.end(): marks[k + 1].start() if k + 1 < len(marks) else len(listing)]
        out[mark.group(1)] = [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(body)]
    return out


def loops(instructions: list[tuple[int, str]]) -> list[Loop]:
    """Every loop closed by a backward branch, innermost (smallest) first."""
    found = []
    for address, text in instructions:
        m = _BRANCH.search(text)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target > address:
            continue
        body = [t for a, t in instructions if target <= a <= address]
        found.append(Loop(target, address, len(body),
                          sum(1 for t in body if re.search(r"\bLDL\b", t)),
                          sum(1 for t in body if re.search(r"\bSTL\b", t)),
                          sum(1 for t in body if "CALL" in t)))
    return sorted(found, key=lambda lp: lp.instructions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("listing", help="the output of cuobjdump -sass")
    ap.add_argument("names", nargs="+", help="words that the kernel's mangled name contains, e.g. "
                    "four_bit_step_kernel Adam BFloat16")
    ap.add_argument("--max", type=int, default=5000, help="leave out loops longer than this (default 5000)")
    args = ap.parse_args(argv)
    with open(args.listing) as f:
        listing = f.read()
    chosen = {name: ins for name, ins in functions(listing).items() if all(w in name for w in args.names)}
    if not chosen:
        print(f"no function's name contains all of {args.names}", file=sys.stderr)
        return 1
    for name, ins in sorted(chosen.items()):
        print(f"{name}: {len(ins)} instructions")
        for lp in loops(ins):
            if lp.instructions <= args.max:
                print(f"  loop {lp.start:#07x}-{lp.end:#07x}: {lp.instructions} instructions, "
                      f"LDL {lp.spill_loads}, STL {lp.spill_stores}, calls {lp.calls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
