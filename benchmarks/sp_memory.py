"""Activation memory per rank of one long row's forward + backward, without and with Ulysses
sequence parallelism (sp=1 vs sp=2), on CPU with gloo.

    python -m benchmarks.sp_memory [--tokens 4096] [--hidden 512] [--layers 4]

Each case is a fresh 2-rank torchrun (OMP_NUM_THREADS=1; glibc told to return freed blocks with
MALLOC_MMAP_THRESHOLD_=65536). A rank builds a Qwen2 (8 query / 2 KV heads, vocabulary 8192,
fp32, attn_implementation=varlen), runs a short warm-up row so the gradients exist, then
measures the rise of its peak resident memory (VmHWM, reset just before) over the forward and
backward of the log-probs of one packed row of ``--tokens`` tokens (a quarter prompt, the rest
response): at sp=1 each rank computes its own row, at sp=2 the two ranks compute one row, half
of its tokens each (``rlhf_hpc.distributed.sequence_parallel``). Both with and without activation
checkpointing. The log-prob sums show both compute the same thing; time is secondary on gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_hpc.distributed.sequence_parallel import build_sequence_parallel
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import per_token_logprobs

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def worker(sp_size: int, checkpointing: bool, tokens: int, hidden: int, layers: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = build_sequence_parallel(sp_size)
    path = (
        f"tiny://qwen2?hidden_size={hidden}&intermediate_size={hidden * 11 // 4}&num_hidden_layers={layers}"
        f"&num_attention_heads=8&num_key_value_heads=2&vocab_size=8192&max_position_embeddings={2 * tokens}"
    )
    model = build_causal_lm(path, torch.float32, seed=0, attn="varlen")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def row(n: int, seed: int) -> dict:
        # sp=1: each rank its own row; sp=2: the group's ranks share one
        g = torch.Generator().manual_seed(seed)
        p = n // 4
        ids = torch.randint(1, 8192, (n,), generator=g).tolist()
        return make_padded_batch([ids[:p]], [ids[p:]], 0, p, n - p)

    def step(batch: dict) -> tuple[float, float]:
        t0 = time.perf_counter()
        lp, _ = per_token_logprobs(model, batch, temperature=1.0, sp=sp)
        lp.sum().backward()
        return lp.sum().item(), time.perf_counter() - t0

    seed = 1 if sp is not None else 1 + rank
    step(row(256, seed))  # allocates the gradients
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    base = peak_memory_bytes(cpu)
    lp_sum, seconds = step(row(tokens, seed))
    rise = (peak_memory_bytes(cpu) - base) / 2**20
    rises = [None] * dist.get_world_size()
    dist.all_gather_object(rises, (rise, lp_sum, seconds))
    if rank == 0:
        out.write_text(
            json.dumps(
                {
                    "sp": sp_size,
                    "checkpointing": checkpointing,
                    "tokens": tokens,
                    "peak_rise_mib": [r[0] for r in rises],
                    "logprob_sum": [r[1] for r in rises],
                    "seconds": max(r[2] for r in rises),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # sp checkpointing out
    args = ap.parse_args(argv)
    if args.worker:
        sp, ckpt, out = args.worker
        worker(int(sp), ckpt == "1", args.tokens, args.hidden, args.layers, Path(out))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ckpt in (False, True):
            for sp in (1, 2):
                out = Path(tmp) / f"{sp}-{int(ckpt)}.json"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node=2",
                        "-m",
                        "benchmarks.sp_memory",
                        "--tokens",
                        str(args.tokens),
                        "--hidden",
                        str(args.hidden),
                        "--layers",
                        str(args.layers),
                        "--worker",
                        str(sp),
                        str(int(ckpt)),
                        str(out),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows.append(json.loads(out.read_text()))
    print(
        f"one row of {args.tokens} tokens, Qwen2 hidden {args.hidden}, {args.layers} layers, 8/2 heads, "
        f"vocabulary 8192, fp32, 2 ranks"
    )
    print(
        "| activation checkpointing | sp | tokens per rank | peak rise per rank (MiB) | fwd+bwd (s) | "
        "log-prob sum per rank |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {'on' if r['checkpointing'] else 'off'} | {r['sp']} | {r['tokens'] // r['sp']} | "
            f"{' / '.join(f'{m:.0f}' for m in r['peak_rise_mib'])} | {r['seconds']:.1f} | "
            f"{' / '.join(f'{s:.3f}' for s in r['logprob_sum'])} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
