"""LoRA under torchrun (gloo, CPU); test_lora.py runs and reads it.

    torchrun --nproc-per-node=2 tests/dist_lora_checks.py OUT

For each layout (FSDP2 sharded over both ranks; replicated on the host) and head (untied, tied):
the 2-rank actor with a LoRA adapter against one process on the whole batch (log-probs before,
metrics of three updates, the adapter after them, the frozen base unchanged), the reference with
the adapter off against a separate base model, and the merged weights the engines receive against
the single process's merge. Rank 0 writes OUT/lora.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import FSDPConfig, ModelConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh, exit_process
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.lora import AdapterDisabled, apply_lora, lora_scaling, merged_state_dict, merged_weights
from rlhf_hpc.ops.batching import select_rows
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement
from rlhf_hpc.rollout.weight_sync import stream_full_params
from tests.dist_engine_checks import (
    FP32,
    PER_RANK_MINI,
    R,
    actor_cfg,
    global_batch,
    max_diff,
    rank_rows,
    reference_order,
)

CPU = torch.device("cpu")
LORA = ModelConfig(path="tiny://qwen2", lora_rank=4, lora_alpha=8)


def lora_model(path: str):
    return apply_lora(build_causal_lm(path, torch.float32, seed=0), dataclasses.replace(LORA, path=path), seed=5)


def check(name: str, path: str, fsdp_size: int, rank: int, world: int, results: dict) -> None:
    batch, cfg = global_batch(), actor_cfg()
    cfg.optim.lr = 2e-2  # the adapter moves visibly in three updates
    model = lora_model(path)
    parallelize(
        model,
        build_train_mesh(CPU, world, fsdp_size),
        FSDPConfig(fsdp_size=fsdp_size, mixed_precision=FP32),
        CPU,
        gradient_checkpointing=True,
    )
    common = ActorSpec(
        temperature=0.8,
        norm_const=R,
        placement=Placement(dp_size=world, all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, CPU)),
    )
    actor = Actor(model, cfg, dataclasses.replace(common, optimizer=build_optimizer(model, cfg.optim)))
    reference = Actor(AdapterDisabled(model), cfg, common)
    local = select_rows(batch, rank_rows(rank, world))
    old_lp, _ = actor.compute_log_prob(local, micro_batch_size=3)
    local["old_log_probs"] = old_lp + 0.05 * local["response_mask"]
    metrics = [actor.update_policy(local, PER_RANK_MINI) for _ in range(3)]
    ref_lp, _ = reference.compute_log_prob(local, micro_batch_size=3)
    new_lp, _ = actor.compute_log_prob(local, micro_batch_size=3)
    params = ckpt.full_model_state(actor.model)
    merged = dict(merged_weights(stream_full_params(model, torch.float32, 1.0), lora_scaling(model)))
    gathered = {
        k: [torch.zeros_like(t) for _ in range(world)] for k, t in (("old", old_lp), ("ref", ref_lp), ("new", new_lp))
    }
    for k, t in (("old", old_lp), ("ref", ref_lp), ("new", new_lp)):
        dist.all_gather(gathered[k], t)
    if rank == 0:
        order = reference_order(world)
        single = lora_model(path)
        one = Actor(
            single,
            dataclasses.replace(cfg, ppo_micro_batch_size_per_gpu=4),
            ActorSpec(
                temperature=0.8, remove_padding=False, optimizer=build_optimizer(single, cfg.optim), norm_const=R
            ),
        )
        whole = select_rows(batch, order)
        lp, _ = one.compute_log_prob(whole, micro_batch_size=16)
        whole["old_log_probs"] = lp + 0.05 * whole["response_mask"]
        one_metrics = [one.update_policy(whole, PER_RANK_MINI * world) for _ in range(3)]
        base = build_causal_lm(path, torch.float32, seed=0)
        base_lp, _ = Actor(base, cfg, ActorSpec(temperature=0.8)).compute_log_prob(whole, micro_batch_size=16)
        start = dict(lora_model(path).state_dict())
        adapter = [k for k in params if ".lora_" in k]
        frozen = [k for k in params if ".lora_" not in k]
        results[name] = {
            "trainable": sorted({k.split(".")[-3] for k, p in model.named_parameters() if p.requires_grad}),
            "optimizer_tensors": sum(len(g["params"]) for g in actor.optimizer.param_groups),
            "adapter_tensors": len(adapter),
            "logprob_max_diff": (torch.cat(gathered["old"])[order] - lp).abs().max().item(),
            # per update: the first is of the same weights; later ones follow Adam, which turns the rounding
            # differences of near-zero gradients (lora_A's start at 0: B = 0) into steps of up to lr
            "metric_rel_diff": [
                max(
                    abs(s[k] - o[k]) / max(1.0, abs(o[k]))
                    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl")
                )
                for s, o in zip(metrics, one_metrics)
            ],
            "lr": cfg.optim.lr,
            "adapter_max_diff": max_diff({k: params[k] for k in adapter}, dict(single.state_dict())),
            "adapter_moved": max_diff({k: params[k] for k in adapter}, start),
            "base_moved": max_diff({k: params[k] for k in frozen}, start),
            "reference_vs_base_model": (torch.cat(gathered["ref"])[order] - base_lp).abs().max().item(),
            "reference_vs_trained_actor": (torch.cat(gathered["ref"])[order] - torch.cat(gathered["new"])[order])
            .abs()
            .max()
            .item(),
            "merged_vs_single": max_diff(merged, merged_state_dict(single)),
            "merged_names_are_base_names": sorted(merged) == sorted(n for n, _ in base.named_parameters()),
        }
    dist.barrier()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    check("sharded_untied", "tiny://qwen2", 2, rank, world, results)
    check("replicated_tied", "tiny://qwen2?tie_word_embeddings=true", 1, rank, world, results)
    check("sharded_tied_llama", "tiny://llama", 2, rank, world, results)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lora.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
