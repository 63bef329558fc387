"""The kernel functionals: what updates one chunk of a bucket, chosen at plan time by the bucket's
``kernel`` (plan.py):

* ``ENGINE``: the generic engine op (``quantized_step_``; 8-bit or 32-bit states, any algorithm
  with a functor in csrc/include/pagedopt/algorithms/), or ``quantized_step_list_`` on the states a
  bucket holds in C++;
* ``FUSED32``: torch's fused kernel for 32-bit states (Adam/AdamW: ``spec.fused32``), on fp32
  copies of 16-bit parameters;
* ``STATELESS``: plain SGD (momentum 0), in torch ops.

Norm-scaled algorithms (LARS, LAMB: ``spec.norm_scaled``) first compute each tensor's update norm
with the engine's ``quantized_update_norm_`` and pass per-tensor scales to the same op.

``hyper_and_lr`` is where a group's settings become the op's arguments: a tensor lr on the
parameters' device is read by the kernel (``lr``), a float one goes in ``hyper``.

Stochastic rounding (``bf16_stochastic_round``, a group setting; bf16 parameters only): the
engine rounds each new parameter value to bf16 with random bits of (the group's ``bf16_sr_seed``,
the parameter's ``Bucket.sr_ids`` entry, its step count, the element's index in the whole
parameter: ``Bucket.sr_offsets`` for a DTensor's shard plus ``Chunk.offsets`` for pieces), so that
any way of cutting a step into chunks gives the same bits. A FUSED32 bucket then runs the engine's
32-bit path instead of torch's fused kernel: one pass over params, grads and states that rounds in
registers, where the fused kernel would need fp32 copies of the parameters and a rounding pass over
them (the same Adam update, computed in fp32 with its own rounding of the last bits). Plain SGD
rounds its fp32 result with the same bits (``stochastic_round_bf16``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _ops
from .algorithms.spec import AlgorithmSpec
from .grad_checks import describe
from .plan import ENGINE, FUSED32, STATELESS, Bucket
from .residency import Chunk, write_back
from .sharding import is_dtensor
from .state_format import CODES4, CODES8

# fp32 copies of 16-bit params and grads for torch's fused 32-bit step: at most this many elements
# at a time (2 x 4 bytes each: 64 MiB), tensors cut at multiples of FP32_COPY_ALIGN elements (torch's
# fused CPU kernel updates whole SIMD vectors and a scalar remainder, which round differently: cuts
# there keep every element on the path it takes in the whole tensor)
FP32_COPY_NUMEL = 8 << 20
FP32_COPY_ALIGN = 1024

# What one launch of the CUDA engine allocates itself (csrc/cuda/quantized_step.cu): the work
# buffer, with a search table per state key (an 8-bit step's CodeTable: 8192 uint32 entries; a
# 4-bit step's CodeTable4: 8196) and,
# per tensor, the algorithm's constants and a stochastic-rounding stream; and the tensors' metadata
# table (TensorMeta and block starts), kept for the next launch on the same tensors (a new one when
# a tensor moved, e.g. a contiguous copy). Per tensor at most ENGINE_BYTES_PER_TENSOR of both (a
# static_assert there), plus ENGINE_FIXED_BYTES: the three dtype groups' starts and the caching
# allocator's rounding of the two allocations up to 512 bytes. Measured on an H100 (AdamW8bit, two
# tensors, one transposed): 66560 bytes beyond the contiguous copies.
CODE_TABLE_BYTES = 8192 * 4
CODE_TABLE4_BYTES = 8196 * 4
TABLE_BYTES_BY_FORMAT = {CODES8: CODE_TABLE_BYTES, CODES4: CODE_TABLE4_BYTES}
ENGINE_BYTES_PER_TENSOR = 256
ENGINE_FIXED_BYTES = 3 * 8 + 2 * 512


def workspace_bytes(spec: AlgorithmSpec, bucket: Bucket, group: dict, params: list, grads: list,
                    contiguous: bool, held_step: bool) -> int:
    """At most how many bytes of temporaries the bucket's update allocates at once (its chunks run
    one after the other, each freeing its temporaries): contiguous copies of its non-contiguous
    parameters and gradients, fp32 copies of a run of 16-bit ones for torch's fused kernel, plain
    SGD's fp32 temporaries of its largest parameter, the norm pass's sums, and the engine's own
    (engine_bytes). ``held_step``: the bucket is one call on states held in C++ (no copies: only
    the engine's own). The executor makes sure this
    much is free before any counter moves (reserve_workspace)."""
    if not params:
        return 0
    if bucket.kernel == STATELESS:  # g32, p32 and the new value of one parameter at a time
        return 3 * 4 * max(p.numel() for p in params)
    rounds = sr_seed(group, bucket) is not None
    total = engine_bytes(spec, bucket, len(params)) if bucket.kernel == ENGINE or rounds else 0
    if held_step:
        return total
    if not contiguous:  # (checked once: a generator over every tensor costs ~0.1 ms a 1000 tensors)
        total += sum(t.numel() * t.element_size() for pair in zip(params, grads) for t in pair
                     if not t.is_contiguous())
    if bucket.kernel == FUSED32 and params[0].dtype != torch.float32 and not rounds:
        total += 2 * 4 * min(FP32_COPY_NUMEL, sum(p.numel() for p in params))
    if spec.norm_scaled:
        total += 24 * len(params)
    return total


def engine_bytes(spec: AlgorithmSpec, bucket: Bucket, n_tensors: int) -> int:
    """At most what the engine's launches for ``n_tensors`` tensors of the bucket allocate on a GPU
    (see ENGINE_BYTES_PER_TENSOR): the norm pass of a norm-scaled algorithm is a launch of its own,
    whose metadata stays while the update's launch runs; an 8-bit or 4-bit update carries a search
    table per state key (counted for every launch of those formats: an upper bound)."""
    launches = 2 if spec.norm_scaled else 1
    tables = len(spec.states) * TABLE_BYTES_BY_FORMAT.get(bucket.fmt, 0)
    return launches * (ENGINE_BYTES_PER_TENSOR * n_tensors + ENGINE_FIXED_BYTES) + tables


def reserve_workspace(device: torch.device, nbytes: int) -> None:
    """Have ``nbytes`` free for a step's temporaries before anything changes: on CUDA one
    allocation of that size, freed at once into the caching allocator, which hands the same memory
    to the step's temporaries (freed blocks are reused before new memory is asked for); running
    out of memory here raises torch.OutOfMemoryError while every counter, state and parameter is
    still as it was. Nothing on the CPU (no allocator to hold memory for later)."""
    if nbytes <= 0 or device.type != "cuda":
        return
    probe = torch.empty(nbytes, dtype=torch.uint8, device=device)
    del probe


def lr_tensor(group: dict, device: torch.device) -> Optional[torch.Tensor]:
    """The group's lr when the kernels can read it on ``device`` (a tensor there), else None (a
    float lr, or a tensor elsewhere, which the step reads on the host)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device == device:
        return lr
    return None


