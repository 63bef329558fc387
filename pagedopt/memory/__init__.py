"""What fits: GPU memory of a training run (weights + gradients + optimizer states + activations).

Command line (``python -m pagedopt.memory`` or ``pagedopt-mem``)::

    pagedopt-mem --config path/to/config.json --optimizer paged_adamw_8bit --gpu 24
    pagedopt-mem --config llama3-8b --lora 16 --gradient-checkpointing --batch 4 --seq 2048 --gpu H200
    pagedopt-mem --params 7e9 --weights bf16 --optimizer adamw_torch --gpu A100-80

prints a table in GiB and says whether the run fits on the GPU, and the largest batch that does.

Plain loops and the Trainer: :func:`memory_report` and :func:`log_memory` here,
``pagedopt.integrations.callbacks.MemoryReportCallback`` for the Hugging Face Trainer.

Modules (the public names of each are re-exported here, so ``pagedopt.memory.X`` works):

* :mod:`.tables`: data: dtype sizes, GPU capacities, the optimizers, model presets;
* :mod:`.model`: a model's parameter tensors (from a config.json, a preset, a module or a count);
* :mod:`.estimator`: the bytes of a training run (:func:`estimate`; what is exact and what is an
  estimate is told there) and :func:`gpu_capacity`;
* :mod:`.modes`: each paging mode's peak (resident, budget, host, gradients released) and the mode
  to pick for a GPU (:func:`predict_modes`, :func:`recommend`);
* :mod:`.cli`: the table (:func:`format_estimate`) and the command line (:func:`main`);
* :mod:`.measure`: what a running process holds (:func:`memory_report`, :func:`log_memory`).
"""
from .cli import format_estimate, main
from .estimator import (ATTENTION_TARGETS, BLOCK, CUDA_CONTEXT_BYTES, MLP_TARGETS, PAGED_CHUNK_BYTES, STEP_BYTES,
                        Estimate, activation_bytes, estimate, gpu_capacity, lora_tensors, normalize_optimizer,
                        state_bytes_of_tensor, weight_cast_bytes)
from .measure import log_memory, memory_report, report_gib
from .modes import (DEFAULT_MARGIN, MODES, ModePrediction, Recommendation, auto_resident, largest_budget, parse_size,
                    predict_modes, recommend, released_gradients, streamed_bytes)
from .model import (Arch, Model, Tensor, load_config, model_from_config, model_from_params, tensors_from_formula,
                    tensors_from_module, tensors_from_transformers)
from .tables import ALIASES, DTYPE_BYTES, EXTRA_STATE_BYTES, GIB, GPUS, OPTIMIZERS, PRESETS

__all__ = [
    "ALIASES", "ATTENTION_TARGETS", "Arch", "BLOCK", "CUDA_CONTEXT_BYTES", "DTYPE_BYTES", "EXTRA_STATE_BYTES",
    "Estimate", "GIB", "GPUS", "MLP_TARGETS", "Model", "OPTIMIZERS", "PAGED_CHUNK_BYTES", "PRESETS", "STEP_BYTES",
    "Tensor", "activation_bytes", "estimate", "format_estimate", "gpu_capacity", "load_config", "log_memory",
    "lora_tensors", "main", "memory_report", "model_from_config", "model_from_params", "normalize_optimizer",
    "report_gib", "state_bytes_of_tensor", "tensors_from_formula", "tensors_from_module", "tensors_from_transformers",
    "DEFAULT_MARGIN", "MODES", "ModePrediction", "Recommendation", "largest_budget", "parse_size", "predict_modes",
    "recommend", "released_gradients", "weight_cast_bytes", "auto_resident", "streamed_bytes",
]
