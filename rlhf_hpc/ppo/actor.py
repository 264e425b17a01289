"""Actor and reference: per-token log-probs of responses, and the PPO update of the actor.

Batches follow ``rlhf_hpc.ops.batching``'s layout; per-token outputs are ``(B, R)``. The update reads
``old_log_probs``, ``advantages`` (and ``ref_log_prob`` with the KL loss) from the batch.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from rlhf_hpc.ops import algos
from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.ops.batching import Batch, dummy_rows, micro_batch_groups, pack, restore_order, select_rows, to_device
from rlhf_hpc.config.schema import ActorConfig, RolloutCorrectionConfig
from rlhf_hpc.ops.rollout_correction import rollout_correction
from rlhf_hpc.ppo.optim import optimizer_state_on
from rlhf_hpc.distributed.sequence_parallel import SequenceParallel
from rlhf_hpc.ppo.update import ppo_update


def per_token_logprobs(model: nn.Module, batch: Batch, temperature: float = 1.0, remove_padding: bool = True,
                       with_entropy: bool = False, entropy_grad: bool = True, sp: Optional[SequenceParallel] = None
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of the response tokens under ``model`` at ``temperature``.

    Returns (log_probs (B, R), entropy (B, R) or None), zero where ``response_mask`` is 0.
    ``remove_padding`` packs the rows into one sequence (no compute on padding).
    ``entropy_grad=False`` computes the entropy for metrics only (no graph through it).
    ``sp``: the packed sequence is split over this sequence-parallel group (rlhf_hpc.distributed.sequence_parallel).
    """
    if sp is not None:
        return sequence_parallel.per_token_logprobs(model, batch, sp, temperature, with_entropy, entropy_grad)
    R = batch["responses"].shape[1]
    mask = batch["response_mask"].bool()
    if remove_padding:
        packed = pack(batch)
        # the head runs only where a logit predicts a response token (not on prompts, not on padding)
        keep = packed.gather_index[mask]
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                       use_cache=False, logits_to_keep=keep, **packed.attention_kwargs()).logits[0]  # (n_valid, V)
        labels = batch["responses"][mask]
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=False, logits_to_keep=R + 1)
        logits = out.logits[:, :-1][mask]  # (n_valid, V): the logits that predict each response token
        labels = batch["responses"][mask]
    # fp32 one chunk at a time: the (n_valid, V) logits stay in the compute dtype
    values, entropies = algos.token_logprobs_chunked(logits, labels, temperature, with_entropy, entropy_grad)
    lp = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device).masked_scatter(mask, values)
    ent = torch.zeros_like(lp).masked_scatter(mask, entropies) if with_entropy else None
    return lp, ent


