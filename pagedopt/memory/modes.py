"""Where the states live, and what each choice costs: the peak of every paging mode of a pagedopt
optimizer (:func:`predict_modes`) and the mode to pick for a GPU (:func:`recommend`).

The modes (each a line of code on a paged class, ``PagedAdamW8bit`` for ``adamw_8bit``):

===================== ==========================================================================
``resident``          states on the GPU (``AdamW8bit``, or ``PagedAdamW8bit`` left resident: then
                      they sit in managed memory, which ``torch.cuda.max_memory_allocated`` does not
                      see)
``resident_released`` the same with ``set_pager(update_in_backward=True)``: each gradient is
                      released once its update ran during backward
``auto_released``     ``set_pager(residency="auto", update_in_backward=True)``: hybrid, gradients
                      released (predicted for a given GPU only)
``auto``              ``set_pager(residency="auto")``: the states that fit in what the GPU has free
                      after the first backward (less a margin) stay there, the rest stream from
                      page-locked host memory through the device buffer (:func:`auto_resident`)
``host_released``     ``set_pager(residency="host", update_in_backward=True)``: every state streamed
                      during backward, gradients released
``host``              ``set_pager(residency="host")``: every state in page-locked host memory,
                      streamed through a device buffer (256 MiB) in ``step()``
``budget``            ``set_pager(device_budget=B)``: hybrid with B bytes of states on the GPU
``managed_budget``    ``set_pager(PageManager(budget_bytes=B))``: managed memory, at most B bytes
                      resident, the rest paged in and out around each step
===================== ==========================================================================

Hybrid and host modes keep the 4-byte step counters on the GPU and move the rest: every byte not
kept on the GPU crosses the host link once each way per step.

The peak of a step, with ``zero_grad(set_to_none=True)`` (torch's default), is the largest of
forward/backward (weights, the gradients held, the states on the GPU, activations) and the
optimizer step (weights, gradients, states on the GPU, the step's temporaries). Gradients and
activations are counted together at their largest, which over-states the backward peak by at most
the activations (small beside the rest with gradient checkpointing). Released gradients are
counted as the largest trainable tensor's gradient (a tensor larger than a chunk keeps its whole
gradient until its last piece is updated) plus two chunks' worth of gradients in flight (the one
filling up and the one being updated: updates that keep up with backward); a chunk is
``CHUNK_BYTES`` of states (a quarter of the device buffer for host-resident states). Where the host
link holds streamed updates back, a step may hold up to ``BackwardUpdates.backlog_chunks`` chunks
more before a hook waits (pagedopt/optim/update_backlog.py): under 2% of the peak from 7B parameters
up with the default buffer, but 19% of a 1B model's at 32 tokens, where the updates keep up and
hold two, so they are not counted.

The first step makes the states; with updates during backward it updates its parameters in
chunks as their gradients arrive (the order later steps follow), releasing their gradients as
later steps do, so ``first_step_peak`` is each mode's ``peak`` (kept apart, and ``fits`` takes the
larger, for a first step that would cost more).

``allocator_peak`` is what ``torch.cuda.max_memory_allocated`` shows: neither the CUDA context
nor managed memory (paged states) count there; ``peak`` adds both (what the GPU must hold).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from .estimator import PAGED_CHUNK_BYTES, STEP_BYTES, Estimate, estimate
from .tables import EXTRA_STATE_BYTES, GIB, OPTIMIZERS
from ..optim.byte_sizes import parse_bytes as parse_size  # sizes such as "4GiB", read as set_pager reads them

# pagedopt.paging.host_resident.DEFAULT_DEVICE_BUFFER: the device buffer of host-resident states
DEVICE_BUFFER_BYTES = 256 << 20
# pagedopt.optim.backward_updates.BackwardUpdates.chunks_per_buffer: a chunk of updates during
# backward with host-resident states is this fraction of the device buffer (else PAGED_CHUNK_BYTES)
CHUNKS_PER_BUFFER = 4
# chunks whose gradients are held at once while updates run during backward: the one filling up
# and the one being updated
CHUNKS_IN_FLIGHT = 2
# host memory a host-resident pager pins beyond the states: its slabs (64 MiB at most) are filled
# one after the other, so at most one is partly empty
HOST_SLAB_BYTES = 64 << 20
# the fraction of the GPU a mode's peak must stay under to "fit": the estimator aims at 5%, and
# the allocator's fragmentation takes some more
DEFAULT_MARGIN = 0.10

# pagedopt.paging.resident_set: what residency="auto" leaves free beyond the peak so far
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN = 1 << 30

# fastest first (bench/RESULTS.md, 936M-parameter LM on an H100/H200: resident 1.0x, host with
# updates during backward 1.08-1.13x, host 1.7x; the hybrid modes move only the states that do not
# fit, so they come before host). The recommendation picks among RECOMMENDED, the budget at the
# largest that fits the GPU less the margin (residency="auto" does the same with a 5% margin of its
# own, so it is shown, not picked; managed_budget pages more and is slower).
MODES = ("resident", "resident_released", "budget_released", "budget", "host_released", "host", "auto_released",
         "auto", "managed_budget")
RECOMMENDED = ("resident", "resident_released", "budget_released", "budget", "host_released", "host")
RELEASED = ("resident_released", "budget_released", "host_released", "auto_released")
BUDGETED = ("budget_released", "budget")



@dataclass
class ModePrediction:
    """Bytes of one mode (see the module docstring); ``link_h2d``/``link_d2h``: bytes crossing
    the host link each step, each way; ``pinned``: page-locked host memory; ``managed``: unified
    memory (paged states), on the GPU up to ``states_on_gpu``."""

    mode: str
    how: str
    states_on_gpu: int
    managed: int
    device_buffer: int
    gradients: int            # held at the peak of a step after the first
    allocator_peak: int
    allocator_first_step_peak: int
    peak: int
    first_step_peak: int
    pinned: int
    link_h2d: int
    link_d2h: int
    note: str = ""

    @property
    def worst_peak(self) -> int:
        return max(self.peak, self.first_step_peak)

    def fits(self, capacity_bytes: int, margin: float = DEFAULT_MARGIN) -> bool:
        return self.worst_peak <= capacity_bytes * (1.0 - margin)

    def as_dict(self) -> dict:
        return dict(asdict(self), worst_peak=self.worst_peak)


def paged_name(optimizer: str) -> Optional[str]:
    """The paged pagedopt optimizer of ``optimizer``'s states (itself if paged), None for torch's."""
    _, bits, paged, _ = OPTIMIZERS[optimizer]
    if bits is None:
        return None
    if paged:
        return optimizer
    name = "paged_" + optimizer
    return name if name in OPTIMIZERS else None


def _class(name: str) -> str:
    """How to make ``name``: ``AdamW8bit(params, ...)``, ``torch.optim.AdamW(params, ..., fused=True)``."""
    label = OPTIMIZERS[name][0].split(" ")[0].replace("pagedopt.", "")
    if label.endswith("(fused=True)"):
        return label[:-len("(fused=True)")] + "(params, ..., fused=True)"
    return label + "(params, ...)"


def streamed_bytes(e: Estimate) -> int:
    """The state bytes host residency keeps on the host and streams in and back each step: the
    moments (codes and absmax), not the per-tensor scalars (the fp32 step counter, and LARS/LAMB's
    norm), which stay on the parameter's device."""
    fixed = STEP_BYTES + EXTRA_STATE_BYTES.get(e.optimizer, 0)
    return max(e.state_bytes - fixed * e.trainable_tensors, 0)


