"""What runs on every node of a Slurm allocation: one torchrun for the node's ranks.

Used by the submitit job (``slurm.py``) and by the plain ``slurm/klppo.sbatch``. torchrun gets the
allocation's node count, a c10d rendezvous at the first node's hostname (resolvable inside the
cluster; never localhost when there are several nodes) on a port derived from the job id, and
``launcher.max_restarts`` for crashed workers.

Stopping (preemption, time limit): Slurm's USR2 reaches every process of the job step, but torchrun
neither handles nor forwards it, and its default action would kill it. torchrun is therefore
started with USR2 ignored (``rank_group``); the workers install their own handler (``stop.install_signal_handler``).
A stop can also be requested with a file (``stop.request_stop``), which is what the submitit job
does when its own USR2 handler runs. Either way the ranks agree at the next step boundary, save a
checkpoint and exit; ``stop.read_stopped`` then says why.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.distributed.heartbeat import ENV_LAUNCH_ID, beat_interval
from rlhf_hpc.launch.failure import (
    BAD_INPUT,
    FAILED,
    OK,
    REQUEUE,
    Failure,
    checkpoint_summary,
    describe_run_end,
    note_in_run_log,
)
from rlhf_hpc.launch.local import TORCHRUN_MONITOR, prune_empty_dirs, torchrun_log_dir, worker_env
from rlhf_hpc.launch.rank_group import Outcome, RankGroup
from rlhf_hpc.launch.run_lock import RunDirLocked, RunLock
from rlhf_hpc.launch.stop import clear, read_stopped
from rlhf_hpc.launch.watchdog import Watchdog
from rlhf_hpc.planning.hardware import step_cpu_warning, usable_cpus
from rlhf_hpc.recipe.load import load_resolved

__all__ = [
    "JOBS_FILE",
    "NodeInfo",
    "NodeJob",
    "NodeRun",
    "node_info",
    "node_python",
    "node_torchrun_command",
    "resume_command",
]


@dataclass
class NodeInfo:
    job_id: str
    node_rank: int
    nnodes: int
    master: str  # first host of the allocation
    port: int  # rendezvous port on the first host
    restart_count: int
    end_time: Optional[float]  # epoch seconds when the allocation ends (None: unknown)


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm nodelist (``gpu[01-03],cpu7``) with ``scontrol show hostnames``."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r}: {out.stderr.strip()}")
    return out.stdout.split()


def job_end_time(job_id: str) -> Optional[float]:
    """When the allocation ends, from Slurm (``squeue -o %e``); None without a limit."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    if not text or text in ("N/A", "NONE", "Unknown"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def node_info(env: Optional[dict] = None) -> NodeInfo:
    env = dict(os.environ if env is None else env)
    if env.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', 0)}"
    else:
        job_id = env["SLURM_JOB_ID"]
    hosts = hostnames(env["SLURM_JOB_NODELIST"])
    # the port from SLURM_JOB_ID, unique per array element too ("12_34" and "123_4" must not collide)
    return NodeInfo(
        job_id=job_id,
        node_rank=int(env.get("SLURM_NODEID", 0)),
        nnodes=len(hosts),
        master=hosts[0],
        port=rendezvous_port(env["SLURM_JOB_ID"]),
        restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
        end_time=job_end_time(env["SLURM_JOB_ID"]),
    )


def rendezvous_port(job_id: str) -> int:
    """A port every node derives alike from the job id (29500-45499), so concurrent jobs sharing a
    node do not collide."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return 29500 + int(digits) % 16000


def node_python(cfg) -> list[str]:
    """The interpreter of torchrun and the ranks: the job's own, or inside ``launcher.container`` the
    container's (``launcher.container_python``): the host venv's would run in the container with the
    host's packages, or not be there at all."""
    if cfg.launcher.container:
        return shlex.split(cfg.launcher.container) + shlex.split(cfg.launcher.container_python)
    return [sys.executable]


def node_torchrun_command(cfg, config_path: str | Path, info: NodeInfo) -> list[str]:
    cmd = node_python(cfg) + [
        "-m",
        "torch.distributed.run",
        f"--nnodes={info.nnodes}",
        f"--nproc-per-node={cfg.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={info.master}:{info.port}",
        f"--rdzv-id={info.job_id}",
        f"--max-restarts={cfg.launcher.max_restarts}",
        TORCHRUN_MONITOR,
        f"--log-dir={torchrun_log_dir(Path(config_path).parent)}",
        "-m",
        "rlhf_hpc.worker",
        str(config_path),
    ]
    return cmd


