"""Stopping a run cleanly at a step boundary: preemption signals, stop requests, time limits.

Every rank calls ``StopCheck.should_stop()`` after each step (a collective): a rank that got USR2,
a stop-request file in the run directory (written by the submitit job's signal handler), or an
allocation that ends within ``launcher.time_margin_s`` makes every rank stop together, save a
checkpoint and exit. ``STOPPED`` in the run directory then tells the launcher why, so it requeues
(Slurm) or says where to resume (locally: the launcher's SIGTERM, SIGINT, SIGUSR1 or SIGHUP, ``local``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch

from rlhf_hpc.launch.failure import BAD_INPUT, FAILURE, Failure, record_failure

__all__ = [
    "STOPPED",
    "StopCheck",
    "clear",
    "install_signal_handler",
    "read_stopped",
    "record_user_error",
    "request_stop",
]

STOP_REQUEST = "STOP_REQUESTED"
STOPPED = "STOPPED"
REASONS = {1: "preempted (signal)", 2: "stop requested", 3: "allocation time limit near"}

_signal_received = False


def _on_usr2(signum, frame) -> None:
    global _signal_received
    _signal_received = True


def install_signal_handler() -> None:
    """USR2 (Slurm's advance warning) sets a flag; the step finishes, then the run stops."""
    signal.signal(signal.SIGUSR2, _on_usr2)


def request_stop(run_dir: str | Path, reason: str) -> None:
    path = Path(run_dir) / STOP_REQUEST
    tmp = path.with_name(f".{STOP_REQUEST}.tmp")
    tmp.write_text(reason)
    os.replace(tmp, path)


def clear(run_dir: str | Path) -> None:
    """Before the ranks start: no stop, no failure of an earlier launch."""
    for name in (STOP_REQUEST, STOPPED, FAILURE):
        (Path(run_dir) / name).unlink(missing_ok=True)


def record_user_error(run_dir: str | Path, message: str) -> None:
    """A user error (bad data, a config a checkpoint cannot resume) found by the workers: the
    launcher prints it once for the job and exits 2, instead of a traceback per rank."""
    record_failure(run_dir, Failure(BAD_INPUT, message))


def read_stopped(run_dir: str | Path) -> Optional[str]:
    path = Path(run_dir) / STOPPED
    return path.read_text().strip() if path.is_file() else None


class StopCheck:
    def __init__(self, run_dir: Path, margin_s: float, all_reduce_max):
        self.run_dir, self.margin_s, self.all_reduce_max = Path(run_dir), margin_s, all_reduce_max
        end = os.environ.get("RLHF_HPC_JOB_END_TIME")
        self.end_time = float(end) if end else None
        self.reason: Optional[str] = None

    def _local_code(self, step_seconds: float) -> int:
        if _signal_received:
            return 1
        if (self.run_dir / STOP_REQUEST).is_file():
            return 2
        # stop when the rest of the allocation would not fit the margin plus one more step
        if self.end_time is not None and self.end_time - time.time() < self.margin_s + step_seconds:
            return 3
        return 0

    def should_stop(self, step_seconds: float) -> bool:
        """Collective: True on every rank when any rank has a reason to stop."""
        code = int(self.all_reduce_max(torch.tensor([float(self._local_code(step_seconds))]))[0].item())
        if code:
            self.reason = REASONS[code]
            try:  # who asked: "signal SIGTERM" (the local launcher), "slurm signal" (the submitit job)
                self.reason += f" ({(self.run_dir / STOP_REQUEST).read_text().strip()})" if code == 2 else ""
            except OSError:
                pass
        return bool(code)

    def mark_stopped(self) -> None:
        (self.run_dir / STOPPED).write_text(self.reason or "stopped")