def released_gradients(e: Estimate, chunk_state_bytes: int) -> int:
    """Gradients held at once while updates run during backward (see the module docstring)."""
    if e.n_trainable == 0:
        return 0
    grad_bytes = e.gradients / e.n_trainable  # per parameter (one dtype for the trainable ones)
    state_per_param = max(e.state_bytes / e.n_trainable, 1e-9)
    chunk_grads = chunk_state_bytes / state_per_param * grad_bytes
    largest = e.largest_trainable * grad_bytes
    return int(min(e.gradients, largest + CHUNKS_IN_FLIGHT * chunk_grads))


def auto_resident(e: Estimate, total: int, device_buffer: int = DEVICE_BUFFER_BYTES) -> int:
    """The state bytes ``residency="auto"`` keeps on a GPU of ``total`` bytes: its budget is what
    the GPU has free when the first state is made (the first step, after forward and backward): the
    total less the context and the peak so far (weights, gradients, activations), less a margin
    (a twentieth of the GPU, at least 1 GiB) and the device buffer
    (pagedopt.paging.resident_set.auto_budget); at most every streamable state."""
    margin = max(int(total * AUTO_MARGIN_FRACTION), AUTO_MARGIN_MIN)
    peak = e.weights + e.gradients + max((e.activations or 0) + e.weight_casts, e.step_temporaries)
    budget = total - e.context - peak - margin - device_buffer
    return max(0, min(budget, streamed_bytes(e)))