def hyper_and_lr(spec: AlgorithmSpec, group: dict, device: torch.device) -> tuple[list, Optional[torch.Tensor]]:
    """The op's ``hyper`` list for ``group`` and the lr tensor the kernel reads instead of hyper[0]
    (None: hyper[0] is the lr)."""
    lr = lr_tensor(group, device)
    return spec.hyper(group if lr is None else {**group, "lr": 0.0}), lr


def sr_seed(group: dict, bucket: Bucket) -> Optional[int]:
    """The seed of the bucket's stochastic rounding at this step, or None when it rounds to nearest
    (the group's bf16_stochastic_round is off, or the parameters are not bf16)."""
    if group["bf16_stochastic_round"] and bucket.params and bucket.params[0].dtype == torch.bfloat16:
        return int(group["bf16_sr_seed"])
    return None


def sr_args(group: dict, bucket: Bucket, chunk: Chunk) -> dict:
    """quantized_step_'s stochastic rounding arguments for a chunk of the bucket (none: off)."""
    seed = sr_seed(group, bucket)
    if seed is None:
        return {}
    index = range(len(bucket.sr_ids)) if chunk.index is None else chunk.index
    pieces = chunk.offsets or [0] * len(index)
    offsets = [bucket.sr_offsets[j] + start for j, start in zip(index, pieces)]
    return dict(sr_ids=[bucket.sr_ids[j] for j in index], sr_offsets=offsets if any(offsets) else None, sr_seed=seed)


