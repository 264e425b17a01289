"""The update loop the actor and the critic share: epochs x mini-batches x micro-batches with
gradient accumulation, losses normalised by the counts of the whole global mini-batch, gradient
clipping, one optimizer step per mini-batch, one scheduler step per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.distributed.fsdp import finish_gradient_sync, set_gradient_sync
from rlhf_hpc.distributed.sequence_parallel import SequenceParallel
from rlhf_hpc.ops import algos
from rlhf_hpc.ops.batching import Batch, dummy_rows, micro_batch_groups, select_rows, to_device
from rlhf_hpc.ops.metric_reduce import UpdateMetrics
from rlhf_hpc.ppo.optim import clip_grad_norm

__all__ = ["MicroLoss", "ModelSpec", "Placement", "UpdateSpec", "ppo_update"]

# (micro-batch, agg_loss keyword arguments, metrics, weight 0/1) -> the loss to backpropagate
MicroLoss = Callable[[Batch, dict, UpdateMetrics, float], torch.Tensor]


@dataclass(frozen=True)
class Placement:
    """Where a model's rows compute and how its numbers are reduced over the ranks.

    ``dp_size``: the number of ranks FSDP averages gradients over (all ranks, replicate x shard);
    ``all_reduce``: SUM over the data-parallel ranks (None when alone); ``sync_max``: the largest
    int over them (every rank runs the same number of micro-batches); ``device``: where the model
    computes (with parameter offload its parameters live on the host, so it is not their device);
    ``sp``: the sequence-parallel group (None without Ulysses): its ranks compute their rows
    together, each a slice of the sequence."""

    dp_size: int = 1
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    sync_max: Optional[Callable[[int], int]] = None
    device: torch.device = torch.device("cpu")
    sp: Optional[SequenceParallel] = None


@dataclass(frozen=True)
class ModelSpec:
    """How a trained (or forward-only) model computes, besides its config section:
    ``remove_padding``: rows packed into one sequence; ``optimizer``/``scheduler`` (None: forward
    only), ``optimizer_offload``: the optimizer state on the host between updates; ``norm_const``:
    the losses' constant for ``seq-mean-token-sum-norm``; ``placement``: its ranks and device."""

    remove_padding: bool = True
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Any = None
    optimizer_offload: bool = False
    norm_const: Optional[float] = None
    placement: Placement = Placement()


@dataclass(frozen=True)
class UpdateSpec:
    """What one ``ppo_update`` trains: ``model`` with its ``optimizer`` and LR ``scheduler`` (or
    None); ``cfg``, the model's section (ActorConfig or CriticConfig: ppo_epochs, shuffle,
    ppo_micro_batch_size_per_gpu, use_dynamic_bsz, ppo_max_token_len_per_gpu, grad_clip); ``prefix``
    of its metrics (``actor``, ``critic``); ``norm_const`` of the losses' ``seq-mean-token-sum-norm``
    and where it runs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cfg: Any
    prefix: str
    norm_const: Optional[float] = None
    placement: Placement = Placement()


def ppo_update(
    spec: UpdateSpec, batch: Batch, mini_batch_rows: int, micro_loss: MicroLoss, seed: int
) -> dict[str, float]:
    """Run the update of ``spec``. ``batch`` lives on the host; each micro-batch moves to the
    placement's device for its forward/backward. Returns metrics that are the same on every rank.
    With a sequence-parallel group, each mini-batch is the group's rows, computed by all its ranks,
    each rank a slice of the tokens."""
    model, optimizer, scheduler, cfg, prefix = spec.model, spec.optimizer, spec.scheduler, spec.cfg, spec.prefix
    dp_size, all_reduce, sync_max = spec.placement.dp_size, spec.placement.all_reduce, spec.placement.sync_max
    norm_const, device, sp = spec.norm_const, spec.placement.device, spec.placement.sp
    model.train()
    B = batch["responses"].shape[0]
    metrics = UpdateMetrics()
    grad_norms, nonfinite = [], 0
    gen = torch.Generator().manual_seed(seed)
    sp_size = 1 if sp is None else sp.size
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.shuffle else torch.arange(B)
        for start in range(0, B, mini_batch_rows):
            mini = select_rows(batch, order[start : start + mini_batch_rows])
            # counted on this rank's own rows: a row the sp group shares counts once
            tokens, seqs = algos.global_batch_counts(mini["response_mask"], all_reduce=all_reduce)
            if sp is not None:
                mini = sequence_parallel.gather_rows(mini, sp)[0]
            groups = micro_batch_groups(
                mini,
                cfg.ppo_micro_batch_size_per_gpu,
                cfg.use_dynamic_bsz,
                cfg.ppo_max_token_len_per_gpu * sp_size,
                sync_max,
            )
            kw = dict(global_tokens=tokens, global_seqs=seqs, norm_const=norm_const)
            optimizer.zero_grad(set_to_none=True)
            metrics.new_mini_batch()
            for i, g in enumerate(groups):
                weight = 1.0 if g else 0.0  # an empty group runs a dummy row: collectives stay in step
                # gradients accumulate over the micro-batches; the all-reduce across replicas runs
                # once, after the last (every rank has the same number of groups)
                set_gradient_sync(model, i == len(groups) - 1)
                micro = to_device(select_rows(mini, g) if g else dummy_rows(mini), device)
                # the ranks of an sp group compute the same loss: each reports 1/sp of it in the metrics
                loss = micro_loss(micro, kw, metrics, weight / sp_size)
                # FSDP averages gradients over dp_size ranks; the loss is this rank's share of a sum
                # (with sp, each rank's backward covers its slice only: the group's gradients sum to one loss's)
                (loss * (dp_size * weight)).backward()
            finish_gradient_sync(model)
            grad_norm = clip_grad_norm(model, cfg.grad_clip)
            grad_norms.append(grad_norm)
            if torch.isfinite(torch.tensor(grad_norm)):
                optimizer.step()
            else:  # a non-finite gradient would poison the weights: skip this step
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
    lr = optimizer.param_groups[0]["lr"]
    if scheduler is not None:
        scheduler.step()
    out = metrics.reduce(all_reduce)
    # the norm is of the global gradient: already the same on every rank
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out[f"{prefix}/grad_norm_nonfinite"] = float(nonfinite)
    out[f"{prefix}/lr"] = lr
    return out
