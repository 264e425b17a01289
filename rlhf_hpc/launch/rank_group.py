"""One torchrun and its ranks, started so that the launcher decides how they end.

- torchrun runs in a session of its own (a terminal's Ctrl-C reaches the launcher only, which
  forwards it to the ranks as a stop request: they finish the step, save and exit), with SIGUSR2
  ignored (Slurm's warning is for the ranks: torchrun's default action would be to die) and with
  PR_SET_PDEATHSIG: a launcher that dies (even by SIGKILL) takes torchrun with it, and each rank
  dies with torchrun (``die_with_parent``, called by the worker). No rank trains on, re-parented,
  writing into a run directory whose lock is gone.
- torchrun starts every rank in a session of its own, so the ranks are reached by their pids
  (torchrun's children), not through torchrun's process group.
- ``supervise`` waits for the group with the watchdog (``rlhf_hpc.launch.watchdog``) and the lock
  refreshed: a rank lost or hung ends the group at once (SIGKILL: torchrun prints no report of its
  own and the launcher's line is the one); after a failure a rank recorded, the group ends once
  every rank has exited or waits after a lost peer, at most ``FAILURE_GRACE_S`` later.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from rlhf_hpc.distributed.host_allreduce import launch_segments
from rlhf_hpc.launch.failure import LOST_RANK, Failure, read_failure, record_failure
from rlhf_hpc.launch.stop import request_stop
from rlhf_hpc.launch.watchdog import Watchdog

__all__ = ["FAILURE_GRACE_S", "Outcome", "RankGroup", "die_with_parent"]

FAILURE_GRACE_S = 10.0  # after a rank recorded a failure: time for the others to exit by themselves
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: a child must not load libraries


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux); if the parent is
    gone already, end now."""
    parent = os.getppid()
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _torchrun_setup() -> None:
    """In the torchrun child, between fork and exec."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)  # torchrun then stops its ranks


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@dataclass
class Outcome:
    code: int  # torchrun's exit code (negative: the signal that ended it)
    failure: Optional[Failure] = None  # what went wrong (recorded by a rank, or found by the watchdog)
    signals: list[int] = field(default_factory=list)  # stop signals the launcher received
    killed: bool = False  # the launcher ended the group


class RankGroup:
    """torchrun (``cmd``) started as the module's docstring says; ``supervise`` waits for its end."""

    def __init__(self, cmd: list[str], env: dict, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_torchrun_setup)

    def ranks(self) -> list[int]:
        return _children(self.proc.pid)

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def stop(self, reason: str) -> None:
        """The ranks finish their step, save a checkpoint and exit (``rlhf_hpc.launch.stop``; a rank
        still starting up stops after its first step)."""
        request_stop(self.run_dir, reason)

    def kill(self) -> None:
        """End torchrun and every rank now, without a checkpoint."""
        ranks = self.ranks()  # before torchrun goes: then they are its children no more
        for pgid in [self.proc.pid, *ranks]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()

    def supervise(
        self,
        watchdog: Watchdog,
        refresh: Callable[[], None] = lambda: None,
        signals: Optional[list[int]] = None,
        kill_lost: bool = True,
    ) -> Outcome:
        """Wait for torchrun to end. ``signals``: filled by the caller's signal handlers; the first
        stops the ranks at the next step boundary, a second kills them. ``kill_lost``: end the
        group when a rank of this host is lost (off where torchrun restarts its ranks itself)."""
        signals = signals if signals is not None else []
        outcome = Outcome(code=0, signals=signals)
        seen_signals, grace_until, next_record_check = 0, None, 0.0
        while self.poll() is None:
            ended = watchdog.wait(0.2)
            refresh()
            if len(signals) > seen_signals:
                seen_signals = len(signals)
                if seen_signals == 1:
                    name = signal.Signals(signals[0]).name
                    print(
                        f"[rlhf-hpc] {name}: the ranks finish their step, save a checkpoint and stop (a second "
                        f"signal stops them at once, without one)",
                        flush=True,
                    )
                    self.stop(f"signal {name}")
                else:
                    outcome.killed = True
                    self.kill()
                    break
            found = watchdog.check(ended)
            if found is not None and (kill_lost or found.code != LOST_RANK):
                found.launch = watchdog.launch_id
                record_failure(self.run_dir, found)
                outcome.killed = True
                self.kill()
                break
            if grace_until is None and time.monotonic() >= next_record_check:
                next_record_check = time.monotonic() + 1.0
                # a rank (or another node's watchdog) found the cause: the others end by themselves, or are ended
                if read_failure(self.run_dir, watchdog.launch_id) is not None:
                    grace_until = time.monotonic() + FAILURE_GRACE_S
            if grace_until is not None and (time.monotonic() > grace_until or watchdog.settled()):
                outcome.killed = True
                self.kill()
                break
        outcome.code = self.proc.wait()
        for path in launch_segments(watchdog.launch_id):  # a rank killed before it dropped the name
            path.unlink(missing_ok=True)
        outcome.failure = read_failure(self.run_dir, watchdog.launch_id)
        if outcome.failure is None and outcome.code != 0 and not outcome.killed:
            outcome.failure = watchdog.after_exit()
        watchdog.close()
        return outcome
