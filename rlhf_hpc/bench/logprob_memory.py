"""Peak memory of log-probs from the LM head's logits: a full fp32 upcast (what the actor did
before) vs fp32 in chunks (``algos.token_logprobs_chunked``), forward and backward, on CPU.

    python -m rlhf_hpc.bench.logprob_memory [--tokens 8192] [--vocab 32000]

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

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def run(variant: str, tokens: int, vocab: int) -> dict:
    # (imports torch: only the measuring child process needs it; the parent only starts children)
    import torch
    from rlhf_hpc.ops import algos
    from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    reset_peak_memory(cpu)
    base = peak_memory_bytes(cpu)
    if variant == "full fp32 upcast":
        z = logits.float() / 0.7
        lp, ent = algos.logprobs_from_logits(z, labels), algos.entropy_from_logits_chunked(z.detach())
    else:
        lp, ent = algos.token_logprobs_chunked(logits, labels, 0.7, with_entropy=True, entropy_grad=False)
    lp.sum().backward()
    return {"variant": variant, "tokens": tokens, "vocab": vocab, "logits_mib": tokens * vocab * 2 / 2**20,
            "peak_rise_mib": (peak_memory_bytes(cpu) - base) / 2**20, "logprob_sum": lp.sum().item(),
            "entropy_sum": ent.sum().item()}


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
    for variant in ("full fp32 upcast", "fp32 chunks of 1024"):
        out = subprocess.run([sys.executable, "-m", "rlhf_hpc.bench.logprob_memory", "--variant", variant,
                              "--tokens", str(args.tokens), "--vocab", str(args.vocab)],
                             env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, bf16 logits {rows[0]['logits_mib']:.0f} MiB")
    print("| variant | peak rise (MiB) | x logits | sum of log-probs | sum of entropies |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_rise_mib']:.0f} | {r['peak_rise_mib'] / r['logits_mib']:.2f} | "
              f"{r['logprob_sum']:.4f} | {r['entropy_sum']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
