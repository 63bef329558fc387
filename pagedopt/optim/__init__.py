from .adam import (Adam, Adam8bit, Adam32bit, AdamW, AdamW8bit, AdamW32bit, PagedAdam, PagedAdam8bit,
                   PagedAdam32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit)
from .base import AdamBase
from .global_manager import GlobalOptimManager

__all__ = ["AdamBase", "GlobalOptimManager", "Adam", "Adam8bit", "Adam32bit", "AdamW", "AdamW8bit", "AdamW32bit", "PagedAdam",
           "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit"]
