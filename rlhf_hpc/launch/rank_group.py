"""One torchrun and its ranks, started so that the launcher decides how they end.

- torchrun runs in a session of its own (a terminal's Ctrl-C reaches the launcher only, which
  forwards it to the ranks as a stop request: they finish the step, save and exit), with SIGUSR2
  ignored (Slurm's warning is for the ranks: torchrun's default action would be to die) and with
  PR_SET_PDEATHSIG: a launcher that dies (even by SIGKILL) takes torchrun with it, and each rank
  dies with torchrun (``die_with_parent``, called by the worker). No rank trains on, re-parented,
  writing into a run directory whose lock is gone.
- torchrun starts every rank in a session of its own, so the ranks are reached by their pids
  (torchrun's children), not through torchrun's process group.
- torchrun in this launcher's own interpreter (the command's Python is ``sys.executable``) is a
  fork of the launcher that calls torchrun's ``main``: torch is imported already, which saves the
  ~1.5 CPU-s and the second of a new interpreter importing it (BENCHMARKS.md). The ranks it
  starts are new interpreters as before; another interpreter (a container's) is started by the
  command itself.
- ``supervise`` waits for the group with the watchdog (``rlhf_hpc.launch.watchdog``) and the lock
  refreshed: a rank lost or hung ends the group at once (SIGKILL: torchrun prints no report of its
  own and the launcher's line is the one); after a failure a rank recorded, the group ends once
  every rank has exited or waits after a lost peer, at most ``FAILURE_GRACE_S`` later.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from rlhf_hpc.distributed.host_allreduce import launch_segments
from rlhf_hpc.launch.failure import LOST_RANK, Failure, read_failure, record_failure
from rlhf_hpc.launch.stop import request_stop
from rlhf_hpc.launch.watchdog import Watchdog

__all__ = ["FAILURE_GRACE_S", "ForkedTorchrun", "Outcome", "RankGroup", "die_with_parent", "start_torchrun"]

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


class ForkedTorchrun:
    """``python -m torch.distributed.run ARGS`` as a fork of this process (``subprocess.Popen``'s
    ``pid``, ``poll``, ``wait`` and ``returncode``), set up as ``_torchrun_setup`` sets up the
    command's: a session of its own, SIGUSR2 ignored, the launcher's death its SIGTERM; the
    launcher's signal handlers are the defaults again, as after an exec."""

    def __init__(self, args: list[str], env: dict):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: Optional[int] = None
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(_run_torchrun(args, env))

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _run_torchrun(args: list[str], env: dict) -> int:
    """In the forked child: torchrun's ``main``; its exit code, as the interpreter would give it."""
    code = 1
    try:
        os.setsid()
        # the launcher's files stay its own, as Popen's close_fds leaves them; its objects are never
        # collected here, so none closes a number torchrun has opened since
        gc.freeze()
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for sig in signal.valid_signals():  # (handlers that are Python functions: an exec resets them)
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        _torchrun_setup()
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.executable, *args]
        from torch.distributed.run import main

        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # what the interpreter prints before it exits with 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def start_torchrun(cmd: list[str], env: dict):
    """torchrun as ``cmd`` says: forked (``ForkedTorchrun``) where its Python is this one, else the
    command in a new process."""
    if cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        return ForkedTorchrun(cmd[3:], env)
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_torchrun_setup)


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
        self.proc = start_torchrun(cmd, env)

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
