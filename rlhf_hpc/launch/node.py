"""What runs on every node of a Slurm allocation: one torchrun for the node's ranks.

Used by the submitit job (``slurm.py``) and by the plain ``slurm/klppo.sbatch``. torchrun gets the
allocation's node count, a c10d rendezvous at the first node's hostname (resolvable inside the
cluster; never localhost when there are several nodes) on a port derived from the job id, and
``launcher.max_restarts`` for crashed workers.

Stopping (preemption, time limit): Slurm's USR2 reaches every process of the job step, but torchrun
neither handles nor forwards it, and its default action would kill it. torchrun is therefore
started with USR2 ignored; the workers install their own handler (``stop.install_signal_handler``).
A stop can also be requested with a file (``stop.request_stop``), which is what the submitit job
does when its own USR2 handler runs. Either way the ranks agree at the next step boundary, save a
checkpoint and exit; ``stop.read_stopped`` then says why.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.launch.local import worker_env
from rlhf_hpc.launch.stop import clear, read_stopped, read_user_error
from rlhf_hpc.recipe.load import load_resolved

__all__ = ["NodeRun", "node_info"]


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
    return NodeInfo(job_id=job_id, node_rank=int(env.get("SLURM_NODEID", 0)), nnodes=len(hosts), master=hosts[0],
                    port=rendezvous_port(env["SLURM_JOB_ID"]),
                    restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
                    end_time=job_end_time(env["SLURM_JOB_ID"]))


def rendezvous_port(job_id: str) -> int:
    """A port every node derives alike from the job id (29500-45499), so concurrent jobs sharing a
    node do not collide."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return 29500 + int(digits) % 16000


def node_torchrun_command(cfg, config_path: str | Path, info: NodeInfo) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={info.nnodes}",
           f"--nproc-per-node={cfg.trainer.n_gpus_per_node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={info.master}:{info.port}",
           f"--rdzv-id={info.job_id}", f"--max-restarts={cfg.launcher.max_restarts}",
           "-m", "rlhf_hpc.worker", str(config_path)]
    if cfg.launcher.container:
        import shlex
        cmd = shlex.split(cfg.launcher.container) + cmd
    return cmd


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class NodeRun:
    """One torchrun on this node; ``wait`` polls (it must stay interruptible by signal handlers that
    also wait on it)."""

    def __init__(self, cfg, config_path: str | Path, info: NodeInfo):
        env = worker_env(cfg)
        if info.end_time is not None:
            env["RLHF_HPC_JOB_END_TIME"] = str(info.end_time)
        self.cmd = node_torchrun_command(cfg, config_path, info)
        # one line per node in its own log: where it runs and where the ranks meet
        print(f"[rlhf-hpc] node {info.node_rank}/{info.nnodes} on {socket.gethostname()}: torchrun with "
              f"{cfg.trainer.n_gpus_per_node} ranks, rendezvous {info.master}:{info.port} "
              f"(id {info.job_id}, restart {info.restart_count})", flush=True)
        self.proc = subprocess.Popen(self.cmd, env=env, preexec_fn=_ignore_usr2)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.5)
        return self.proc.returncode


def main(argv: list[str]) -> int:
    """``python -m rlhf_hpc.launch.node RUN_DIR/config.yaml``: run this node's share (plain sbatch)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm's warning is for the workers, not for us
    cfg = load_resolved(argv[0])
    info = node_info()
    if info.node_rank == 0:
        clear(Path(argv[0]).parent)
    code = NodeRun(cfg, argv[0], info).wait()
    user_error = read_user_error(Path(argv[0]).parent)
    if user_error:  # found by the workers (bad data, ...): once in the job's log, no requeue
        if info.node_rank == 0:
            print(user_error, file=sys.stderr, flush=True)
        return 2
    stopped = read_stopped(Path(argv[0]).parent)
    if code == 0 and stopped and info.restart_count >= cfg.launcher.max_requeues:
        print(f"[rlhf-hpc] stopped ({stopped}) but launcher.max_requeues={cfg.launcher.max_requeues} is used up",
              flush=True)
        return 0
    if code == 0 and stopped and info.node_rank == 0:
        print(f"[rlhf-hpc] stopped ({stopped}); exit code {EXIT_REQUEUE} asks the sbatch script to requeue",
              flush=True)
        return EXIT_REQUEUE
    return code


# exit code of a node whose training stopped early (preemption, time limit) and should be requeued
EXIT_REQUEUE = 85

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
