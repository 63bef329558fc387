"""A Hugging Face Trainer callback that records memory every N optimizer steps (transformers 4.57 and 5.x).

    from pagedopt.integrations.callbacks import MemoryReportCallback

    Trainer(model=model, args=args, train_dataset=ds, callbacks=[MemoryReportCallback(every_n_steps=50)])

At the end of every ``every_n_steps``-th optimizer step (``state.global_step % every_n_steps == 0``)
it appends one entry to ``trainer.state.log_history`` (saved in each checkpoint's
``trainer_state.json``)::

    {"mem/allocated_gib": ..., "mem/reserved_gib": ..., "mem/max_allocated_gib": ...,
     "mem/rss_gib": ...,                        # with psutil
     "mem/optimizer_state_gib": ...,            # the optimizer's state tensors
     "mem/paged_resident_gib": ..., "mem/paged_host_gib": ..., "mem/unpaged_gib": ...,  # paged pagedopt
     "step": global_step}

(``pagedopt.memory.memory_report`` gives the same in bytes.) Without CUDA the allocated/reserved figures
are 0. The entry goes into the log history directly, as ``Trainer.log`` records its own entries: a
callback cannot call ``Trainer.log``, and asking the Trainer to log (``control.should_log``) would
also reset its running training loss average off the ``logging_steps`` schedule. Reporters
(TensorBoard, W&B) therefore do not receive these entries; ``log_to`` (a callable taking the dict)
forwards them anywhere else, e.g. ``log_to=wandb.log``.

To have the reporters receive the figures, attach the callback instead of passing it:

    MemoryReportCallback(every_n_steps=50).attach(trainer)

It then runs before every other callback, and adds the memory figures of the moment to each of the
Trainer's own training log entries (every ``logging_steps``) before the reporters see them (the
Trainer's log history keeps its copy of the entry without them, and the every-N entries above).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from transformers import TrainerCallback

from ..memory import memory_report, report_gib


class MemoryReportCallback(TrainerCallback):
    """Record allocated / reserved / paged-resident memory every ``every_n_steps`` optimizer steps
    into the Trainer's log history (see the module docstring). ``reset_peak``: reset CUDA's peak
    counter after each report, so that ``mem/max_allocated_gib`` is the peak since the last report."""

    def __init__(self, every_n_steps: int = 100, prefix: str = "mem/", reset_peak: bool = False,
                 log_to: Optional[Callable[[dict], Any]] = None):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, not {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.reset_peak = reset_peak
        self.log_to = log_to
        self._into_logs = False

    def attach(self, trainer) -> "MemoryReportCallback":
        """Add this callback to ``trainer`` ahead of all others (the reporters included), so that
        the Trainer's training log entries carry the memory figures to them. Returns self."""
        handler = trainer.callback_handler
        handler.callbacks = [self] + [cb for cb in handler.callbacks if cb is not self]
        self._into_logs = True
        return self

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if self._into_logs and isinstance(logs, dict) and "loss" in logs:  # a training entry
            logs.update(report_gib(memory_report(optimizer), self.prefix))
        return None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step % self.every_n_steps:
            return None
        entry = {**report_gib(memory_report(optimizer), self.prefix), "step": state.global_step}
        state.log_history.append(entry)  # as Trainer.log does, on every process
        if self.log_to is not None and state.is_world_process_zero:
            self.log_to(entry)
        if self.reset_peak:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
        return None
