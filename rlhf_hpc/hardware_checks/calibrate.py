"""Measures this machine's CPU figures for the time plan (rlhf_hpc.planning.hardware, preset ``cpu``)
and writes them, atomically, where the plan reads them (``~/.cache/rlhf-hpc/calibration/cpu.json``, or ``--out``).

    python -m rlhf_hpc.hardware_checks.calibrate [--ranks 2] [--out PATH] [--skip-vllm]

Re-launches itself under torchrun (gloo), one thread per rank, every rank measuring at once (as a
run's ranks share the machine):

  fp32_tflops / bf16_tflops,   what the project's log-prob pass reaches through 2 decoder layers of
    backward_ratio(_fp32)      SmolLM2's shape (model FLOPs / s: matmuls, norms, attention, all of it),
                               and its backward's time over its forward's
  hbm_gb_s                     a + b into c over 64 MiB tensors (bytes read and written per second)
  layer_overhead_s,            the project's log-prob pass (packed rows, the head on response tokens)
    pass_overhead_s            of 32 tokens through a hidden-64 Qwen2: the time per layer (1 vs 5
                               layers) and per pass beside it
  routed_layer_overhead_s,     a routed (mixture-of-experts) layer's forward beside a dense one's,
    expert_overhead_s,         16 rows of 8 tokens, hidden 64: a fixed part per layer, a part per
    routed_token_overhead_s    expert reached and one per (token, expert) pair (4 and 64 experts,
                               2 and 8 per token, 1 vs 5 layers)
  host_adam_params_s           AdamW (foreach) parameters per second
  collective_latency_s,        gloo all-reduce of one float, and of 16 MiB (bus bandwidth
    intra_node_gb_s            2 (n-1)/n x bytes / s); inter_node_gb_s is the same (one machine)
  disk_gb_s                    a 256 MiB file written and fsync'ed in the cache directory
  decode_step_overhead_s,      vLLM's CPU engine on a model too small to cost anything but its
    request_overhead_s,        overheads: per decode step, request and generate call (1 request of
    generate_overhead_s,       8 and of 64 new tokens, 16 requests of 8), per weight sync (resume,
    sync_overhead_s,           then sync_weights_to_rollout from the FSDP-wrapped model), per
    sync_param_overhead_s,     parameter it gathers and per checkpoint tensor it sends (2 vs 10
    sync_tensor_overhead_s     layers: 27 vs 123 of both; a 64-expert Qwen3-MoE: 25 and 405)
  engine_load_gb_s,            the 19.5M-parameter bench model in an fp32 engine: the bytes per
    prefill_*_tflops,          second its weight sync takes in beyond that; in an fp32 and a bf16
    decode_*_tflops            engine, the FLOP/s of its prefill (16 prompts of 64 tokens) and
                               decode (32 tokens more) beyond its overheads
  cast_gb_s                    fp32 -> bf16 copies (a bf16 engine's weight sync), source bytes per second
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import build_train_mesh
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.planning.hardware import calibration_path, write_calibration
from rlhf_hpc.planning.sizing import forward_flops, model_shape
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout

__all__ = ["best_time", "log_prob_pass", "main", "replicated"]  # main: launch.py calibrate; the rest: benchmarks/

BENCH_MODEL = (
    "tiny://qwen2?hidden_size=512&num_hidden_layers=4&num_attention_heads=8&num_key_value_heads=2"
    "&intermediate_size=1408&vocab_size=8000"
)
DECODER = (
    "tiny://qwen2?vocab_size=64&hidden_size=576&intermediate_size=1536&num_hidden_layers=2"
    "&num_attention_heads=9&num_key_value_heads=3"
)  # SmolLM2-135M's layer shape


def best_time(fn, calls: int = 5, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def memory_gb_s() -> float:
    a, b = torch.randn(16 * 2**20), torch.randn(16 * 2**20)
    c = torch.empty_like(a)
    return 3 * a.numel() * 4 / best_time(lambda: torch.add(a, b, out=c), calls=3) / 1e9


def replicated(model):
    """``model`` wrapped as the trainer wraps a small model (FSDP2, replicated over the ranks)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"
    parallelize(
        model,
        build_train_mesh(torch.device("cpu"), world, 1),
        FSDPConfig(fsdp_size=1, reshard_after_forward=False, mixed_precision=MixedPrecisionConfig(param_dtype=dtype)),
        torch.device("cpu"),
    )
    return model


