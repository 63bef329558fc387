"""scripts/sass_loops.py: the loops of a kernel read from a SASS listing (cuobjdump -sass), on a
hand-written listing whose loops, spills and calls are known."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sass_loops", os.path.join(ROOT, "scripts", "sass_loops.py"))
sass_loops = importlib.util.module_from_spec(_spec)
sys.modules["sass_loops"] = sass_loops  # the dataclass looks its module up
_spec.loader.exec_module(sass_loops)

# Two functions. In kernel_a: an outer loop 0x0010-0x0090 (9 instructions, a spill load, a call)
# around an inner one 0x0030-0x0060 (4 instructions, a spill store), a forward branch, and a
# divergence fallback branching backwards (BRA.DIV: not a loop). kernel_b: a one-instruction loop.
LISTING = """
        Function : _Z8kernel_aPf
        .headerflags    @"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        /*0010*/                   LDL R2, [R1] ;                               /* 0x0000000001027983 */
        /*0020*/              @P0 BRA 0x80 ;                                   /* 0x0000000000000947 */
        /*0030*/                   FADD R3, R3, 1 ;                             /* 0x3f80000003037421 */
        /*0040*/                   STL [R1+0x4], R3 ;                           /* 0x0000040301007387 */
        /*0050*/                   IADD3 R4, R4, 0x1, RZ ;                      /* 0x0000000104047810 */
        /*0060*/             @!P1 BRA 0x30 ;                                   /* 0xfffffffc00008947 */
        /*0070*/                   CALL.REL.NOINC 0xc0 ;                        /* 0x0000004000007944 */
        /*0080*/                   BRA.DIV UR4, 0x10 ;                          /* 0x0000000000007947 */
        /*0090*/              @P2 BRA P3, 0x10 ;                               /* 0xfffffff400002947 */
        /*00a0*/                   EXIT ;                                       /* 0x000000000000794d */
        /*00b0*/                   BRA 0xb0;                                    /* 0xfffffffc00007947 */
        /*00c0*/                   RET.REL.NODEC R20 0x0 ;                      /* 0xffffff3c14007950 */
        ..........
        Function : _Z8kernel_bPf
        /*0000*/                   NOP ;                                        /* 0x0000000000007918 */
        /*0010*/                   BRA 0x10;                                    /* 0xfffffffc00007947 */
"""


def test_functions_split_by_name():
    fns = sass_loops.functions(LISTING)
    assert sorted(fns) == ["_Z8kernel_aPf", "_Z8kernel_bPf"]
    assert len(fns["_Z8kernel_aPf"]) == 13 and len(fns["_Z8kernel_bPf"]) == 2
    assert fns["_Z8kernel_aPf"][3] == (0x30, "FADD R3, R3, 1")


def test_loops_are_backward_branches_innermost_first():
    got = [(lp.start, lp.end, lp.instructions, lp.spill_loads, lp.spill_stores, lp.calls)
           for lp in sass_loops.loops(sass_loops.functions(LISTING)["_Z8kernel_aPf"])]
    assert got == [(0xb0, 0xb0, 1, 0, 0, 0), (0x30, 0x60, 4, 0, 1, 0), (0x10, 0x90, 9, 1, 1, 1)]


def test_main_prints_the_chosen_kernel_only(tmp_path, capsys):
    listing = tmp_path / "k.sass"
    listing.write_text(LISTING)
    assert sass_loops.main([str(listing), "kernel_a", "--max", "5"]) == 0
    out = capsys.readouterr().out
    assert "_Z8kernel_aPf: 13 instructions" in out and "kernel_b" not in out
    assert "loop 0x00030-0x00060: 4 instructions, LDL 0, STL 1, calls 0" in out
    assert "0x00010" not in out  # 9 instructions > --max 5
    assert sass_loops.main([str(listing), "no_such_kernel"]) == 1
