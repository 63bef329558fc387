"""pagedopt: paged, 8-bit blockwise-quantized optimizers for PyTorch."""
from .optim import (Adam, Adam8bit, Adam32bit, AdamBase, AdamW, AdamW8bit, AdamW32bit, GlobalOptimManager,
                    PagedAdam, PagedAdam8bit, PagedAdam32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit)
from . import convert
from .paging import PageManager

__version__ = "0.1.0"
__all__ = ["Adam", "Adam8bit", "Adam32bit", "AdamBase", "AdamW", "AdamW8bit", "AdamW32bit", "GlobalOptimManager", "PagedAdam",
           "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "PageManager"]
