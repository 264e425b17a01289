"""How a run starts and ends (issue #40): the run directory's lock, the launcher's stop signals,
and one line with a documented exit code for each way a run fails. Real launches (torchrun, gloo,
2 ranks), real signals; faults through ``trainer.inject_fault`` (rlhf_hpc/ppo/faults.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_hpc.distributed.heartbeat import ENV_LAUNCH_ID, process_start, signal_note
from rlhf_hpc.distributed.host_allreduce import MIN_CAPACITY, SharedMemoryAllReduce, launch_segments
from rlhf_hpc.launch.failure import (
    BAD_INPUT,
    EXIT_CODES,
    FAILED,
    GUARD_STOP,
    HUNG_RANK,
    LATEST_FILE,
    LOST_RANK,
    unwritable_path,
)
from rlhf_hpc.launch.run_lock import LOCK_FILE, RunDirLocked, RunLock, check_free
from rlhf_hpc.launch.watchdog import Watchdog
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ppo import checkpoint as ckpt
from tests.conftest import REPO, run_launch

HOST = socket.gethostname()
FAST = [
    "recipe=tiny_klppo",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


# ------------------------------------------------------------------------------- the codes
def test_exit_codes_are_one_table_in_the_code_and_the_readme():
    readme = (REPO / "docs" / "reliability.md").read_text().split("\n## Reliability\n")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^ *\| (\d+) \| ([^|]+?) \|", readme, flags=re.M))
    assert {int(k): v for k, v in rows.items()} == {k: name for k, (name, _) in EXIT_CODES.items()}
    assert "| 128 + N |" in readme  # stopped by signal N
    assert LATEST_FILE == ckpt.LATEST  # the name the launcher's line reads is the one checkpoints write


def test_a_write_the_filesystem_refuses_is_found_through_causes():
    from torch.distributed.checkpoint.api import CheckpointException

    refused = OSError(errno.EROFS, "Read-only file system", "/runs/x/global_step_4/extra.pt")
    assert unwritable_path(refused) == "/runs/x/global_step_4/extra.pt: Read-only file system"
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as wrapped:
        assert unwritable_path(wrapped) == "No space left on device"
    dcp = CheckpointException("save failed", {1: (refused, None)})  # DCP: a BaseException with per-rank failures
    assert unwritable_path(dcp) == "/runs/x/global_step_4/extra.pt: Read-only file system"
    assert unwritable_path(ValueError("bad")) is None


def test_shared_memory_the_project_names_carries_the_launch(tmp_path, monkeypatch):
    """A rank killed between creating the all-reduce segment and dropping its name leaves it behind:
    the name says which launch it was, and that launch's launcher removes it."""
    monkeypatch.setenv(ENV_LAUNCH_ID, "abc123")
    path, why = SharedMemoryAllReduce._make_file(tmp_path, 2, MIN_CAPACITY)
    assert why == "" and Path(path).name.startswith(f"rlhf_hpc_allreduce_{os.getpid()}_run-abc123_")
    assert launch_segments("abc123", tmp_path) == [Path(path)] and launch_segments("abc12", tmp_path) == []


# ------------------------------------------------------------------------------- the lock
HOLD = (
    "import sys, time; from rlhf_hpc.launch.run_lock import RunLock; "
    "lock = RunLock.acquire(sys.argv[1], stale_after_s=600, job_id=sys.argv[2] or None); "
    "print('locked', flush=True); time.sleep(600)"
)


