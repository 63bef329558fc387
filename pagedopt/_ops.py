"""Typed Python wrappers over torch.ops.pagedopt.*, and a fake (meta) implementation of every
op so that torch.compile, torch.export and torch.library.opcheck can trace them
(tests/test_op_fakes.py fails for an op of csrc/pagedopt.cpp without one)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, unset_fake_temporarily

from . import _C  # noqa: F401  (loads the library, which registers the ops)

ops = torch.ops.pagedopt


def has_cuda_kernels() -> bool:
    """True when this build of pagedopt carries the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("pagedopt::quantized_step_", "CUDA")


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int = 256):
    """(codes, absmax): uint8 codes shaped like x for a 256-entry code; for a 16-entry code 4-bit
    codes packed two a byte, 1-D of ceil(x.numel() / 2) bytes (blocksize: any multiple of 32)."""
    return ops.quantize_blockwise(x, code, blocksize)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int = 256,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values shaped like codes (256-entry code); for a 16-entry code, 2 * codes.numel() values, 1-D
    (an odd number of values: drop the last one)."""
    return ops.dequantize_blockwise(codes, absmax, code, blocksize, dtype)


GRADS_CONTIGUOUS = -1
GRADS_NOT_CONTIGUOUS = -2


def check_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> int:
    """Index of the first gradient that does not match its parameter, else GRADS_CONTIGUOUS or
    GRADS_NOT_CONTIGUOUS."""
    return ops.check_grads(list(params), list(grads))


def quantized_step_(algorithm: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    states: Sequence[Sequence[torch.Tensor]], absmax: Sequence[Sequence[torch.Tensor]], steps,
                    qmaps: Sequence[torch.Tensor], hyper: Sequence[float], *,
                    grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None,
                    scales: Optional[torch.Tensor] = None, lr: Optional[torch.Tensor] = None,
                    sr_ids: Optional[Sequence[int]] = None, sr_offsets: Optional[Sequence[int]] = None,
                    sr_seed: int = 0) -> None:
    """One fused step of the generic engine (csrc/include/pagedopt/algorithms.h). ``states`` and
    ``absmax`` hold one list per state key (``absmax`` and ``qmaps`` empty for 32-bit states);
    ``scales``: the per-tensor update scales of lars and lamb; ``lr``: a one-element tensor on the
    parameters' device that the kernel reads in place of ``hyper[0]`` (capturable steps).
    ``sr_ids`` (one per parameter): bf16 parameters are rounded stochastically with the bits of
    (``sr_seed``, ``sr_ids[i]``, ``steps[i]``, element index counted from ``sr_offsets[i]``).
    With every list empty there is nothing to update: no call (an op without a tensor argument
    has no device for torch's dispatcher to choose a kernel by)."""
    if not params and not grads and not steps and not any(states) and not any(absmax):
        return
    ops.quantized_step_(algorithm, list(params), list(grads), [t for key in states for t in key],
                        [t for key in absmax for t in key], list(steps), list(qmaps), [float(h) for h in hyper],
                        grad_scale, found_inf, scales, lr, None if sr_ids is None else list(sr_ids),
                        None if sr_offsets is None else list(sr_offsets), sr_seed)


def stochastic_round_bf16(x: torch.Tensor, step: torch.Tensor, seed: int, id: int, offset: int = 0) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 stochastically, element i with the random bits of
    (``seed``, ``id``, ``step``, ``offset + i``): the bits quantized_step_ rounds parameter ``id``'s
    element ``offset + i`` with at that step (csrc/include/pagedopt/stochastic_round.h)."""
    return ops.stochastic_round_bf16(x, step, seed, id, offset)


def quantized_step_list_(held, params: list, grads: list, hyper: list, grad_scale: Optional[torch.Tensor] = None,
                         found_inf: Optional[torch.Tensor] = None, lr: Optional[torch.Tensor] = None,
                         sr_seed: Optional[int] = None) -> None:
    """quantized_step_ on the states that ``held`` (a torch.classes.pagedopt.QuantizedStateList)
    holds. An eager call with a real held object goes straight to the op's C++ entry point:
    torch's Python entry point of an op with a custom-class argument first walks every element of
    every list argument, looking for a fake object (for tracing): measured on a 2-core CPU machine,
    2.00 ms against 1.45 ms per call for 2000 one-element parameters (about 0.14 us per tensor of
    the two lists). Under tracing (a FakeScriptObject) it goes the usual way. ``sr_seed``:
    stochastic rounding of bf16 parameters with the ids and offsets ``held`` holds (``set_sr_ids``)."""
    if isinstance(held, torch.ScriptObject):
        _QUANTIZED_STEP_LIST(held, params, grads, hyper, grad_scale, found_inf, None, lr, sr_seed)
    else:
        ops.quantized_step_list_(held, params, grads, hyper, grad_scale, found_inf, None, lr, sr_seed)


_QUANTIZED_STEP_LIST = ops.quantized_step_list_.default._op


def quantized_update_norm_(algorithm: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                           states: Sequence[Sequence[torch.Tensor]], absmax: Sequence[Sequence[torch.Tensor]], steps,
                           qmaps: Sequence[torch.Tensor], hyper: Sequence[float], norms: torch.Tensor, *,
                           grad_scale: Optional[torch.Tensor] = None, lr: Optional[torch.Tensor] = None) -> None:
    """The norm pass of lars and lamb: ``norms`` (float64, one per parameter) receives the sum of
    squares of each parameter's update direction; nothing else changes. ``lr`` as for
    quantized_step_."""
    ops.quantized_update_norm_(algorithm, list(params), list(grads), [t for key in states for t in key],
                               [t for key in absmax for t in key], list(steps), list(qmaps),
                               [float(h) for h in hyper], grad_scale, norms, lr)


# A 16-entry code means 4-bit codes, packed two a byte (csrc/include/pagedopt/four_bit.h): a 1-D
# tensor of ceil(n / 2) bytes, which dequantizes to 2 * bytes values.
CODE_SIZE_4BIT = 16


@torch.library.register_fake("pagedopt::quantize_blockwise")
def _quantize_blockwise_fake(x, code, blocksize):
    torch._check(blocksize > 0)
    blocks = (x.numel() + blocksize - 1) // blocksize
    if code.numel() == CODE_SIZE_4BIT:
        codes = x.new_empty(((x.numel() + 1) // 2,), dtype=torch.uint8)
    else:
        codes = torch.empty_like(x, dtype=torch.uint8)
    return codes, x.new_empty((blocks,), dtype=torch.float32)


@torch.library.register_fake("pagedopt::dequantize_blockwise")
def _dequantize_blockwise_fake(codes, absmax, code, blocksize, dtype):
    torch._check(codes.dtype == torch.uint8)
    if code.numel() == CODE_SIZE_4BIT:
        return codes.new_empty((2 * codes.numel(),), dtype=dtype)
    return torch.empty_like(codes, dtype=dtype)


@torch.library.register_fake("pagedopt::check_grads")
def _check_grads_fake(params, grads):
    # check_grads reads metadata only, so its fake gives the real answer (csrc/check_grads.cpp).
    torch._check(len(params) == len(grads), lambda: f"check_grads: {len(params)} params but {len(grads)} grads")
    contiguous = True
    for i, (p, g) in enumerate(zip(params, grads)):
        if not (g.layout == torch.strided and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and g.dtype == p.dtype and g.shape == p.shape and g.device == p.device):
            return i
        contiguous = contiguous and p.is_contiguous() and g.is_contiguous()
    return GRADS_CONTIGUOUS if contiguous else GRADS_NOT_CONTIGUOUS


@torch.library.register_fake("pagedopt::managed_empty")
def _managed_empty_fake(size, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.register_fake("pagedopt::prefetch_")
def _prefetch_fake(t, to):
    return None


@torch.library.register_fake("pagedopt::discard_")
def _discard_fake(t, to):
    return None


@torch.library.register_fake("pagedopt::copy_bytes_")
def _copy_bytes_fake(dst, src):
    return None


@torch.library.register_fake("pagedopt::pinned_empty")
def _pinned_empty_fake(size, dtype):
    return torch.empty(size, dtype=dtype, device="cpu")


@torch.library.register_fake("pagedopt::advise_preferred_location_")
def _advise_fake(t, to):
    return None


@torch.library.register_fake("pagedopt::concurrent_managed_access")
def _concurrent_managed_access_fake(device_index):
    # A property of the device, not of any tensor: the fake gives the real answer (the op run
    # outside the fake mode), the one eager code sees.
    with unset_fake_temporarily():
        return ops.concurrent_managed_access.default(device_index)


# is_managed and residency answer where a tensor's bytes live, which is not in its metadata (a fake
# tensor has no bytes): tracing cannot know the answer of a CUDA tensor, so their fakes raise
# DataDependentOutputException, as torch's own ops with data-dependent non-tensor outputs do;
# torch.compile then breaks the graph there and runs the op eagerly.
@torch.library.register_fake("pagedopt::is_managed")
def _is_managed_fake(t):
    if t.device.type != "cuda":
        return False  # as the CPU kernel: only CUDA tensors can be managed memory
    raise DataDependentOutputException(ops.is_managed.default)


@torch.library.register_fake("pagedopt::residency")
def _residency_fake(t):
    torch._check(t.device.type == "cuda",
                 lambda: f"residency: t must be a CUDA tensor in managed memory, got a tensor on {t.device}")
    raise DataDependentOutputException(ops.residency.default)


@torch.library.register_fake("pagedopt::quantized_step_")
def _quantized_step_fake(algorithm, params, grads, states, absmax, steps, qmaps, hyper, grad_scale, found_inf,
                         scales=None, lr=None, sr_ids=None, sr_offsets=None, sr_seed=0):
    torch._check(len(grads) == len(params) and len(steps) == len(params))
    torch._check(sr_ids is None or len(sr_ids) == len(params))
    return None


@torch.library.register_fake("pagedopt::stochastic_round_bf16")
def _stochastic_round_bf16_fake(x, step, seed, id, offset=0):
    torch._check(x.dtype == torch.float32, lambda: f"stochastic_round_bf16: x must be float32, got {x.dtype}")
    return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)


@torch.library.register_fake("pagedopt::quantized_update_norm_")
def _quantized_update_norm_fake(algorithm, params, grads, states, absmax, steps, qmaps, hyper, grad_scale, norms,
                                lr=None):
    torch._check(len(grads) == len(params) and norms.numel() == len(params))
    return None


@torch._library.register_fake_class("pagedopt::QuantizedStateList")
class FakeQuantizedStateList:
    """What tracing (torch.compile, torch.export, opcheck) sees of a torch.classes.pagedopt.QuantizedStateList:
    the held states, steps and codebooks as fake tensors (from the C++ ``__obj_flatten__``)."""

    def __init__(self, algorithm, states, absmax, steps, qmaps, sr_ids=(), sr_offsets=()):
        self.algorithm, self.states, self.absmax, self.steps, self.qmaps = algorithm, states, absmax, steps, qmaps
        self.sr_ids, self.sr_offsets = list(sr_ids), list(sr_offsets)

    @classmethod
    def __obj_unflatten__(cls, flattened):
        return cls(**dict(flattened))

    def size(self) -> int:
        return len(self.steps)


@torch.library.register_fake("pagedopt::quantized_step_list_")
def _quantized_step_list_fake(states, params, grads, hyper, grad_scale, found_inf, scales=None, lr=None,
                              sr_seed=None):
    # The states held by `states` are updated in place too, which a schema cannot annotate (they
    # are inside a custom class): a traced graph sees this op as mutating params only (it is
    # auto-functionalized; an op with mutable arguments gets no effect token), so a graph that also
    # read the held states could be reordered around it. The optimizers' step() never traces it;
    # the op exists to cut the eager step's per-call overhead. This fake is what opcheck,
    # torch.export and a user's own trace of the op need.
    n = states.size()
    torch._check(len(params) == n and len(grads) == n,
                 lambda: f"quantized_step_list_: {len(params)} params, {len(grads)} grads, {n} held states")
    return None
