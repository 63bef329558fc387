"""Bit-for-bit comparison of tensors across backends, and random inputs for the kernel tests
(tests/test_cuda_kernels.py, tests/test_cuda_quantize.py)."""
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        bad = (a != e).reshape(-1).nonzero().reshape(-1)
        i = bad[:5].tolist()
        fa, fe = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} elements differ; first at {i}: "
                             f"got {fa[i].tolist()}, expected {fe[i].tolist()}")


def rand_nonzero(n: int, gen: torch.Generator, dtype=torch.float32, spread: float = 1.0) -> torch.Tensor:
    """Random values over several orders of magnitude, never zero (also after rounding to dtype)."""
    x = torch.randn(n, generator=gen) * torch.exp(spread * torch.randn(n, generator=gen))
    x = x.to(dtype)
    x[x == 0] = 1e-3
    return x
