import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default: "ci" when CI is set, else "dev"):
#   ci        15 examples, derandomized: the same examples on every run.
#   dev       40 examples, derandomized too, so a local failure reproduces on rerunning the same
#             command; print_blob=True also prints a @reproduce_failure line for it.
#   thorough  300 examples, random (fresh examples each run), print_blob=True: for hunting bugs,
#             e.g. HYPOTHESIS_PROFILE=thorough python -m pytest -q tests/test_quant.py
_quiet = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, suppress_health_check=_quiet)
settings.register_profile("dev", max_examples=40, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=_quiet)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_quiet)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
