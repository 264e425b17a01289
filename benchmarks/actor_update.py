"""Actor update throughput on CPU: padded fixed micro-batches vs packed token-budget micro-batches,
fp32 vs bf16 compute, side by side in one run, on a ~20M-parameter Qwen2-shaped model and a skewed
response-length distribution (most responses short, a few long: what RL rollouts look like).

    python -m benchmarks.actor_update [--rows 16] [--reps 2] [--json OUT.json]

Tokens/s counts valid tokens (prompt + response) per second of ``Actor.update_policy`` wall time:
the padded variant computes on padding too, which is exactly the waste packing removes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import ActorConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement

__all__: list[str] = []  # a script: nothing here is imported elsewhere

MODEL = (
    "tiny://qwen2?vocab_size=24000&hidden_size=256&intermediate_size=1024&num_hidden_layers=8"
    "&num_attention_heads=4&num_key_value_heads=2"
)
P, R = 64, 192


def skewed_batch(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(32, P + 1, (rows,), generator=g)
    # 80% short (8-32 tokens), 20% long (128-192): a mean of ~50, a max of 192
    long = torch.rand(rows, generator=g) < 0.2
    rlen = torch.where(
        long, torch.randint(128, R + 1, (rows,), generator=g), torch.randint(8, 33, (rows,), generator=g)
    )
    prompts = [torch.randint(1, 24000, (int(n),), generator=g).tolist() for n in plen]
    resps = [torch.randint(1, 24000, (int(n),), generator=g).tolist() for n in rlen]
    b = make_padded_batch(prompts, resps, 0, P, R)
    b["advantages"] = torch.randn(rows, R, generator=g) * b["response_mask"]
    return b


def run_variant(batch, packed: bool, dtype: str, reps: int) -> dict:
    model = build_causal_lm(MODEL, torch.float32, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionConfig(param_dtype=dtype, reduce_dtype="float32")
    parallelize(
        model,
        build_train_mesh(torch.device("cpu"), 1, -1),
        FSDPConfig(fsdp_size=-1, mixed_precision=mp),
        torch.device("cpu"),
    )
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=packed,
        ppo_max_token_len_per_gpu=1024,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    actor = Actor(
        model,
        cfg,
        ActorSpec(
            remove_padding=packed,
            optimizer=build_optimizer(model, cfg.optim),
            placement=Placement(
                all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, torch.device("cpu"))
            ),
        ),
    )
    rows = batch["responses"].shape[0]
    lp, _ = actor.compute_log_prob(batch, 4, packed, 1024)
    batch = dict(batch, old_log_probs=lp)
    actor.update_policy(batch, rows)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        actor.update_policy(batch, rows)
        times.append(time.perf_counter() - t0)
    valid = int(batch["attention_mask"].sum())
    best = min(times)
    return {
        "batching": "packed+dynamic" if packed else "padded fixed",
        "dtype": dtype,
        "params_M": n_params / 1e6,
        "valid_tokens": valid,
        "computed_tokens": valid if packed else batch["input_ids"].numel(),
        "update_s": best,
        "tokens_per_s": valid / best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    batch = skewed_batch(args.rows)
    results = [
        run_variant(batch, packed, dtype, args.reps) for dtype in ("float32", "bfloat16") for packed in (False, True)
    ]
    base = results[0]["tokens_per_s"]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
        f"{args.rows} rows, {results[0]['valid_tokens']} valid tokens, "
        f"{batch['input_ids'].numel()} padded; best of {args.reps}"
    )
    print("| batching | compute dtype | params (M) | update (s) | valid tokens/s | vs padded fp32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['batching']} | {r['dtype']} | {r['params_M']:.1f} | {r['update_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
