"""How fast one host core multiplies the matrices of the issue-19 workload, fp32 against bf16: the
floor under any trainer's step on the CPU.

    python -m benchmarks.matmul_rate [--tokens 464] [--threads 1]

The shapes are one micro-batch of the ``ppo_step`` workload (8 rows x 58 tokens = 464 tokens per
rank) through the Qwen2-shaped model of hidden 512, intermediate 1408, 2 KV heads of 64, vocabulary
8000: the attention projections, the MLP and the output head, forward (``x @ W.T``) and the two
products of its backward (``dY @ W`` and ``dY.T @ x``). Each rate is the best of 5 timings of 20
calls. A CPU without native bf16 (AVX512-BF16 or AMX) runs bf16 far slower than fp32.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.ppo_step import model_shape

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of each kind of weight matrix of the ``ppo_step`` workload's model."""
    m = model_shape()
    hidden, kv = m["hidden_size"], m["num_key_value_heads"] * m["hidden_size"] // m["num_attention_heads"]
    return {
        "q/o projection": (hidden, hidden),
        "k/v projection": (kv, hidden),
        "MLP up/gate": (m["intermediate_size"], hidden),
        "MLP down": (hidden, m["intermediate_size"]),
        "output head": (m["vocab_size"], hidden),
    }


def rate(fn, flops: float, calls: int = 20) -> float:
    """GFLOP/s of ``fn`` (best of 5 timings of ``calls`` calls, after a warm-up)."""
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return flops / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=464)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.tokens
    print(f"GFLOP/s on {args.threads} thread(s), {n} tokens (forward / backward dY@W / backward dY.T@x)")
    print("| matrix (out x in) | fp32 | bf16 | bf16 / fp32 |")
    print("| --- | --- | --- | --- |")
    totals = {torch.float32: [0.0, 0.0], torch.bfloat16: [0.0, 0.0]}  # flops, seconds
    figures = {}
    for name, (out_f, in_f) in shapes().items():
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(n, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype)
            dy = torch.randn(n, out_f, dtype=dtype)
            flops = 2.0 * n * in_f * out_f
            rates = [
                rate(lambda: torch.nn.functional.linear(x, w), flops),
                rate(lambda: dy @ w, flops),
                rate(lambda: dy.t() @ x, flops),
            ]
            figures[name, dtype] = rates
            totals[dtype][0] += 3 * flops
            totals[dtype][1] += sum(flops / r / 1e9 for r in rates)
        f32, b16 = figures[name, torch.float32], figures[name, torch.bfloat16]
        print(
            f"| {name} ({out_f} x {in_f}) | "
            + " / ".join(f"{r:.0f}" for r in f32)
            + " | "
            + " / ".join(f"{r:.0f}" for r in b16)
            + f" | {sum(b16) / sum(f32):.2f}x |"
        )
    f32, b16 = (totals[d][0] / totals[d][1] / 1e9 for d in (torch.float32, torch.bfloat16))
    print(f"all of them, weighted by their FLOPs: fp32 {f32:.0f} GFLOP/s, bf16 {b16:.0f} GFLOP/s ({b16 / f32:.2f}x)")


if __name__ == "__main__":
    main()