def hold_lock(run: Path, job_id: str = "", env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run), job_id],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **(env or {})),
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_the_lock_refuses_a_live_holder_and_takes_over_what_is_stale(tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        busy = rf"{run} is in use by another run \(host {HOST}, pid {holder.pid}, since "
        with pytest.raises(RunDirLocked, match=busy):
            RunLock.acquire(run, stale_after_s=600)
        with pytest.raises(RunDirLocked):
            check_free(run)
    finally:
        holder.kill()
        holder.wait()
    # its holder is gone (SIGKILL: nothing released it): the next launch takes it over
    check_free(run)
    with RunLock.acquire(run, stale_after_s=600) as lock:
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.refresh(every_s=0)
    assert not (run / LOCK_FILE).exists()

    # a requeued Slurm job takes over the lock of its earlier allocation (same job id), another job does not
    holder = hold_lock(run, job_id="4242")
    try:
        with pytest.raises(RunDirLocked, match="Slurm job 4242"):
            RunLock.acquire(run, stale_after_s=600, job_id="4243")
        with RunLock.acquire(run, stale_after_s=600, job_id="4242"):
            assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()

    # a holder on another host (a shared filesystem): stale once not refreshed for its stale_after_s
    (run / LOCK_FILE).write_text(
        json.dumps(
            {
                "host": "elsewhere",
                "pid": 1,
                "pid_start": "",
                "started": time.time(),
                "job_id": None,
                "stale_after_s": 60,
            }
        )
    )
    with pytest.raises(RunDirLocked, match="host elsewhere, pid 1"):
        RunLock.acquire(run, stale_after_s=600)
    os.utime(run / LOCK_FILE, (time.time() - 61, time.time() - 61))
    with RunLock.acquire(run, stale_after_s=600):
        pass
    assert not (run / LOCK_FILE).exists()


# ---------------------------------------------------------------------------- the watchdog
BEAT = (
    "import sys, time; from rlhf_hpc.distributed.heartbeat import Heartbeat; "
    "Heartbeat(sys.argv[1], int(sys.argv[2]), 'launch-1', 0.2).start(); print('beating', flush=True); "
    "time.sleep(600)"
)


@pytest.mark.exclusive
@pytest.mark.slow
def test_the_watchdog_tells_a_lost_a_crashed_a_terminated_and_a_hung_rank_apart(tmp_path):
    """Four beating processes: SIGKILL (lost), SIGSEGV (crashed), SIGTERM (ended by torchrun or a
    user: not the cause) and SIGSTOP (hung: its count stops moving)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BEAT, str(tmp_path), str(rank)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "beating"
        dog = Watchdog(tmp_path, "launch-1", timeout_s=1.5)
        assert dog.check(dog.wait(0.1)) is None and len(dog.beats) == 4

        def next_failure(limit_s: float = 10.0):
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                found = dog.check(dog.wait(0.1))
                if found is not None:
                    return found
            return None

        procs[0].send_signal(signal.SIGKILL)
        lost = next_failure()
        assert (lost.code, lost.where) == (LOST_RANK, f"rank 0 on {HOST}, pid {procs[0].pid}")
        assert lost.what.startswith("the process died without an error of its own")
        procs[1].send_signal(signal.SIGSEGV)
        crashed = next_failure()
        assert crashed.code == LOST_RANK and crashed.where.startswith("rank 1 ")
        assert crashed.what.startswith("the process crashed (Fatal Python error: Segmentation fault")
        procs[2].send_signal(signal.SIGTERM)
        procs[3].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        hung = next_failure()
        assert hung.code == HUNG_RANK and hung.where.startswith("rank 3 "), hung  # rank 2 was not the cause
        # the timeout, less what a beat (0.2 s) and a read of the files (every 0.5 s) may hide of it
        assert 1.5 - 0.7 < time.monotonic() - t0 < 5 and "the process is stopped or stuck" in hung.what
        assert [b.rank for b in dog.terminated] == [2]
        assert signal_note(tmp_path, 2).startswith("Stack (most recent call first)")
        dog.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


# --------------------------------------------------------------------- real launches, real ends
def processes_of(run: Path) -> list[str]:
    """Command lines of the processes still running for ``run`` (torchrun, ranks, launcher)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run) in cmdline:
                out.append(cmdline)
    return out


def assert_one_line_end(
    out: subprocess.CompletedProcess, run: Path, code: int, where: str, what: str, checkpoint: int, tracebacks: int = 0
) -> str:
    """The run's end is the project's one line, last on the console and in the run's log: what,
    where, the last checkpoint, the command that resumes, the documented code."""
    assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"[rlhf-hpc] run failed: {where}"), line
    assert what in line, line
    assert f"last checkpoint {run}/global_step_{checkpoint} (step {checkpoint})" in line, line
    assert f"resume with: python {REPO / 'launch.py'} recipe=tiny_klppo " in line
    assert f"trainer.default_local_dir={run}" in line
    assert line.endswith(f"exit code {code} ({EXIT_CODES[code][0]})"), line
    # no report per rank, none of torchrun
    assert out.stderr.count("Traceback") == tracebacks and "ChildFailedError" not in out.stderr
    assert line in (run / "logs" / "launch.log").read_text()
    assert processes_of(run) == []  # no rank, no torchrun left
    assert not (run / "logs" / "torchrun").exists() and not (run / LOCK_FILE).exists()
    return line


