"""Weight sync of a LoRA actor into vLLM: the adapter alone against the merged full weights, side by
side on the same actor and engine (one process, CPU).

    python -m benchmarks.lora_sync [--model DIR|tiny://...] [--rank 8] [--reps 5]

The actor is the model with a PEFT adapter (``target_modules: all-linear``, lora_B randomised so
the adapter changes the model); the engine is vLLM's CPU build with LoRA enabled. Per method: the
bytes moved (the tensors the stream yields, in the rollout dtype), the median time of a sync, and
the engine's log-probs of sampled continuations against the actor's (the sync is right). vLLM loads the
adapter at the next generate (not counted here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.lora import apply_lora, is_adapter
from rlhf_hpc.models.real_model import cache_dir
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout

__all__: list[str] = []  # a script: nothing here is imported elsewhere

FALLBACK = (
    "tiny://qwen2?vocab_size=50000&hidden_size=768&intermediate_size=2048&num_hidden_layers=12"
    "&num_attention_heads=12&num_key_value_heads=2&max_position_embeddings=2048"
)


def default_model() -> str:
    real = cache_dir() / "SmolLM2-135M-Instruct"
    return str(real) if (real / "config.json").is_file() else FALLBACK


def engine_vs_actor(engine, actor, vocab: int) -> float:
    """Max |engine - actor| log-prob over sampled continuations of a few fixed prompts."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (12,), generator=g).tolist() for _ in range(4)]
    out = engine.generate(prompts, Sampling(n=1, temperature=1.0, max_tokens=16, ignore_eos=True, seed=1))
    resps = [o[0].token_ids for o in out]
    batch = make_padded_batch(prompts, resps, 0, 12, 16)
    with torch.no_grad():
        lp = per_token_logprobs(actor, batch)[0]
    engine_lp = torch.zeros_like(lp)
    for i, o in enumerate(out):
        engine_lp[i, : len(o[0].logprobs)] = torch.tensor(o[0].logprobs)
    return (lp - engine_lp)[batch["response_mask"].bool()].abs().max().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    cfg, _ = load_config(
        "tiny_klppo",
        [
            f"actor_rollout_ref.model.path={args.model}",
            "trainer.n_gpus_per_node=1",
            f"actor_rollout_ref.model.lora_rank={args.rank}",
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.rollout.name=vllm",
            "data.max_prompt_length=12",
            "data.max_response_length=16",
        ],
        check_files=False,
    )
    mcfg = cfg.actor_rollout_ref.model
    actor = apply_lora(build_causal_lm(args.model, torch.float32, seed=0), mcfg, seed=1)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    engine = make_engine(cfg, args.model, torch.device("cpu"))
    bucket = cfg.actor_rollout_ref.rollout.update_weights_bucket_mb

    rows = []
    for label, adapter_only in (("merged full weights", False), ("adapter only", True)):
        if adapter_only:
            sync_weights_to_rollout(actor, engine, torch.float32, bucket)  # the base goes in once
        times, moved = [], 0.0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            moved = sync_weights_to_rollout(actor, engine, torch.float32, bucket, adapter_only=adapter_only)[
                "rollout/weight_sync_mib"
            ]
            times.append(time.perf_counter() - t0)
        rows.append((label, moved, statistics.median(times), engine_vs_actor(engine, actor, actor.config.vocab_size)))
    n_params = sum(p.numel() for p in actor.parameters())
    n_adapter = sum(p.numel() for n, p in actor.named_parameters() if is_adapter(n))
    print(
        f"model {args.model}: {n_params / 1e6:.1f}M parameters, LoRA rank {args.rank} on all linear layers: "
        f"{n_adapter / 1e6:.2f}M adapter parameters; fp32; median of {args.reps}"
    )
    print("| sync | MiB moved per sync | seconds per sync | max abs(engine - actor) log-prob |")
    print("| --- | --- | --- | --- |")
    for label, mib, sec, diff in rows:
        print(f"| {label} | {mib:.1f} | {sec:.3f} | {diff:.2e} |")
    full, adapter = rows[0], rows[1]
    print(f"adapter only: {full[1] / adapter[1]:.0f}x fewer bytes, {full[2] / adapter[2]:.1f}x faster")
    engine.close()


if __name__ == "__main__":
    main()
