"""Run the job on this machine: one torchrun with ``trainer.n_gpus_per_node`` processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_hpc.config import Config


def torchrun_command(cfg: Config, config_path: str | Path) -> list[str]:
    """The exact command line local mode runs (also what ``--dry-run`` prints)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={cfg.trainer.n_gpus_per_node}",
            f"--max-restarts={cfg.launcher.max_restarts}",
            "-m", "rlhf_hpc.worker", str(config_path)]


def worker_env(cfg: Config) -> dict[str, str]:
    """Environment for the ranks. CPU ranks share the cores: without a cap on OpenMP threads each
    rank would start one thread per core and they would all fight over them."""
    env = dict(os.environ)
    if cfg.trainer.device == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.trainer.n_gpus_per_node))
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    return env


def run_local(cfg: Config, config_path: str | Path) -> int:
    """Start torchrun in the foreground; its exit code is the job's."""
    proc = subprocess.run(torchrun_command(cfg, config_path), env=worker_env(cfg))
    return proc.returncode
