"""pagedopt: paged, 8-bit (and 4-bit) blockwise-quantized optimizers for PyTorch."""
from .optim import (LAMB, LARS, LAMB8bit, LAMB32bit, LARS8bit, LARS32bit, SGD, Adagrad, Adagrad8bit, Adagrad32bit, RMSprop, RMSprop8bit, RMSprop32bit, SGD8bit, SGD32bit,
                    AdEMAMix, AdEMAMix8bit, AdEMAMix32bit, Lion, Lion8bit, Lion32bit, PagedAdEMAMix,
                    PagedAdEMAMix8bit, PagedAdEMAMix32bit, PagedLion, PagedLion8bit, PagedLion32bit, QuantizedOptimizer,
                    Adam, Adam8bit, Adam32bit, AdamBase, AdamW, AdamW8bit, AdamW32bit, GlobalOptimManager,
                    PagedAdam, PagedAdam8bit, PagedAdam32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit,
                    Adam4bit, AdamW4bit, PagedAdam4bit, PagedAdamW4bit, Lion4bit, PagedLion4bit)
from . import convert
from .paging import HostResidentPager, PageManager
from . import integrations as _integrations

__version__ = "0.1.0"
__all__ = ["Adam", "Adam8bit", "Adam32bit", "AdamBase", "AdamW", "AdamW8bit", "AdamW32bit", "GlobalOptimManager", "PagedAdam",
           "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "PageManager", "HostResidentPager",
           "QuantizedOptimizer", "Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit",
           "AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit",
           "SGD", "SGD8bit", "SGD32bit", "RMSprop", "RMSprop8bit", "RMSprop32bit", "Adagrad", "Adagrad8bit", "Adagrad32bit",
           "LARS", "LARS8bit", "LARS32bit", "LAMB", "LAMB8bit", "LAMB32bit",
           "Adam4bit", "AdamW4bit", "PagedAdam4bit", "PagedAdamW4bit", "Lion4bit", "PagedLion4bit"]

# The Trainer's optim= names ("pagedopt_paged_adamw_8bit", ...) once transformers is imported, before
# or after pagedopt (pagedopt/integrations/__init__.py; PAGEDOPT_AUTO_REGISTER=0 turns it off).
_integrations.set_up_on_import()
