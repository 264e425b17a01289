"""The update loop the actor and the critic share: epochs x mini-batches x micro-batches with
gradient accumulation, losses normalised by the counts of the whole global mini-batch, gradient
clipping, one optimizer step per mini-batch, one scheduler step per call."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from rlhf_hpc.ops import algos
from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.ops.batching import Batch, dummy_rows, micro_batch_groups, select_rows, to_device
from rlhf_hpc.ops.metrics import UpdateMetrics
from rlhf_hpc.ppo.optim import clip_grad_norm
from rlhf_hpc.distributed.fsdp import finish_gradient_sync, set_gradient_sync

# (micro-batch, agg_loss keyword arguments, metrics, weight 0/1) -> the loss to backpropagate
MicroLoss = Callable[[Batch, dict, UpdateMetrics, float], torch.Tensor]


def ppo_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, batch: Batch, mini_batch_rows: int,
               cfg, micro_loss: MicroLoss, prefix: str, seed: int, dp_size: int,
               all_reduce: Optional[Callable] = None, sync_max: Optional[Callable] = None,
               norm_const: Optional[float] = None, device: torch.device = torch.device("cpu"),
               sp=None) -> dict[str, float]:
    """Run the update; ``cfg`` has ppo_epochs, shuffle, ppo_micro_batch_size_per_gpu, use_dynamic_bsz,
    ppo_max_token_len_per_gpu and grad_clip (ActorConfig or CriticConfig). ``batch`` lives on the
    host; each micro-batch moves to ``device`` for its forward/backward. Returns metrics that are
    the same on every rank. ``sp`` (a ``SequenceParallel`` or None): each mini-batch is the
    group's rows, computed by all its ranks, each rank a slice of the tokens."""
    model.train()
    B = batch["responses"].shape[0]
    metrics = UpdateMetrics()
    grad_norms, nonfinite = [], 0
    gen = torch.Generator().manual_seed(seed)
    sp_size = 1 if sp is None else sp.size
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.shuffle else torch.arange(B)
        for start in range(0, B, mini_batch_rows):
            mini = select_rows(batch, order[start:start + mini_batch_rows])
            # counted on this rank's own rows: a row the sp group shares counts once
            tokens, seqs = algos.global_batch_counts(mini["response_mask"], all_reduce=all_reduce)
            if sp is not None:
                mini = sequence_parallel.gather_rows(mini, sp)[0]
            groups = micro_batch_groups(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                        cfg.ppo_max_token_len_per_gpu * sp_size, sync_max)
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

