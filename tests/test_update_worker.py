"""UpdateWorker (pagedopt/optim/update_worker.py): calls run in order on a thread of their own, under
no_grad; join() waits for them and raises the first error (the calls after it are skipped); a
dropped worker's thread ends; a process that exits with a worker alive exits cleanly."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedopt.optim import update_worker
from pagedopt.optim.update_worker import UpdateWorker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_calls_run_in_order_on_another_thread_under_no_grad():
    w = UpdateWorker()
    seen = []

    def call(i):
        time.sleep(0.001 * (5 - i % 5))  # later calls are quicker: order must not follow speed
        seen.append((i, threading.get_ident(), torch.is_grad_enabled()))
    for i in range(20):
        w.submit(call, i)
    w.join()
    assert [i for i, _, _ in seen] == list(range(20))
    assert {t for _, t, _ in seen} != {threading.get_ident()} and len({t for _, t, _ in seen}) == 1
    assert not any(g for _, _, g in seen) and torch.is_grad_enabled()
    assert not w.busy
    w.close()


def test_the_first_error_skips_the_rest_and_join_raises_it_once():
    w = UpdateWorker()
    ran = []
    w.submit(ran.append, 1)
    w.submit(lambda: (_ for _ in ()).throw(ValueError("bad chunk 2")))
    w.submit(ran.append, 3)  # skipped: after the error
    with pytest.raises(ValueError, match="bad chunk 2"):
        w.join()
    assert ran == [1]
    w.submit(ran.append, 4)  # the worker goes on after join() reported the error
    w.join()
    assert ran == [1, 4]
    w.close()
    with pytest.raises(RuntimeError, match="after close"):
        w.submit(ran.append, 5)


def test_a_dropped_worker_ends_its_thread():
    w = UpdateWorker()
    w.submit(lambda: None)
    w.join()
    thread = w._thread
    assert thread in update_worker._RUNNING and thread.is_alive()
    del w
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and thread not in update_worker._RUNNING


@pytest.mark.parametrize("busy", [False, True])
def test_a_process_exits_cleanly_with_a_worker_alive(busy):
    """The worker's thread idle (or still running torch ops) at exit: stopped and joined before the
    interpreter finalizes, so the process neither aborts nor hangs."""
    code = f"""
import torch
from pagedopt.optim.update_worker import UpdateWorker
w = UpdateWorker()
x = torch.randn(256, 256)
def work():
    for _ in range(20):
        x.add_(torch.mm(x, x).tanh_())
w.submit(work)
w.join()
if {busy}:
    for _ in range(5):
        w.submit(work)
print("exiting")
"""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
        assert "terminate" not in proc.stderr, proc.stderr[-2000:]


def test_an_idle_worker_holds_nothing_its_calls_referred_to():
    """After a call, the thread keeps no reference to its arguments (an optimizer whose chunks it
    updated can be freed, and with it the worker and its thread)."""
    import weakref

    class Payload:
        pass

    w = UpdateWorker()
    p = Payload()
    ref = weakref.ref(p)
    w.submit(lambda x: None, p)
    w.join()
    del p
    gc.collect()
    assert ref() is None
    w.close()
