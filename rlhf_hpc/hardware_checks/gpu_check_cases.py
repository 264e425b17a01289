"""The GPU readiness check's cases (``rlhf_hpc.hardware_checks.gpu_check`` runs them in order, each timed
against its estimate)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.process_group import DistContext
from rlhf_hpc.hardware_checks.gpu_check_setup import (
    Models,
    Shape,
    Workload,
    batch_flops,
    fixed_batch,
    free_memory,
    peak_memory_gib,
    reset_peak,
    rollout_batch,
    sync,
    timed,
    used_memory_gib,
)
from rlhf_hpc.observability.perf import peak_flops
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ops import policy_losses
from rlhf_hpc.ops.batching import to_device
from rlhf_hpc.planning.memory_plan import check_plan, update_bytes
from rlhf_hpc.planning.sizing import model_shape
from rlhf_hpc.planning.split_plan import colocated_step, split_step
from rlhf_hpc.planning.time_plan import build_time_plan
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.ppo.optim import clip_grad_norm, move_optimizer_state
from rlhf_hpc.ppo.trainer import fit
from rlhf_hpc.preflight import run_preflight
from rlhf_hpc.recipe.config_checks import validate
from rlhf_hpc.recipe.load import load_config, write_resolved
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout

__all__ = [
    "CaseSkipped",
    "UPDATE_MODES",
    "actor_update_case",
    "attention_case",
    "forward_case",
    "host_adamw_s_per_param",
    "preflight_case",
    "rollout_case",
    "split_layout_case",
    "tiny_klppo_case",
    "update_step_case",
    "update_step_estimate_s",
]


def attention_case(
    device: torch.device, work: Workload, head_dim: int = 128, heads: int = 12, kv_heads: int = 2
) -> dict:
    """Packed sequences through attention: what the packed path costs with sdpa (transformers
    builds a dense block-diagonal mask over the whole packed row, so the kernel computes the full
    N x N square) against per-sequence causal attention and torch's varlen kernel."""
    import torch.nn.functional as F

    S, L = work.attn_seqs, work.attn_len
    N = S * L
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, N, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, N, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, N, head_dim, device=device, dtype=dtype, generator=g)
    doc = torch.arange(N, device=device) // L
    pos = torch.arange(N, device=device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    rep = heads // kv_heads
    kf, vf = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def dense():
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask)

    def per_seq():
        qs = q.view(heads, S, L, head_dim).transpose(0, 1)
        ks, vs = kf.view(heads, S, L, head_dim).transpose(0, 1), vf.view(heads, S, L, head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return out.transpose(0, 1).reshape(1, heads, N, head_dim)

    t_dense, o_dense = timed(dense, device, work.reps + 2)
    t_seq, o_seq = timed(per_seq, device, work.reps + 2)
    out = {
        "time_s": t_dense,
        "dense_mask_s": t_dense,
        "per_sequence_s": t_seq,
        "max_abs_diff": (o_dense.float() - o_seq.float()).abs().max().item(),
        "tokens_per_s": N / t_dense,
    }
    note = f"{S}x{L} tokens packed: dense mask {t_dense * 1e3:.2f} ms vs per-sequence {t_seq * 1e3:.2f} ms"
    varlen = None
    with contextlib.suppress(ImportError):
        from torch.nn.attention.varlen import varlen_attn as varlen
    if varlen is not None and device.type == "cuda":
        import inspect

        params = inspect.signature(varlen).parameters  # its causal switch changed between releases
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        cu = torch.arange(0, N + 1, L, device=device, dtype=torch.int32)
        qv, kv_, vv = (t[0].transpose(0, 1).contiguous() for t in (q, kf, vf))  # (N, heads, d)
        try:
            t_var, o_var = timed(lambda: varlen(qv, kv_, vv, cu, cu, L, L, **causal), device, work.reps + 2)
            out["varlen_s"] = t_var
            out["varlen_max_abs_diff"] = (o_var.transpose(0, 1).unsqueeze(0).float() - o_seq.float()).abs().max().item()
            note += f", varlen {t_var * 1e3:.2f} ms"
        except Exception as e:  # an optional kernel: its absence is a finding, not a failure
            note += f", varlen failed: {type(e).__name__}: {str(e)[:80]}"
    else:
        note += ", varlen n/a" + (" on cpu" if device.type != "cuda" else " (not in this torch)")
    out["note"] = note
    return out


def tiny_overrides(
    device: torch.device, run_dir: Path, bf16: bool = False, engine: str = "hf", lora_rank: int = 0, moe: bool = False
) -> list[str]:
    """``tiny_klppo`` on this one device with ``engine`` (vllm: the colocated engine, asleep in the
    training phases on a GPU; hf where vLLM is not installed); ``bf16``: every model and the engine
    in bfloat16, with flash-attn's kernel where it is installed (GPU); ``lora_rank``: the actor's
    LoRA adapters, which vLLM serves adapter-only; ``moe``: the tiny Qwen3-MoE, the engine recording
    its routing and the actor replaying it (router_replay R3), with verl's load-balance metrics."""
    out = [
        f"trainer.device={device.type}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.rollout.name={engine}",
    ]
    if lora_rank:
        out += [f"actor_rollout_ref.model.lora_rank={lora_rank}", f"actor_rollout_ref.model.lora_alpha={2 * lora_rank}"]
    if moe:
        out += [
            "actor_rollout_ref.model.path=tiny://qwen3_moe?vocab_size=64",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ]
    if bf16:
        out += [
            f"{m}.fsdp_config.mixed_precision.param_dtype=bfloat16"
            for m in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
        ]
        out.append("actor_rollout_ref.rollout.dtype=bfloat16")
        if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            out += [
                f"{m}.override_config.attn_implementation=flash_attention_2"
                for m in ("actor_rollout_ref.model", "critic.model")
            ]
    return out


def plan_overrides(device: torch.device, shape: Shape, response_len: int) -> list[str]:
    """``tiny_klppo`` with ``shape``'s model (actor, reference, critic) and longer responses, the
    plan sized for this device's memory: the memory-per-phase case."""
    out = [
        f"actor_rollout_ref.model.path={shape.path}",
        f"data.max_response_length={response_len}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    if device.type == "cuda":
        out.append(f"trainer.gpu_memory_gb={torch.cuda.get_device_properties(device).total_memory / 2**30:.1f}")
    return out


def tiny_klppo_case(
    device: torch.device,
    bf16: bool = False,
    plan_shape: Optional[Shape] = None,
    response_len: int = 512,
    engine: str = "hf",
    lora_rank: int = 0,
    moe: bool = False,
) -> dict:
    """Two steps of the tiny recipe through ``fit`` on this device with ``engine``: with vLLM its
    sleep and wake around the training phases (GPU), the in-place reload with its verdicts (a
    failed one raises), and the engine's log-probs against the actor's; with ``lora_rank`` the
    second sync moves the adapter alone; with ``moe`` a mixture of experts whose routing the
    engine returns and the actor replays (vLLM: enable_return_routed_experts, GPU builds only).
    With ``plan_shape``: that model instead, and each
    memory-plan phase against its measured peak (``memory_gb/<phase>`` of step 2; on a GPU
    max_memory_allocated against the plan less its runtime part, which that counter cannot see)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_tiny_"))
    try:
        overrides = tiny_overrides(device, run_dir, bf16, engine, lora_rank, moe)
        if plan_shape is not None:
            overrides += plan_overrides(device, plan_shape, response_len)
        cfg, _ = load_config("tiny_klppo", overrides)
        write_resolved(cfg, run_dir)
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, backend=dist.get_backend())
        fit(cfg, ctx)
        records = read_metrics(run_dir)
        if [r["training/global_step"] for r in records] != [1, 2]:
            raise RuntimeError(
                f"expected metrics for steps 1 and 2, got {[r['training/global_step'] for r in records]}"
            )
        bad = sorted(k for r in records for k, v in r.items() if isinstance(v, str) and v in ("nan", "inf", "-inf"))
        if bad:
            raise RuntimeError(f"non-finite metrics: {bad[:5]}")
        problem = ckpt.verify_checkpoint(run_dir / "global_step_2")
        if problem:
            raise RuntimeError(f"checkpoint of step 2: {problem}")
        first, last = records
        if plan_shape is not None:
            return memory_per_phase(check_plan(cfg)[0], last)
        synced = [r.get("rollout/weight_sync_mib", 0.0) for r in records]
        if moe and not all("rollout/router_topk_agreement" in r and "rollout/moe/max_vio/max" in r for r in records):
            raise RuntimeError("mixture of experts: a step logged no router agreement or load-balance metrics")
        if lora_rank and engine == "vllm" and not 0 < synced[1] < synced[0]:
            raise RuntimeError(
                f"LoRA: the second weight sync moved {synced[1]:.1f} MiB, the first {synced[0]:.1f} "
                f"MiB: not the adapter alone"
            )
        return {
            "time_s": last["timing_s/step"],
            "tokens_per_s": last["perf/throughput"],
            "peak_gib": last["perf/max_memory_allocated_gb"],
            "logprob_diff_max": last["rollout/logprob_diff_max"],
            "score_mean": last["critic/score/mean"],
            "engine_actor_kl": last["rollout/engine_actor_kl"],
            "sync_mib": synced,
            "sync_s": [r.get("timing_s/update_weights") for r in records],
            **({"router_topk_agreement": last["rollout/router_topk_agreement"]} if moe else {}),
            "note": f"{engine} engine, 2 steps + checkpoint + validation{', bf16' if bf16 else ''}"
            f"{', flash_attention_2' if any('flash_attention_2' in o for o in overrides) else ''}"
            f"{f', LoRA rank {lora_rank}' if lora_rank else ''}"
            f"{', Qwen3-MoE with routing replay (R3)' if moe else ''}; "
            f"step 2 {last['timing_s/step']:.2f} s, engine-vs-actor logprob diff "
            f"{last['rollout/logprob_diff_max']:.1e}, KL {last['rollout/engine_actor_kl']:.1e}; "
            f"weight sync {synced[0]:.1f} then {synced[1]:.1f} MiB",
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class CaseSkipped(Exception):
    """A case this machine cannot run: its row says why (not an error)."""


# the split case's run: the async recipe on one trainer and one rollout rank, its steps 2-4 measured
SPLIT_STEPS = 4
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def split_layout_overrides(device: torch.device, run_dir: Path, engine: str) -> list[str]:
    """``tiny_grpo_async`` (one-step-off) on 1 trainer + 1 rollout rank of this node, ``engine`` on the
    rollout rank."""
    return [
        "recipe=tiny_grpo_async",
        f"trainer.device={device.type}",
        "trainer.n_gpus_per_node=1",
        "rollout.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "cluster=local",
        f"trainer.total_training_steps={SPLIT_STEPS}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.rollout.name={engine}",
    ]


def split_layout_case(device: torch.device, engine: str, timeout_s: float = 600) -> dict:
    """The split layout (``actor_rollout_ref.hybrid_engine=false``: trainer and rollout ranks apart,
    one-step-off) as a user runs it: ``launch.py recipe=tiny_grpo_async`` on this node, 1 trainer and
    1 rollout rank (on GPUs two devices, the weights sent over NCCL; skipped where fewer are visible),
    ``SPLIT_STEPS`` steps. What it measured against what the time plan says of the split layout and of
    the colocated one on the same ranks (the dry run's ``# layouts:`` lines): the step (the median of
    steps 2 on, where generation runs ahead), the generation seconds overlapped with the update, each
    side's idle share, the rows' staleness."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        raise CaseSkipped(f"needs 2 GPUs (one trainer, one rollout rank), {torch.cuda.device_count()} visible")
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_split_"))
    try:
        args = split_layout_overrides(device, run_dir / "run", engine)
        cfg, _ = load_config(args[0].split("=", 1)[1], args[1:])
        trainer = build_time_plan(cfg)
        _, planned = split_step(cfg, trainer)
        colocated, _, why = colocated_step(cfg, trainer, lambda c: validate(c, check_files=False))
        # the product's launcher in a process of its own (this one holds the device and its group),
        # without this process's rendezvous: its torchrun makes its own
        launch = "import sys; from rlhf_hpc.cli import main; sys.exit(main())"
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        proc = subprocess.run(
            [sys.executable, "-c", launch, *args], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"the split layout's run failed (exit {proc.returncode}): {said}"[:300])
        records = read_metrics(run_dir / "run")
        if [r["training/global_step"] for r in records] != list(range(1, SPLIT_STEPS + 1)):
            raise RuntimeError(f"expected steps 1-{SPLIT_STEPS}, got {[r['training/global_step'] for r in records]}")
        later = records[1:]
        step = statistics.median(r["timing_s/step"] for r in later)
        overlapped = sum(r["timing_s/gen_overlapped"] for r in later)
        staleness = max(r["rollout/staleness/max"] for r in records)
        if staleness < 1 or overlapped <= 0:
            raise RuntimeError(
                f"no step trained rows generated ahead (staleness max {staleness:g}, generation overlapped "
                f"{overlapped:.2f} s over steps 2-{SPLIT_STEPS})"
            )
        trainer_idle = statistics.mean(r["async/trainer_idle_share"] for r in later)
        rollout_idle = statistics.mean(r["async/rollout_idle_share"] for r in later)
        return {
            "time_s": step,
            "tokens_per_s": statistics.median(r["perf/throughput"] for r in later),
            "peak_gib": max(r["perf/max_memory_allocated_gb"] for r in records),
            "planned_step_s": planned,
            **({"planned_colocated_step_s": colocated} if colocated is not None else {}),
            "measured_over_plan": step / planned if planned > 0 else float("nan"),
            "gen_overlapped_s": overlapped,
            "staleness_max": staleness,
            "trainer_idle_share": trainer_idle,
            "rollout_idle_share": rollout_idle,
            "note": f"{engine} engine, 1 trainer + 1 rollout rank, one-step-off; step {step:.2f} s (median of steps "
            f"2-{SPLIT_STEPS}) against the split plan's {planned:.2f} s ({step / planned:.2f}x; colocated "
            + (f"planned {colocated:.2f} s" if colocated is not None else f"not a layout here: {why}")
            + f"); generation overlapped {overlapped:.2f} s; idle: trainer {trainer_idle:.0%}, "
            f"rollout {rollout_idle:.0%}; staleness max {staleness:g}",
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def memory_per_phase(plan, last: dict) -> dict:
    """The plan's phases against step 2's measured peaks (the optimizer state exists from step 1's
    update on, as the plan counts it): figures per phase and the worst ratio."""
    rows = plan.against_measured(last)
    if len(rows) != len(plan.phases):
        raise RuntimeError(
            f"phases without a measured peak: {sorted({p.name for p in plan.phases} - {r[0] for r in rows})}"
        )
    ratios = {name: measured / planned for name, planned, measured in rows if planned > 0}
    worst = max(ratios, key=lambda n: abs(math.log(ratios[n])))
    return {
        "time_s": last["timing_s/step"],
        "tokens_per_s": last["perf/throughput"],
        "peak_gib": last["perf/max_memory_allocated_gb"],
        "phases": {name: {"plan_gib": planned, "measured_gib": measured} for name, planned, measured in rows},
        "worst_phase": worst,
        "worst_measured_over_plan": ratios[worst],
        "note": "measured/plan GiB: "
        + ", ".join(f"{n} {m:.2f}/{p:.2f}" for n, p, m in rows)
        + f"; worst {worst} {ratios[worst]:.2f}x",
    }


def preflight_case(device: torch.device, engine: str = "hf") -> dict:
    """``launch.py preflight``'s checks (rlhf_hpc.preflight) in this process on this one device:
    the rank's engine start, weight sync, generation agreement, vLLM's sleep and wake against the
    memory plan (GPU), and one actor micro-batch's peak against the memory plan (on a GPU:
    max_memory_allocated against the plan less its runtime)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_preflight_"))
    try:
        cfg, _ = load_config("tiny_klppo", tiny_overrides(device, run_dir, engine=engine) + ["trainer.preflight=true"])
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, backend=dist.get_backend())
        checks: list = []
        run_preflight(cfg, ctx, lambda line: print(f"[gpu_check] preflight: {line}", flush=True), checks)
        micro = next(c for c in checks if c.name == "actor micro-batch")
        f = micro.figures
        return {
            "checks": [c.line() for c in checks],
            "time_s": f["seconds"],
            "tokens_per_s": f["tokens"] / f["seconds"],
            "peak_gib": f["peak_gib"],
            "plan_gib": f.get("plan_gib"),
            "plan_ratio": f.get("plan_ratio"),
            "note": f"{len(checks)} checks passed; micro-batch {micro.detail}",
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def attention_agreement(models: Models, shape: Shape, work: Workload, actor, batch: dict) -> dict:
    """Log-probs of ``actor`` (another attention implementation) against sdpa with the same
    weights (same seed) on the same batch; raises when they disagree beyond bf16 noise."""
    lp, _ = actor.compute_log_prob(batch, work.padded_micro, True, work.max_token_len)
    reference = models.actor(shape, work, train=False)
    lp_ref, _ = reference.compute_log_prob(batch, work.padded_micro, True, work.max_token_len)
    diff = (lp - lp_ref).abs()[batch["response_mask"].bool()]
    out = {"logprob_diff_vs_sdpa_max": diff.max().item(), "logprob_diff_vs_sdpa_mean": diff.mean().item()}
    if not out["logprob_diff_vs_sdpa_mean"] < 2e-2:
        raise RuntimeError(
            f"attention disagrees with sdpa: mean |log-prob diff| {out['logprob_diff_vs_sdpa_mean']:.3g}"
        )
    return out


def actor_update_case(
    models: Models,
    shape: Shape,
    work: Workload,
    device: torch.device,
    grad_ckpt: bool,
    packed: bool = True,
    attn: str = "sdpa",
) -> dict:
    actor = models.actor(shape, work, grad_ckpt=grad_ckpt, packed=packed, attn=attn)
    batch = rollout_batch(work, shape.vocab_size)
    agreement = attention_agreement(models, shape, work, actor, batch) if attn != "sdpa" else {}
    free_memory(device)
    resident = used_memory_gib(device)
    reset_peak(device)
    secs, metrics = timed(lambda: actor.update_policy(batch, work.rows), device, work.reps)
    if not math.isfinite(metrics["actor/pg_loss"]) or not math.isfinite(metrics["actor/grad_norm"]):
        raise RuntimeError(
            f"non-finite update: pg_loss {metrics['actor/pg_loss']}, grad_norm {metrics['actor/grad_norm']}"
        )
    flops = batch_flops(shape, batch, 3)
    valid = int(batch["attention_mask"].sum())
    computed = valid if packed else batch["input_ids"].numel()
    micro = f"token budget {work.max_token_len}" if packed else f"{work.padded_micro} rows/micro-batch"
    note = f"{work.rows} rows, {valid} tokens, {micro}"
    if agreement:
        note += f"; log-probs vs sdpa: mean diff {agreement['logprob_diff_vs_sdpa_mean']:.1e}"
    return {
        "time_s": secs,
        "tokens_per_s": valid / secs,
        "mfu": flops / secs / peak_flops(device),
        "peak_gib": peak_memory_gib(device),
        "resident_gib": resident,
        "valid_tokens": valid,
        "computed_tokens": computed,
        "model_tflop": flops / 1e12,
        **agreement,
        "note": note,
    }


def forward_case(models: Models, shape: Shape, work: Workload, device: torch.device, critic: bool) -> dict:
    batch = rollout_batch(work, shape.vocab_size)
    if critic:
        model = models.critic(shape)
        run = lambda: model.compute_values(batch, work.padded_micro)  # noqa: E731
    else:
        model = models.actor(shape, work, train=False)
        run = lambda: model.compute_log_prob(batch, work.padded_micro, True, 2 * work.max_token_len)  # noqa: E731
    reset_peak(device)
    secs, out = timed(run, device, work.reps)
    out = out if critic else out[0]
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite forward outputs")
    flops = batch_flops(shape, batch, 1, lm_head=not critic)
    valid = int(batch["attention_mask"].sum())
    return {
        "time_s": secs,
        "tokens_per_s": valid / secs,
        "mfu": flops / secs / peak_flops(device),
        "peak_gib": peak_memory_gib(device),
        "note": f"{valid} tokens, bf16 compute",
    }


def sync_into(
    engine, models: Models, shape: Shape, work: Workload, device: torch.device, bucket_mb: float
) -> tuple[float, float]:
    """Stream a freshly built FSDP actor into ``engine``: (seconds, peak memory rise in GiB). The
    actor is gone when this returns, as in training the engine then has the memory to itself."""
    actor = models.actor(shape, work, train=False)
    sync(device)
    base = used_memory_gib(device)
    reset_peak(device)
    secs, _ = timed(lambda: sync_weights_to_rollout(actor.model, engine, torch.bfloat16, bucket_mb), device, work.reps)
    rise = peak_memory_gib(device) - base
    # the engine holds what the actor holds: compare one tensor end to end
    name, p = next(iter(actor.model.named_parameters()))
    full = p.full_tensor().to(torch.bfloat16)
    if not torch.equal(engine.model.get_parameter(name).to(full.device), full):
        raise RuntimeError(f"weight sync: engine parameter {name} differs from the actor's")
    return secs, rise


def rollout_case(models: Models, shape: Shape, work: Workload, device: torch.device) -> dict:
    """Weight sync FSDP actor -> hf engine (bf16), then generation with the synced weights."""
    cfg, _ = load_config(
        "tiny_klppo",
        ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=bfloat16", "trainer.n_gpus_per_node=1"],
    )
    engine = make_engine(cfg, shape.path, device)
    bucket = cfg.actor_rollout_ref.rollout.update_weights_bucket_mb
    sync_s, sync_rise = sync_into(engine, models, shape, work, device, bucket)
    free_memory(device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, shape.vocab_size, (work.gen_prompts, work.gen_prompt_len), generator=g).tolist()
    sampling = Sampling(n=1, temperature=1.0, max_tokens=work.gen_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], Sampling(max_tokens=4, ignore_eos=True, seed=0))  # warm-up
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    sync(device)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for grp in outs for r in grp)
    if tokens != work.gen_prompts * work.gen_tokens:
        raise RuntimeError(f"generated {tokens} tokens, expected {work.gen_prompts * work.gen_tokens}")
    return {
        "time_s": gen_s,
        "tokens_per_s": tokens / gen_s,
        "peak_gib": peak_memory_gib(device),
        "sync_s": sync_s,
        "sync_peak_rise_gib": sync_rise,
        "bucket_mb": bucket,
        "note": f"{work.gen_prompts} prompts x {work.gen_prompt_len} -> {work.gen_tokens} tokens, bf16; "
        f"weight sync {sync_s:.3f} s, peak rise {sync_rise:.2f} GiB ({bucket} MiB buckets)",
    }


UPDATE_MODES = {
    "no offload": (False, False),
    "optimizer offload (7B recipe)": (False, True),
    "param+optimizer offload": (True, True),
}


def update_step_case(
    models: Models, shape: Shape, work: Workload, device: torch.device, mode: str, full_params: int
) -> dict:
    """One full update step (forward/backward of a micro-batch, gradient clipping, the optimizer's
    state moves and step) with one CPU thread, as under torchrun (OMP_NUM_THREADS=1), timing each
    part; then the memory plan's estimate for this step against the measured peak (on a GPU:
    max_memory_allocated; the CPU smoke run's peak RSS includes the whole process). Per-parameter
    costs are scaled to ``full_params`` / 8 (a rank's shard of the real model on 8 GPUs)."""
    param_off, opt_off = UPDATE_MODES[mode]
    actor = models.actor(shape, work, grad_ckpt=True, offload=param_off, optimizer_offload=opt_off)
    model, opt = actor.model, actor.optimizer
    batch = fixed_batch(work.offload_rows, work.offload_len, work.offload_len, shape.vocab_size)
    micro = to_device(batch, device)
    model.train()
    home = next(model.parameters()).device  # the host with parameter offload
    moves = opt_off and not param_off and device.type == "cuda"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rep in range(2):  # the first step creates Adam's state; the second is measured
            times = {}
            opt.zero_grad(set_to_none=True)
            sync(device)
            reset_peak(device)
            t0 = time.perf_counter()
            lp, _ = per_token_logprobs(model, micro, remove_padding=True)
            loss, _ = policy_losses.ppo_clip_loss(
                micro["old_log_probs"], lp, micro["advantages"], micro["response_mask"]
            )
            loss.backward()
            sync(device)
            times["fwd_bwd_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            norm = clip_grad_norm(model, 1.0)
            sync(device)
            times["clip_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if moves and rep:
                move_optimizer_state(opt, home)
            sync(device)
            times["state_in_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            times["step_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if moves:
                move_optimizer_state(opt, "cpu")
            sync(device)
            times["state_out_s"] = time.perf_counter() - t0
            # the moments offloaded to the host are in pinned memory (an asynchronous way back)
            pinned = (
                all(
                    v.is_pinned()
                    for st in opt.state.values()
                    for k, v in st.items()
                    if torch.is_tensor(v) and k != "step"
                )
                if moves
                else None
            )
            peak = peak_memory_gib(device)
    finally:
        torch.set_num_threads(threads)
    if not (math.isfinite(loss.item()) and math.isfinite(norm)):
        raise RuntimeError(f"non-finite loss {loss.item()} or gradient norm {norm}")
    mshape = model_shape(shape.path)
    valid = int(batch["attention_mask"].sum())
    estimate = (
        sum(
            update_bytes(
                mshape,
                mshape.params,
                models.fsdp(param_off),
                1,
                valid,
                int(batch["response_mask"].sum()),
                True,
                mshape.vocab,
            ).values()
        )
        / 2**30
    )
    per_param = (times["step_s"] + times["state_in_s"] + times["state_out_s"]) / mshape.params
    rank_step = per_param * full_params / 8
    total = sum(times.values())
    return {
        **times,
        "time_s": total,
        "tokens_per_s": valid / total,
        "peak_gib": peak,
        "plan_estimate_gib": estimate,
        "plan_over_measured": estimate / peak if peak else None,
        "optimizer_s_per_rank_step_7b": rank_step,
        "offloaded_moments_pinned": pinned,
        "note": f"{work.offload_rows}x{2 * work.offload_len} tokens, 1 thread; fwd/bwd {times['fwd_bwd_s']:.2f} s, "
        f"clip {times['clip_s']:.3f} s, state in/out {times['state_in_s']:.2f}/{times['state_out_s']:.2f} s, "
        f"step {times['step_s']:.2f} s -> ~{rank_step:.1f} s per optimizer step for a 7B rank shard "
        f"(x4 mini-batches a step); memory plan {estimate:.1f} GiB vs {peak:.1f} GiB measured",
    }


def host_adamw_s_per_param(probe: int = 2**24) -> tuple[float, float]:
    """Seconds per parameter of AdamW on this host with one thread (the update step's setting; the
    project's fused optimizer), timed on ``probe`` parameters: (the first step, which allocates and
    zeroes the state, a later step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = torch.nn.Parameter(torch.zeros(probe))
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        return first / probe, (time.perf_counter() - t0) / probe
    finally:
        torch.set_num_threads(threads)


def update_step_estimate_s(mode: str, params: int, k: float, host_rate: tuple[float, float]) -> float:
    """The update-step case's estimate: the device part (~20 s on a GPU) and, with parameter
    offload, its two AdamW steps on the host (the first creates the state) at the probed rate, a
    half more for clipping the host gradients and moving the weights."""
    base = 20 * k
    if UPDATE_MODES[mode][0]:
        base += params * sum(host_rate) * 1.5
    return base
