"""AdamW on the host, one thread (as a torchrun rank with OMP_NUM_THREADS=1 runs it when the
optimizer lives on the CPU: FSDP2 CPUOffloadPolicy, i.e. ``param_offload``). Parameters per
second, and what that means for one optimizer step of a 7B model's shard on 8 GPUs.

    python -m benchmarks.host_adamw [--params-m 50]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=50.0, help="millions of fp32 parameters")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = int(args.params_m * 1e6)
    params = [torch.nn.Parameter(torch.randn(n // 50)) for _ in range(50)]
    for p in params:
        p.grad = torch.randn_like(p)
    shard = 7_615_616_512 / 8  # Qwen2.5-7B over 8 ranks
    print("| AdamW | M params/s (1 thread) | s per step for a 7B shard (0.95B) | x4 mini-batches |")
    print("| --- | --- | --- | --- |")
    for foreach in (False, True):
        opt = torch.optim.AdamW(params, lr=1e-6, foreach=foreach)
        opt.step()  # creates the state
        t0 = time.perf_counter()
        opt.step()
        rate = n / (time.perf_counter() - t0)
        print(f"| foreach={foreach} | {rate / 1e6:.0f} | {shard / rate:.0f} | {4 * shard / rate:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
