"""Adam-family optimizers: AdamBase (Adam on its own fused kernels: adam8bit_step_ for 8-bit
states, torch's fused Adam/AdamW for 32-bit ones) and thin declarations over it, with the
bitsandbytes signatures.

Adam* use L2 weight decay (added to the gradient), AdamW* decoupled decay, exactly as torch.
The *8bit classes always keep 8-bit states (their optim_bits argument is accepted for
signature compatibility, as in bitsandbytes, and must be 8 or 32); *32bit always 32-bit;
Paged* always page their states through CUDA unified memory.
"""
from typing import Any

import torch

from .. import _ops
from .algorithm import AlgorithmSpec, StateSpec
from .base import QuantizedOptimizer, _Bucket

ADAM = AlgorithmSpec("adam", states=(StateSpec("state1"), StateSpec("state2", signed=False)))


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
                 is_paged: bool = False):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by pagedopt optimizers")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, optim_bits=optim_bits,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults, args=args, percentile_clipping=percentile_clipping, block_wise=block_wise,
                         is_paged=is_paged)

    def _hold_states(self, lists: tuple, first_state: dict, eight_bit: bool):
        if not eight_bit:
            return None  # torch's fused kernel takes the lists
        return torch.classes.pagedopt.AdamStateList(*lists, first_state["qmap1"], first_state["qmap2"])

    def _step_bucket(self, group: dict, bucket: _Bucket, params, grads, contiguous: bool, grad_scale,
                     found_inf) -> None:
        if bucket.eight_bit:
            self._step_8bit(group, bucket, params, grads, contiguous, grad_scale, found_inf)
        else:
            self._step_32bit(group, bucket, params, grads, contiguous, grad_scale, found_inf)

    def _step_8bit(self, group: dict, bucket: "_Bucket", params, grads, contiguous: bool, grad_scale,
                   found_inf) -> None:
        """``params``/``grads``: the bucket's (local shards of DTensor parameters)."""
        beta1, beta2 = group["betas"]
        if contiguous and (self._pager is None or self._pager.all_resident()):
            _ops.ops.adam8bit_step_list_(
                bucket.held, params, grads, float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), self.decoupled, grad_scale, found_inf)
            return
        qmap1, qmap2 = bucket.states[0]["qmap1"], bucket.states[0]["qmap2"]
        for params, work_params, work_grads, (state1, state2, absmax1, absmax2, steps) in self._bucket_chunks(
                bucket, params, grads, contiguous):
            _ops.ops.adam8bit_step_(
                work_params, work_grads, state1, state2, absmax1, absmax2, steps, qmap1, qmap2,
                float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), self.decoupled, grad_scale, found_inf)
            if work_params is not params:
                self._write_back(params, work_params)

    def _step_32bit(self, group: dict, bucket: "_Bucket", params, grads, contiguous: bool, grad_scale,
                    found_inf) -> None:
        """32-bit states reuse torch's fused Adam/AdamW kernel (CPU and CUDA), on plain (local) tensors."""
        beta1, beta2 = group["betas"]
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        for params, work_params, work_grads, (state1, state2, steps) in self._bucket_chunks(bucket, params, grads,
                                                                                              contiguous):
            # torch's fused kernel wants params, grads and states of one dtype; states stay fp32.
            if work_params[0].dtype != torch.float32:
                work_params = [w.float() for w in work_params]
                work_grads = [g.float() for g in work_grads]
            fused(work_params, work_grads, state1, state2, [], steps, lr=float(group["lr"]), beta1=float(beta1),
                  beta2=float(beta2), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                  amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            if work_params is not params:
                self._write_back(params, work_params)




class Adam(AdamBase):
    """Adam with states of optim_bits (32 or 8) bits; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class Adam8bit(AdamBase):
    """Adam with 8-bit blockwise-quantized states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class Adam32bit(AdamBase):
    """Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class PagedAdam(AdamBase):
    """Paged Adam with states of optim_bits (32 or 8) bits; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdam8bit(AdamBase):
    """Paged Adam with 8-bit blockwise-quantized states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdam32bit(AdamBase):
    """Paged Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class AdamW(AdamBase):
    """AdamW with states of optim_bits (32 or 8) bits; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class AdamW8bit(AdamBase):
    """AdamW with 8-bit blockwise-quantized states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class AdamW32bit(AdamBase):
    """AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class PagedAdamW(AdamBase):
    """Paged AdamW with states of optim_bits (32 or 8) bits; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdamW8bit(AdamBase):
    """Paged AdamW with 8-bit blockwise-quantized states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdamW32bit(AdamBase):
    """Paged AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True
    _bits = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         percentile_clipping, block_wise, True)
