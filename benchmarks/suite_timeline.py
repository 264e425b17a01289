"""A pytest plugin that logs each test's start, end and CPU seconds, for the suite's time
(tests/README.md, "Where the full suite's time goes"):

    RLHF_HPC_TIMELINE=/tmp/timeline.jsonl PYTEST_ADDOPTS="-p benchmarks.suite_timeline" bash .ci/run

One JSON line per test: the worker, the node id, start and end (epoch seconds), and the CPU seconds
of the worker itself (``self``) and of the processes it started and reaped (``children``: launches,
torchrun groups; Slurm's jobs run under slurmd and are not counted). The launches the tests fork
from their launcher server (``tests/launcher_fork.py``) are reaped by that server: its own and its
reaped children's seconds (``/proc/PID/stat``) are counted in ``children`` too.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

__all__: list[str] = []


def _server_cpu() -> float:
    """CPU seconds of the multiprocessing forkserver (user, system, and its reaped children's)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def _cpu() -> tuple[float, float]:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime + _server_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, (own0, reaped0) = time.time(), _cpu()
    yield
    own1, reaped1 = _cpu()
    row = {
        "w": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "id": item.nodeid,
        "t0": t0,
        "t1": time.time(),
        "self": own1 - own0,
        "children": reaped1 - reaped0,
    }
    with open(os.environ.get("RLHF_HPC_TIMELINE", "suite_timeline.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
