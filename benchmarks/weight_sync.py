"""Weight sync FSDP2 actor -> rollout engine, four ways, side by side; then vllm vs hf generation.

    python -m benchmarks.weight_sync [--nproc 4] [--skip-generate]

Re-launches itself under torchrun (gloo, CPU) with MALLOC_MMAP_THRESHOLD_=65536 so freed memory
goes back to the OS and the peak resident memory (VmHWM) of each rank measures what a method
really holds. A ~150M-parameter Qwen2-shaped model is sharded over all ranks (FULL_SHARD); the
consumer is the hf engine's in-place copy (its own weights allocated before measuring):

  full state dict   get_model_state_dict(full_state_dict=True) on every rank, then load it all
  per-parameter     p.full_tensor() one parameter at a time
  bucketed S MiB    rlhf_hpc.rollout.weight_sync.stream_full_params (async all-gathers of the next bucket
                    in flight while this one is copied)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from rlhf_hpc.config.schema import FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import build_train_mesh
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory, rss_bytes
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import stream_full_params

__all__: list[str] = []  # a script: nothing here is imported elsewhere

MODEL = (
    "tiny://qwen2?vocab_size=50000&hidden_size=768&intermediate_size=2048&num_hidden_layers=12"
    "&num_attention_heads=12&num_key_value_heads=2&max_position_embeddings=2048"
)


def relaunch(args) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "benchmarks.weight_sync",
        "--worker",
    ] + (["--skip-generate"] if args.skip_generate else [])
    sys.exit(subprocess.call(cmd, env=env))


# One function on purpose (96 lines): the four sync methods and the two engines run in sequence on
# the same model and engine, and reading it top to bottom is reading the benchmark's protocol.
def worker(skip_generate: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    model = build_causal_lm(MODEL, torch.float32, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4
    parallelize(
        model,
        build_train_mesh(cpu, world, -1),
        FSDPConfig(fsdp_size=-1, mixed_precision=MixedPrecisionConfig(param_dtype="float32")),
        cpu,
    )
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.dtype=float32",
            f"trainer.n_gpus_per_node={world}",
            "data.max_prompt_length=64",
            "data.max_response_length=64",
        ],
    )
    hf = make_engine(cfg, MODEL, cpu)

    def full_state_dict():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        return iter(list(sd.items()))

    def per_parameter():
        for name, p in model.named_parameters():
            yield name, p.full_tensor()

    methods = {
        "full state dict": full_state_dict,
        "per-parameter full_tensor": per_parameter,
        "bucketed 16 MiB": lambda: stream_full_params(model, torch.float32, 16),
        "bucketed 256 MiB": lambda: stream_full_params(model, torch.float32, 256),
    }
    rows = []
    for name, make in methods.items():
        times, rises = [], []
        for _ in range(2):
            dist.barrier()
            base = rss_bytes()
            reset_peak_memory(cpu)
            t0 = time.perf_counter()
            hf.update_weights(make())
            dist.barrier()
            times.append(time.perf_counter() - t0)
            rises.append(peak_memory_bytes(cpu) - base)
        rise = torch.tensor([float(max(rises))])
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)
        rows.append({"method": name, "time_s": min(times), "peak_rise_mib_max_rank": rise.item() / 2**20})

    gen = []
    if not skip_generate:
        g = torch.Generator().manual_seed(rank)
        prompts = [torch.randint(1, 50000, (32,), generator=g).tolist() for _ in range(8)]
        sampling = Sampling(n=1, temperature=1.0, max_tokens=64, ignore_eos=True)
        engines = [("hf", hf)]
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            cfg.actor_rollout_ref.rollout.name = "vllm"
            engines.append(("vllm", make_engine(cfg, MODEL, cpu)))
        for ename, engine in engines:
            engine.update_weights(stream_full_params(model, torch.float32, 64))
            engine.generate(prompts[:1], Sampling(max_tokens=4, ignore_eos=True))  # warm-up
            dist.barrier()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sampling)
            dist.barrier()
            dt = time.perf_counter() - t0
            tokens = torch.tensor([float(sum(len(r.token_ids) for grp in outs for r in grp))])
            dist.all_reduce(tokens)
            gen.append(
                {"engine": ename, "tokens": int(tokens.item()), "time_s": dt, "tokens_per_s": tokens.item() / dt}
            )
        closers = [e for _, e in engines]
    if rank == 0:
        print(
            f"{n_params / 1e6:.1f}M params, largest tensor {largest / 2**20:.0f} MiB (fp32), model "
            f"{n_params * 4 / 2**20:.0f} MiB (fp32), {world} ranks (gloo, CPU)"
        )
        print("| method | sync time (s) | peak RSS rise, max over ranks (MiB) |")
        print("| --- | --- | --- |")
        for r in rows:
            print(f"| {r['method']} | {r['time_s']:.2f} | {r['peak_rise_mib_max_rank']:.0f} |")
        if gen:
            print(f"\nrollout: {world} ranks x 8 prompts of 32 tokens, 64 new tokens each, fp32, sampling")
            print("| engine | tokens | time (s) | tokens/s (all ranks) |")
            print("| --- | --- | --- | --- |")
            for r in gen:
                print(f"| {r['engine']} | {r['tokens']} | {r['time_s']:.2f} | {r['tokens_per_s']:.0f} |")
        print(json.dumps({"sync": rows, "generate": gen}))
    dist.barrier()
    if not skip_generate:
        for e in reversed(closers):
            e.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.skip_generate)
    else:
        relaunch(args)


if __name__ == "__main__":
    main()
