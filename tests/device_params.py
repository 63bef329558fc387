"""The devices a kernel test runs on: the CPU always, CUDA (marked ``cuda``) where there is a GPU and
this build of pagedopt carries the CUDA kernels."""
import pytest
import torch

import pagedopt

HAS_CUDA = torch.cuda.is_available() and pagedopt._ops.has_cuda_kernels()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA kernels")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
