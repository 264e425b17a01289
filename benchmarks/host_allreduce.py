"""Averaging a replicated model's gradient across the ranks of one machine: gloo against shared memory.

    python -m benchmarks.host_allreduce [--nproc 2] [--reps 10]

Re-launches itself under torchrun (gloo, one thread per rank). The gradient is the ``ppo_step``
workload's actor (19.5M fp32 parameters, 78 MB, one tensor per parameter). Four ways, each the
median of ``--reps`` timings after two warm-ups, rank 0's figure:

  gloo per tensor      one asynchronous all-reduce per gradient, then wait for all
                       (``ReplicaGradients`` without shared memory)
  gloo flat            one all-reduce of the whole gradient copied into one buffer
  shared memory        ``rlhf_hpc.distributed.host_allreduce.SharedMemoryAllReduce.mean_``
  ... beside compute   the same with a fixed amount of matrix products on the rank meanwhile (the
                       backward, on a machine with one core per rank): gloo's all-reduces started
                       before the products and waited for after; shared memory after the products
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.ppo_step import MODEL
from rlhf_hpc.distributed.host_allreduce import SharedMemoryAllReduce
from rlhf_hpc.models.hf import build_causal_lm

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def relaunch(args) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "benchmarks.host_allreduce",
        "--worker",
        "--reps",
        str(args.reps),
    ]
    sys.exit(subprocess.call(cmd, env=env))


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (after two), the ranks lined up before each."""
    times = []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(reps: int) -> None:

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = [torch.randn_like(p) for p in build_causal_lm(MODEL, torch.float32).parameters()]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    shm, why = SharedMemoryAllReduce.create(dist.group.WORLD)
    if shm is None:
        sys.exit(f"shared memory is not available here: {why}")
    a, b = torch.randn(464, 1408), torch.randn(1408, 512)

    def compute() -> None:  # about one mini-batch's backward of the workload on one core
        for _ in range(20):
            a @ b

    def gloo_per_tensor() -> None:
        works = [dist.all_reduce(g.div_(world), async_op=True) for g in grads]
        for w in works:
            w.wait()

    def gloo_flat() -> None:
        flat = torch.cat([g.view(-1) for g in grads]).div_(world)
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.view(-1).copy_(flat[offset : offset + g.numel()])
            offset += g.numel()

    def gloo_beside_compute() -> None:
        works = [dist.all_reduce(g.div_(world), async_op=True) for g in grads]
        compute()
        for w in works:
            w.wait()

    def shm_after_compute() -> None:
        compute()
        shm.mean_(grads)

    figures = {
        "compute alone": timed(compute, reps),
        "gloo per tensor": timed(gloo_per_tensor, reps),
        "gloo flat": timed(gloo_flat, reps),
        "shared memory": timed(lambda: shm.mean_(grads), reps),
        "gloo per tensor beside compute": timed(gloo_beside_compute, reps),
        "shared memory after compute": timed(shm_after_compute, reps),
    }
    if rank == 0:
        print(f"{world} ranks, {len(grads)} gradients, {nbytes / 1e6:.0f} MB fp32; {why}")
        print("| way | ms | GB/s of gradient |")
        print("| --- | --- | --- |")
        for name, sec in figures.items():
            rate = "" if "compute" in name else f"{nbytes / sec / 1e9:.2f}"
            print(f"| {name} | {sec * 1e3:.1f} | {rate} |")
        print(
            f"shared memory / gloo per tensor: {figures['shared memory'] / figures['gloo per tensor']:.2f}x the "
            f"time; beside compute: "
            f"{figures['shared memory after compute'] / figures['gloo per tensor beside compute']:.2f}x"
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.reps)
    else:
        relaunch(args)


if __name__ == "__main__":
    main()
