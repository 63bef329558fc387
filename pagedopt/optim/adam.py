"""Adam-family optimizers: thin declarations over AdamBase, with the bitsandbytes signatures.

Adam* use L2 weight decay (added to the gradient), AdamW* decoupled decay, exactly as torch.
The *8bit classes always keep 8-bit states (their optim_bits argument is accepted for
signature compatibility, as in bitsandbytes, and must be 8 or 32); *32bit always 32-bit;
Paged* always page their states through CUDA unified memory.
"""
from .base import AdamBase


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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        _check_fixed_bits(optim_bits, 8)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 8, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class Adam32bit(AdamBase):
    """Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        _check_fixed_bits(optim_bits, 32)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size,
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        _check_fixed_bits(optim_bits, 8)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 8, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdam32bit(AdamBase):
    """Paged Adam with 32-bit states; weight decay is L2 (Adam)."""

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        _check_fixed_bits(optim_bits, 32)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size,
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        _check_fixed_bits(optim_bits, 8)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 8, args, min_8bit_size,
                         percentile_clipping, block_wise, is_paged)


class AdamW32bit(AdamBase):
    """AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False):
        _check_fixed_bits(optim_bits, 32)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size,
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        _check_fixed_bits(optim_bits, 8)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 8, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


class PagedAdamW32bit(AdamBase):
    """Paged AdamW with 32-bit states; weight decay is decoupled (AdamW)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
        _check_fixed_bits(optim_bits, 32)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size,
                         percentile_clipping, block_wise, True)


def _check_fixed_bits(optim_bits, fixed: int) -> None:
    # bitsandbytes' fixed-width classes take optim_bits (default 32) and ignore it; we accept
    # the default and the class's own width, and refuse anything else rather than ignore it.
    if optim_bits not in (32, fixed):
        raise ValueError(f"optim_bits={optim_bits!r} is not valid for a {fixed}-bit optimizer class "
                         f"(pass {fixed} or leave the default)")
