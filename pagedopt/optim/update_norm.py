"""The base of the algorithms whose update is scaled per tensor by its norm (LARS, LAMB): each step
first computes every tensor's update norm ||u|| (the engine's quantized_update_norm_, from the same
states and gradients the step will use), then steps with the scale
min(1, max_unorm * ||p|| / ||u||) (1 when max_unorm = 0), ||p|| taken before the step, as
bitsandbytes does. ``state["unorm_vec"]`` holds the last ||u|| of each parameter."""
from __future__ import annotations

import torch

from .. import _ops
from .base import QuantizedOptimizer, _Bucket
from .sharding import is_dtensor


class ScaledByUpdateNorm(QuantizedOptimizer):
    def _init_state(self, config: dict, p: torch.Tensor) -> dict:
        state = super()._init_state(config, p)
        if "unorm_vec" not in state:
            state["unorm_vec"] = torch.zeros((1,), dtype=torch.float32, device=p.device)
        return state

    def _step_bucket(self, group: dict, bucket: _Bucket, params, grads, contiguous: bool, grad_scale,
                     found_inf) -> None:
        if any(is_dtensor(p) for p in bucket.params):
            raise ValueError(f"{type(self).__name__} scales each update by norms of whole tensors, which a sharded "
                             "(DTensor, FSDP2) parameter does not hold on one rank; use it on unsharded parameters")
        spec = self.algorithm
        hyper = self._engine_hyper(group)
        max_unorm = float(group["max_unorm"])
        n_keys = len(spec.states)
        qmaps = [bucket.states[0][q] for q in spec.qmap_keys] if bucket.eight_bit else []
        for chunk_params, work_params, work_grads, lists in self._bucket_chunks(bucket, params, grads, contiguous):
            absmax = lists[n_keys:2 * n_keys] if bucket.eight_bit else []
            norms = torch.empty(len(work_params), dtype=torch.float64, device=work_params[0].device)
            _ops.quantized_update_norm_(spec.engine, work_params, work_grads, lists[:n_keys], absmax, lists[-1], qmaps,
                                        hyper, norms, grad_scale=grad_scale)
            unorm = norms.sqrt()
            pnorm = torch.stack(torch._foreach_norm([w.float() for w in work_params])).double()
            limit = max_unorm * pnorm
            scales = torch.where((unorm > limit) & (max_unorm > 0), limit / unorm, torch.ones_like(unorm)).float()
            torch._foreach_copy_([self.state[p]["unorm_vec"] for p in chunk_params], list(unorm.float().unsqueeze(1)))
            _ops.quantized_step_(spec.engine, work_params, work_grads, lists[:n_keys], absmax, lists[-1], qmaps, hyper,
                                 grad_scale=grad_scale, found_inf=found_inf, scales=scales)
            if work_params is not chunk_params:
                self._write_back(chunk_params, work_params)
