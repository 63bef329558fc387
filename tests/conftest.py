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

# Under pytest-xdist (make test: one worker per core) each worker takes its share of the cores for
# torch's intra-op threads, and so do the processes its tests start (OMP_NUM_THREADS): with every
# worker on every core, torch's threads contend, and a test that took 15 s alone took 126 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# The closing summary groups the skipped tests by reason, a line each (most of them need a GPU on
# a machine without one); `pytest -rs` still lists them one by one.
SKIP_SUMMARY_LINES = 8


def skip_reasons(reports) -> list[tuple[int, str]]:
    """[(count, reason)] of skipped test reports, most frequent first (ties by reason)."""
    counts: dict[str, int] = {}
    for rep in reports:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        counts[reason] = counts.get(reason, 0) + 1
    return sorted(((n, r) for r, n in counts.items()), key=lambda nr: (-nr[0], nr[1]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if not reports:
        return
    grouped = skip_reasons(reports)
    shown, rest = grouped[:SKIP_SUMMARY_LINES], grouped[SKIP_SUMMARY_LINES:]
    terminalreporter.write_sep("-", f"{len(reports)} skipped, by reason")
    for n, reason in shown:
        terminalreporter.write_line(f"{n:6d}  {reason}")
    if rest:
        terminalreporter.write_line(f"{sum(n for n, _ in rest):6d}  for {len(rest)} other reasons (pytest -rs lists each)")
