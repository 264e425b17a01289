"""The split layout's ranks and the groups between them (``actor_rollout_ref.hybrid_engine=false``).

One torchrun job starts ``trainer.n_gpus_per_node + rollout.n_gpus_per_node`` processes a node:
on each node the trainer's ranks come first, then the rollout ranks. Each side gets its own
default process group (its ``WORLD``), so the trainer's code (the FSDP2 mesh, the metric
all-reduces) and the engines' (vLLM's ``external_launcher`` reuses the default group) run as they
do in the colocated layout. Two more groups join the sides, both from torchrun's store:

- ``weights``: trainer rank 0 and every rollout rank; trainer rank 0 broadcasts each full tensor
  (the trainer's ranks gather them from their shards, a bucket at a time, as the colocated sync).
- ``rows``: rollout rank 0 and every trainer rank; rollout rank 0 broadcasts each step's rows
  (host objects: gloo on every device).

Messages are pickled objects broadcast as bytes (their size first), or tensors. No Ray: the
rollout ranks run their own loop (rlhf_hpc/ppo/split_rollout.py).
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import Config

__all__ = [
    "Bridge",
    "SplitRole",
    "init_split_groups",
    "split_role",
]


@dataclass(frozen=True)
class SplitRole:
    """This process's place in the split layout."""

    role: str  # "trainer" or "rollout"
    rank: int  # within its side
    size: int  # its side's ranks
    global_rank: int
    trainer_ranks: list[int]  # the global ranks of the trainer's ranks, by trainer rank
    rollout_ranks: list[int]  # the global ranks of the rollout ranks, by rollout rank

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"


def split_role(cfg: Config, global_rank: int) -> SplitRole:
    """Where torchrun's ``global_rank`` sits: on every node the trainer's ranks, then the rollout's."""
    per, n_t, n_r = cfg.procs_per_node, cfg.trainer.n_gpus_per_node, cfg.rollout.n_gpus_per_node
    nodes = cfg.trainer.nnodes
    trainers = [node * per + i for node in range(nodes) for i in range(n_t)]
    rollouts = [node * per + n_t + i for node in range(nodes) for i in range(n_r)]
    if global_rank in trainers:
        return SplitRole("trainer", trainers.index(global_rank), len(trainers), global_rank, trainers, rollouts)
    return SplitRole("rollout", rollouts.index(global_rank), len(rollouts), global_rank, trainers, rollouts)


class Bridge:
    """One group between the sides, its broadcasts rooted at group rank 0. ``send`` may run
    asynchronously (the sender goes on; the buffers stay referenced until their broadcast is done);
    ``recv`` blocks."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.pending: list = []  # (work, buffers it must keep alive)

    def _broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.group.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def send_object(self, obj: Any, async_op: bool = False) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        works = [self._broadcast(size, async_op), self._broadcast(data, async_op)]
        if async_op:
            self.pending = [(w, b) for w, b in self.pending if not all(x.is_completed() for x in w)]
            self.pending.append((works, (size, data)))

    def recv_object(self) -> Any:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        # (the peer is the same job's rank 0 of the other side, not a file or the network's input)
        return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301

    def send_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast each tensor in turn (the receivers know their names, shapes and dtypes from
        a manifest sent before); returns the bytes sent."""
        sent = 0
        for _, t in tensors:
            t = t.to(self.device).contiguous()
            self._broadcast(t)
            sent += t.numel() * t.element_size()
        return sent

    def recv_tensors(self, manifest: list[tuple[str, tuple, str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``manifest`` ((name, shape, dtype) each), one at a time as they arrive."""
        for name, shape, dtype in manifest:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(t)
            yield name, t


def _group(store, members: list[int], global_rank: int, name: str, device: torch.device, timeout_s: float):
    prefixed = dist.PrefixStore(f"rlhf_hpc/{name}", store)
    rank, size = members.index(global_rank), len(members)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def init_split_groups(
    cfg: Config, device: torch.device, backend: str
) -> tuple[SplitRole, Optional[Bridge], Optional[Bridge]]:
    """Join torchrun's store: this side's default process group, then the ``weights`` and ``rows``
    bridges this rank is a member of (None where it is not). Returns (role, weights, rows)."""
    store, global_rank, global_size = next(dist.rendezvous("env://"))
    store.set_timeout(datetime.timedelta(seconds=cfg.trainer.dist_timeout_s))
    expected = cfg.trainer.nnodes * cfg.procs_per_node
    if global_size != expected:
        raise RuntimeError(
            f"torchrun started {global_size} ranks but the split layout needs {expected} "
            f"(trainer.nnodes x (trainer.n_gpus_per_node + rollout.n_gpus_per_node))"
        )
    role = split_role(cfg, global_rank)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(role.rank), str(role.size)  # (this side's, for vLLM)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"rlhf_hpc/{role.role}", store),
        rank=role.rank,
        world_size=role.size,
        timeout=datetime.timedelta(seconds=cfg.trainer.dist_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    timeout = cfg.trainer.dist_timeout_s
    weights_members = [role.trainer_ranks[0], *role.rollout_ranks]
    rows_members = [role.rollout_ranks[0], *role.trainer_ranks]
    weights = rows = None
    if global_rank in weights_members:
        weights = Bridge(_group(store, weights_members, global_rank, "weights", device, timeout), device)
    if global_rank in rows_members:
        host = torch.device("cpu")
        rows = Bridge(_group(store, rows_members, global_rank, "rows", host, timeout), host)
    return role, weights, rows
