"""What every torchrun rank runs: ``python -m rlhf_hpc.worker RUN_DIR/config.yaml``."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.process_group import exit_process, init_distributed
from rlhf_hpc.distributed.host_allocator import describe_malloc_settings
from rlhf_hpc.observability.library_logs import library_log_path, route_library_logs
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.recipe.load import load_resolved
from rlhf_hpc.data.dataset import DataError
from rlhf_hpc.launch.stop import install_signal_handler, record_user_error
from rlhf_hpc.ppo.trainer import fit
from rlhf_hpc.preflight import PreflightFailed, run_preflight, write_report

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlhf_hpc.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).parent
    try:
        cfg = load_resolved(argv[0])
    except ConfigError as e:
        record_user_error(run_dir, f"error: {e}")  # the launcher prints it once for the job
        return 0
    install_signal_handler()  # Slurm's USR2: finish the step, save, stop
    route_library_logs(run_dir, int(os.environ.get("RANK", "0")))  # before vLLM is imported
    ctx = init_distributed(cfg)
    # one collective proves every rank joined the same group on the chosen backend
    ranks = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(ranks)
    expected = ctx.world_size * (ctx.world_size - 1) / 2
    if ranks.item() != expected:
        raise RuntimeError(f"process group check failed: sum of ranks {ranks.item()} != {expected}")
    # which host each rank runs on: on a multi-node job, proof that the group spans the nodes
    hosts: list = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if ctx.is_main:
        print(f"[rlhf-hpc] process group up: {ctx.world_size} ranks, backend {ctx.backend}, "
              f"device {ctx.device.type}, hosts by rank: {','.join(hosts)}", flush=True)
        if ctx.device.type == "cpu":
            print(f"[rlhf-hpc] host memory: {describe_malloc_settings()}", flush=True)
        print(f"[rlhf-hpc] vLLM's and torch's warnings: {library_log_path(run_dir, '*')}", flush=True)
    try:
        if cfg.trainer.preflight:
            preflight(cfg, ctx, run_dir)
        else:
            fit(cfg, ctx)
    except (ConfigError, DataError) as e:
        # a user error every rank meets alike: one line for the job (printed by the launcher),
        # not a traceback per rank and torchrun's failure report
        record_user_error(run_dir, f"error: {e}")
    if dist.is_initialized():  # a vLLM engine's shutdown already ended the group
        dist.destroy_process_group()
    return 0


def preflight(cfg, ctx, run_dir: Path) -> None:
    """The allocation check in place of training (rlhf_hpc.preflight): a failed check becomes the
    job's one-line error (exit code 2 from the launcher, no requeue)."""
    def log(line: str) -> None:  # rank 0 reports (other ranks' prints would interleave with its lines)
        if ctx.is_main:
            print(f"[rlhf-hpc] preflight: {line}", flush=True)
    checks: list = []
    try:
        checks = run_preflight(cfg, ctx, log, checks)
    except PreflightFailed as e:
        if ctx.is_main:
            report = write_report(run_dir, checks, str(e))
            record_user_error(run_dir, f"error: preflight failed: {e} (report: {report})")
        return
    if ctx.is_main:
        report = write_report(run_dir, checks, None)
        print(f"[rlhf-hpc] preflight passed: {len(checks)} checks ({report})", flush=True)


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
