"""Every op of the pagedopt namespace has a fake (a Meta kernel, which torch.library.register_fake
registers), so that torch.compile, torch.export and opcheck can trace it: an op declared in
csrc/pagedopt.cpp without one fails here. The fakes of the tensor ops are checked against the
real ops elsewhere (opcheck in test_quant.py, test_engine.py, test_compile.py); the three
queries whose answers are not tensors are checked here."""
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException

import pagedopt  # noqa: F401  (loads the library and registers the fakes)

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "csrc" / "pagedopt.cpp"


def declared_ops():
    """The names of the ops that csrc/pagedopt.cpp declares (m.def("name(...) -> ...");
    a schema string may begin on the line after m.def( )."""
    return sorted(set(re.findall(r'\bm\.def\(\s*"(\w+)\(', SCHEMA_FILE.read_text())))


def dispatcher_ops():
    """The names of the ops of the pagedopt namespace that the dispatcher knows."""
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("pagedopt::"))


def has_fake(name):
    qualname = f"pagedopt::{name}"
    return (torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
            or torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None)


def test_the_schema_file_declares_every_op_of_the_namespace():
    """The parse of the schema file finds exactly the ops the dispatcher knows (so the next test
    looks at all of them, and an op defined elsewhere would show up here)."""
    declared = declared_ops()
    assert declared, f"no m.def found in {SCHEMA_FILE}"
    assert declared == dispatcher_ops()


@pytest.mark.parametrize("name", declared_ops())
def test_op_has_a_fake(name):
    assert has_fake(name), (f"pagedopt::{name} has no fake: register one with "
                            f"@torch.library.register_fake(\"pagedopt::{name}\") in pagedopt/_ops.py")


def test_an_op_without_a_fake_is_reported():
    """The check itself can fail: an op defined without a fake is seen as such, and once a fake is
    registered, as having one."""
    lib = torch.library.Library("pagedopt_fake_probe", "FRAGMENT")
    try:
        lib.define("probe(Tensor x) -> Tensor")
        qualname = "pagedopt_fake_probe::probe"
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
        assert torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is None
        torch.library.register_fake(qualname, lambda x: torch.empty_like(x), lib=lib)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
    finally:
        lib._destroy()


def test_concurrent_managed_access_fake_gives_the_real_answer():
    """A property of the device: the same answer (or the same error) as the real op."""
    try:
        expected = torch.ops.pagedopt.concurrent_managed_access(0)
    except RuntimeError as e:
        with FakeTensorMode(), pytest.raises(RuntimeError, match=re.escape(str(e).splitlines()[0])):
            torch.ops.pagedopt.concurrent_managed_access(0)
        return
    with FakeTensorMode():
        assert torch.ops.pagedopt.concurrent_managed_access(0) == expected


def test_memory_query_fakes():
    """is_managed of a CPU tensor is False (as its CPU kernel); of a CUDA tensor, and residency,
    the answer depends on where the bytes live, which a fake tensor lacks: the fakes say so with
    DataDependentOutputException, and residency refuses a CPU tensor, naming the argument."""
    with FakeTensorMode() as mode:
        cpu = mode.from_tensor(torch.zeros(4))
        cuda = torch.empty(4, device="meta")  # a fake CUDA tensor needs no GPU: metadata only
        cuda = mode.from_tensor(cuda)
        cuda.fake_device = torch.device("cuda", 0)
        assert torch.ops.pagedopt.is_managed(cpu) is False
        with pytest.raises(DataDependentOutputException):
            torch.ops.pagedopt.is_managed(cuda)
        with pytest.raises(DataDependentOutputException):
            torch.ops.pagedopt.residency(cuda)
        with pytest.raises(RuntimeError, match=r"residency: t must be a CUDA tensor .* on cpu"):
            torch.ops.pagedopt.residency(cpu)


def test_is_managed_under_torch_compile_breaks_the_graph_and_answers_eagerly():
    def f(x):
        y = x + 1
        return y * 2 if torch.ops.pagedopt.is_managed(y) else y * 3

    x = torch.ones(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=False)(x), f(x))


@pytest.mark.parametrize("n", [1, 201, 256])
def test_four_bit_quantize_fakes_give_the_real_shapes(n):
    """A 16-entry code means 4-bit codes packed two a byte: the fakes give the real ops' shapes
    ((ceil(n/2),) codes, (2 * bytes,) values) and pass opcheck."""
    from pagedopt.quant import dynamic_codebook_4bit
    x = torch.randn(n)
    code = dynamic_codebook_4bit(True)
    codes, absmax = torch.ops.pagedopt.quantize_blockwise(x, code, 128)
    out = torch.ops.pagedopt.dequantize_blockwise(codes, absmax, code, 128, torch.bfloat16)
    assert codes.shape == ((n + 1) // 2,) and absmax.shape == ((n + 127) // 128,)
    assert out.shape == (2 * codes.numel(),) and out.dtype == torch.bfloat16
    with FakeTensorMode() as mode:
        fc, fa = torch.ops.pagedopt.quantize_blockwise(mode.from_tensor(x), mode.from_tensor(code), 128)
        fo = torch.ops.pagedopt.dequantize_blockwise(mode.from_tensor(codes), mode.from_tensor(absmax),
                                                     mode.from_tensor(code), 128, torch.bfloat16)
    assert (fc.shape, fc.dtype, fa.shape, fa.dtype) == (codes.shape, codes.dtype, absmax.shape, absmax.dtype)
    assert (fo.shape, fo.dtype) == (out.shape, out.dtype)
    torch.library.opcheck(torch.ops.pagedopt.quantize_blockwise, (x, code, 128))
    torch.library.opcheck(torch.ops.pagedopt.dequantize_blockwise, (codes, absmax, code, 128, torch.float32))
