"""Averaging host tensors across the ranks of one process group that all run on this machine,
through shared memory instead of gloo's loopback TCP.

Why: replicated models on the host (``rlhf_hpc.distributed.fsdp.ReplicaGradients``) average their whole
gradient every mini-batch. gloo moves it through the kernel's socket buffers in background
threads, which on a machine with one core per rank compete with the backward for the cores
(78 MB on 2 ranks: 87 ms). Here each rank copies its share into a mapped ``/dev/shm`` file, each
rank sums one slice of every rank's copy, and each copies the sums back: 30 ms for the same 78 MB,
in the rank's own thread (``python -m benchmarks.host_allreduce``).

Layout of the mapping: ``(2, N, capacity)`` bytes. Tensors are streamed through it in buckets of
``capacity`` bytes; bucket k uses half ``k % 2`` (counting across calls), so a rank can fill the
next bucket while the others still read the last one. Per bucket: copy in (scaled by 1/N), sync,
sum slice ``rank`` of all N copies into this rank's copy, sync, copy every slice back out. The
syncs are gloo barriers (the first of each call an all-reduce that also checks that every rank
brought the same number of elements).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.heartbeat import ENV_LAUNCH_ID

__all__ = ["MIN_CAPACITY", "SHM_DIR", "SharedMemoryAllReduce", "launch_segments"]

SHM_DIR = Path("/dev/shm")
DEFAULT_CAPACITY = 32 << 20  # bytes per rank and bucket: 3 buckets for the 19.5M-parameter fp32 actor of #19
MIN_CAPACITY = 1 << 20


def host_identity() -> str:
    """This machine, as far as processes on it can tell: the host name and the kernel's boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _launch_tag(launch_id: Optional[str] = None) -> str:
    """The launch's part of a segment's name (``run-<id>_``): what it leaves behind if a rank dies
    before the name is dropped is found by it (``launch_segments``)."""
    launch_id = launch_id if launch_id is not None else os.environ.get(ENV_LAUNCH_ID, "")
    return f"run-{launch_id}_" if launch_id else ""