def engine_step(spec: AlgorithmSpec, bucket: Bucket, chunk: Chunk, hyper: list, lr, grad_scale, found_inf,
                scales: Optional[torch.Tensor] = None, sr: Optional[dict] = None) -> None:
    lists = chunk.lists
    absmax = [lists[k] for k in spec.absmax_keys] if bucket.fmt.quantized else []
    _ops.quantized_step_(spec.engine, chunk.work_params, chunk.work_grads, [lists[k] for k in spec.state_keys], absmax,
                         lists["step"], bucket.qmaps(spec), hyper, grad_scale=grad_scale, found_inf=found_inf,
                         scales=scales, lr=lr, **(sr or {}))


def fused32_hyper(group: dict, lr: Optional[torch.Tensor]) -> tuple[list, Optional[torch.Tensor]]:
    """torch's fused Adam/AdamW settings of ``group``: [lr, beta1, beta2, weight_decay, eps] (the
    order of QuantizedStateList.step_torch_fused), and the lr tensor the kernel reads instead of
    the first (float32, as torch's kernel reads it; None: a float lr)."""
    if lr is not None and lr.dtype != torch.float32:
        lr = lr.float()
    beta1, beta2 = group["betas"]
    return [0.0 if lr is not None else float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]),
            float(group["eps"])], lr


