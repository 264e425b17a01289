"""What every torchrun rank runs: ``python -m rlhf_hpc.worker RUN_DIR/config.yaml``."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rlhf_hpc.dist import init_distributed
from rlhf_hpc.recipe import ConfigError, load_resolved

# Exit code of a worker whose process group came up but which has no training loop to run yet.
EXIT_NO_TRAINER = 3


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlhf_hpc.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    try:
        cfg = load_resolved(argv[0])
    except ConfigError as e:
        print(f"rank config error: {e}", file=sys.stderr)
        return 2
    ctx = init_distributed(cfg)
    # one collective proves every rank joined the same group on the chosen backend
    ranks = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(ranks)
    expected = ctx.world_size * (ctx.world_size - 1) / 2
    if ranks.item() != expected:
        raise RuntimeError(f"process group check failed: sum of ranks {ranks.item()} != {expected}")
    if ctx.is_main:
        print(f"[rlhf-hpc] process group up: {ctx.world_size} ranks, backend {ctx.backend}, "
              f"device {ctx.device.type}", flush=True)
    try:
        from rlhf_hpc.trainer import fit  # noqa: F401  (arrives with the training-loop issue)
    except ImportError:
        if ctx.is_main:
            print("[rlhf-hpc] the training loop is not part of this version yet; stopping after the "
                  "process-group check", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return EXIT_NO_TRAINER
    fit(cfg, ctx)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
