"""Run the job on this machine: one torchrun with ``trainer.n_gpus_per_node`` processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.host_allocator import malloc_tunables
from rlhf_hpc.launch.stop import USER_ERROR, read_user_error

__all__ = ["LAYOUT_SHOWN", "run_local", "standalone_torchrun_command", "worker_env"]


# set for ranks whose console already shows the plan's layout lines: rank 0 does not repeat them
LAYOUT_SHOWN = "RLHF_HPC_LAYOUT_SHOWN"


def standalone_torchrun_command(cfg: Config, config_path: str | Path) -> list[str]:
    """The exact command line local mode runs (also what ``--dry-run`` prints)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={cfg.trainer.n_gpus_per_node}", "--max-restarts=0",
            "-m", "rlhf_hpc.worker", str(config_path)]


def worker_env(cfg: Config) -> dict[str, str]:
    """Environment for the ranks. CPU ranks share the cores: without a cap on OpenMP threads each
    rank would start one thread per core and they would all fight over them. They also get glibc
    malloc settings that keep freed tensor memory (``rlhf_hpc.distributed.host_allocator``) unless the user set
    their own. GPU ranks get NCCL without cuMem (see below). A variable the user set is kept."""
    env = dict(os.environ)
    if cfg.trainer.device == "cpu":
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.trainer.n_gpus_per_node))
        tunables, _ = malloc_tunables(env)
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        # torch's C++ warnings go straight to stderr (rlhf_hpc.observability.library_logs cannot route them); on
        # CPU ranks they are vLLM's thread and NUMA binding notes
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    elif cfg.trainer.device == "cuda":
        # NCCL's buffers off the CUDA virtual-memory API (cuMem): vLLM's sleep mode frees and remaps
        # memory through that API in the same process, and NCCL buffers allocated through it have
        # crashed colocated engines on wake (verl sets the same for its colocated vLLM)
        env.setdefault("NCCL_CUMEM_ENABLE", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    return env


def run_local(cfg: Config, config_path: str | Path) -> int:
    """Start torchrun in the foreground; its exit code is the job's. ``launcher.max_restarts``:
    when the workers fail, a new torchrun (fresh rendezvous) resumes from the latest checkpoint.
    torchrun's own in-place restarts are not used here: on gloo its restarted group sometimes
    never connects (seen with torch 2.13 on this kind of machine)."""
    run_dir = Path(config_path).parent
    (run_dir / USER_ERROR).unlink(missing_ok=True)
    attempts = cfg.launcher.max_restarts + 1
    for attempt in range(attempts):
        env = worker_env(cfg)
        env["RLHF_HPC_ATTEMPT"] = str(attempt)
        env[LAYOUT_SHOWN] = "1"  # this console has the layout lines already (cli printed the plan)
        code = subprocess.run(standalone_torchrun_command(cfg, config_path), env=env).returncode
        user_error = read_user_error(run_dir)
        if user_error:
            print(user_error, file=sys.stderr, flush=True)
            return 2
        if code == 0:
            return 0
        if attempt + 1 < attempts:
            print(f"[rlhf-hpc] workers failed (exit {code}); restart {attempt + 1}/{cfg.launcher.max_restarts} "
                  f"from the latest checkpoint", flush=True)
    return code