def fused32_step(spec: AlgorithmSpec, group: dict, gi: int, chunk: Chunk, lr, grad_scale, found_inf) -> None:
    """32-bit states updated by torch's fused Adam/AdamW kernel (CPU and CUDA), on plain (local)
    tensors, after checking the moments' sizes (``gi``: the group's index, for the message)."""
    state1, state2, steps = chunk.lists["state1"], chunk.lists["state2"], chunk.lists["step"]
    work_params, work_grads = chunk.work_params, chunk.work_grads
    numels = [w.numel() for w in work_params]
    for key, moments in (("state1", state1), ("state2", state2)):  # torch's kernel trusts their sizes
        if [s.numel() for s in moments] != numels or not all(s.is_contiguous() for s in moments):
            i = next(i for i, s in enumerate(moments) if s.numel() != numels[i] or not s.is_contiguous())
            p = chunk.params[i]
            pi = next((k for k, q in enumerate(group["params"]) if q is p), None)
            where = describe(gi, pi, p) if pi is not None else f"a parameter of param_groups[{gi}]"
            raise ValueError(f"{where}: state[{key!r}] has {moments[i].numel()} elements"
                             f"{'' if moments[i].is_contiguous() else ', not contiguous'} for a parameter of "
                             f"{numels[i]} (changed in place since the step plan was made)")
    fused = getattr(torch, spec.fused32)
    (lr_value, beta1, beta2, weight_decay, eps), lr = fused32_hyper(group, lr)
    hyper = dict(lr=lr_value if lr is None else lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                 amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
    if work_params[0].dtype == torch.float32:
        fused(work_params, work_grads, state1, state2, [], steps, **hyper)
        return
    # torch's fused kernel wants params, grads and states of one dtype, and the states stay fp32:
    # it runs on fp32 copies of the params and grads, made a run of at most FP32_COPY_NUMEL
    # elements at a time (the update is elementwise, so a tensor may be cut into flat ranges), so
    # that the copies never cost more than a few MiB of memory. Each run's copies are views of one
    # fp32 buffer filled and written back by one _foreach_copy_ each (a few launches a run, not
    # three a tensor: the host time of a step over many small 16-bit tensors).
    for run in flat_runs(numels, FP32_COPY_NUMEL, FP32_COPY_ALIGN):
        parts = run_parts(work_params, run, numels)
        run_params = fp32_copies(parts)
        fused(run_params, fp32_copies(run_parts(work_grads, run, numels)), run_parts(state1, run, numels),
              run_parts(state2, run, numels), [], [steps[i] for i, _, _ in run], **hyper)
        torch._foreach_copy_(parts, run_params)


def plain_sgd(group: dict, params, grads, grad_scale, found_inf, bucket: Optional[Bucket] = None) -> None:
    """Plain SGD (torch.optim.SGD with momentum = 0): p -= lr * (g + weight_decay * p), in fp32;
    GradScaler's found_inf keeps every parameter as it was (torch.where: no host synchronisation).
    With the ``bucket`` of the parameters, bf16 ones are rounded stochastically when its group says
    so (sr_seed); an unchanged parameter (found_inf) rounds to itself."""
    seed = None if bucket is None else sr_seed(group, bucket)
    lr_t = lr_tensor(group, params[0].device) if params else None  # read on the device (capturable)
    lr, wd = (0.0 if lr_t is not None else float(group["lr"])), float(group["weight_decay"])
    inv_scale = None if grad_scale is None else grad_scale.reciprocal()  # exact for GradScaler's powers of two
    for j, (p, g) in enumerate(zip(params, grads)):  # params[j]: the bucket's j-th parameter (or its shard)
        g32 = g.float()
        if inv_scale is not None:
            g32 = g32 * inv_scale
        p32 = p.float()
        if wd != 0:
            g32 = g32.add(p32, alpha=wd)
        new = p32.add(g32, alpha=-lr) if lr_t is None else torch.addcmul(p32, g32, lr_t, value=-1)
        if found_inf is not None:
            new = torch.where(found_inf > 0, p32, new)
        if seed is not None:
            new = _ops.stochastic_round_bf16(new, bucket.lists["step"][j], seed, bucket.sr_ids[j], bucket.sr_offsets[j])
        p.copy_(new)


def step_chunk(spec: AlgorithmSpec, bucket: Bucket, group: dict, chunk: Chunk, grad_scale, found_inf,
               squares: Optional[torch.Tensor] = None) -> None:
    """One chunk of a bucket updated by the bucket's kernel; its contiguous copies written back.
    Norm-scaled algorithms take the chunk's ``squares`` (update_squares) when given (a sharded
    bucket's, reduced over the shards), else compute them from the chunk."""
    hyper, lr = hyper_and_lr(spec, group, bucket.device)
    sr = sr_args(group, bucket, chunk)
    if bucket.kernel == "fused32" and not sr:  # with stochastic rounding: the engine (see the module)
        fused32_step(spec, group, bucket.gi, chunk, lr, grad_scale, found_inf)
    elif spec.norm_scaled:
        if squares is None:
            squares = update_squares(spec, bucket, chunk, hyper, lr, grad_scale)
        scales = norm_scales(squares, float(group["max_unorm"]), chunk.lists["unorm_vec"])
        engine_step(spec, bucket, chunk, hyper, lr, grad_scale, found_inf, scales, sr)
    else:
        engine_step(spec, bucket, chunk, hyper, lr, grad_scale, found_inf, sr=sr)
    if chunk.work_params is not chunk.params:
        write_back(chunk.params, chunk.work_params)


# ------------------------------------------------------------------ norm-scaled (LARS, LAMB)
def update_squares(spec: AlgorithmSpec, bucket: Bucket, chunk: Chunk, hyper: list, lr, grad_scale) -> torch.Tensor:
    """(n, 2) float64: each tensor's sum of squares of its update direction and of its values."""
    lists, work_params = chunk.lists, chunk.work_params
    absmax = [lists[k] for k in spec.absmax_keys] if bucket.fmt.quantized else []
    squares = torch.empty((len(work_params), 2), dtype=torch.float64, device=work_params[0].device)
    norms = torch.empty(len(work_params), dtype=torch.float64, device=work_params[0].device)
    _ops.quantized_update_norm_(spec.engine, work_params, chunk.work_grads, [lists[k] for k in spec.state_keys],
                                absmax, lists["step"], bucket.qmaps(spec), hyper, norms, grad_scale=grad_scale, lr=lr)
    squares[:, 0] = norms
    squares[:, 1] = torch.stack(torch._foreach_norm(work_params, 2, dtype=torch.float64)).square()
    return squares


def norm_scales(squares: torch.Tensor, max_unorm: float, unorm_vec: list) -> torch.Tensor:
    """Each tensor's scale min(1, max_unorm * ||p|| / ||u||) (1 when max_unorm = 0), ||u|| stored
    in its ``unorm_vec``."""
    unorm, pnorm = squares[:, 0].sqrt(), squares[:, 1].sqrt()
    limit = max_unorm * pnorm
    scales = torch.where((unorm > limit) & (max_unorm > 0), limit / unorm, torch.ones_like(unorm)).float()
    torch._foreach_copy_(unorm_vec, list(unorm.float().unsqueeze(1)))
    return scales


def sum_over_shards(params: list, squares: torch.Tensor) -> None:
    """``squares[i]``: the shard of ``params[i]``'s sums of squares; for each DTensor parameter,
    summed in place over every mesh dimension it is sharded on (one all_reduce per mesh dimension
    and group of parameters, in parameter order: the same calls on every rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    groups: dict = {}
    for i, p in enumerate(params):
        if is_dtensor(p):
            for dim, placement in enumerate(p.placements):
                if isinstance(placement, Shard):
                    groups.setdefault((p.device_mesh, dim), []).append(i)
    for (mesh, dim), index in groups.items():
        part = squares[index]
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        squares[index] = part


# ------------------------------------------------------------------ flat runs (fp32 copies)
def flat_runs(numels: list[int], max_numel: int, align: int = 1) -> list[list[tuple[int, int, int]]]:
    """Runs of at most ``max_numel`` elements over the concatenation of tensors of ``numels``
    elements, in order: each run a list of (tensor index, start, end) of flat element ranges. A
    tensor that does not fit the rest of a run is cut, for elementwise updates, at multiples of
    ``align`` elements from its start (a kernel that treats a vector-width remainder differently
    then sees the same remainders as on the whole tensor); ``max_numel`` must be a multiple of
    ``align``."""
    if max_numel < align or max_numel % align:
        raise ValueError(f"max_numel ({max_numel}) must be a positive multiple of align ({align})")
    runs, current, room = [], [], max_numel
    for i, n in enumerate(numels):
        start = 0
        while start < n:
            take = n - start if n - start <= room else room // align * align
            if take == 0:  # less than `align` left in this run: the tensor goes on in the next one
                runs.append(current)
                current, room = [], max_numel
                continue
            current.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                runs.append(current)
                current, room = [], max_numel
    if current:
        runs.append(current)
    return runs


def run_parts(tensors: list[torch.Tensor], run: list[tuple[int, int, int]], numels: list[int]) -> list[torch.Tensor]:
    """What a run of flat_runs names of ``tensors`` (contiguous; ``numels``: their sizes): a whole
    tensor as it is, a cut one as the flat view of its range."""
    return [tensors[i] if start == 0 and end == numels[i] else tensors[i].view(-1)[start:end]
            for i, start, end in run]


def fp32_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 copies of ``tensors`` (contiguous, of one device), each of its tensor's shape: views of
    one new buffer, filled by one _foreach_copy_."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=tensors[0].device)
    copies = list(torch._C._nn.unflatten_dense_tensors(flat, tensors))
    torch._foreach_copy_(copies, tensors)
    return copies
