"""Critic: per-token values of the states before each response token, and its clipped-value update.

Reads ``values`` (the old values) and ``returns`` from the batch during the update; shapes (B, R).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rlhf_hpc.config.schema import CriticConfig
from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.distributed.sequence_parallel import SequenceParallel
from rlhf_hpc.ops import algos
from rlhf_hpc.ops.batching import (
    Batch,
    dummy_rows,
    micro_batch_groups,
    pack,
    restore_order,
    select_rows,
    to_device,
    unpack_per_token,
)
from rlhf_hpc.ppo.optim import optimizer_state_on
from rlhf_hpc.ppo.update import ModelSpec, UpdateSpec, ppo_update

__all__ = ["Critic", "CriticSpec", "per_token_values"]


def per_token_values(
    model: nn.Module, batch: Batch, remove_padding: bool = True, sp: Optional[SequenceParallel] = None
) -> torch.Tensor:
    """V(s_t) for the state before each response token: (B, R), zero where masked. ``sp``: the
    packed sequence is split over this sequence-parallel group."""
    if sp is not None:
        return sequence_parallel.per_token_values(model, batch, sp)
    R = batch["responses"].shape[1]
    mask = batch["response_mask"]
    if remove_padding:
        packed = pack(batch)
        values = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            **packed.attention_kwargs(),
        )
        return unpack_per_token(values, packed)
    values = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )
    return values[:, -R - 1 : -1] * mask.to(values.dtype)


@dataclass(frozen=True)
class CriticSpec(ModelSpec):
    """How a critic computes and trains, besides its config section (``update.ModelSpec``)."""


class Critic:
    """The value model on its training mesh, as ``spec`` says."""

    def __init__(self, model: nn.Module, cfg: CriticConfig, spec: CriticSpec = CriticSpec()):
        self.model, self.cfg, self.spec = model, cfg, spec
        self.remove_padding, self.placement = spec.remove_padding, spec.placement
        self.device, self.sp, self.sync_max = spec.placement.device, spec.placement.sp, spec.placement.sync_max
        self.optimizer, self.scheduler = spec.optimizer, spec.scheduler

    @torch.no_grad()
    def compute_values(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """(B, R) values for every row, in the batch's row order."""
        self.model.eval()
        own, max_token_len = slice(None), self.cfg.forward_max_token_len_per_gpu
        if self.sp is not None:  # the group's rows, each micro-batch's tokens split over its ranks
            batch, own = sequence_parallel.gather_rows(batch, self.sp)
            max_token_len *= self.sp.size
        groups = micro_batch_groups(batch, micro_batch_size, self.cfg.use_dynamic_bsz, max_token_len, self.sync_max)
        outs, kept = [], []
        for g in groups:
            micro = to_device(select_rows(batch, g) if g else dummy_rows(batch), self.device)
            v = per_token_values(self.model, micro, self.remove_padding, self.sp)
            if g:
                outs.append(v.cpu())
                kept.append(g)
        return restore_order(outs, kept)[own]

    def update_critic(self, batch: Batch, mini_batch_rows: int, seed: int = 0) -> dict[str, float]:
        """Clipped value regression onto ``returns``; loop structure as ``Actor.update_policy``."""
        with optimizer_state_on(self.optimizer, next(self.model.parameters()).device, self.spec.optimizer_offload):
            return self._update_critic(batch, mini_batch_rows, seed)

    def _update_critic(self, batch: Batch, mini_batch_rows: int, seed: int = 0) -> dict[str, float]:
        cfg = self.cfg

        def micro_loss(micro: Batch, kw: dict, metrics, weight: float) -> torch.Tensor:
            v = per_token_values(self.model, micro, self.remove_padding, self.sp)
            mask = micro["response_mask"]
            loss, clipfrac = algos.value_loss(
                v, micro["returns"], micro["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, **kw
            )
            # tensors: read back once per update (metrics.UpdateMetrics), not per micro-batch
            n_tokens = weight * mask.sum()
            metrics.share("critic/vf_loss", weight * loss)
            metrics.token_mean("critic/vf_clipfrac", clipfrac, n_tokens)
            metrics.token_mean("critic/vpred_mean", algos.masked_mean(v.detach(), mask), n_tokens)
            return loss

        return ppo_update(
            UpdateSpec(self.model, self.optimizer, self.scheduler, cfg, "critic", self.spec.norm_const, self.placement),
            batch,
            mini_batch_rows,
            micro_loss,
            seed,
        )
