"""The launcher's watch over the ranks of one launch, from outside them: a rank that died, a rank
that hung. Locally the ``launch.py`` process runs it; on Slurm each node's task does, for its own
ranks (node 0 also for every other rank, whose heartbeat files it reads from the shared run
directory).

- **Lost rank**: a rank of this host whose process ended without saying so in its heartbeat file
  (``rlhf_hpc.distributed.heartbeat``). The watchdog holds a pidfd per rank, so it learns of the
  end at once, before torchrun's own monitor, and before the other ranks fail on the closed
  connection. A rank ended by SIGTERM (left a faulthandler note) was ended by torchrun or the
  user, not lost: the rank that made torchrun act is the one to name.
- **Hung rank**: a rank whose heartbeat count did not move for ``launcher.heartbeat_timeout_s``,
  by this process's clock. If the run directory cannot be written either, that is the cause named.

What it finds is a ``Failure`` (``rlhf_hpc.launch.failure``); acting on it is the caller's job.
"""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path
from typing import Optional

from rlhf_hpc.distributed.heartbeat import Beat, beat_interval, process_start, read_beats, signal_note
from rlhf_hpc.launch.failure import HUNG_RANK, LOST_RANK, RUN_DIR_UNWRITABLE, Failure

__all__ = ["Watchdog", "describe_rank"]


def describe_rank(beat: Beat) -> str:
    return f"rank {beat.rank} on {beat.host}, pid {beat.pid}"


class Watchdog:
    """``wait`` for a rank of this host to end (or a moment), then ``check``: a Failure or None."""

    def __init__(self, run_dir: str | Path, launch_id: str, timeout_s: float, watch_all: bool = True):
        self.run_dir, self.launch_id, self.timeout_s, self.watch_all = Path(run_dir), launch_id, timeout_s, watch_all
        self.host = socket.gethostname()
        self.read_every = min(1.0, beat_interval(timeout_s))
        self._read_at = 0.0
        self.beats: dict[int, Beat] = {}
        self._moved: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last changed)
        self._pidfds: dict[int, tuple[int, int]] = {}  # rank -> (pid, pidfd), ranks of this host
        self._gone: set[tuple[int, int]] = set()  # (rank, pid) whose end was judged
        self.terminated: list[Beat] = []  # ranks ended by SIGTERM (not a cause by themselves)

    def close(self) -> None:
        for _, fd in self._pidfds.values():
            if fd >= 0:
                os.close(fd)
        self._pidfds = {}

    # ---------------------------------------------------------------------------------- reading
    def _read(self) -> None:
        now = time.monotonic()
        self._read_at = now
        self.beats = read_beats(self.run_dir, self.launch_id)
        for rank, beat in self.beats.items():
            count, _ = self._moved.get(rank, (None, now))
            if count != beat.count:
                self._moved[rank] = (beat.count, now)
            if (
                beat.host == self.host
                and self._pidfds.get(rank, (None,))[0] != beat.pid
                and beat.state != "exited"
                and (rank, beat.pid) not in self._gone
            ):
                self._watch_pid(rank, beat)

    def _watch_pid(self, rank: int, beat: Beat) -> None:
        if rank in self._pidfds:
            os.close(self._pidfds.pop(rank)[1])
        try:
            fd = os.pidfd_open(beat.pid)  # readable once the process ends: no polling, no race with torchrun
        except OSError:
            fd = -1  # gone already: ``wait`` reports it at once
        if fd >= 0 and process_start(beat.pid) != beat.pid_start:  # the pid was reused: the rank is gone
            os.close(fd)
            fd = -1
        self._pidfds[rank] = (beat.pid, fd)

    # ----------------------------------------------------------------------------------- waiting
    def wait(self, seconds: float) -> list[int]:
        """Sleep up to ``seconds``, less when a watched rank ends; the ranks that ended."""
        fds = {fd: rank for rank, (_, fd) in self._pidfds.items() if fd >= 0}
        gone = [rank for rank, (_, fd) in self._pidfds.items() if fd < 0]
        if gone:
            return gone
        if not fds:
            time.sleep(seconds)
            return []
        ready, _, _ = select.select(list(fds), [], [], seconds)
        return [fds[fd] for fd in ready]

    # ---------------------------------------------------------------------------------- judging
    def check(self, ended: list[int]) -> Optional[Failure]:
        """A rank lost or hung, or None. ``ended``: ranks of this host whose process ended (``wait``)."""
        if ended or time.monotonic() - self._read_at >= self.read_every:
            self._read()  # fresh beats: a rank that ended on purpose has said so by now
        for rank in ended:
            failure = self._ended(rank)
            if failure is not None:
                return failure
        return self._stale()

    def _ended(self, rank: int) -> Optional[Failure]:
        pid, fd = self._pidfds.pop(rank, (None, -1))
        if fd >= 0:
            os.close(fd)
        self._gone.add((rank, pid))
        beat = self.beats.get(rank)
        if beat is None or beat.pid != pid or beat.state != "running":
            return None  # ended on purpose (done, a recorded failure, waiting after a lost peer)
        note = signal_note(self.run_dir, rank)
        if note.startswith("Fatal Python error"):
            return Failure(
                LOST_RANK,
                f"the process crashed ({note.splitlines()[0]}; its stack: "
                f"{self.run_dir / 'heartbeat' / f'rank{rank}.signal'})",
                describe_rank(beat),
            )
        if note:
            self.terminated.append(beat)
            return None
        return Failure(
            LOST_RANK,
            "the process died without an error of its own (killed by a signal, by the "
            "out-of-memory killer, or exited past Python)",
            describe_rank(beat),
        )

    def _stale(self) -> Optional[Failure]:
        now = time.monotonic()
        for rank, beat in sorted(self.beats.items()):
            if (
                beat.state == "exited"
                or (rank, beat.pid) in self._gone
                or not (self.watch_all or beat.host == self.host)
            ):
                continue
            _, since = self._moved[rank]
            if now - since > self.timeout_s:
                if not writable(self.run_dir):
                    return Failure(
                        RUN_DIR_UNWRITABLE,
                        f"{self.run_dir} cannot be written (the heartbeats stopped with it)",
                        describe_rank(beat),
                    )
                return Failure(
                    HUNG_RANK,
                    f"no heartbeat for {now - since:.0f} s (launcher.heartbeat_timeout_s="
                    f"{self.timeout_s:g}): the process is stopped or stuck",
                    describe_rank(beat),
                )
        return None

    def settled(self) -> bool:
        """Every rank has ended or waits after a lost peer: nothing more will come from the group."""
        self._read()
        return bool(self.beats) and all(
            beat.state != "running" or (rank, beat.pid) in self._gone for rank, beat in self.beats.items()
        )

    def after_exit(self) -> Optional[Failure]:
        """Once torchrun has ended with an error and nothing was recorded: the rank that ended
        without a word, else one ended by SIGTERM that nothing else explains."""
        self._read()
        for rank, beat in sorted(self.beats.items()):
            if beat.host == self.host and beat.state == "running" and (rank, beat.pid) not in self._gone:
                self._pidfds.setdefault(rank, (beat.pid, -1))
                failure = self._ended(rank)
                if failure is not None:
                    return failure
        if self.terminated:
            beat = self.terminated[0]
            return Failure(LOST_RANK, "the process was ended by SIGTERM from outside the run", describe_rank(beat))
        return None


def writable(run_dir: Path) -> bool:
    probe = run_dir / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
        return True
    except OSError:
        return False
