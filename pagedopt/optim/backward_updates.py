"""Updates during backward: ``set_pager(update_in_backward=True)``, with any residency (states
resident, paged under a device budget, or host-resident).

Once a parameter's update has run, its gradient is released (``p.grad = None``; the memory goes
back once the update stream has read it), so that gradients take about one chunk of device memory
instead of the whole model's; ``set_pager(..., keep_grads=True)`` keeps them for code that reads them
after backward. Where the updates are slower than backward (states streamed over the host link), a
hook waits once ``backlog_chunks`` chunk updates are queued and not done (update_backlog.py), so
that backward cannot run ahead holding every gradient.

Host-resident states cross the link twice per step (in, then back). After backward the whole
crossing waits for the update; during backward the link is idle. Here each parameter's update
runs as soon as its gradient is final (``register_post_accumulate_grad_hook``), in chunks of about
a quarter of the device buffer, so that the copies of states in and back overlap with the rest of
backward, and ``step()`` only updates what is left (the parameters whose gradients came last).

The first step. Without a schedule (the first step, and the first after anything that drops it),
the parameters are updated in chunks as their gradients arrive: once those waiting have a chunk's
worth of states (made then, as one transaction), one step plan of theirs runs, and their gradients
are released, so that no step holds more than about a chunk of gradients (backward_first_step.py).
``step()`` updates the parameters still waiting, then makes the schedule.

The schedule. After a step without one, the order in which the gradients arrived in that step's
backward is cut into chunks (per device, in arrival order, each at most a quarter of the buffer,
or one parameter); one pager pass (``HostResidentPager.open_pass``)
per device and step copies the chunks in, in that order, starting right after the previous step
(so the first chunks arrive during forward). During backward a chunk is updated once every one of
its parameters has its gradient, on a stream of its own (after everything the backward has queued
so far), so that backward's own kernels never wait for a copy. ``step()`` updates the remaining
chunks, then makes the caller's stream wait for all of it. Results are bit for bit those of the
ordinary step: the same kernels on the same tensors, each parameter updated once, its step counter
incremented once.

What the mode cannot do, and refuses or says: the gradient a parameter is updated with is the one
it has when its hook fires, so gradient clipping and GradScaler (whose ``step`` unscales and checks
all gradients after backward) don't apply (a GradScaler step raises before ``step()`` changes
anything, but the chunks updated during backward keep their update: a scaler cannot be seen
before its step); under DDP the hook sees the gradient before it is
all-reduced, so a process group of several ranks is refused, as are DTensor (FSDP2) parameters.
A second backward before ``step()`` raises (gradient accumulation: set ``opt.update_in_backward =
False`` for the micro-batches before the last). A parameter whose gradient did not come through a
hook (set by hand) is updated in ``step()``, as are parameters not in the schedule; anything that
changes the step plan (new states, ``load_state_dict``, ``add_param_group``, a different set of
parameters with gradients) drops the schedule, and the next step, updated as the first one is,
makes a new one. A ``step()`` that raises (out of memory for the states of the parameters left to
it) may be repeated: it finds the step's progress as it was; the next backward starts a new step.

The parts: the hooks (backward_hooks.py), a step without a schedule (backward_first_step.py), the
schedule's chunks (backward_schedule.py), the worker thread (update_worker.py); here, what ties
them to the optimizer's step().
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import torch

from .. import _ops
from .backward_first_step import FirstStep, update_chunk
from .backward_hooks import GradHooks
from .backward_schedule import Run, cut_into_chunks, update_part
from .grad_checks import locate, raise_bad_grad
from . import residency
from .update_backlog import UpdateBacklog
from .update_worker import UpdateWorker


class BackwardUpdates:
    """The hooks, the schedule and the per-step progress of updates during backward (see the module)."""

    # the update stream's priority (-1: high, so that a chunk's update runs as soon as it may,
    # between backward's kernels, and its region of the device buffer comes free for the next copy
    # in) and the chunk size (a quarter of the device buffer, every chunk of it in flight: the
    # pass's prefetch depth is chunks_per_buffer - 1). On the H200, 936M-parameter bench, loop ms
    # per step (scripts/profile_train_step.py --variants, 2026-12-04): 3 chunks 57.0, 4 chunks
    # 55.1, 2 chunks 57.8; priority 0 instead of -1: within 1 ms either way. Another machine, each
    # variant in its own process (bench_train @cNpM): 3 chunks 69.9, 4 chunks 72.9 / 68.8 (priority
    # 0), 6 chunks 80.2, 8 chunks 86.0: every chunk costs host time in the hook (bench/RESULTS.md)
    stream_priority = -1
    chunks_per_buffer = 4
    # whether the chunks' updates run on a worker thread (update_worker.py) instead of in the hooks,
    # on the autograd engine's thread; off until measured on a GPU (bench_train's @w variant)
    update_thread = False
    # how many chunk updates may be queued and not yet done before a hook waits for the oldest
    # (update_backlog.py): the gradients held are about that many chunks'; twice the chunks of the
    # device buffer, so that the update stream always has chunks before it whose copies in are done
    backlog_chunks = 8

    def __init__(self, opt):
        self._opt = weakref.ref(opt)
        self.enabled = True
        self._lock = threading.RLock()        # the hooks' bookkeeping, one thread at a time (_on_grad)
        self.keep_grads = False               # True: gradients stay after their update (set_pager(keep_grads=True))
        self._last_chunk: dict = {}           # id(param) -> (device, chunk) that updates its last piece
        self._hooks = GradHooks(self, BackwardUpdates._on_grad, self._opt)
        self._arrived: list[int] = []         # ids of params in the order their gradients arrived
        self._arrived_set: set[int] = set()
        self._plan = None                     # the optimizer's step plan the schedule was made from
        self._schedule: Optional[dict] = None  # device -> [(parts, ids)]
        self._chunk_of: dict[int, list] = {}  # id(param) -> [(device, chunk index)] (pieces: several)
        self._runs: Optional[dict] = None     # device -> Run of the coming step
        self._counted: set[int] = set()       # params whose gradient counted towards a chunk this step
        self._updated: set[int] = set()       # params updated this step
        self._checked = False                 # the schedule was checked against the optimizer this step
        self._settings_checked = False        # the param groups' settings were checked this step
        self._began = False                   # the pager was told that a step began
        self._stepped: dict = {}              # id(bucket) -> positions whose counter was incremented
        self._streams: dict = {}
        self._worker: Optional[UpdateWorker] = None
        self._first: Optional[FirstStep] = None  # a step without a schedule: its progress (backward_first_step.py)
        self._backlog = UpdateBacklog(self.backlog_chunks)  # the chunk updates queued on the GPU, not yet done
        self._failed = False                  # step() raised: the next backward starts the step afresh
        self._pass_plans: Optional[dict] = None  # device -> the pager's PassPlan of the schedule's chunks
        self.trace: Optional[list] = None     # a list: per chunk update, (chunk, gradients ready, update
        # started, update done) as CUDA timing events (scripts/profile_train_step.py reads it)
        self.copy_trace: Optional[list] = None  # a list: the passes' copies, (chunk, "in"/"back", start, end)

    # ------------------------------------------------------------------ hooks
    def hook_params(self, params) -> None:
        self._hooks.add(params)

    def remove_hooks(self) -> None:
        self._hooks.remove()
        self.drop_schedule()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _on_grad(self, p: torch.Tensor) -> None:
        # autograd runs the backward of each GPU on a thread of its own: a model spread over several
        # GPUs calls these hooks from several threads, whose bookkeeping must not interleave
        with self._lock:
            self._grad_arrived(p)

    def _grad_arrived(self, p: torch.Tensor) -> None:
        opt = self._opt()
        if opt is None:
            return
        pid = id(p)
        if self._failed:  # the backward after a step() that raised: a new step
            self._failed = False
            self._arrived, self._arrived_set = [], set()
            self._reset_step()
        if pid not in self._arrived_set:
            self._arrived_set.add(pid)
            self._arrived.append(pid)
        if not self.enabled:
            return
        if pid in self._counted:
            raise RuntimeError(f"{type(opt).__name__}: {locate(opt.param_groups, p)} received a second gradient before "
                               "step(); with update_in_backward=True every backward() must be followed by step() "
                               "(for gradient accumulation set opt.update_in_backward = False for the micro-batches "
                               "before the last)")
        self._counted.add(pid)
        if not self._settings_checked:
            self._check_settings(opt)
        if self._schedule is None or not self._current(opt):
            self._first_step_grad(opt, p)
            return
        for device, k in self._chunk_of.get(pid, ()):
            run = self._runs[device]
            run.waiting[k] -= 1
            while run.queued < len(run.chunks) and run.waiting[run.queued] == 0:
                self._release_chunk(opt, device, run)

    def _first_step_grad(self, opt, p: torch.Tensor) -> None:
        """A gradient in a step without a schedule: its parameter waits for its chunk, which is
        updated once full (backward_first_step.py), and the chunk's gradients released."""
        if self._first is None:
            self._first = FirstStep(opt, self.chunks_per_buffer)
        chunk = self._first.arrive(opt, p)
        if chunk is None:
            return
        stream = self._stream(p.device)
        if stream is not None:
            self._backlog.admit()
        try:
            done = update_chunk(opt, chunk, self._first.overrides, stream, begin=not self._began)
        except ValueError as exc:  # a bad gradient
            self._bad_gradient(exc)
        if not done:
            self._first.stopped = True
            return
        self._began = True
        self._updated.update(id(q) for q in chunk)
        if not self.keep_grads:
            for q in chunk:
                g = q.grad
                if stream is not None:
                    g.record_stream(stream)
                q.grad = None
        self._backlog_queued(stream)

    # ------------------------------------------------------------------ the schedule
    def _current(self, opt) -> bool:
        """Whether the schedule still fits the optimizer (checked once a step); drops it if not."""
        if self._checked:
            return self._schedule is not None
        self._checked = True
        plan = opt.step_plan
        in_groups = {id(q) for g in opt.param_groups for q in g["params"]}
        if (plan is not self._plan or not opt.plan_is_current(plan)
                or not all(id(p) in in_groups for b in plan.buckets for p in b.params)):
            self.drop_schedule()
            return False
        if self._runs is None:
            self._open_passes(opt)
        return True

    def drop_schedule(self) -> None:
        self._plan = self._schedule = self._runs = self._pass_plans = None
        self._chunk_of = {}
        self._last_chunk = {}

    def make_schedule(self, opt, plan) -> None:
        """After an ordinary step of ``plan``: chunks in the order the gradients arrived, and the
        next step's copies in started."""
        arrived, self._arrived, self._arrived_set = self._arrived, [], set()
        self._reset_step()
        self.drop_schedule()
        if not self.enabled or plan is None or plan.sharded or not arrived or not self._hooks:
            return
        position = {}
        for bi, b in enumerate(plan.buckets):
            if not b.stateful:
                return  # not a paged optimizer's bucket: leave everything to step()
            for j, p in enumerate(b.params):
                position[id(p)] = (bi, j)
        limit = residency.pass_chunk_bytes(opt.pager, self.chunks_per_buffer)
        schedule = cut_into_chunks(opt.algorithm, plan, arrived, position, limit)
        self._plan = plan
        self._schedule = schedule
        # laid out once: each step's pass reuses the layouts and the device views
        self._pass_plans = {device: residency.plan_pass(opt.pager, self._groups(chunks))
                            for device, chunks in self._schedule.items()}
        self._chunk_of = {}
        for device, chunks in self._schedule.items():
            for k, (_, ids) in enumerate(chunks):
                for pid in ids:
                    self._chunk_of.setdefault(pid, []).append((device, k))
        # the chunk that updates the last piece of each parameter: its gradient is released there
        self._last_chunk = {pid: places[-1] for pid, places in self._chunk_of.items()}
        self._open_passes(opt)

    @staticmethod
    def _groups(chunks: list) -> list:
        return [[t for _, pieces in parts for piece in pieces for t in piece.host] for parts, _ in chunks]

    def _open_passes(self, opt) -> None:
        """The coming step's pager passes: their first copies in start now."""
        depth = self.chunks_per_buffer - 1
        copies = self.copy_trace
        self._runs = {device: Run(chunks, residency.open_pass(opt.pager, device, self._pass_plans[device], depth,
                                                              trace=copies))
                      for device, chunks in self._schedule.items()}

    # ------------------------------------------------------------------ updates
    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device, priority=self.stream_priority)
        return self._streams[device]

    def _release_chunk(self, opt, device: torch.device, run: Run) -> None:
        """Chunk ``run.queued`` has all its gradients: update it now, or (``update_thread``) check
        its gradients here, mark them ready on the current stream and queue the rest for the worker."""
        k = run.queued
        stream = self._stream(device)
        if not self.update_thread:
            if stream is not None:  # before the chunk counts as queued: an error here leaves it to step()
                self._backlog.admit()
            run.queued += 1
            self._update_chunk(opt, device, run, k, self._plan)
            self._backlog_queued(stream)
            return
        run.queued += 1
        try:
            verdicts = self._check_chunk(opt, run, k)
        except ValueError as exc:
            self._bad_gradient(exc)
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event(enable_timing=self.trace is not None)
            ready.record(torch.cuda.current_stream(device))
        if self._worker is None:
            self._worker = UpdateWorker()
        if stream is not None:  # the chunks handed to the worker count towards the backlog, their
            # gradients held until it runs them: at most backlog_chunks - 1 of them, then the events
            self._backlog.admit(self._worker.wait_below(self._backlog.limit))
        self._worker.submit(self._update_and_count, opt, device, run, k, self._plan, ready, verdicts, stream)

    def _update_and_count(self, opt, device, run: Run, k: int, plan, ready, verdicts, stream) -> None:
        """The worker's call: chunk k's update, then its event in the backlog."""
        self._update_chunk(opt, device, run, k, plan, ready, verdicts)
        self._backlog_queued(stream)

    def _backlog_queued(self, stream) -> None:
        """A chunk's update was queued on ``stream`` (None: on the CPU, done already)."""
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._backlog.queued(event)

    def _check_chunk(self, opt, run: Run, k: int) -> list:
        """The gradients of chunk k's parts checked (a ValueError names a bad one); their verdicts."""
        verdicts = []
        for bi, pieces in run.chunks[k][0]:
            bucket = self._plan.buckets[bi]
            params = [bucket.params[piece.j] for piece in pieces if bucket.params[piece.j].grad is not None]
            verdict = _ops.check_grads(params, [p.grad for p in params]) if params else _ops.GRADS_CONTIGUOUS
            if verdict >= 0:
                raise_bad_grad(opt.param_groups, params[verdict])
            verdicts.append(verdict)
        return verdicts

    def _check_settings(self, opt) -> None:
        """At the step's first gradient, before any update: the settings changed in param_groups
        since they were last checked are checked as step() checks them (a bad one raises, and
        stops backward, with nothing updated)."""
        try:
            opt.check_changed_settings()
        except ValueError as exc:
            self._abandon_step()
            raise ValueError(f"{exc} (met during backward with update_in_backward=True, before any update: "
                             "nothing was changed; fix the setting, call zero_grad() and run backward again)") from None
        self._settings_checked = True

    def _bad_gradient(self, exc: ValueError):
        """A bad gradient met during backward: the step is abandoned, the error raised."""
        self._abandon_step()
        raise ValueError(f"{exc} (met during backward with update_in_backward=True: the parameters "
                         "updated earlier in this backward keep their update; call zero_grad() and go on, "
                         "or load a checkpoint)") from None

    def _update_chunk(self, opt, device: torch.device, run: Run, k: int, plan, ready=None,
                      verdicts: Optional[list] = None, release: bool = True) -> None:
        """Update chunk k (``run.next``) on the update stream, after the work queued so far (or,
        from the worker, after ``ready``), with the gradients its parameters have now (those
        without one are left alone); ``verdicts``: its parts' gradients, already checked;
        ``release``: free the gradients it finished with (during backward; step() keeps them)."""
        parts, _ = run.chunks[k]
        if not self._began:
            self._began = True
            if opt.pager is not None:
                opt.pager.begin_step()  # the step's first chunk
        stream = self._stream(device)
        marks = None
        if stream is not None:
            if self.trace is not None:
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                if ready is None:
                    ready = torch.cuda.Event(enable_timing=True)
                    ready.record(torch.cuda.current_stream(device))
                self.trace.append((k, ready, *marks))
            if ready is None:
                stream.wait_stream(torch.cuda.current_stream(device))
            else:
                stream.wait_event(ready)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            views = run.pass_.take(k)
            if marks is not None:
                marks[0].record(stream)
            view_of = {id(t): v for t, v in zip(run.pass_.groups[k], views)}
            try:
                updated = []
                for i, (bi, positions) in enumerate(parts):
                    bucket = plan.buckets[bi]
                    part = update_part(opt, bucket, positions, view_of, self._stepped.setdefault(id(bucket), set()),
                                       None if verdicts is None else verdicts[i])
                    self._updated.update(map(id, part))
                    updated += part
                if release and not self.keep_grads:
                    self._release_grads(updated, device, k, stream)
            except ValueError as exc:  # a bad gradient (checked here when not by the hook): the step is abandoned
                if verdicts is not None:
                    raise
                self._bad_gradient(exc)
            finally:
                if marks is not None:
                    marks[1].record(stream)
                run.pass_.give_back(k)  # what was updated goes back; the rest goes back unchanged
                run.next += 1

    def _join_worker(self) -> None:
        """Wait for the chunks queued for the worker (raising the error one of them met, if any)."""
        if self._worker is not None:
            self._worker.join()

    def _abandon_step(self) -> None:
        try:
            self._join_worker()
        finally:
            self.wait_for_updates()
            self.drop_schedule()
            self._arrived, self._arrived_set = [], set()
            self._reset_step()

    def _release_grads(self, params: list, device, k: int, stream) -> None:
        """Free the gradients of the parameters whose last piece chunk k updated (``p.grad = None``):
        their memory goes back to the caching allocator once the update stream has read them."""
        for p in params:
            if self._last_chunk.get(id(p)) != (device, k):
                continue
            g = p.grad
            if g is not None:
                if stream is not None:
                    g.record_stream(stream)
                p.grad = None

    # ------------------------------------------------------------------ step()
    def active(self, opt) -> bool:
        """Whether step() finishes a step of the schedule (it is current, and on or begun)."""
        return self._schedule is not None and (self.enabled or bool(self._updated)) and self._current(opt)

    @staticmethod
    def _under_grad_scaler(opt) -> bool:
        return getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None

    @classmethod
    def refuse_grad_scaler(cls, opt) -> None:
        if cls._under_grad_scaler(opt):
            raise RuntimeError(f"{type(opt).__name__}: update_in_backward=True cannot run under GradScaler (the "
                               "parameters would be updated during backward with scaled gradients, before the "
                               "scaler checks them); use bf16 autocast without a scaler, or turn the mode off")

    def finish_step(self, opt) -> set[int]:
        """step() after updates in backward: the remaining chunks, then the caller's stream waits
        for them. Returns the ids of the parameters updated (step() updates any others with
        gradients the ordinary way)."""
        if self._under_grad_scaler(opt):  # a scaler brought in after updates began: stop them
            self._join_worker()  # (the queued chunks first: they are the backward's updates)
            if self._updated:
                self.drop_schedule()
            self.refuse_grad_scaler(opt)
        try:
            self._join_worker()  # the chunks the hooks queued, in order, before the ones left
            for device, run in self._runs.items():
                while run.queued < len(run.chunks):
                    k = run.queued
                    run.queued += 1
                    self._update_chunk(opt, device, run, k, self._plan, release=False)
        except BaseException:
            self.drop_schedule()  # an error in the middle of the chunks: the next step is an ordinary one
            raise
        finally:
            self.wait_for_updates()
        return self._updated

    @property
    def began(self) -> bool:
        """Whether the pager was told that this step began (by an update during backward)."""
        return self._began

    def finish_first_step(self, opt) -> set[int]:
        """step() of a step without a schedule: the ids of the parameters updated during its
        backward (step() updates the rest the ordinary way), once the caller's streams wait for
        their updates."""
        try:
            self._join_worker()
        finally:
            self.wait_for_updates()
        return self._updated

    def step_failed(self) -> None:
        """step() raised: a repeated step() finds this step's progress as it was; the next
        backward starts a new step."""
        self._failed = True

    def wait_for_updates(self) -> None:
        """The caller's streams wait for every update queued on the update streams."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def end_step(self, opt, drop: bool) -> None:
        """After step(): ready for the next backward, whose copies in start now (``drop``: some
        parameters were not in the schedule, which the next ordinary step makes again)."""
        self._arrived, self._arrived_set = [], set()
        self._reset_step()
        if drop:
            self.drop_schedule()
        elif self._current(opt):
            self._checked = False  # checked again at the next step's first gradient

    def _reset_step(self) -> None:
        self._began = False
        self._settings_checked = False
        self._stepped = {}  # id(bucket) -> positions whose step counter this step incremented
        self._counted = set()
        self._updated = set()
        self._checked = False
        self._runs = None
        self._first = None
        self._failed = False
        self._backlog = UpdateBacklog(self.backlog_chunks)
