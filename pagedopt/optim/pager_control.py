"""What the paged optimizers add to QuantizedOptimizer (a base of it): choosing the pager
(``set_pager``: a PageManager, a device budget or host residency), ``page_out`` / ``prefetch`` /
``paging_stats``, and the check that host-resident states fit their device buffer."""
from __future__ import annotations

from typing import Optional

import torch

from . import sharding
from .byte_sizes import optimizer_state_bytes, parse_bytes

# Paged states smaller than a quarter of this share managed slabs of this size, so that paging
# a chunk in or out takes a few driver calls instead of one per tensor: on the H200 this took
# page-in from 25 to 44 GB/s for the 714 state tensors of a 1.1B-parameter model.
PAGED_SLAB_BYTES = 64 << 20


class PagerControl:
    """The paging methods of QuantizedOptimizer (see there for the attributes they use)."""

    def set_pager(self, pager=None, *, device_budget=None, residency=None, device_buffer=None,
                  update_in_backward: bool = False, keep_grads: bool = False) -> None:
        """Page this optimizer's states through ``pager`` (a ``pagedopt.PageManager`` or
        ``pagedopt.HostResidentPager``), or through a new one:

        * ``residency="host"``: a HostResidentPager: states live in page-locked host memory and
          stream through a device buffer of ``device_buffer`` bytes (default ``"256MiB"``) during
          step(), which is all the GPU memory the states take; results are bit-identical to
          resident states.
        * ``residency="auto"``: hybrid: as many states as fit in ``device_budget`` stay on the GPU
          (ordinary device memory, never moved), the rest live on the host and stream as with
          ``"host"``; so a step moves only what does not fit, and nothing when all fit. Without a
          ``device_budget`` the budget is what the GPU has free when the states are made (the
          first step, after forward and backward reached their peak), less a margin
          (``pagedopt.paging.resident_set.auto_budget``); on the CPU every state stays.
        * ``device_budget`` alone: the same as ``residency="auto"`` with that budget per GPU (an
          int, or a string such as ``"4GiB"`` or ``"512MiB"``). (A PageManager of managed memory
          with a budget, which pages states in and out around each step, is still
          ``set_pager(pagedopt.PageManager(budget_bytes=...))``; it moves more and is slower.)
        * ``update_in_backward=True`` (with any of them): each parameter is updated during
          ``backward()`` as soon as its gradient is final (from the first step on: there, in
          chunks as the gradients arrive), so that the states' copies overlap with backward, and
          its gradient is then released (``p.grad = None``; ``keep_grads=True`` keeps it);
          ``step()`` updates what is left. Bit for bit the ordinary step; not with
          gradient clipping, GradScaler, DDP or FSDP2 (see pagedopt/optim/backward_updates.py).
          ``opt.update_in_backward = False`` turns it off (e.g. for gradient accumulation's
          micro-batches) and ``True`` on again.

        Paged optimizers, before their first step: states already made stay where their pager put
        them, so changing it later raises a ValueError. An optimizer that does not page takes
        ``set_pager(update_in_backward=True)`` (and ``keep_grads``) alone."""
        from ..paging import HostResidentPager, PageManager

        if not isinstance(keep_grads, bool):
            raise ValueError(f"set_pager: keep_grads must be True or False, got {keep_grads!r}")
        if not self.is_paged:
            if pager is not None or device_budget is not None or residency is not None or device_buffer is not None:
                raise ValueError(f"{type(self).__name__} is not a paged optimizer; use its Paged* class to page "
                                 "states (it takes set_pager(update_in_backward=True) alone)")
            if not isinstance(update_in_backward, bool):
                raise ValueError(f"set_pager: update_in_backward must be True or False, got {update_in_backward!r}")
            if update_in_backward:
                from .backward_hooks import refuse_unsupported

                refuse_unsupported(self)
            self._set_backward_updates(update_in_backward, keep_grads)
            return
        if any(len(s) for s in self.state.values()):
            raise ValueError("set_pager: this optimizer already holds states (set the pager before the first step "
                             "or load_state_dict)")
        if residency is not None and residency not in ("host", "device", "auto"):
            raise ValueError(f"set_pager: residency must be 'host', 'auto' or 'device', got {residency!r}")
        if device_budget is not None and residency is not None and residency != "auto":
            raise ValueError(f"set_pager: device_budget=... goes with residency='auto' (or alone), not with "
                             f"residency={residency!r}")
        hybrid = residency == "auto" or (device_budget is not None and pager is None)
        if device_buffer is not None and residency != "host" and not hybrid:
            raise ValueError("set_pager: device_buffer=... goes with residency='host' or 'auto' (or device_budget)")
        if not isinstance(update_in_backward, bool):
            raise ValueError(f"set_pager: update_in_backward must be True or False, got {update_in_backward!r}")
        if update_in_backward:
            from .backward_hooks import refuse_unsupported

            refuse_unsupported(self)
        chosen = (pager is not None) + (residency in ("host", "auto") or device_budget is not None)
        if chosen != 1 and not (chosen == 0 and (residency == "device" or update_in_backward)):
            raise ValueError("set_pager takes a pager, residency='host' or 'auto', or device_budget=..., exactly one "
                             "of them")
        if pager is not None and not isinstance(pager, (PageManager, HostResidentPager)):
            raise ValueError("set_pager: pager must be a pagedopt.PageManager or pagedopt.HostResidentPager, got "
                             f"{type(pager).__name__}")
        if residency == "host" or hybrid:
            from ..paging.host_resident import DEFAULT_DEVICE_BUFFER

            resident = None
            if hybrid:
                resident = "auto" if device_budget is None else parse_bytes(device_budget, "device_budget")
            size = DEFAULT_DEVICE_BUFFER if device_buffer is None else parse_bytes(device_buffer, "device_buffer")
            try:
                pager = HostResidentPager(size, resident_bytes=resident)
            except ValueError as exc:
                raise ValueError(f"set_pager: device_buffer={device_buffer!r}: {exc}") from None
        elif pager is None:  # residency="device" alone: a PageManager without a budget, the default
            pager = PageManager(None, arena_bytes=PAGED_SLAB_BYTES)
        # a buffer of the default size grows to hold the largest state that cannot be cut
        self._buffer_may_grow = device_buffer is None and (residency == "host" or hybrid)
        self._pager = pager
        self._plan = None
        self._set_backward_updates(update_in_backward, keep_grads)

    def _set_backward_updates(self, on: bool, keep_grads: bool = False) -> None:
        from .backward_updates import BackwardUpdates

        if self._backward_updates is not None:
            self._backward_updates.remove_hooks()
            self._backward_updates = None
        if on:
            self._backward_updates = BackwardUpdates(self)
            self._backward_updates.keep_grads = keep_grads
            self._backward_updates.hook_params(p for g in self.param_groups for p in g["params"])

    @property
    def update_in_backward(self) -> bool:
        """Whether parameters are updated during backward (``set_pager(..., update_in_backward=True)``);
        settable to False and back to True, e.g. around gradient accumulation's micro-batches."""
        return self._backward_updates is not None and self._backward_updates.enabled

    @update_in_backward.setter
    def update_in_backward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"update_in_backward must be True or False, got {value!r}")
        if self._backward_updates is None:
            if value:
                raise ValueError("update_in_backward: turn it on with set_pager(update_in_backward=True) first")
            return
        self._backward_updates.enabled = value

    def page_out(self) -> None:
        """Send every paged state to host memory (for example right after step(), to free
        the GPU for activations). A no-op for unpaged optimizers."""
        if self._pager is not None:
            self._pager.page_out()

    def prefetch(self) -> None:
        """Bring every paged state back to its device ahead of the next step."""
        if self._pager is not None:
            self._pager.prefetch()

    def settle(self) -> None:
        """Make every state tensor readable by any torch op right now: states paged out into host
        copies come back to the GPU, and host-resident states wait for the last step's copies back
        (state_dict() and copies do this themselves). A no-op for unpaged optimizers."""
        if self._pager is not None:
            self._pager.settle()

    def paging_stats(self):
        return None if self._pager is None else self._pager.stats()

    def state_bytes(self) -> int:
        """Bytes held by optimizer state tensors (codes, absmax, 32-bit moments, steps)."""
        return optimizer_state_bytes(self)

    def planned_state_bytes(self, config: dict, p: torch.Tensor) -> Optional[int]:
        """The bytes of ``p``'s state tensors that take memory (the algorithm's ``memory_keys``):
        those it has, else those a new state would have under ``config`` (its group's settings with
        overrides); None when it has none and would get none (a stateless setting)."""
        state = self.state.get(p, {})
        keys = self.algorithm.memory_keys
        if any(isinstance(state.get(k), torch.Tensor) for k in keys):
            return sum(state[k].numel() * state[k].element_size() for k in keys
                       if isinstance(state.get(k), torch.Tensor))
        if not self.algorithm.needs_states(config):
            return None
        fmt = self.state_format(config, p)
        return sum(fmt.state_bytes(spec.moments, sharding.local_numel(p)) for spec in self.algorithm.states)

    def check_fits_device_buffer(self, config: dict, p: torch.Tensor, gi: int, pi: int) -> None:
        """Host-resident states stream through the device buffer in pieces of whole blocks, so any
        size fits; but the states of an algorithm that cannot be cut (stacked moments, an update
        scaled by the whole tensor's norm) stream in one piece and must fit the buffer: a buffer
        of the default size grows to hold them (before its first pass), one set by
        ``device_buffer=`` does not. Checked before the states are made, so a refused step
        changes nothing."""
        from .residency import cuttable

        if cuttable(self.algorithm):
            return
        nbytes = self.planned_state_bytes(config, p)
        if nbytes is None:
            return
        # each state tensor's region is rounded up to the buffer's alignment (host_resident.REGION_ALIGN)
        from ..paging.host_resident import REGION_ALIGN

        needed = nbytes + REGION_ALIGN * 2 * len(self.algorithm.states)
        if needed > self._pager.device_buffer_bytes and getattr(self, "_buffer_may_grow", False):
            self._pager.grow_device_buffer(needed)
        if needed > self._pager.device_buffer_bytes:
            raise ValueError(f"param_groups[{gi}]['params'][{pi}]: its states take {nbytes} bytes, more than the device "
                             f"buffer of host-resident states holds ({self._pager.device_buffer_bytes} bytes); "
                             f"set_pager(residency='host', device_buffer=...) with at least {needed} bytes")