class Actor:
    """The policy on its training mesh (or a plain module with ``dp_size=1`` for references).

    ``all_reduce``: SUM over the data-parallel ranks (None when alone); ``dp_size``: the number of
    ranks FSDP averages gradients over (all ranks, replicate x shard). ``device``: where the model
    computes (with parameter offload its parameters live on the host, so it is not their device).
    Batches stay on the host; outputs come back to the host. ``sp``: the sequence-parallel group
    (None without Ulysses): its ranks compute their rows together, each a slice of the sequence.
    """

    def __init__(self, model: nn.Module, cfg: ActorConfig, temperature: float = 1.0, remove_padding: bool = True,
                 optimizer: Optional[torch.optim.Optimizer] = None, scheduler=None, dp_size: int = 1,
                 all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 sync_max: Optional[Callable[[int], int]] = None, norm_const: Optional[float] = None,
                 optimizer_offload: bool = False, device: torch.device = torch.device("cpu"),
                 sp: Optional[SequenceParallel] = None, all_reduce_max: Optional[Callable] = None,
                 bypass_correction: Optional[RolloutCorrectionConfig] = None):
        self.model, self.cfg, self.device, self.sp = model, cfg, device, sp
        self.temperature, self.remove_padding = temperature, remove_padding
        self.optimizer, self.scheduler = optimizer, scheduler
        self.dp_size, self.all_reduce, self.sync_max = dp_size, all_reduce, sync_max
        self.norm_const = norm_const
        self.optimizer_offload = optimizer_offload
        self.kl_loss_coef = cfg.kl_loss_coef  # the trainer scales it on a guard rollback (cfg stays as set)
        # verl's bypass mode: old_log_probs are the engine's, and each micro-batch's rollout correction
        # compares the current policy with them (rlhf_hpc.ops.rollout_correction)
        self.all_reduce_max, self.bypass_correction = all_reduce_max, bypass_correction

    # ------------------------------------------------------------------------------ forward only
    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, micro_batch_size: int, use_dynamic_bsz: bool = False,
                         max_token_len: int = 16384, with_entropy: bool = False
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, R) log-probs (and entropies) for every row of ``batch``, in its row order."""
        self.model.eval()
        own = slice(None)
        if self.sp is not None:  # the group's rows, each micro-batch's tokens split over its ranks
            batch, own = sequence_parallel.gather_rows(batch, self.sp)
            max_token_len *= self.sp.size
        groups = micro_batch_groups(batch, micro_batch_size, use_dynamic_bsz, max_token_len, self.sync_max)
        lps, ents, kept = [], [], []
        for g in groups:
            micro = to_device(select_rows(batch, g) if g else dummy_rows(batch), self.device)
            lp, ent = per_token_logprobs(self.model, micro, self.temperature, self.remove_padding, with_entropy,
                                         sp=self.sp)
            if g:
                lps.append(lp.cpu())
                ents.append(ent.cpu() if with_entropy else None)
                kept.append(g)
        lp = restore_order(lps, kept)[own]
        ent = restore_order(ents, kept)[own] if with_entropy else None
        return lp, ent

    # ------------------------------------------------------------------------------ PPO update
    def update_policy(self, batch: Batch, mini_batch_rows: int, seed: int = 0,
                      pre_update_sample: Optional[list] = None) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches over this rank's rows; one optimizer step per
        mini-batch; the LR scheduler advances once per call (one training step).

        ``mini_batch_rows``: rows of this rank in one mini-batch (ppo_mini_batch_size x n / ranks).
        ``pre_update_sample``: when given (verl's bypass mode, where no old-log-prob pass ran), the
        first mini-batch, whose forward still sees the pre-update weights, appends
        ``(engine_log_probs, log_probs, response_mask)`` (host tensors, (b, R) each) per micro-batch
        for the rollout/actor check, and reports ``actor/entropy`` over its tokens.
        Returns metrics averaged over mini-batches and ranks (the same on every rank).
        """
        with optimizer_state_on(self.optimizer, next(self.model.parameters()).device, self.optimizer_offload):
            return self._update_policy(batch, mini_batch_rows, seed, pre_update_sample)

    def _update_policy(self, batch: Batch, mini_batch_rows: int, seed: int = 0,
                       pre_update_sample: Optional[list] = None) -> dict[str, float]:
        cfg, bypass = self.cfg, self.bypass_correction
        corr_sample: list = []  # bypass mode: (current, engine log-probs, mask) of every micro-batch

        def micro_loss(micro: Batch, kw: dict, metrics, weight: float) -> torch.Tensor:
            # the entropy only where the loss uses it (else actor/entropy comes from the old-log-prob
            # pass; in bypass mode, without a gradient, from the first mini-batch)
            sample = pre_update_sample is not None and metrics.n_mini == 1
            with_entropy = cfg.entropy_coeff != 0 or sample
            lp, ent = per_token_logprobs(self.model, micro, self.temperature, self.remove_padding,
                                         with_entropy=with_entropy, entropy_grad=cfg.entropy_coeff != 0, sp=self.sp)
            mask = micro["response_mask"]
            if sample and weight:
                pre_update_sample.append((micro["engine_log_probs"].cpu(), lp.detach().cpu(), mask.cpu()))
                if cfg.entropy_coeff == 0:
                    metrics.token_mean("actor/entropy", algos.masked_mean(ent, mask), mask.sum())
            pg_loss, pgm = self.policy_loss(micro, lp, mask, weight, kw, corr_sample)
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                ent_loss = algos.agg_loss(ent, mask, cfg.loss_agg_mode, **kw)
                loss = loss - cfg.entropy_coeff * ent_loss
                metrics.share("actor/entropy", weight * ent_loss)
            if cfg.use_kl_loss:
                kl_loss = algos.agg_loss(algos.kl_penalty(lp, micro["ref_log_prob"], cfg.kl_loss_type), mask,
                                         cfg.loss_agg_mode, **kw)
                loss = loss + self.kl_loss_coef * kl_loss
                metrics.share("actor/kl_loss", weight * kl_loss)
            metrics.share("actor/pg_loss", weight * pg_loss)
            for k, v in pgm.items():
                metrics.token_mean(f"actor/{k}", v, weight * mask.sum())
            return loss

        out = ppo_update(self.model, self.optimizer, self.scheduler, batch, mini_batch_rows, cfg, micro_loss,
                         "actor", seed, self.dp_size, self.all_reduce, self.sync_max, self.norm_const, self.device,
                         self.sp)
        if bypass is not None:  # verl reports the correction of the micro-batches it trained on
            cur, eng, mask = (torch.cat(t) for t in zip(*corr_sample)) if corr_sample else \
                (torch.zeros(0, 1),) * 3
            out.update(rollout_correction(cur, eng, mask, bypass, self.all_reduce, self.all_reduce_max)[2])
        return out

    def policy_loss(self, micro: Batch, lp: torch.Tensor, mask: torch.Tensor, weight: float, kw: dict,
                    corr_sample: list) -> tuple[torch.Tensor, dict]:
        """The micro-batch's policy-gradient loss: PPO's clipped ratio against ``old_log_probs``, times
        the rollout correction's IS weights where there are any (decoupled mode: ``rollout_is_weights``
        of the batch). In bypass mode the correction is computed here, current policy against the
        engine's log-probs: rejected tokens leave this loss (its normalisation stays the mini-batch's
        sampled tokens), and ``loss_type: reinforce`` trains -A log pi w instead (verl's)."""
        cfg, bypass = self.cfg, self.bypass_correction
        is_weights = micro.get("rollout_is_weights")
        if bypass is not None:
            if weight:
                corr_sample.append((lp.detach().cpu(), micro["old_log_probs"].cpu(), micro["response_mask"].cpu()))
            if bypass.rollout_is is not None or bypass.rollout_rs is not None:  # (else weights 1, mask as is)
                is_weights, mask = rollout_correction(lp, micro["old_log_probs"], mask * bool(weight), bypass,
                                                      self.all_reduce, self.all_reduce_max, with_metrics=False)[:2]
            if bypass.loss_type == "reinforce":
                return algos.reinforce_loss(micro["old_log_probs"], lp, micro["advantages"], mask, cfg.loss_agg_mode,
                                            is_weights=is_weights, **kw)
            is_weights = None  # PPO's ratio is already current / engine: the weights are reported only
        return algos.policy_loss(micro["old_log_probs"], lp, micro["advantages"], mask, cfg.clip_ratio_low,
                                 cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode, is_weights=is_weights,
                                 **kw)