def log_prob_pass(model, batch, grad: bool = False):
    if not grad:
        with torch.no_grad():
            return per_token_logprobs(model, batch, 1.0, True, True)
    lp, _ = per_token_logprobs(model, batch, 1.0, True, False)
    lp.sum().backward()


def together() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def decoder_rates() -> dict[str, float]:
    """What a decoder's forward reaches per dtype (model FLOPs / s, the project's log-prob pass over
    8 packed rows of 32 + 32 tokens through 2 layers of SmolLM2's shape, FSDP-wrapped as the
    trainer's), and its backward's time over its forward's."""
    batch = make_padded_batch([list(range(1, 33))] * 8, [list(range(1, 33))] * 8, 0, 32, 32)
    flops = forward_flops(model_shape(DECODER), 512, 64, 256, 64)
    out = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = replicated(build_causal_lm(DECODER, dtype))
        # the ranks start each timing together (as a run's ranks compute together), and the best of
        # 10: one burst of another process on a 2-core VM read the bf16 rate 20% low with 5
        together()
        forward = best_time(lambda: log_prob_pass(model, batch), calls=2, repeat=10)
        together()
        both = best_time(lambda: log_prob_pass(model, batch, grad=True), calls=2, repeat=10)
        out[f"{name}_tflops"] = flops / forward / 1e12
        out["backward_ratio" + ("_fp32" if name == "fp32" else "")] = max(both - forward, 0.0) / forward
    return out


def pass_overheads() -> tuple[float, float]:
    """(seconds per decoder layer, seconds per pass beside the layers) of the project's own
    log-prob pass (packed rows, the head on response tokens) through an FSDP-wrapped (replicated)
    near-FLOP-free model: 4 rows of 6 + 2 tokens, hidden 64, 1 vs 5 layers."""
    batch = make_padded_batch([[1, 2, 3, 4, 5, 6]] * 4, [[7, 8]] * 4, 0, 6, 2)
    times = {}
    for layers in (1, 5):
        model = replicated(
            build_causal_lm(
                f"tiny://qwen2?vocab_size=64&hidden_size=64&num_hidden_layers={layers}"
                f"&num_attention_heads=4&num_key_value_heads=2&intermediate_size=128",
                torch.float32,
            )
        )
        times[layers] = best_time(lambda: log_prob_pass(model, batch), calls=20)
    per_layer = max((times[5] - times[1]) / 4, 1e-6)
    return per_layer, max(times[1] - per_layer, 1e-6)


def routed_overheads() -> dict[str, float]:
    """A routed layer's forward beside a dense one's, in the project's log-prob pass (16 rows of 6
    + 2 tokens through near-FLOP-free Qwen3 layers, hidden 64, 1 vs 5 layers): the seconds per
    layer of the dense layer, of 4 experts and of 64, 2 per token (every expert reached), and of 64
    with 8 per token, solved for a fixed part per layer, a part per expert and one per (token,
    expert) pair."""
    tokens, batch = 16 * 8, make_padded_batch([[1, 2, 3, 4, 5, 6]] * 16, [[7, 8]] * 16, 0, 6, 2)
    per_layer, reached = {}, {}
    for experts, k in ((0, 0), (4, 2), (64, 2), (64, 8)):
        path = ROUTED_LAYER.format(experts=experts, k=k, layers="{layers}") if experts else DENSE_LAYER
        times = {}
        for layers in (1, 5):
            model = replicated(build_causal_lm(path.format(layers=layers), torch.float32))
            log_prob_pass(model, batch)  # (a first call's set-up: the grouped matmul's first use)
            times[layers] = best_time(lambda: log_prob_pass(model, batch), calls=20)
        per_layer[experts, k] = (times[5] - times[1]) / 4
        reached[experts, k] = model_shape(path.format(layers=1)).touched_experts(tokens)
    per_pair = max((per_layer[64, 8] - per_layer[64, 2]) / (tokens * 6), 0.0)
    per_expert = max((per_layer[64, 2] - per_layer[4, 2]) / (reached[64, 2] - reached[4, 2]), 0.0)
    fixed = per_layer[4, 2] - per_layer[0, 0] - reached[4, 2] * per_expert - tokens * 2 * per_pair
    return {
        "routed_layer_overhead_s": max(fixed, 0.0),
        "expert_overhead_s": per_expert,
        "routed_token_overhead_s": per_pair,
    }


