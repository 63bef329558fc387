"""The base of the algorithms whose update is scaled per tensor by its norm (LARS, LAMB): each step
first computes every tensor's update norm ||u|| (the engine's quantized_update_norm_, from the same
states and gradients the step will use), then steps with the scale
min(1, max_unorm * ||p|| / ||u||) (1 when max_unorm = 0), ||p|| taken before the step, as
bitsandbytes does. ``state["unorm_vec"]`` holds the last ||u|| of each parameter.

Both norms are summed as squares in float64. A sharded (DTensor, FSDP2) parameter's shard holds
only part of each sum: the shards' sums are all-reduced over the mesh dimensions the parameter is
sharded on, once per bucket (after a first pass over all its chunks, so that every rank makes the
same collective calls whatever its chunks), and every rank then steps its shard with the whole
tensor's scale."""
from __future__ import annotations

import torch

from .. import _ops
from .base import QuantizedOptimizer, _Bucket
from .capture import lr_tensor
from .sharding import is_dtensor


def _sum_over_shards(params: list, squares: torch.Tensor) -> None:
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


class ScaledByUpdateNorm(QuantizedOptimizer):
    _held_step_only = False  # a norm pass and per-tensor scales before each step: no fast step
    def _init_state(self, config: dict, p: torch.Tensor) -> dict:
        state = super()._init_state(config, p)
        if "unorm_vec" not in state:
            state["unorm_vec"] = torch.zeros((1,), dtype=torch.float32, device=p.device)
        return state

    def _squares(self, spec, hyper, qmaps, work_params, work_grads, lists, eight_bit, grad_scale,
                 lr=None) -> torch.Tensor:
        """(n, 2) float64: each tensor's sum of squares of its update direction and of its values."""
        n_keys = len(spec.states)
        absmax = lists[n_keys:2 * n_keys] if eight_bit else []
        squares = torch.empty((len(work_params), 2), dtype=torch.float64, device=work_params[0].device)
        norms = torch.empty(len(work_params), dtype=torch.float64, device=work_params[0].device)
        _ops.quantized_update_norm_(spec.engine, work_params, work_grads, lists[:n_keys], absmax, lists[-1], qmaps,
                                    hyper, norms, grad_scale=grad_scale, lr=lr)
        squares[:, 0] = norms
        squares[:, 1] = torch.stack(torch._foreach_norm(work_params, 2, dtype=torch.float64)).square()
        return squares

    def _step_bucket(self, group: dict, bucket: _Bucket, params, grads, contiguous: bool, grad_scale,
                     found_inf) -> None:
        spec = self.algorithm
        lr = lr_tensor(group, bucket.device)
        hyper = self._engine_hyper(group if lr is None else {**group, "lr": 0.0})
        max_unorm = float(group["max_unorm"])
        n_keys = len(spec.states)
        qmaps = [bucket.states[0][q] for q in spec.qmap_keys] if bucket.eight_bit else []
        sharded = any(is_dtensor(p) for p in bucket.params)
        position = {id(t): j for j, t in enumerate(params)}  # a chunk's tensors -> their bucket positions
        chunks = self._bucket_chunks(bucket, params, grads, contiguous)
        if sharded:  # every chunk's squares first, then one reduction for the bucket
            if getattr(self._pager, "streams_states", False):
                raise ValueError(f"{type(self).__name__}: host-resident states (residency='host') are not supported "
                                 "for DTensor (FSDP2) parameters, whose norms need every chunk before any update")
            chunks = list(chunks)
            squares = torch.zeros((len(params), 2), dtype=torch.float64, device=params[0].device)
            for chunk_params, work_params, work_grads, lists in chunks:
                squares[[position[id(t)] for t in chunk_params]] = self._squares(
                    spec, hyper, qmaps, work_params, work_grads, lists, bucket.eight_bit, grad_scale, lr)
            _sum_over_shards(bucket.params, squares)
        for chunk_params, work_params, work_grads, lists in chunks:
            index = [position[id(t)] for t in chunk_params]
            if sharded:
                chunk_squares = squares[index]
            else:
                chunk_squares = self._squares(spec, hyper, qmaps, work_params, work_grads, lists, bucket.eight_bit,
                                              grad_scale, lr)
            unorm, pnorm = chunk_squares[:, 0].sqrt(), chunk_squares[:, 1].sqrt()
            limit = max_unorm * pnorm
            scales = torch.where((unorm > limit) & (max_unorm > 0), limit / unorm, torch.ones_like(unorm)).float()
            torch._foreach_copy_([bucket.states[j]["unorm_vec"] for j in index], list(unorm.float().unsqueeze(1)))
            absmax = lists[n_keys:2 * n_keys] if bucket.eight_bit else []
            _ops.quantized_step_(spec.engine, work_params, work_grads, lists[:n_keys], absmax, lists[-1], qmaps, hyper,
                                 grad_scale=grad_scale, found_inf=found_inf, scales=scales, lr=lr)
            if work_params is not chunk_params:
                self._write_back(chunk_params, work_params)
