"""One run per run directory: ``<run dir>/RUN_LOCK``, created with O_EXCL (atomic on local
filesystems and NFSv3+), holding the holder's host, pid, start time and Slurm job id.

The launcher takes it before anything in the directory is written (locally the ``launch.py``
process, on Slurm the job's task on node 0), refreshes its mtime while the ranks run, and removes it
when it ends, however it ends: the ranks die with it (``rlhf_hpc.launch.rank_group``). A second
launch is refused with the holder named. A lock left behind is taken over when it is stale:

- its holder ran on this host and that process is gone (or the pid now belongs to another process);
- the holder is the same Slurm job (a requeued job runs again under its job id and takes over the
  lock of its previous allocation, which Slurm ended without a word);
- the holder ran on another host and the lock was not refreshed for its ``stale_after_s``
  (that host's clock against ours: a margin of minutes, not seconds).

A takeover goes through ``RUN_LOCK.takeover`` (also O_EXCL), and re-reads the lock inside it, so two
launches that both found a stale lock never both win.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.heartbeat import process_start

__all__ = ["LOCK_FILE", "LockHolder", "RunDirLocked", "RunLock", "check_free", "current_job_id"]

LOCK_FILE = "RUN_LOCK"
TAKEOVER_STALE_S = 60.0  # a takeover takes milliseconds: a marker this old was left by a dead process


def current_job_id() -> Optional[str]:
    """The Slurm job this process runs in (the array element's own id for an array job)."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', 0)}"
    return os.environ.get("SLURM_JOB_ID") or None


@dataclass
class LockHolder:
    host: str
    pid: int
    pid_start: str
    started: float  # epoch seconds
    job_id: Optional[str]
    stale_after_s: float

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return (
            f"host {self.host}, pid {self.pid}{job}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}"
        )


class RunDirLocked(ConfigError):
    """Another run holds the run directory (exit code 2: the launch is refused before it starts)."""

    def __str__(self) -> str:
        return self.errors[0]


class RunLock:
    """The lock of one run directory, held by this process; ``acquire`` takes it."""

    def __init__(self, run_dir: Path, holder: LockHolder):
        self.path = Path(run_dir) / LOCK_FILE
        self.holder = holder
        self._refreshed = time.monotonic()

    # ------------------------------------------------------------------------------ taking it
    @classmethod
    def acquire(cls, run_dir: str | Path, stale_after_s: float, job_id: Optional[str] = None) -> "RunLock":
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        me = LockHolder(
            host=socket.gethostname(),
            pid=pid,
            pid_start=process_start(pid),
            started=time.time(),
            job_id=job_id,
            stale_after_s=stale_after_s,
        )
        lock = cls(run_dir, me)
        for _ in range(20):
            if lock._create():
                return lock
            holder, text = read_holder(lock.path)
            if text is None:
                continue  # released meanwhile: try again
            if holder is None:  # being written by a launch that just created it, or left half-written
                if _age(lock.path) < TAKEOVER_STALE_S:
                    time.sleep(0.1)
                    continue
            elif stale_reason(holder, me, lock.path) is None:
                raise RunDirLocked(busy_message(run_dir, holder))
            lock._take_over(text)
        raise RunDirLocked(
            f"trainer.default_local_dir: cannot lock {run_dir}: {LOCK_FILE} keeps changing (several launches at once?)"
        )

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self.holder)))
        return True

    def _take_over(self, seen: Optional[str]) -> None:
        """Remove the lock if it still is what we found stale (``seen``), under the takeover marker."""
        marker = self.path.with_name(f"{LOCK_FILE}.takeover")
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                if time.time() - marker.stat().st_mtime > TAKEOVER_STALE_S:
                    marker.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.05)  # another launch is taking over: look again after it
            return
        os.close(fd)
        try:
            _, now = read_holder(self.path)
            if now == seen:
                self.path.unlink(missing_ok=True)
        finally:
            marker.unlink(missing_ok=True)

    # ----------------------------------------------------------------------------- holding it
    def refresh(self, every_s: float = 10.0) -> None:
        """Show hosts elsewhere that the holder is alive (the lock's mtime), at most every ``every_s``."""
        if time.monotonic() - self._refreshed < every_s:
            return
        self._refreshed = time.monotonic()
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Remove the lock if it is still ours (a launch elsewhere may have found it stale meanwhile)."""
        holder, _ = read_holder(self.path)
        if holder is not None and (holder.host, holder.pid, holder.started) == (
            self.holder.host,
            self.holder.pid,
            self.holder.started,
        ):
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(path: Path) -> tuple[Optional[LockHolder], Optional[str]]:
    """(holder, the file's text): (None, None) when there is no lock, (None, text) for a lock
    still being written (empty, not JSON yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    try:
        return LockHolder(**json.loads(text)), text
    except (ValueError, TypeError):
        return None, text


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def stale_reason(holder: LockHolder, me: LockHolder, path: Path) -> Optional[str]:
    """Why ``holder``'s lock may be taken over by ``me``, or None while it holds."""
    if holder.job_id and holder.job_id == me.job_id:
        return f"the same Slurm job {holder.job_id} (requeued)"
    if holder.host == me.host:
        if holder.pid == me.pid:
            return "this process"
        start = process_start(holder.pid)
        if not start or (holder.pid_start and start != holder.pid_start):
            return f"process {holder.pid} is gone"
        return None
    age = _age(path)
    return f"not refreshed for {age:.0f} s" if age > holder.stale_after_s else None


def busy_message(run_dir: Path, holder: LockHolder) -> str:
    return (
        f"trainer.default_local_dir: {run_dir} is in use by another run ({holder.describe()}); "
        f"stop that run first (or wait for it), or choose another directory. A lock left by a process "
        f"that is gone is taken over by itself"
    )


def check_free(run_dir: str | Path, job_id: Optional[str] = None) -> None:
    """Refuse (RunDirLocked) when a live run holds ``run_dir``: what a Slurm submission checks
    before writing anything (the job's node 0 takes the lock when it starts)."""
    path = Path(run_dir) / LOCK_FILE
    holder, _ = read_holder(path)
    if holder is None:
        return  # free, or being taken right now (the launch that takes it decides)
    me = LockHolder(
        host=socket.gethostname(), pid=os.getpid(), pid_start="", started=time.time(), job_id=job_id, stale_after_s=0.0
    )
    if stale_reason(holder, me, path) is None:
        raise RunDirLocked(busy_message(Path(run_dir), holder))
