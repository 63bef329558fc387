from .adam import (Adam, Adam8bit, Adam32bit, AdamW, AdamW8bit, AdamW32bit, PagedAdam, PagedAdam8bit,
                   PagedAdam32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit)
from .base import AdamBase

__all__ = ["AdamBase", "Adam", "Adam8bit", "Adam32bit", "AdamW", "AdamW8bit", "AdamW32bit", "PagedAdam",
           "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit"]