def launch_segments(launch_id: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The segments of launch ``launch_id`` still in ``shm_dir``."""
    return sorted(shm_dir.glob(f"rlhf_hpc_allreduce_*_{_launch_tag(launch_id)}*")) if launch_id else []


class SharedMemoryAllReduce:
    """In-place mean of same-shaped host tensors over ``group``, every rank on this machine.

    Build with ``create`` (a collective): it returns None on every rank when the ranks are not all
    on one host or no shared mapping can be made, and the caller keeps gloo.
    """

    def __init__(self, group, buffer: torch.Tensor):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.buffer = buffer  # (2, size, capacity) uint8, mapped from shared memory
        self.capacity = buffer.shape[-1]
        self.rounds = 0  # buckets done, over all calls: which half the next one uses

    @classmethod
    def create(
        cls, group, capacity: int = DEFAULT_CAPACITY, host: Optional[str] = None, shm_dir: Path = SHM_DIR
    ) -> tuple[Optional["SharedMemoryAllReduce"], str]:
        """(the all-reduce or None, why in words). Collective over ``group``; every rank gets the
        same answer. ``host``: this rank's machine (default ``host_identity()``)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        hosts: list = [None] * size
        dist.all_gather_object(hosts, host or host_identity(), group=group)
        if len(set(hosts)) > 1:
            return None, f"the {size} ranks run on {len(set(hosts))} hosts"
        plan: list = [None, ""]  # [path, why not]
        if rank == 0:
            plan = cls._make_file(shm_dir, size, capacity)
        dist.broadcast_object_list(plan, src=dist.get_global_rank(group, 0), group=group)
        path, why = plan
        if path is None:
            return None, why
        buffer, error = None, ""
        try:
            nbytes = Path(path).stat().st_size
            buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(2, size, -1)
        except (OSError, RuntimeError) as e:
            error = f"rank {rank} cannot map {path}: {e}"
        errors: list = [None] * size
        dist.all_gather_object(errors, error, group=group)
        if rank == 0:  # every rank has mapped it (or failed): the name is no longer needed
            Path(path).unlink(missing_ok=True)
        problems = [e for e in errors if e]
        if problems:
            return None, problems[0]
        return cls(group, buffer), f"shared memory ({2 * size} x {buffer.shape[-1] >> 20} MiB in {shm_dir})"

    @staticmethod
    def _make_file(shm_dir: Path, size: int, capacity: int) -> list:
        """[path, ""] of a new file of 2 x size x capacity bytes, its pages reserved, or [None, why]."""
        if not shm_dir.is_dir():
            return [None, f"{shm_dir} does not exist"]
        try:
            st = os.statvfs(shm_dir)
        except OSError as e:
            return [None, f"{shm_dir}: {e}"]
        # at most a quarter of what is free: the rollout engine and data loaders use it too
        fits = st.f_bavail * st.f_frsize // (4 * 2 * size)
        capacity = min(capacity, fits) // 4096 * 4096
        if capacity < MIN_CAPACITY:
            return [
                None,
                f"{shm_dir} has {st.f_bavail * st.f_frsize >> 20} MiB free, too little for "
                f"{2 * size} x {MIN_CAPACITY >> 20} MiB",
            ]
        path = shm_dir / f"rlhf_hpc_allreduce_{os.getpid()}_{_launch_tag()}{uuid.uuid4().hex[:12]}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # reserve the pages now: a full tmpfs would otherwise kill a rank with SIGBUS mid-step
                os.posix_fallocate(fd, 0, 2 * size * capacity)
            finally:
                os.close(fd)
        except OSError as e:
            path.unlink(missing_ok=True)
            return [None, f"cannot create {path}: {e}"]
        return [str(path), ""]

    def mean_(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the ranks. Every rank passes tensors of the same
        dtype and sizes, in the same order; each contiguous, on the host."""
        if not tensors:
            return
        dtype = tensors[0].dtype
        for t in tensors:
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(
                    f"SharedMemoryAllReduce: expected contiguous host tensors of {dtype}, got "
                    f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})"
                )
        flats = [t.view(-1) for t in tensors]
        total = sum(f.numel() for f in flats)
        per_bucket = self.capacity // dtype.itemsize
        scale = 1.0 / self.size
        # the first sync also checks that every rank brought as many elements
        counts = torch.tensor([total, -total], dtype=torch.int64)
        pieces: list[tuple[torch.Tensor, int]] = []  # (part of a tensor, its offset in the bucket)
        filled = 0
        for f in flats:
            start = 0
            while start < f.numel():
                n = min(f.numel() - start, per_bucket - filled)
                pieces.append((f[start : start + n], filled))
                start, filled = start + n, filled + n
                if filled == per_bucket:
                    self._bucket(pieces, filled, dtype, scale, counts)
                    pieces, filled, counts = [], 0, None
        if pieces:
            self._bucket(pieces, filled, dtype, scale, counts)

    def _bucket(
        self, pieces: list, used: int, dtype: torch.dtype, scale: float, counts: Optional[torch.Tensor]
    ) -> None:
        half = self.buffer[self.rounds % 2]
        self.rounds += 1
        slots = half.view(dtype)  # (size, capacity / itemsize): one row per rank
        mine = slots[self.rank]
        for part, offset in pieces:
            torch.mul(part, scale, out=mine[offset : offset + part.numel()])
        if counts is None:
            dist.barrier(group=self.group)
        else:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
            if counts[0] != -counts[1]:
                raise RuntimeError(
                    f"SharedMemoryAllReduce: ranks brought different numbers of elements "
                    f"(between {-int(counts[1])} and {int(counts[0])}); every rank must pass "
                    f"the same tensors"
                )
        chunk = -(-used // self.size)  # this rank sums elements [rank * chunk, (rank + 1) * chunk)
        lo, hi = self.rank * chunk, min(used, (self.rank + 1) * chunk)
        if lo < hi:
            for other in range(self.size):
                if other != self.rank:
                    mine[lo:hi].add_(slots[other, lo:hi])
        dist.barrier(group=self.group)
        for part, offset in pieces:  # element i's sum lives in the row of rank i // chunk
            at, end = offset, offset + part.numel()
            while at < end:
                owner = at // chunk
                stop = min(end, (owner + 1) * chunk)
                part[at - offset : stop - offset].copy_(slots[owner, at:stop])
                at = stop