def adam_params_s() -> float:
    params = [torch.nn.Parameter(torch.randn(2**20)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    return 8 * 2**20 / best_time(opt.step, calls=2, repeat=3)


def collectives(world: int) -> tuple[float, float]:
    """(seconds per small all-reduce, bus GB/s of a 16 MiB one) over gloo."""
    import torch.distributed as dist

    one, big = torch.ones(1), torch.ones(4 * 2**20)

    def timed(t, n):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter() - t0) / n

    timed(one, 5)
    latency = min(timed(one, 50) for _ in range(3))
    timed(big, 1)
    seconds = min(timed(big, 3) for _ in range(3))
    return latency, 2 * (world - 1) / world * big.numel() * 4 / seconds / 1e9


def disk_gb_s(where: Path) -> float:
    where.mkdir(parents=True, exist_ok=True)
    data = os.urandom(2**20) * 256
    with tempfile.NamedTemporaryFile(dir=where) as f:
        t0 = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return len(data) / (time.perf_counter() - t0) / 1e9


TINY_ENGINE_MODEL = (
    "tiny://qwen2?vocab_size=64"  # the demo's model, 2 layers (vLLM's CPU attention needs head_dim >= 32)
)
DEEP_ENGINE_MODEL = "tiny://qwen2?vocab_size=64&num_hidden_layers=10"  # the same, 10 layers
ROUTED_ENGINE_MODEL = "tiny://qwen3_moe?vocab_size=64&num_experts=64&num_experts_per_tok=4"  # 2 layers, 64 experts
# near-FLOP-free Qwen3 layers, dense and routed (a token's experts as wide as the dense MLP)
_QWEN3_LAYER = "vocab_size=64&hidden_size=64&num_attention_heads=4&num_key_value_heads=2&head_dim=16"
DENSE_LAYER = f"tiny://qwen3?{_QWEN3_LAYER}&intermediate_size=64&num_hidden_layers={{layers}}"
ROUTED_LAYER = (
    f"tiny://qwen3_moe?{_QWEN3_LAYER}&moe_intermediate_size=32&num_experts={{experts}}"
    f"&num_experts_per_tok={{k}}&num_hidden_layers={{layers}}"
)


def engine_figures() -> dict[str, float]:
    """vLLM's CPU engine, as the trainer drives it. A model too small to cost anything else: the
    overheads per decode step, request and generate call (1 request of 8 and of 64 new tokens, 16
    requests of 8) and per weight sync (resume, then sync_weights_to_rollout from the FSDP-wrapped
    model). The 19.5M-parameter bench model: the bytes per second its weight sync takes in beyond
    that (fp32 engine), and the FLOP/s of its prefill and decode beyond the overheads (fp32 and bf16
    engines)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out, syncs = {}, {}
    # (wrapped before any engine starts: closing one takes the process group down with it)
    models = {
        path: replicated(build_causal_lm(path, torch.float32, seed=0))
        for path in (TINY_ENGINE_MODEL, DEEP_ENGINE_MODEL, ROUTED_ENGINE_MODEL, BENCH_MODEL)
    }
    prompt = [list(range(1, 27))]
    for path, dtype in (
        (TINY_ENGINE_MODEL, "float32"),
        (DEEP_ENGINE_MODEL, "float32"),
        (ROUTED_ENGINE_MODEL, "float32"),
        (BENCH_MODEL, "float32"),
        (BENCH_MODEL, "bfloat16"),
    ):  # (bf16: the engine's bf16 rates)
        model = models[path]
        cfg, _ = load_config(
            "tiny_klppo",
            [
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.dtype={dtype}",
                f"trainer.n_gpus_per_node={world}",
                "data.max_prompt_length=64",
                "data.max_response_length=64",
            ],
        )
        engine = make_engine(cfg, path, torch.device("cpu"))
        try:

            def sync():  # the trainer's weight sync phase
                engine.resume()
                sync_weights_to_rollout(
                    model, engine, getattr(torch, dtype), cfg.actor_rollout_ref.rollout.update_weights_bucket_mb
                )

            if dtype == "float32":
                syncs[path, dtype] = best_time(sync, calls=1, repeat=3)
            else:
                sync()  # (the engine's weights, for its generation below)
            if path in (DEEP_ENGINE_MODEL, ROUTED_ENGINE_MODEL):
                continue

            def gen(rows, tokens):
                return best_time(
                    lambda: engine.generate(prompt * rows, Sampling(max_tokens=tokens, ignore_eos=True)),
                    calls=1,
                    repeat=3,
                )

            gen(1, 4)
            if path == TINY_ENGINE_MODEL:
                t_short, t_long, t_wide = gen(1, 8), gen(1, 64), gen(16, 8)
                out["decode_step_overhead_s"] = max((t_long - t_short) / 56, 1e-6)
                out["request_overhead_s"] = max((t_wide - t_short) / 15, 1e-6)
                out["generate_overhead_s"] = max(
                    t_short - 8 * out["decode_step_overhead_s"] - out["request_overhead_s"], 1e-6
                )
                continue
            # 16 prompts of 64 tokens: one new token (the prefill), then 32 more (the decode)
            # (distinct prompts, new ones each call: vLLM's prefix cache would skip the prefill of a prompt it saw)
            shape, calls = model_shape(path), out["generate_overhead_s"] + 16 * out["request_overhead_s"]
            fresh = iter(range(10**6))

            def prompts():
                return [
                    torch.randint(1, 8000, (64,), generator=torch.Generator().manual_seed(next(fresh))).tolist()
                    for _ in range(16)
                ]

            t_prefill = best_time(
                lambda: engine.generate(prompts(), Sampling(max_tokens=1, ignore_eos=True)), calls=1, repeat=3
            )
            t_all = best_time(
                lambda: engine.generate(prompts(), Sampling(max_tokens=33, ignore_eos=True)), calls=1, repeat=3
            )
            name = "fp32" if dtype == "float32" else "bf16"
            prefill = forward_flops(shape, 16 * 64, 64, 16, shape.vocab)
            out[f"prefill_{name}_tflops"] = (
                prefill / max(t_prefill - calls - out["decode_step_overhead_s"], 1e-6) / 1e12
            )
            decode = 32 * forward_flops(shape, 16, 80, 16, shape.vocab)
            out[f"decode_{name}_tflops"] = (
                decode / max(t_all - t_prefill - 32 * out["decode_step_overhead_s"], 1e-6) / 1e12
            )
        finally:
            engine.close()
    n = sum(p.numel() for p in models[BENCH_MODEL].parameters())
    # per sync, per parameter gathered, per checkpoint tensor sent: the dense models send their
    # parameters as they are (2 vs 10 layers: both), the routed one 384 expert matrices of 4 parameters
    params = {path: model_shape(path).param_tensors for path in models}
    tensors = {path: model_shape(path).checkpoint_tensors for path in models}
    t = {path: syncs[path, "float32"] for path in (TINY_ENGINE_MODEL, DEEP_ENGINE_MODEL, ROUTED_ENGINE_MODEL)}
    both = (t[DEEP_ENGINE_MODEL] - t[TINY_ENGINE_MODEL]) / (tensors[DEEP_ENGINE_MODEL] - tensors[TINY_ENGINE_MODEL])
    both = max(both, 0.0)
    fewer = params[TINY_ENGINE_MODEL] - params[ROUTED_ENGINE_MODEL]  # (its fused experts: 2 a layer)
    more = tensors[ROUTED_ENGINE_MODEL] - tensors[TINY_ENGINE_MODEL]
    per_tensor = min(max((t[ROUTED_ENGINE_MODEL] - t[TINY_ENGINE_MODEL] + fewer * both) / (more + fewer), 0.0), both)
    out["sync_tensor_overhead_s"], out["sync_param_overhead_s"] = per_tensor, both - per_tensor
    out["sync_overhead_s"] = max(t[TINY_ENGINE_MODEL] - tensors[TINY_ENGINE_MODEL] * both, 1e-6)
    overhead = out["sync_overhead_s"] + tensors[BENCH_MODEL] * both  # (dense: a tensor per parameter)
    out["engine_load_gb_s"] = n * 4 / max(syncs[BENCH_MODEL, "float32"] - overhead, 1e-6) / 1e9
    return out


def cast_gb_s() -> float:
    """fp32 -> bf16 copies (what a bf16 engine's weight sync does to each gathered tensor), source
    bytes per second."""
    a = torch.randn(16 * 2**20)
    return a.numel() * 4 / best_time(lambda: a.to(torch.bfloat16, copy=True), calls=3) / 1e9


def worker(out: Path, skip_vllm: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    fig = {**decoder_rates(), "hbm_gb_s": memory_gb_s(), "cast_gb_s": cast_gb_s()}
    fig["layer_overhead_s"], fig["pass_overhead_s"] = pass_overheads()
    fig.update(routed_overheads())
    fig["host_adam_params_s"] = adam_params_s()
    fig["collective_latency_s"], fig["intra_node_gb_s"] = collectives(world)
    fig["inter_node_gb_s"] = fig["intra_node_gb_s"]
    fig["host_link_gb_s"] = fig["hbm_gb_s"]  # "offloading" on a CPU is a copy in the same memory
    if rank == 0:
        fig["disk_gb_s"] = disk_gb_s(out.parent)
    # the slowest rank's figure: a step waits for it
    gathered = [None] * world
    dist.all_gather_object(gathered, fig)
    if rank == 0:
        merged = {}
        for k in fig:
            values = [g[k] for g in gathered if k in g]
            slow_is_small = not k.endswith("_s") or k.endswith("gb_s") or k.endswith("params_s")
            merged[k] = min(values) if slow_is_small else max(values)
        merged["disk_gb_s"] = fig["disk_gb_s"]
    dist.barrier()
    if not skip_vllm:  # every rank runs its engine at once, as in a run (vLLM takes the process group over)
        engine = engine_figures()
        if rank == 0:
            merged.update(engine)
    if rank == 0:
        merged["measured"] = {
            "ranks": world,
            "threads_per_rank": 1,
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        try:  # atomically, as the plan reads it: a launch reading meanwhile sees the old file or this one
            write_calibration(out, merged)
        except ConfigError as e:  # a figure the plan would refuse: nothing is written
            print(f"error: {e}", file=sys.stderr)
            failed = True
        else:
            print(f"CPU figures per rank ({world} ranks x 1 thread, all measuring at once), written to {out}:")
            print("| figure | value |\n| --- | --- |")
            for k, v in merged.items():
                if k != "measured":
                    print(f"| {k} | {v:.4g} |")
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        sys.exit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=None, help=f"default {calibration_path()}")
    ap.add_argument("--skip-vllm", action="store_true", help="keep the engine figures' defaults")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out).expanduser() if args.out else calibration_path()
    if args.worker:
        worker(out, args.skip_vllm)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        "-m",
        "rlhf_hpc.hardware_checks.calibrate",
        "--worker",
        "--out",
        str(out),
    ] + (["--skip-vllm"] if args.skip_vllm else [])
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
