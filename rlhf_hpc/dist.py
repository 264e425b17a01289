"""Process group set-up from torchrun's environment: NCCL on CUDA, gloo on CPU."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_hpc.config import Config


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str) -> torch.device:
    """``trainer.device`` -> a torch device for this rank (``auto``: CUDA when torch sees a GPU)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but torch sees no GPU on this node "
                               "(use trainer.device=cpu, or check the CUDA build of torch)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(cfg: Config) -> DistContext:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR ... in the env).

    The group's size must be what the config planned for (``trainer.nnodes x n_gpus_per_node``):
    batch sizes and meshes were validated against that number.
    """
    device = pick_device(cfg.trainer.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=cfg.trainer.dist_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"torchrun started {world} ranks but trainer.nnodes x trainer.n_gpus_per_node "
                           f"= {cfg.world_size}; launch with the configured number of processes")
    return DistContext(rank=dist.get_rank(), world_size=world,
                       local_rank=int(os.environ.get("LOCAL_RANK", 0)), device=device, backend=backend)