class NodeRun:
    """One torchrun on this node (``rank_group.RankGroup``: USR2 ignored, it dies with this
    process); ``wait`` polls (it must stay interruptible by signal handlers that also wait on it)."""

    def __init__(self, cfg, config_path: str | Path, info: NodeInfo):
        self.run_dir = Path(config_path).parent
        self.launch_id = f"{info.job_id}.{info.restart_count}"  # alike on every node of the allocation
        env = worker_env(cfg)
        if cfg.launcher.container:
            for name in ("VIRTUAL_ENV", "PYTHONHOME"):  # the host's interpreter, not the container's
                env.pop(name, None)
        env[ENV_LAUNCH_ID] = self.launch_id
        if info.end_time is not None:
            env["RLHF_HPC_JOB_END_TIME"] = str(info.end_time)
        self.cmd = node_torchrun_command(cfg, config_path, info)
        # one line per node in its own log: where it runs and where the ranks meet
        cpus = usable_cpus()
        print(
            f"[rlhf-hpc] node {info.node_rank}/{info.nnodes} on {socket.gethostname()}: torchrun with "
            f"{cfg.procs_per_node} ranks on {cpus} CPUs, rendezvous {info.master}:{info.port} "
            f"(id {info.job_id}, restart {info.restart_count})",
            flush=True,
        )
        warning = step_cpu_warning(cfg.launcher.cpus_per_task, cpus, os.environ.get("SLURM_CPUS_PER_TASK"))
        if warning:
            print(f"[rlhf-hpc] warning: {warning}", flush=True)
        self.group = RankGroup(self.cmd, env, self.run_dir)
        self.proc = self.group.proc

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.5)
        return self.proc.returncode


class NodeJob:
    """This node's share of a Slurm job, for the submitit job and the plain sbatch script alike:
    on node 0 the run directory's lock (taken over from an earlier allocation of the same job, so
    a requeued job resumes), torchrun with the heartbeat watchdog (this node's ranks; node 0 also
    every other rank's), and how it ended: ``(exit code, the line that says so)``."""

    def __init__(self, cfg, config_path: str | Path, info: NodeInfo):
        self.cfg, self.config_path, self.info = cfg, str(config_path), info
        self.run_dir = Path(config_path).parent
        self.run: Optional[NodeRun] = None

    def __call__(self) -> tuple[int, str]:
        cfg, info, run_dir = self.cfg, self.info, self.run_dir
        lock = None
        if info.node_rank == 0:
            try:
                lock = RunLock.acquire(run_dir, 2 * cfg.launcher.heartbeat_timeout_s, job_id=info.job_id)
            except RunDirLocked as e:
                return BAD_INPUT, f"error: {e}"
            clear(run_dir)
        every = beat_interval(cfg.launcher.heartbeat_timeout_s)
        try:
            self.run = NodeRun(cfg, self.config_path, info)
            watchdog = Watchdog(
                run_dir, self.run.launch_id, cfg.launcher.heartbeat_timeout_s, watch_all=info.node_rank == 0
            )
            # with torchrun restarting its ranks itself (launcher.max_restarts), a lost rank is its call
            refresh = (lambda: lock.refresh(every)) if lock else (lambda: None)
            outcome = self.run.group.supervise(watchdog, refresh=refresh, kill_lost=cfg.launcher.max_restarts == 0)
        finally:
            if lock is not None:
                lock.release()
            prune_empty_dirs(torchrun_log_dir(run_dir))
        return self.result(outcome)

    def result(self, outcome: Outcome) -> tuple[int, str]:
        cfg, info, run_dir = self.cfg, self.info, self.run_dir
        failure = outcome.failure
        if failure is not None and failure.code == BAD_INPUT:  # once in the job's log, no requeue
            return BAD_INPUT, failure.what if info.node_rank == 0 else ""
        if failure is None and outcome.code != 0:
            failure = Failure(
                FAILED,
                f"torchrun exited with code {outcome.code} (its report is above)",
                f"node {info.node_rank} ({socket.gethostname()})",
            )
        if failure is not None:
            line = describe_run_end(failure, run_dir, resume_command(run_dir))
            note_in_run_log(run_dir, f"job {info.job_id} node {info.node_rank}: {line}")
            return failure.code, line
        stopped = read_stopped(run_dir)
        if stopped and info.restart_count >= cfg.launcher.max_requeues:
            return OK, (
                f"[rlhf-hpc] stopped ({stopped}) but launcher.max_requeues={cfg.launcher.max_requeues} "
                f"is used up; {checkpoint_summary(run_dir)}; resume with: {resume_command(run_dir)}"
            )
        if stopped and info.node_rank == 0:
            return REQUEUE, f"[rlhf-hpc] stopped ({stopped}); exit code {REQUEUE} asks the sbatch script to requeue"
        return OK, ""


def resume_command(run_dir: Path) -> str:
    """The command that submitted the run (recorded in ``slurm_jobs.json``), else one that
    submits its resolved config again."""
    try:
        command = json.loads((run_dir / JOBS_FILE).read_text())[-1].get("command")
    except (OSError, ValueError, IndexError, AttributeError):
        command = None
    return command or f"python launch.py recipe={run_dir / 'config.yaml'} cluster=slurm"


def main(argv: list[str]) -> int:
    """``python -m rlhf_hpc.launch.node RUN_DIR/config.yaml``: run this node's share (plain sbatch)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm's warning is for the workers, not for us
    cfg = load_resolved(argv[0], checks=False)  # (the ranks check it)
    code, line = NodeJob(cfg, argv[0], node_info())()
    if line:
        print(line, file=sys.stderr if code not in (OK, REQUEUE) else sys.stdout, flush=True)
    return code


JOBS_FILE = "slurm_jobs.json"  # the run's Slurm jobs, written at submission (rlhf_hpc.launch.slurm)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
