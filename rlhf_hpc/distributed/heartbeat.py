"""Each rank's heartbeat, for the launcher's watchdog (``rlhf_hpc.launch.watchdog``): a way to find
a rank that stopped, apart from the collectives' own timeout (``trainer.dist_timeout_s``, 30 min by
default), which is otherwise the only thing that notices.

A daemon thread rewrites ``<run dir>/heartbeat/rank<R>.json`` every few seconds with a growing
count. The watchdog judges by whether the count moves on its own clock (no clocks are compared
across hosts). A process that is stopped (SIGSTOP, a frozen node), whose interpreter is stuck, or
whose host can no longer write the run directory stops beating; a rank blocked in a collective,
waiting for a peer, still beats (the peer is the one to look at).

The file also says how the rank ended: ``state`` is ``exited`` when it ended on purpose (done, or a
failure it recorded) and ``lost peer`` while it waits for the launcher after a collective failed.
``rank<R>.signal`` receives a faulthandler dump, written at C level even while the rank is blocked
in a collective, when SIGTERM arrives (torchrun ending the group because another rank failed) or
the process crashes (segfault). A rank gone without either was lost: killed from outside, by the
OOM killer, or by a fault injected on purpose.

Only ranks started by a launcher of this project beat (it sets ``RLHF_HPC_LAUNCH_ID``: files of
another launch are ignored by the watchdog).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

__all__ = [
    "Beat",
    "ENV_INTERVAL",
    "ENV_LAUNCH_ID",
    "HEARTBEAT_DIR",
    "Heartbeat",
    "beat_interval",
    "process_start",
    "read_beats",
    "signal_note",
]

HEARTBEAT_DIR = "heartbeat"
ENV_LAUNCH_ID = "RLHF_HPC_LAUNCH_ID"
ENV_INTERVAL = "RLHF_HPC_HEARTBEAT_S"


@dataclass
class Beat:
    rank: int
    host: str
    pid: int
    pid_start: str  # the process's start time (/proc): a reused pid is not taken for this rank
    launch: str
    count: int = 0
    state: str = "running"  # running | lost peer | exited


def beat_interval(timeout_s: float) -> float:
    """Ten beats per timeout, between 0.5 s and 30 s."""
    return min(30.0, max(0.5, timeout_s / 10))


def process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot, "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # field 22; the name in parentheses may hold spaces


def _path(run_dir: Path, rank: int, suffix: str) -> Path:
    return run_dir / HEARTBEAT_DIR / f"rank{rank}.{suffix}"


class Heartbeat:
    """This rank's beat; ``from_env`` returns None outside a launcher of this project."""

    def __init__(self, run_dir: str | Path, rank: int, launch_id: str, interval_s: float):
        self.run_dir, self.interval = Path(run_dir), interval_s
        pid = os.getpid()
        self.beat = Beat(rank=rank, host=socket.gethostname(), pid=pid, pid_start=process_start(pid), launch=launch_id)
        self._stop = threading.Event()
        self._writing = threading.Lock()  # the thread's beats and the main thread's state share a file
        self._thread = threading.Thread(target=self._run, name="rlhf-hpc-heartbeat", daemon=True)
        self._note = None

    @classmethod
    def from_env(cls, run_dir: str | Path) -> Optional["Heartbeat"]:
        launch_id = os.environ.get(ENV_LAUNCH_ID)
        if not launch_id:
            return None
        return cls(run_dir, int(os.environ.get("RANK", "0")), launch_id, float(os.environ.get(ENV_INTERVAL, "10")))

    def start(self) -> "Heartbeat":
        (self.run_dir / HEARTBEAT_DIR).mkdir(parents=True, exist_ok=True)
        # where the rank was when SIGTERM or a fatal signal ended it (see the module's docstring)
        self._note = open(_path(self.run_dir, self.beat.rank, "signal"), "w")
        faulthandler.register(signal.SIGTERM, file=self._note, all_threads=False, chain=True)
        faulthandler.enable(file=self._note, all_threads=False)
        self._write()
        self._thread.start()
        return self

    def set_state(self, state: str) -> None:
        """``lost peer`` or ``exited``; ``exited`` also ends the beat."""
        self.beat.state = state
        if state == "exited":
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(timeout=2 * self.interval)
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()

    def _write(self) -> None:
        with self._writing:
            self.beat.count += 1
            path = _path(self.run_dir, self.beat.rank, "json")
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text(json.dumps(asdict(self.beat)))
                os.replace(tmp, path)  # a new file each time: readers on NFS see it on open
            except OSError:
                pass  # a run directory that cannot be written stops the beat: the watchdog says so


def read_beats(run_dir: str | Path, launch_id: str) -> dict[int, Beat]:
    """The beats of launch ``launch_id`` by rank (a file being replaced is read next time)."""
    out = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if beat.launch == launch_id:
            out[beat.rank] = beat
    return out


def signal_note(run_dir: str | Path, rank: int) -> str:
    """What faulthandler wrote when a signal ended rank ``rank`` ("" if nothing)."""
    try:
        return _path(Path(run_dir), rank, "signal").read_text()
    except OSError:
        return ""
