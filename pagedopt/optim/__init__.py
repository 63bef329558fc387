from .algorithms.adam import (AdamBase, Adam, Adam8bit, Adam32bit, AdamW, AdamW8bit, AdamW32bit, PagedAdam,
                              PagedAdam8bit, PagedAdam32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Adam4bit,
                              AdamW4bit, PagedAdam4bit, PagedAdamW4bit)
from .algorithms.ademamix import (AdEMAMix, AdEMAMix8bit, AdEMAMix32bit, PagedAdEMAMix, PagedAdEMAMix8bit,
                                  PagedAdEMAMix32bit)
from .algorithms.adagrad import Adagrad, Adagrad8bit, Adagrad32bit
from .algorithms.lamb import LAMB, LAMB8bit, LAMB32bit
from .algorithms.lars import LARS, LARS8bit, LARS32bit
from .algorithms.lion import Lion, Lion8bit, Lion32bit, Lion4bit, PagedLion, PagedLion8bit, PagedLion32bit, PagedLion4bit
from .algorithms.rmsprop import RMSprop, RMSprop8bit, RMSprop32bit
from .algorithms.sgd import SGD, SGD8bit, SGD32bit
from .base import QuantizedOptimizer
from .global_manager import GlobalOptimManager

__all__ = ["QuantizedOptimizer", "AdamBase", "GlobalOptimManager", "Adam", "Adam8bit", "Adam32bit", "AdamW", "AdamW8bit", "AdamW32bit", "PagedAdam",
           "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit",
           "Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit",
           "AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit",
           "SGD", "SGD8bit", "SGD32bit", "RMSprop", "RMSprop8bit", "RMSprop32bit", "Adagrad", "Adagrad8bit", "Adagrad32bit",
           "LARS", "LARS8bit", "LARS32bit", "LAMB", "LAMB8bit", "LAMB32bit",
           "Adam4bit", "AdamW4bit", "PagedAdam4bit", "PagedAdamW4bit", "Lion4bit", "PagedLion4bit"]