def predict_modes(e: Estimate, device_buffer=DEVICE_BUFFER_BYTES, budget=None,
                  capacity: Optional[int] = None) -> list[ModePrediction]:
    """The modes open to ``e``'s optimizer (MODES' order, fastest first): only ``resident`` for
    torch's AdamW; every mode for pagedopt's (the paged ones through its Paged* class); ``auto``
    and ``auto_released`` only for a GPU of ``capacity`` bytes. ``budget``: the device budget of the
    ``budget`` and ``managed_budget`` modes (bytes or "4GiB"; default half the states)."""
    buf = parse_size(device_buffer, "device_buffer")
    w, g, s, ctx = e.weights, e.gradients, e.state_bytes, e.context
    act, temps = (e.activations or 0) + e.weight_casts, e.step_temporaries
    transient = max(act, temps)  # activations are gone by the step; the step's temporaries come after
    own = _class(e.optimizer)
    paged = paged_name(e.optimizer)
    is_paged = OPTIMIZERS[e.optimizer][2]
    out = {}

    def add(mode, how, on_gpu_alloc, managed, managed_on_gpu, bufb, grads, pinned, link, note=""):
        steady = w + grads + on_gpu_alloc + bufb + transient
        first = steady  # released modes release the first step's gradients too (backward_first_step.py)
        out[mode] = ModePrediction(mode, how, on_gpu_alloc + managed_on_gpu, managed, bufb, grads, steady, first,
                                   steady + managed_on_gpu + ctx, first + managed_on_gpu + ctx, pinned, link, link, note)

    # resident: a paged class keeps its states in managed memory (outside torch's allocator)
    alloc_states, managed = (0, s) if is_paged else (s, 0)
    add("resident", own, alloc_states, managed, managed, 0, g, 0, 0)
    if paged is None:
        return list(out.values())
    released = "no gradient clipping, GradScaler or DDP"
    add("resident_released", f"{own}; opt.set_pager(update_in_backward=True)", alloc_states, managed,
        managed, 0, released_gradients(e, PAGED_CHUNK_BYTES), 0, 0, released)
    paged_how = _class(paged)
    moved = streamed_bytes(e)
    counters = s - moved  # the step counters stay on the GPU whatever the residency
    rel_host = released_gradients(e, max(buf // CHUNKS_PER_BUFFER, 1))

    def hybrid(mode, how, kept, grads, note=""):
        """``kept`` bytes of states stay on the GPU (ordinary memory), the rest stream from the host."""
        rest = moved - kept
        add(mode, how, counters + kept, 0, 0, buf if rest else 0, grads, rest + HOST_SLAB_BYTES if rest else 0, rest,
            note)

    bud = moved // 2 if budget is None else parse_size(budget, "budget")
    kept = min(bud, moved)
    within = "the states within the budget stay on the GPU, the rest stream from the host"
    hybrid("budget_released", f"{paged_how}; opt.set_pager(device_budget={_size(bud)!r}, update_in_backward=True)",
           kept, rel_host, f"{within}; {released}")
    hybrid("budget", f"{paged_how}; opt.set_pager(device_budget={_size(bud)!r})", kept, g, within)
    hybrid("host_released", f"{paged_how}; opt.set_pager(residency=\"host\", update_in_backward=True)", 0, rel_host,
           released)
    hybrid("host", f"{paged_how}; opt.set_pager(residency=\"host\")", 0, g)
    if capacity is not None:
        kept = auto_resident(e, capacity, buf)
        auto_note = f"keeps {kept / GIB:.2f} GiB of states on a GPU of {capacity / GIB:.1f} GiB, a 5% margin"
        hybrid("auto_released", f"{paged_how}; opt.set_pager(residency=\"auto\", update_in_backward=True)", kept,
               rel_host, f"{auto_note}; {released}")
        hybrid("auto", f"{paged_how}; opt.set_pager(residency=\"auto\")", kept, g, auto_note)
    on_gpu = min(bud, s)
    add("managed_budget", f"{paged_how}; opt.set_pager(pagedopt.PageManager(budget_bytes={bud}))", 0, s, on_gpu, 0, g,
        s - on_gpu, s - on_gpu, "managed memory: states beyond the budget are paged in and out around each step")
    return [out[m] for m in MODES if m in out]


def _size(n: int) -> str:
    """``n`` bytes as set_pager takes them: "4GiB", "768MiB", or the number itself."""
    for unit, k in (("GiB", 30), ("MiB", 20)):
        if n and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def largest_budget(e: Estimate, capacity_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """The largest device budget (a whole number of GiB, or of 256 MiB under 1 GiB) whose peak stays
    under ``capacity_bytes * (1 - margin)``; 0 when even no states on the GPU do not fit, or the
    optimizer cannot page."""
    zero = next((p for p in predict_modes(e, budget=0) if p.mode == "budget"), None)
    if zero is None:  # torch's AdamW: no budget mode
        return 0
    room = int(capacity_bytes * (1.0 - margin)) - zero.worst_peak
    if room <= 0:
        return 0
    room = min(room, streamed_bytes(e))  # all of them: no device buffer then, still fits
    step = GIB if room >= GIB else 256 << 20
    return room // step * step


@dataclass
class Recommendation:
    mode: Optional[str]                  # None: nothing fits
    how: str
    reason: str
    prediction: Optional[ModePrediction]
    alternatives: list


def recommend(e: Estimate, capacity_bytes: int, margin: float = DEFAULT_MARGIN, release_ok: bool = True,
              device_buffer=DEVICE_BUFFER_BYTES) -> Recommendation:
    """The fastest mode whose peak (first step included) stays under ``capacity_bytes * (1 -
    margin)``, among RECOMMENDED, the budgeted ones at the largest budget that fits
    (:func:`largest_budget`); with ``release_ok=False`` (gradient clipping, GradScaler, DDP or
    gradient accumulation) the modes that release gradients are left out. When nothing fits and the
    weights are fp32, says whether bf16 parameters would."""
    budget = largest_budget(e, capacity_bytes, margin)
    preds = predict_modes(e, device_buffer, budget=budget, capacity=capacity_bytes)
    usable = [p for p in preds if p.mode in RECOMMENDED and (release_ok or p.mode not in RELEASED)
              and not (p.mode in BUDGETED and budget <= 0)]  # a budget of 0 is host residency
    fitting = [p for p in usable if p.fits(capacity_bytes, margin)]
    cap = f"{capacity_bytes / GIB:.1f} GiB less a {margin:.0%} margin"
    if fitting:
        best = fitting[0]
        reason = f"{best.mode}: the fastest mode whose peak ({best.worst_peak / GIB:.1f} GiB) fits {cap}"
        if best.link_h2d:
            reason += f"; it moves {best.link_h2d / GIB:.2f} GiB of states each way per step"
        if best.mode in BUDGETED:
            reason += ("; residency=\"auto\" chooses the budget itself, from what the GPU has free after the first "
                       "backward, less 5%")
        return Recommendation(best.mode, best.how, reason, best, [p.mode for p in fitting[1:]])
    smallest = min(usable, key=lambda p: p.worst_peak)
    reason = f"nothing fits {cap}: the smallest peak is {smallest.mode}'s, {smallest.worst_peak / GIB:.1f} GiB"
    if paged_name(e.optimizer) is None:
        reason += "; an 8-bit pagedopt optimizer (--optimizer paged_adamw_8bit) keeps its states off the GPU"
    if e.weights_dtype == "fp32":
        r = recommend(with_weights(e, "bf16"), capacity_bytes, margin, release_ok, device_buffer)
        if r.mode is not None:
            reason += (f"; with bf16 parameters {r.mode} fits ({r.prediction.worst_peak / GIB:.1f} GiB; the updates "
                       "are computed in fp32 but stored in bf16)")
    return Recommendation(None, "", reason, None, [])


def _estimate_kwargs(e: Estimate) -> dict:
    s = e.settings
    return dict(batch=s["batch"], seq=s["seq"], gradient_checkpointing=s["gradient_checkpointing"],
                attention=s["attention"], min_8bit_size=s["min_8bit_size"], embeddings_32bit=s["embeddings_32bit"],
                act_dtype=s.get("act_dtype"), context_bytes=e.context)


def with_weights(e: Estimate, weights: str) -> Estimate:
    """``e`` with the parameters in another dtype."""
    return estimate(e.model, e.optimizer, weights, lora_rank=e.settings["lora_rank"], lora_mlp=e.settings["lora_mlp"],
                    **_estimate_kwargs(e))


__all__ = ["AUTO_MARGIN_FRACTION", "AUTO_MARGIN_MIN", "BUDGETED", "CHUNKS_IN_FLIGHT", "CHUNKS_PER_BUFFER",
           "DEFAULT_MARGIN", "DEVICE_BUFFER_BYTES", "HOST_SLAB_BYTES", "MODES", "ModePrediction", "RECOMMENDED",
           "RELEASED", "Recommendation", "auto_resident", "largest_budget", "paged_name", "parse_size", "predict_modes",
           "recommend", "released_gradients", "streamed_bytes", "with_weights"]
