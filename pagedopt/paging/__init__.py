"""Paging of tensors through CUDA unified (managed) memory.

This package knows nothing about optimizers. It offers

* thin wrappers over the ``torch.ops.pagedopt`` managed-memory operators (``managed_empty``,
  ``prefetch_``, ``advise_preferred_location_``, ``is_managed``, ``residency``);
* :func:`paging_available` / :func:`paging_unavailable_reason` and a one-time fallback warning;
* :class:`PageManager`: allocation of paged tensors, residency bookkeeping, page-in/page-out,
  a pipelined :meth:`PageManager.stage` for chunked kernels, an optional device budget and
  statistics.

Paged tensors are real CUDA tensors whose bytes live in ``cudaMallocManaged`` memory, so every
torch op works on them and the driver migrates pages on demand. Explicit prefetches only make the
migration early and bulk; **correctness never depends on them** (a kernel touching a page that is
on the host faults it in). Every event and stream below is therefore about speed, not safety.

Where paging is not possible (CPU tensors, a build without CUDA, a GPU without concurrent managed
access, or ``PAGEDOPT_DISABLE_PAGING=1``), :meth:`PageManager.zeros` returns ordinary tensors,
warns once (per device, per manager), and every other method is a cheap no-op for them.

A PageManager is not thread-safe; use it from the thread that launches the work.

Modules (every name is re-exported here, so ``pagedopt.paging.X`` keeps working):

* :mod:`.managed`: the managed-memory operator wrappers, ``RESIDENCY_*``, availability and the
  fallback warning;
* :mod:`.manager`: :class:`PageManager` (allocation, arenas, residency bookkeeping, steps) and
  :class:`PagingStats`;
* :mod:`.migration`: page-in/page-out (streams, events, driver prefetches, ``prefetch()``,
  ``page_out()``) and the budget's evictions, a base of PageManager;
* :mod:`.staging`: the pipelined ``stage()`` schedule, a base of PageManager, and
  :func:`split_by_bytes`;
* :mod:`.host_resident`: :class:`HostResidentPager`, tensors in page-locked host memory that
  stream through a fixed device buffer.

Module state (``_warned``, ``_concurrent_cache``) lives in :mod:`.managed`; the names here are the
same objects. To replace a function for the code that calls it, patch it in the module that
calls it (e.g. ``pagedopt.paging.manager.paging_unavailable_reason`` for ``PageManager.zeros``).
"""
from __future__ import annotations

# Names the single-module pagedopt/paging.py had (its imports included), kept importable from here.
import ctypes  # noqa: F401
import os  # noqa: F401
import warnings  # noqa: F401
import weakref  # noqa: F401
from dataclasses import asdict, dataclass, field  # noqa: F401
from typing import Iterable, Iterator, Optional, Sequence, Union  # noqa: F401

import torch  # noqa: F401

from .. import _ops  # noqa: F401  (loads pagedopt._C, which registers the ops, and their fakes)
from .managed import (RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, DeviceLike,  # noqa: F401
                      PagingFallbackWarning, _as_device, _concurrent_cache, _concurrent_managed_access,
                      _reset_fallback_warnings, _span_bytes, _warned, advise_preferred_location_, is_managed,
                      managed_empty, paging_available, paging_built, paging_unavailable_reason, prefetch_,
                      residency, warn_not_paged)
from .manager import _PAGE, PageManager, PagingStats, _Arena, _Entry, _forget_cb  # noqa: F401
from .migration import _MERGE_GAP, _CudaBackend  # noqa: F401
from .staging import split_by_bytes  # noqa: F401
from .host_resident import HostResidentPager  # noqa: F401

__all__ = [
    "RESIDENCY_UNKNOWN", "RESIDENCY_DEVICE", "RESIDENCY_HOST", "PagingFallbackWarning", "PagingStats",
    "PageManager", "HostResidentPager", "paging_built", "paging_available", "paging_unavailable_reason", "warn_not_paged",
    "managed_empty", "is_managed", "residency", "prefetch_", "advise_preferred_location_",
]
