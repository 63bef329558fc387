"""Adam-family optimizers: AdamBase (8-bit states on the generic engine with the Adam functor,
32-bit states on torch's fused Adam/AdamW) and thin declarations over it, with the bitsandbytes
signatures.

Adam* use L2 weight decay (added to the gradient), AdamW* decoupled decay, exactly as torch.
The *8bit classes always keep 8-bit states (their optim_bits argument is accepted for
signature compatibility, as in bitsandbytes, and must be 8 or 32); *32bit always 32-bit;
Paged* always page their states through CUDA unified memory.
"""
from typing import Any

import torch

from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer, _Bucket
from .bucket_chunks import flat_parts, flat_runs
from .capture import lr_tensor

# fp32 copies of 16-bit params and grads for torch's fused 32-bit step: at most this many elements
# at a time (2 x 4 bytes each: 64 MiB), tensors cut at multiples of _FP32_COPY_ALIGN elements (torch's
# fused CPU kernel updates whole SIMD vectors and a scalar remainder, which round differently: cuts
# there keep every element on the path it takes in the whole tensor)
_FP32_COPY_NUMEL = 8 << 20
_FP32_COPY_ALIGN = 1024

ADAM = AlgorithmSpec("adam", states=(StateSpec("state1"), StateSpec("state2", signed=False)), engine="adam")


class AdamBase(QuantizedOptimizer):
    """Adam with 8-bit blockwise-quantized or 32-bit states, optionally paged.

    ``decoupled`` (a class attribute of the concrete class) selects AdamW's decoupled
    weight decay; otherwise weight decay is L2, added to the gradient, as in torch.optim.Adam.
    """

    algorithm = ADAM
    decoupled: bool = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, optim_bits: int = 32, args: Any = None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 is_paged: bool = False, capturable: bool = False):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by pagedopt optimizers")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         is_paged=is_paged, capturable=capturable)

    def _engine_hyper(self, group: dict) -> list:
        """The Adam functor's hyper list: lr, beta1, beta2, eps, weight_decay, decoupled."""
        beta1, beta2 = group["betas"]
        return [float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                1.0 if self.decoupled else 0.0]

    def _hold_states(self, lists: tuple, first_state: dict, eight_bit: bool):
        return super()._hold_states(lists, first_state, eight_bit) if eight_bit else None  # 32-bit: torch's lists

    def _step_chunk(self, group: dict, bucket: _Bucket, params, work_params, work_grads, lists: tuple, grad_scale,
                    found_inf) -> None:
        """32-bit states reuse torch's fused Adam/AdamW kernel (CPU and CUDA), on plain (local) tensors."""
        if bucket.eight_bit:
            super()._step_chunk(group, bucket, params, work_params, work_grads, lists, grad_scale, found_inf)
            return
        state1, state2, steps = lists
        beta1, beta2 = group["betas"]
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        lr = lr_tensor(group, bucket.device)  # a tensor on the params' device: read there (capturable)
        if lr is not None and lr.dtype != torch.float32:
            lr = lr.float()  # torch's fused kernel reads a float32 lr tensor
        hyper = dict(lr=float(group["lr"]) if lr is None else lr, beta1=float(beta1), beta2=float(beta2),
                     weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False,
                     maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        if work_params[0].dtype == torch.float32:
            fused(work_params, work_grads, state1, state2, [], steps, **hyper)
        else:
            # torch's fused kernel wants params, grads and states of one dtype, and the states stay
            # fp32: it runs on fp32 copies of the params and grads, made a run of at most
            # _FP32_COPY_NUMEL elements at a time (the update is elementwise, so a tensor may be cut
            # into flat ranges), so that the copies never cost more than a few MiB of memory.
            for run in flat_runs([w.numel() for w in work_params], _FP32_COPY_NUMEL, _FP32_COPY_ALIGN):
                views = flat_parts(work_params, run)
                run_params = [x.float() for x in views]
                fused(run_params, [x.float() for x in flat_parts(work_grads, run)], flat_parts(state1, run),
                      flat_parts(state2, run), [], [steps[i] for i, _, _ in run], **hyper)
                self._write_back(views, run_params)
        if work_params is not params:
            self._write_back(params, work_params)


class Adam(AdamBase):
    """Adam with states of optim_bits (32 or 8) bits; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class Adam8bit(AdamBase):
    """Adam with 8-bit blockwise-quantized states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class Adam32bit(AdamBase):
    """Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class PagedAdam(AdamBase):
    """Paged Adam with states of optim_bits (32 or 8) bits; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)


class PagedAdam8bit(AdamBase):
    """Paged Adam with 8-bit blockwise-quantized states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)


class PagedAdam32bit(AdamBase):
    """Paged Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)


class AdamW(AdamBase):
    """AdamW with states of optim_bits (32 or 8) bits; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class AdamW8bit(AdamBase):
    """AdamW with 8-bit blockwise-quantized states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class AdamW32bit(AdamBase):
    """AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged, capturable=capturable)


class PagedAdamW(AdamBase):
    """Paged AdamW with states of optim_bits (32 or 8) bits; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)


class PagedAdamW8bit(AdamBase):
    """Paged AdamW with 8-bit blockwise-quantized states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)


class PagedAdamW32bit(AdamBase):
    """Paged AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 capturable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True, capturable=capturable)
