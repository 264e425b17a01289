"""How a run ends: its exit code (one table, ``EXIT_CODES``, the same as docs/reliability.md), the
record of what went wrong (``FAILURE`` in the run directory) and the one line a launcher prints for
it: what happened, on which rank and host, the last complete checkpoint and the command that
resumes.

Whoever finds the cause first records it: a rank (the guard's stop, a checkpoint that cannot be
written, a bug: ``record_failure``), or a launcher's watchdog (a rank lost or hung:
``rlhf_hpc.launch.watchdog``). The first record wins (``os.link`` refuses to replace a file, on a
shared filesystem too), so a rank that only lost its peer never hides the rank that died.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from rlhf_hpc.distributed.heartbeat import ENV_LAUNCH_ID

__all__ = [
    "BAD_INPUT",
    "EXIT_CODES",
    "FAILED",
    "FAILURE",
    "Failure",
    "GUARD_STOP",
    "HUNG_RANK",
    "LATEST_FILE",
    "LOST_RANK",
    "OK",
    "REQUEUE",
    "RESTARTABLE",
    "RUN_DIR_UNWRITABLE",
    "checkpoint_summary",
    "describe_run_end",
    "interrupted_code",
    "launch_command",
    "lost_peer",
    "note_in_run_log",
    "read_failure",
    "record_failure",
    "unwritable_path",
]

OK = 0
FAILED = 1
BAD_INPUT = 2
GUARD_STOP = 3
LOST_RANK = 4
HUNG_RANK = 5
RUN_DIR_UNWRITABLE = 6
REQUEUE = 85
# the codes of a launch (launch.py, a Slurm node's task): (name, meaning); 128 + N: stopped by signal N
# (interrupted_code). docs/reliability.md has the same table.
EXIT_CODES: dict[int, tuple[str, str]] = {
    OK: ("done", "the run finished"),
    FAILED: ("error", "a rank failed with an unexpected error (a bug: the traceback is in that rank's output)"),
    BAD_INPUT: (
        "bad input",
        "refused before or as the ranks started: config, data, a checkpoint of another run, "
        "a failed preflight, a run directory another run holds",
    ),
    GUARD_STOP: ("guard stop", "the stability guard stopped training after trainer.guard.max_rollbacks rollbacks"),
    LOST_RANK: ("lost rank", "a rank died (killed, crashed, out of host memory) or its node was lost"),
    HUNG_RANK: ("hung rank", "a rank stopped responding: no heartbeat for launcher.heartbeat_timeout_s"),
    RUN_DIR_UNWRITABLE: (
        "run directory unwritable",
        "a write into the run directory failed (permissions, read-only, full disk, quota)",
    ),
    REQUEUE: ("requeue", "Slurm node: stopped early (preemption, time limit); the sbatch script requeues the job"),
}
# a failure a new attempt may get past (launcher.max_restarts); the others would repeat
RESTARTABLE = (FAILED, LOST_RANK, HUNG_RANK)

FAILURE = "FAILURE"
# the file rlhf_hpc.ppo.checkpoint.LATEST writes (verl's name); named here as launch sits below ppo
LATEST_FILE = "latest_checkpointed_iteration.txt"
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


@dataclass
class Failure:
    code: int
    what: str  # what happened, in words
    where: str = ""  # "rank 1 on node2, pid 123"; empty when every rank agreed (the guard)
    launch: str = ""  # the launch it belongs to (a rank's: its RLHF_HPC_LAUNCH_ID)

    def label(self) -> str:
        return EXIT_CODES[self.code][0]

    def summary(self) -> str:
        return f"{self.where}: {self.what}" if self.where else self.what


def record_failure(run_dir: str | Path, failure: Failure) -> bool:
    """Record ``failure`` unless a cause of the same launch is recorded already (a record of an
    earlier launch is replaced); True when this one is the record."""
    if not failure.launch:
        failure.launch = os.environ.get(ENV_LAUNCH_ID, "")
    path = Path(run_dir) / FAILURE
    tmp = path.with_name(f".{FAILURE}.tmp-{os.uname().nodename}-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(failure)))
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, and never replaces a record that is there
                return True
            except FileExistsError:
                there = read_failure(run_dir)
                if there is None or there.launch == failure.launch:
                    return False
                path.unlink(missing_ok=True)  # left by an earlier launch of the run
        return False
    finally:
        tmp.unlink(missing_ok=True)


def read_failure(run_dir: str | Path, launch: Optional[str] = None) -> Optional[Failure]:
    """The recorded failure (of launch ``launch`` only, when given)."""
    try:
        failure = Failure(**json.loads((Path(run_dir) / FAILURE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return failure if launch is None or failure.launch == launch else None


def unwritable_path(exc: BaseException) -> Optional[str]:
    """``"<path>: <reason>"`` when ``exc`` comes from a write the filesystem refused (permissions,
    read-only, full, quota), looking through causes and a DCP checkpoint's per-rank failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _UNWRITABLE:
            return f"{e.filename}: {e.strerror}" if e.filename else (e.strerror or str(e))
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    return None


# what a collective raises on a rank whose peer died or was killed (gloo's and NCCL's words)
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)


def lost_peer(exc: BaseException) -> bool:
    """``exc`` is a collective failing because another rank is gone: a consequence, not the cause."""
    e: Optional[BaseException] = exc
    while e is not None:
        if isinstance(e, dist.DistNetworkError) or any(words in str(e) for words in _PEER_LOST):
            return True
        e = e.__cause__ or e.__context__
    return False


def launch_command() -> str:
    """The command of this process, as typed (``python launch.py recipe=... key=value``): run again,
    it resumes from the run directory's latest checkpoint."""
    return shlex.join(["python", *sys.argv])


def checkpoint_summary(run_dir: str | Path) -> str:
    """The last complete checkpoint (what ``latest_checkpointed_iteration.txt`` names) and the last
    step logged after it, in words."""
    run_dir = Path(run_dir)
    try:
        step = int((run_dir / LATEST_FILE).read_text().strip())
        text = f"last checkpoint {run_dir / f'global_step_{step}'} (step {step})"
    except (OSError, ValueError):
        step, text = None, "no checkpoint yet (a new launch starts over)"
    logged = _last_logged_step(run_dir)
    if logged is not None and logged != step:
        text += f", last step logged {logged}"
    return text


def _last_logged_step(run_dir: Path) -> Optional[int]:
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 65536))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return int(json.loads(lines[-1])["training/global_step"]) if lines else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


def interrupted_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def describe_run_end(failure: Failure, run_dir: str | Path, resume: str) -> str:
    """The one line of a failed run: what, where, the last checkpoint, how to resume, the code."""
    return (
        f"[rlhf-hpc] run failed: {failure.summary().rstrip('.')}; {checkpoint_summary(run_dir)}; "
        f"resume with: {resume}; exit code {failure.code} ({failure.label()})"
    )


RUN_LOG = "launch.log"


def note_in_run_log(run_dir: str | Path, line: str) -> None:
    """Append a launcher's line to ``<run dir>/logs/launch.log``: how each launch of the run ended
    stays with the run, after the console is gone."""
    try:
        path = Path(run_dir) / "logs" / RUN_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    except OSError:
        pass  # an unwritable run directory is what the line says already
