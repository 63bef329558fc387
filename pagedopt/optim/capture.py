"""Steps captured in a CUDA graph (``capturable=True``, as in torch.optim.AdamW).

A captured step replays the kernels it queued at capture with the arguments they had then. What
changes from one replay to the next must therefore live on the GPU, and nothing in ``step()`` may
synchronise with the host or decide on the host from values that change:

* the step counters already do (float32 tensors on the parameters' device, incremented by a
  device ``add_``; GradScaler's ``found_inf`` is a device tensor the kernels read);
* the learning rate does when it is a tensor on the parameters' device (``lr=torch.tensor(1e-3,
  device="cuda")``): the kernels read it at every replay, so a scheduler that writes it between
  replays (torch's schedulers ``fill_`` a tensor lr) changes the captured step's lr. A float lr is
  fixed in the graph at capture, as in torch;
* the kernels' metadata goes up from page-locked memory kept for the life of the process
  (csrc/cuda/quantized_step.cu).

Everything else is decided once, at capture, and refused here when it cannot hold: the states and
the step plan must exist before capture (run eager warm-up steps first, as torch's recipe does);
paged states must be resident; host-resident states (``residency="host"``) cannot be captured.
"""
from __future__ import annotations

import torch

from .residency import all_resident, streams_now


def capturing(p: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured (``p``: a parameter of the step)."""
    return p.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_check(opt, plan) -> None:
    """Refuse, before anything changes, a step being captured that could not replay correctly."""
    name = type(opt).__name__
    if not getattr(opt, "capturable", False):
        raise RuntimeError(f"{name}.step() is being captured in a CUDA graph but the optimizer was made with "
                           "capturable=False: construct it with capturable=True")
    for gi, group in enumerate(opt.param_groups):
        if not group["params"]:
            continue
        lr = group["lr"]
        device = group["params"][0].device
        if isinstance(lr, torch.Tensor) and lr.device != device:
            raise RuntimeError(f"{name}.step() is being captured in a CUDA graph but param_groups[{gi}]['lr'] is a "
                               f"tensor on {lr.device}, the parameters on {device}: a captured step reads lr on the "
                               "parameters' device (or pass a float, fixed at capture)")
    if plan is None:
        raise RuntimeError(f"{name}.step() is being captured in a CUDA graph before its states exist for this set of "
                           "parameters with gradients (or after they changed: a new parameter, load_state_dict, "
                           "add_param_group): run eager warm-up steps with the same parameters having gradients "
                           "first, so that the states and step counters are made outside the graph")
    pager = opt.pager
    if streams_now(pager):
        raise RuntimeError(f"{name}.step() cannot be captured in a CUDA graph with host-resident states "
                           "(residency='host'): their copies are scheduled on the host at every step; use "
                           "set_pager(residency='device') for a captured step")
    if not all_resident(pager):
        raise RuntimeError(f"{name}.step() cannot be captured in a CUDA graph while paged states are not all "
                           "resident on the GPU (after page_out(), over the device budget, or with a page-in in "
                           "flight): run an eager step (which pages them in) right before capture, and keep them "
                           "resident (no page_out() or device budget) while the graph is replayed")
