"""Paging of tensors through CUDA unified (managed) memory, or through a device buffer.

This package knows nothing about what the tensors hold or who uses them. It offers

* thin wrappers over the ``torch.ops.pagedopt`` managed-memory operators (``managed_empty``,
  ``prefetch_``, ``advise_preferred_location_``, ``is_managed``, ``residency``);
* :func:`paging_available` / :func:`paging_unavailable_reason` and a one-time fallback warning;
* :class:`PageManager`: allocation of paged tensors, residency bookkeeping, page-in/page-out,
  a pipelined :meth:`PageManager.stage` for chunked kernels, an optional device budget and
  statistics (:class:`PagingStats`), and :func:`split_by_bytes` to cut work into chunks;
* :class:`HostResidentPager`: tensors in page-locked host memory that stream through a fixed
  device buffer (``DEFAULT_DEVICE_BUFFER``, regions aligned to ``REGION_ALIGN``:
  :func:`aligned_bytes`).

Paged tensors are real CUDA tensors whose bytes live in ``cudaMallocManaged`` memory, so every
torch op works on them and the driver migrates pages on demand. Explicit prefetches only make the
migration early and bulk; **correctness never depends on them** (a kernel touching a page that is
on the host faults it in). Every event and stream below is therefore about speed, not safety.

Where paging is not possible (CPU tensors, a build without CUDA, a GPU without concurrent managed
access, or ``PAGEDOPT_DISABLE_PAGING=1``), :meth:`PageManager.zeros` returns ordinary tensors,
warns once (per device, per manager), and every other method is a cheap no-op for them.

A PageManager is not thread-safe; use it from the thread that launches the work (only its
host copies are made on a thread of their own, :mod:`.pin_ahead`).

Modules (the public names are re-exported here; each module imports only those below it):

* :mod:`.managed`: the managed-memory operator wrappers, ``RESIDENCY_*``, availability and the
  fallback warning;
* :mod:`.stats`: :class:`PagingStats`;
* :mod:`.backends`: the stream, event and copy calls of the pagers (tests substitute fakes);
* :mod:`.ledger`: a PageManager's bookkeeping (entries, residency counters, host copies, steps,
  budget);
* :mod:`.pin_ahead`: the page-locked host copies made ahead of the first page-out, on a
  background thread (:class:`.pin_ahead.PinAhead`);
* :mod:`.migration`: a PageManager's page-in/page-out (streams, events, driver prefetches, host
  copies, ``prefetch()``, ``page_out()``) and the budget's evictions;
* :mod:`.staging`: a PageManager's pipelined ``stage()``, and :func:`split_by_bytes`;
* :mod:`.manager`: :class:`PageManager` (allocation, arenas), which holds a ledger, a migration
  and a staging;
* :mod:`.stream_pass`: one pass of a HostResidentPager (:class:`StreamPass`, :class:`PassPlan`);
* :mod:`.host_resident`: :class:`HostResidentPager`.

Module state (``_warned``, ``_concurrent_cache``) lives in :mod:`.managed`. To replace a function
for the code that calls it, patch it in the module that calls it (e.g.
``pagedopt.paging.manager.paging_unavailable_reason`` for ``PageManager.zeros``).
"""
from .host_resident import DEFAULT_DEVICE_BUFFER, REGION_ALIGN, HostResidentPager, aligned_bytes
from .managed import (RESIDENCY_DEVICE, RESIDENCY_HOST, RESIDENCY_UNKNOWN, DeviceLike, PagingFallbackWarning,
                      advise_preferred_location_, is_managed, managed_empty, paging_available, paging_built,
                      paging_unavailable_reason, prefetch_, residency, warn_not_paged)
from .manager import PageManager
from .staging import split_by_bytes
from .stats import PagingStats
from .stream_pass import PassPlan, StreamPass

__all__ = [
    "RESIDENCY_UNKNOWN", "RESIDENCY_DEVICE", "RESIDENCY_HOST", "DeviceLike", "PagingFallbackWarning", "PagingStats",
    "PageManager", "split_by_bytes", "HostResidentPager", "StreamPass", "PassPlan", "DEFAULT_DEVICE_BUFFER",
    "REGION_ALIGN", "aligned_bytes", "paging_built", "paging_available", "paging_unavailable_reason",
    "warn_not_paged", "managed_empty", "is_managed", "residency", "prefetch_", "advise_preferred_location_",
]
