"""The memory plan's training-phase estimate against measured peaks on CPU.

    python -m benchmarks.memory_plan_check [--json OUT.json]

For each case a fresh process (1 rank, gloo, FSDP2 over a 1-rank mesh, fp32) builds the actor,
its AdamW optimizer and runs two ``Actor.update_policy`` steps (the second with the optimizer state
alive, as in every later step; one mini-batch = one micro-batch of full-length rows, so the plan's
"rows x (prompt + response)" is exact). Measured: the rise of the
process's peak resident memory (VmHWM, reset through /proc/self/clear_refs; glibc told to return
freed blocks to the OS with MALLOC_MMAP_THRESHOLD_=65536) from just before the model is built to
the end of the step. Estimated: ``memory_plan.update_bytes`` for the same shapes (what the plan's
update_actor phase adds per GPU). RSS counts whole pages and the allocator's slack, and the plan
ignores small tensors (masks, indices, the batch): the check reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

from rlhf_hpc.config.schema import ActorConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory, rss_bytes
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.planning.memory_plan import update_bytes
from rlhf_hpc.planning.sizing import model_shape
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement

__all__: list[str] = []  # a script: nothing here is imported elsewhere

CASES = [  # (name, model, rows, prompt length, response length, gradient checkpointing)
    ("tiny", "tiny://qwen2", 8, 64, 192, False),
    (
        "small",
        "tiny://qwen2?vocab_size=8000&hidden_size=512&intermediate_size=1408&num_hidden_layers=4"
        "&num_attention_heads=8&num_key_value_heads=2",
        8,
        64,
        192,
        False,
    ),
    (
        "small+ckpt",
        "tiny://qwen2?vocab_size=8000&hidden_size=512&intermediate_size=1408&num_hidden_layers=4"
        "&num_attention_heads=8&num_key_value_heads=2",
        8,
        64,
        192,
        True,
    ),
    (
        "wide-vocab",
        "tiny://qwen2?vocab_size=32000&hidden_size=256&intermediate_size=1024&num_hidden_layers=4"
        "&num_attention_heads=4&num_key_value_heads=2",
        16,
        32,
        96,
        False,
    ),
    (
        "deep+ckpt",
        "tiny://qwen2?vocab_size=4000&hidden_size=384&intermediate_size=1024&num_hidden_layers=12"
        "&num_attention_heads=6&num_key_value_heads=2",
        16,
        64,
        192,
        True,
    ),
]


def measure(name: str) -> dict:
    """Run in a child process: one update step of ``name``; measured and estimated bytes."""
    import torch
    import torch.distributed as dist

    _, path, rows, P, R, recompute = next(c for c in CASES if c[0] == name)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    shape = model_shape(path)
    batch = make_padded_batch(
        [torch.randint(1, shape.vocab, (P,), generator=g).tolist() for _ in range(rows)],
        [torch.randint(1, shape.vocab, (R,), generator=g).tolist() for _ in range(rows)],
        0,
        P,
        R,
    )
    batch["advantages"] = torch.randn(rows, R, generator=g)
    batch["old_log_probs"] = -torch.rand(rows, R, generator=g) * 5
    fsdp = FSDPConfig(fsdp_size=-1, mixed_precision=MixedPrecisionConfig(param_dtype="float32"))
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=rows, clip_ratio_low=0.2, clip_ratio_high=0.2)

    base = rss_bytes()
    reset_peak_memory(cpu)  # VmHWM := VmRSS
    model = build_causal_lm(path, torch.float32, seed=0)
    parallelize(model, build_train_mesh(cpu, 1, -1), fsdp, cpu, gradient_checkpointing=recompute)
    actor = Actor(
        model,
        cfg,
        ActorSpec(
            optimizer=build_optimizer(model, cfg.optim),
            placement=Placement(all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, cpu)),
        ),
    )
    for _ in range(2):  # the second step runs with the optimizer state alive, as every later one
        actor.update_policy(batch, rows)
    measured = peak_memory_bytes(cpu) - base
    estimate = update_bytes(shape, shape.params, fsdp, 1, rows * (P + R), rows * R, recompute, shape.vocab)
    dist.destroy_process_group()
    return {
        "case": name,
        "params": shape.params,
        "tokens": rows * (P + R),
        "checkpointing": recompute,
        "measured_mib": measured / 2**20,
        "estimated_mib": sum(estimate.values()) / 2**20,
        "estimate_parts_mib": {k: v / 2**20 for k, v in estimate.items()},
    }


def run_case(name: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS="1",
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_plan_check", "--case", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"case {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process's case
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(measure(args.case)))
        return 0
    results = []
    print(f"{'case':<12}{'params':>10}{'tokens':>8}  {'measured MiB':>12}  {'estimated MiB':>13}  ratio")
    for name in args.cases.split(","):
        r = run_case(name)
        r["ratio"] = r["estimated_mib"] / r["measured_mib"]
        results.append(r)
        print(
            f"{name:<12}{r['params'] / 1e6:>9.1f}M{r['tokens']:>8}  {r['measured_mib']:>12.1f}  "
            f"{r['estimated_mib']:>13.1f}  {r['ratio']:.2f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
