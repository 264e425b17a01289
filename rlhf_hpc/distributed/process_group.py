"""Process group set-up from torchrun's environment: NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.distributed.split_layout import Bridge, SplitRole, init_split_groups

__all__ = [
    "DistContext",
    "all_reduce_max",
    "all_reduce_max_int",
    "all_reduce_min",
    "all_reduce_sum",
    "build_rollout_tp_group",
    "build_train_mesh",
    "device_memory_gb",
    "exit_process",
    "init_distributed",
    "mesh_shape",
    "on_exit_process",
    "process_group_backend",
]


@dataclass
class DistContext:
    """This rank in its process group: the whole job, or in the split layout its side's."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    split: Optional[SplitRole] = None  # the split layout's role; None: colocated
    weights: Optional[Bridge] = None  # the split layout's bridges this rank is a member of
    rows: Optional[Bridge] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str) -> torch.device:
    """``trainer.device`` -> a torch device for this rank (``auto``: CUDA when torch sees a GPU)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "trainer.device=cuda but torch sees no GPU on this node "
                "(use trainer.device=cpu, or check the CUDA build of torch)"
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def device_memory_gb(device: torch.device) -> Optional[float]:
    """GiB of this rank's GPU (None on the CPU): the memory plan's size where the config names none."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def host_collectives_needed(cfg: Config) -> bool:
    """A model whose shards live on the host (FSDP2 CPUOffloadPolicy: param_offload/offload_policy)
    has CPU DTensor gradients: the gradient-norm all-reduce of a CPU tensor needs a CPU backend."""
    sections = [
        cfg.actor_rollout_ref.actor.fsdp_config,
        cfg.actor_rollout_ref.ref.fsdp_config,
        cfg.critic.model.fsdp_config,
    ]
    return any(f.param_offload or f.offload_policy for f in sections)


def process_group_backend(device: torch.device, cfg: Config) -> str:
    """gloo on CPU; NCCL on CUDA, plus gloo for CPU tensors where host shards need it."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_collectives_needed(cfg) else "nccl"


def init_distributed(cfg: Config) -> DistContext:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR ... in the env).

    The group's size must be what the config planned for (``trainer.nnodes x n_gpus_per_node``):
    batch sizes and meshes were validated against that number.
    """
    device = pick_device(cfg.trainer.device)
    backend = process_group_backend(device, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.split and not dist.is_initialized():
        role, weights, rows = init_split_groups(cfg, device, backend)
        return DistContext(
            role.rank, role.size, int(os.environ.get("LOCAL_RANK", 0)), device, backend, role, weights, rows
        )
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=cfg.trainer.dist_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(
            f"torchrun started {world} ranks but trainer.nnodes x trainer.n_gpus_per_node "
            f"= {cfg.world_size}; launch with the configured number of processes"
        )
    return DistContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=device,
        backend=backend,
    )


def mesh_shape(world_size: int, fsdp_size: int) -> tuple[int, int]:
    """(replicate, shard) for a shard group of ``fsdp_size`` ranks (-1: all ranks)."""
    shard = world_size if fsdp_size in (-1, None) else fsdp_size
    if shard <= 0 or world_size % shard:
        raise ValueError(f"fsdp_size {fsdp_size} does not divide the world size {world_size}")
    return world_size // shard, shard


def build_train_mesh(device: torch.device, world_size: int, fsdp_size: int):
    """The training mesh: 1-D ``("shard",)`` when nothing is replicated (FULL_SHARD), else 2-D
    ``("replicate", "shard")`` (HSDP: shard inside a group, all-reduce across groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = mesh_shape(world_size, fsdp_size)
    if replicate == 1:
        return init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """``op`` over all ranks into a new tensor on ``t``'s device. NCCL reduces device tensors only:
    host tensors (metrics, counts) make a round trip."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t.clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.to(device, copy=True)
    with collective():
        dist.all_reduce(out, op=op)
    return out.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """SUM over all ranks, returning a new tensor (for the ``all_reduce`` hooks of ``algos``)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.MIN)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    return -all_reduce_min(-t)


def all_reduce_max_int(value: int, device: torch.device) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    with collective():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def build_rollout_tp_group(tp: int, ranks_per_node: int):
    """The process group of this rank's rollout tensor-parallel group: ``tp`` consecutive ranks
    inside one node (vLLM's external launcher groups ranks the same way). None when tp == 1."""
    if tp == 1 or not dist.is_initialized():
        return None
    if ranks_per_node % tp:
        raise ValueError(f"rollout tensor_model_parallel_size {tp} does not divide {ranks_per_node} ranks per node")
    mine = None
    for start in range(0, dist.get_world_size(), tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks, backend="gloo")  # carries Python objects (prompt lists)
        if dist.get_rank() in ranks:
            mine = group
    return mine


_EXIT_CLEANUPS: list = []


def on_exit_process(fn) -> None:
    """Run ``fn()`` in ``exit_process`` (which skips atexit and C++ static teardown): for resources
    the OS does not reclaim with the process, e.g. named shared-memory segments. Also registered
    with atexit, for a process that ends by an exception; ``fn`` must be safe to run twice."""
    _EXIT_CLEANUPS.append(fn)
    atexit.register(fn)


def exit_process(code: int = 0):
    """End a distributed process whose work is done (outputs written, process group destroyed)
    without the interpreter's teardown: there a C++ thread still joinable at exit can abort a
    finished process ("terminate called without an active exception"; gloo, seen on a loaded CPU
    machine in 4 of 8 runs), and torchrun then reports the finished run as failed. Cleanups
    registered with ``on_exit_process`` run first."""
    while _EXIT_CLEANUPS:
        try:
            _EXIT_CLEANUPS.pop()()
        except Exception as e:  # noqa: BLE001 - exiting anyway; say what was left behind
            print(f"[rlhf-hpc] exit cleanup failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
