"""Peak memory and time of log-probs from the LM head's logits, forward and backward, on CPU: a
full fp32 upcast (what the actor did first), fp32 chunks recomputed in backward by activation
checkpointing (what it did next), and ``algos.token_logprobs_chunked`` (fp32 chunks, the gradient
written out: ``algos._TokenLogProbs``).

    python -m benchmarks.logprob_memory [--tokens 8192] [--vocab 32000]

Each variant runs in a fresh process (peak resident memory, VmHWM, reset just before; glibc told to
return freed blocks with MALLOC_MMAP_THRESHOLD_=65536). The logits are bf16, as a bf16 model's head
gives them; the figure is the rise above the logits themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__: list[str] = []  # a script: nothing here is imported elsewhere

VARIANTS = ("full fp32 upcast", "fp32 chunks, checkpointed", "fp32 chunks, backward written out")


def checkpointed_chunks(logits, labels, temperature: float, chunk_size: int = 1024):
    """The chunked log-probs as they were before ``_TokenLogProbs``: each chunk's forward rerun in
    backward and differentiated by autograd."""
    # (imports torch: only the measuring child process needs it, as in run below)
    import torch
    from torch.utils.checkpoint import checkpoint

    from rlhf_hpc.ops import algos

    def chunk(z, y):
        return algos.logprobs_from_logits(z.float() / temperature, y)

    parts = [
        checkpoint(chunk, z, y, use_reentrant=False) for z, y in zip(logits.split(chunk_size), labels.split(chunk_size))
    ]
    return torch.cat(parts)


def run(variant: str, tokens: int, vocab: int) -> dict:
    # (imports torch: only the measuring child process needs it; the parent only starts children)
    import torch

    from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory
    from rlhf_hpc.ops import algos

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    reset_peak_memory(cpu)
    base = peak_memory_bytes(cpu)
    t0 = time.perf_counter()
    if variant == VARIANTS[0]:
        z = logits.float() / 0.7
        lp, ent = algos.logprobs_from_logits(z, labels), algos.entropy_from_logits_chunked(z.detach())
    elif variant == VARIANTS[1]:
        lp = checkpointed_chunks(logits, labels, 0.7)
        ent = algos.token_logprobs_chunked(logits.detach(), labels, 0.7, with_entropy=True)[1]
    else:
        lp, ent = algos.token_logprobs_chunked(logits, labels, 0.7, with_entropy=True, entropy_grad=False)
    lp.sum().backward()
    return {
        "variant": variant,
        "tokens": tokens,
        "vocab": vocab,
        "logits_mib": tokens * vocab * 2 / 2**20,
        "peak_rise_mib": (peak_memory_bytes(cpu) - base) / 2**20,
        "seconds": time.perf_counter() - t0,
        "logprob_sum": lp.sum().item(),
        "entropy_sum": ent.sum().item(),
        "grad_sum": logits.grad.float().abs().sum().item(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(run(args.variant, args.tokens, args.vocab)))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows = []
    for variant in VARIANTS:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.logprob_memory",
                "--variant",
                variant,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, bf16 logits {rows[0]['logits_mib']:.0f} MiB")
    print(
        "| variant | seconds (forward + backward) | peak rise (MiB) | x logits | sum of log-probs | "
        "sum of entropies | sum of abs gradient |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['variant']} | {r['seconds']:.2f} | {r['peak_rise_mib']:.0f} | "
            f"{r['peak_rise_mib'] / r['logits_mib']:.2f} | {r['logprob_sum']:.4f} | {r['entropy_sum']:.4f} | "
            f"{r['grad_sum']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
