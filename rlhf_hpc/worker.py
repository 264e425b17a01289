"""What every torchrun rank runs: ``python -m rlhf_hpc.worker RUN_DIR/config.yaml``."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.dist import exit_process, init_distributed
from rlhf_hpc.host_allocator import describe as host_memory_line
from rlhf_hpc.recipe import ConfigError, load_resolved


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlhf_hpc.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    from rlhf_hpc.data.dataset import DataError
    from rlhf_hpc.launch.stop import install_signal_handler, record_user_error
    run_dir = Path(argv[0]).parent
    try:
        cfg = load_resolved(argv[0])
    except ConfigError as e:
        record_user_error(run_dir, f"error: {e}")  # the launcher prints it once for the job
        return 0
    install_signal_handler()  # Slurm's USR2: finish the step, save, stop
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
            print(f"[rlhf-hpc] host memory: {host_memory_line()}", flush=True)
    from rlhf_hpc.trainer import fit
    try:
        fit(cfg, ctx)
    except (ConfigError, DataError) as e:
        # a user error every rank meets alike: one line for the job (printed by the launcher),
        # not a traceback per rank and torchrun's failure report
        record_user_error(run_dir, f"error: {e}")
    if dist.is_initialized():  # a vLLM engine's shutdown already ended the group
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