def launch(run: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_launch(*FAST, f"trainer.default_local_dir={run}", *extra, timeout=600, env=env)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_at_once_with_one_line_and_code_4(tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    out = launch(run, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.inject_fault=kill@2:1")
    assert_one_line_end(
        out, run, LOST_RANK, f"rank 1 on {HOST}, pid ", "the process died without an error of its own", checkpoint=1
    )
    assert time.monotonic() - start < 300


@pytest.mark.slow
def test_a_hung_rank_is_found_by_the_heartbeat_in_seconds_with_code_5(tmp_path):
    """Rank 1 stops itself (SIGSTOP) in step 2: rank 0 waits in its next collective, which gloo would
    hold for trainer.dist_timeout_s (30 min); the heartbeat watchdog ends the run after 10 s."""
    run = tmp_path / "run"
    out = launch(
        run,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.inject_fault=hang@2:1",
        "launcher.heartbeat_timeout_s=10",
    )
    line = assert_one_line_end(out, run, HUNG_RANK, f"rank 1 on {HOST}, pid ", "no heartbeat for 1", checkpoint=1)
    assert "(launcher.heartbeat_timeout_s=10): the process is stopped or stuck" in line
    assert json.loads((run / "FAILURE").read_text())["code"] == HUNG_RANK


@pytest.mark.slow
def test_a_bug_in_one_rank_is_its_traceback_once_and_one_line_with_code_1(tmp_path):
    """Rank 1 raises in step 2; rank 0's next collective fails on the closed connection and it waits:
    the launcher ends the group at once, naming rank 1, not rank 0."""
    run = tmp_path / "run"
    out = launch(run, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.inject_fault=raise@2:1")
    assert_one_line_end(
        out,
        run,
        FAILED,
        f"rank 1 on {HOST}, pid ",
        "RuntimeError: fault injected: trainer.inject_fault=raise@2 (rank 1) (traceback above)",
        checkpoint=1,
        tracebacks=1,
    )


@pytest.mark.slow
def test_the_guards_final_stop_is_one_line_with_code_3(tmp_path):
    run = tmp_path / "run"
    out = launch(
        run,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.inject_fault=nan_grad@2",
        "trainer.guard.max_rollbacks=0",
    )
    line = assert_one_line_end(
        out,
        run,
        GUARD_STOP,
        "stability guard: actor/pg_loss is nan; stopping after 0 rollbacks",
        "Lower the learning rate",
        checkpoint=1,
    )
    assert "last step logged 2" in line
    assert [r["training/global_step"] for r in read_metrics(run)] == [1, 2]  # the divergent step is logged
    assert (run / "global_step_1").is_dir()  # what was saved before is kept
    assert "stopping after 0 rollbacks (trainer.guard.max_rollbacks)" in out.stdout + out.stderr


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_a_second_launch_is_refused_and_the_resume_has_every_step_once(tmp_path):
    """The launcher gets SIGTERM: the ranks finish their step, save and exit, the launcher exits 143
    with the line; no process of the run is left. While it ran, a second launch on the directory was
    refused (exit 2, the holder named) without touching it. The printed command resumes, and every
    step is trained (and logged) once."""
    run = tmp_path / "run"
    steps = 6
    # slow@1: every step 1 s longer, so the run is still going when the second launch looks
    args = [
        *FAST,
        f"trainer.default_local_dir={run}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=100",
        "trainer.inject_fault=slow@1",
    ]
    first = subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ((run / LOCK_FILE).exists() and (run / "config.yaml").exists()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the lock comes first, then the config
        config = (run / "config.yaml").read_text()
        second = launch(run, f"trainer.total_training_steps={steps + 1}")
        assert second.returncode == BAD_INPUT and "Traceback" not in second.stderr
        assert (
            f"error: trainer.default_local_dir: {run} is in use by another run (host {HOST}, pid {first.pid}, "
            in second.stderr
        )
        assert (run / "config.yaml").read_text() == config and not list(run.glob("config.prev-*"))
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [json.loads(p.read_text()) for p in (run / "heartbeat").glob("rank*.json")]
        assert len(ranks) == 2 and first.poll() is None, "the run ended before the test could stop it"
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, stdout[-3000:] + stderr[-3000:]
    stopped_at = int((run / LATEST_FILE).read_text())
    assert 1 <= stopped_at < steps
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(
        "[rlhf-hpc] stopped by SIGTERM: the ranks finished their step and saved a checkpoint; "
        f"last checkpoint {run}/global_step_{stopped_at} (step {stopped_at}); "
        "resume with: python "
    ), line
    assert line.endswith("; exit code 143")
    assert f"[rlhf-hpc] stopping after step {stopped_at}: stop requested (signal SIGTERM); checkpoint saved" in stdout
    assert processes_of(run) == [] and not (run / LOCK_FILE).exists()
    assert all(process_start(r["pid"]) != r["pid_start"] for r in ranks)  # both ranks are gone

    resume = line.split("resume with: ")[1].split("; exit code")[0].split()
    assert resume[:2] == ["python", str(REPO / "launch.py")] and resume[2:] == args
    again = run_launch(*resume[2:], timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {run}/global_step_{stopped_at} (step {stopped_at})" in again.stdout
    logged = [r["training/global_step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert logged == list(range(1, steps + 1))  # every step once, none repeated, none skipped
    assert [r["training/global_step"] for r in read_metrics(run)] == list(range(1, steps + 1))
    assert processes_of(run) == [] and not (run / "heartbeat").exists() and not (run / LOCK_FILE).exists()
