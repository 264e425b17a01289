"""What the sandboxed programs of this process did since the metrics were last taken: one count per
outcome, for the trainer's step metrics (``sandbox/timeouts``, ...)."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["METRIC_NAMES", "SANDBOX_METRICS", "SandboxCounters", "STATUSES"]

# a run's outcome (SandboxResult.status) -> its step metric
METRIC_NAMES = {
    "ok": "sandbox/ok",  # exit code 0 (a wrong answer included: that is the reward's verdict)
    "error": "sandbox/errors",  # a non-zero exit: an exception, a syntax error
    "timeout": "sandbox/timeouts",  # the wall-clock or CPU-time limit
    "memory": "sandbox/memory",  # the address-space limit
    "output_limit": "sandbox/output_limit",  # more output than sandbox.max_output_kb
    "process_limit": "sandbox/process_limit",  # a fork refused at sandbox.max_processes
    "file_limit": "sandbox/file_limit",  # a file beyond sandbox.max_file_mb
    "killed": "sandbox/killed",  # another signal (a crash)
    "sandbox_error": "sandbox/sandbox_errors",  # the sandbox or the SandboxFusion service failed
}
STATUSES = tuple(METRIC_NAMES)


class SandboxCounters:
    """Thread-safe counts of outcomes; ``take_metrics()`` returns them and starts again. Each process
    (trainer rank) counts its own programs: sum over ranks for the step's totals."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._seconds: list[float] = []

    def record(self, status: str, seconds: float) -> None:
        if status not in METRIC_NAMES:
            raise ValueError(f"unknown sandbox status {status!r}; known: {', '.join(STATUSES)}")
        with self._lock:
            self._counts[status] += 1
            self._seconds.append(seconds)

    def take_metrics(self) -> dict[str, float]:
        """``{"sandbox/runs": n, "sandbox/ok": ..., "sandbox/timeouts": ..., "sandbox/seconds_mean",
        "sandbox/seconds_max"}`` since the last call; empty when no program ran."""
        with self._lock:
            counts, seconds = self._counts, self._seconds
            self._counts, self._seconds = Counter(), []
        if not seconds:
            return {}
        out = {"sandbox/runs": float(len(seconds))}
        out.update({name: float(counts[status]) for status, name in METRIC_NAMES.items()})
        out["sandbox/seconds_mean"] = sum(seconds) / len(seconds)
        out["sandbox/seconds_max"] = max(seconds)
        return out


SANDBOX_METRICS = SandboxCounters()  # this process's counts: every run records its outcome here
