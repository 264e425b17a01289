"""Actor and reference: per-token log-probs of responses, and the PPO update of the actor.

Batches follow ``rlhf_hpc.ops.batching``'s layout; per-token outputs are ``(B, R)``. The update reads
``old_log_probs``, ``advantages`` (and ``ref_log_prob`` with the KL loss) from the batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rlhf_hpc.config.schema import ActorConfig
from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.distributed.sequence_parallel import SequenceParallel
from rlhf_hpc.models.moe_routing import RoutingReplay, laid_out
from rlhf_hpc.ops import algos
from rlhf_hpc.ops.batching import Batch, dummy_rows, micro_batch_groups, pack, restore_order, select_rows, to_device
from rlhf_hpc.ops.policy_losses import POLICY_LOSSES
from rlhf_hpc.ppo.optim import optimizer_state_on
from rlhf_hpc.ppo.rollout_correction import RolloutCorrection
from rlhf_hpc.ppo.update import ModelSpec, UpdateSpec, ppo_update

__all__ = ["Actor", "ActorSpec", "per_token_logprobs"]


def per_token_logprobs(
    model: nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    remove_padding: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    sp: Optional[SequenceParallel] = None,
    with_sum_pi_squared: bool = False,
    routing: Optional[RoutingReplay] = None,
    aux_loss: Optional[list] = None,
    routing_key: str = "routed_experts",
    routing_out: Optional[list] = None,
) -> tuple:
    """Log-probs (and entropies) of the response tokens under ``model`` at ``temperature``.

    Returns (log_probs (B, R), entropy (B, R) or None), zero where ``response_mask`` is 0;
    ``with_sum_pi_squared``: a third (B, R), sum over the vocabulary of pi^2 at each response token
    (``algos.sum_pi_squared_chunked``, no graph; the Optimal Token Baseline's).
    ``remove_padding`` packs the rows into one sequence (no compute on padding).
    ``entropy_grad=False`` computes the entropy for metrics only (no graph through it).
    ``sp``: the packed sequence is split over this sequence-parallel group (rlhf_hpc.distributed.sequence_parallel).
    ``routing``: a mixture of experts routes each token to the experts in ``batch[routing_key]``
    (the engine's, router_replay R3; the old-log-prob pass's, R2), in the order the forward sees the
    tokens; with ``routing_out`` it routes on its own, and the (B, P + R, layers, k) experts it chose
    (zero on padding) are appended there (R2's old-log-prob pass; the agreement with a
    ``batch[routing_key]`` is counted). ``aux_loss``: a list
    the forward's router load-balancing loss is appended to (a mixture of experts whose config sets
    ``output_router_logits``: transformers computes it over the tokens the forward sees).
    """
    if sp is not None:
        return sequence_parallel.per_token_logprobs(
            model,
            batch,
            sp,
            temperature,
            with_entropy,
            entropy_grad,
            with_sum_pi_squared=with_sum_pi_squared,
            routing=routing,
            routing_key=routing_key,
            routing_out=routing_out,
        )
    R = batch["responses"].shape[1]
    mask = batch["response_mask"].bool()
    replay = contextlib.nullcontext()
    if routing is not None:
        routed = batch.get(routing_key)  # (B, P + R, layers, k)
        if routed is not None:
            routed = (routed[batch["attention_mask"].bool()] if remove_padding else routed.flatten(0, 1)).long()
        replay = routing.around_forward(routed, record=routing_out is not None)
    if remove_padding:
        packed = pack(batch)
        # the head runs only where a logit predicts a response token (not on prompts, not on padding)
        keep = packed.gather_index[mask]
        with replay:
            out = model(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                attention_mask=None,
                use_cache=False,
                logits_to_keep=keep,
                **packed.attention_kwargs(),
            )
        logits = out.logits[0]  # (n_valid, V)
        labels = batch["responses"][mask]
    else:
        with replay:
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                use_cache=False,
                logits_to_keep=R + 1,
            )
        logits = out.logits[:, :-1][mask]  # (n_valid, V): the logits that predict each response token
        labels = batch["responses"][mask]
    if aux_loss is not None:
        aux_loss.append(out.aux_loss)
    if routing_out is not None:  # (the padded forward routed its padding too)
        where = batch["attention_mask"].bool()
        routing_out.append(laid_out(routing.chosen(), where if remove_padding else torch.ones_like(where)))
    # fp32 one chunk at a time: the (n_valid, V) logits stay in the compute dtype
    values, entropies = algos.token_logprobs_chunked(logits, labels, temperature, with_entropy, entropy_grad)
    lp = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device).masked_scatter(mask, values)
    ent = torch.zeros_like(lp).masked_scatter(mask, entropies) if with_entropy else None
    if with_sum_pi_squared:
        spi2 = torch.zeros_like(lp).masked_scatter(mask, algos.sum_pi_squared_chunked(logits.detach(), temperature))
        return lp, ent, spi2
    return lp, ent


@dataclass(frozen=True)
class ActorSpec(ModelSpec):
    """``update.ModelSpec`` (a reference: no optimizer) and the actor's own: ``temperature`` of its
    log-probs (the rollout's); ``correction``: verl's rollout correction (the trained actor's; None
    for a reference); ``routing``: with the engine's routing in the batch, a mixture of experts'
    forwards ``"replay"`` it (router_replay R3) or ``"measure"`` their agreement with it; ``"record"``:
    the old-log-prob pass records the actor's own routing and the update's forwards replay it
    (router_replay R2); None: none of these."""

    temperature: float = 1.0
    correction: Optional[RolloutCorrection] = None
    routing: Optional[str] = None


class Actor:
    """The policy on its training mesh (or a plain module alone for references), as ``spec`` says.
    Batches stay on the host; outputs come back to the host.
    """

    def __init__(self, model: nn.Module, cfg: ActorConfig, spec: ActorSpec = ActorSpec()):
        self.model, self.cfg, self.spec = model, cfg, spec
        self.placement, self.device, self.sp = spec.placement, spec.placement.device, spec.placement.sp
        self.temperature, self.remove_padding = spec.temperature, spec.remove_padding
        self.optimizer, self.scheduler = spec.optimizer, spec.scheduler
        self.sync_max = spec.placement.sync_max
        self.loss_fn = POLICY_LOSSES[cfg.policy_loss.loss_mode]
        self.kl_loss_coef = cfg.kl_loss_coef  # scaled on a guard rollback (``scale``; cfg stays as set)
        # the LR schedule's own base LRs, before a rollback (or a checkpoint's schedule) scaled them
        self.base_lrs = list(self.scheduler.base_lrs) if self.scheduler is not None else []
        self.correction = spec.correction
        self.routing = RoutingReplay(model, substitute=spec.routing in ("replay", "record")) if spec.routing else None
        # the routing the update's forwards replay: the engine's (R3), or the old-log-prob pass's (R2)
        self.routing_key = "actor_routed_experts" if spec.routing == "record" else "routed_experts"
        # transformers' router load-balancing loss (override_config.output_router_logits), x its coefficient
        config = getattr(model, "config", None)
        self.router_aux_loss_coef = (
            float(config.router_aux_loss_coef)
            if self.optimizer is not None and getattr(config, "output_router_logits", False)
            else 0.0
        )

    def scale(self, lr_scale: float, kl_scale: float) -> None:
        """The stability guard's scales, relative to the configured settings: the LR schedule's base
        LRs (and the optimizer's current LR on that schedule) and the KL-loss coefficient."""
        sched = self.scheduler
        sched.base_lrs = [lr * lr_scale for lr in self.base_lrs]
        for group, base, fn in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
        self.kl_loss_coef = self.cfg.kl_loss_coef * kl_scale

    @property
    def bypass(self) -> Optional[RolloutCorrection]:
        """The rollout correction when it runs inside the update (verl's bypass mode), else None."""
        return self.correction if self.correction is not None and self.correction.bypass else None

    @property
    def in_update(self) -> Optional[RolloutCorrection]:
        """The rollout correction when the engine check runs on the update's forward (bypass mode,
        or on-policy: that forward is pi_old), else None."""
        return self.correction if self.correction is not None and self.correction.in_update else None

    # ------------------------------------------------------------------------------ forward only
    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: Batch,
        micro_batch_size: int,
        use_dynamic_bsz: bool = False,
        max_token_len: int = 16384,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        routing_out: Optional[list] = None,
    ) -> tuple:
        """(B, R) log-probs (and entropies) for every row of ``batch``, in its row order;
        ``with_sum_pi_squared``: a third (B, R), sum over the vocabulary of pi^2 (``per_token_logprobs``);
        ``routing_out``: the actor's own routing of every row, (B, P + R, layers, k), is appended there
        (router_replay R2)."""
        self.model.eval()
        own = slice(None)
        if self.sp is not None:  # the group's rows, each micro-batch's tokens split over its ranks
            batch, own = sequence_parallel.gather_rows(batch, self.sp)
            max_token_len *= self.sp.size
        groups = micro_batch_groups(batch, micro_batch_size, use_dynamic_bsz, max_token_len, self.sync_max)
        lps, ents, spi2s, routes, kept = [], [], [], [], []
        for g in groups:
            micro = to_device(select_rows(batch, g) if g else dummy_rows(batch), self.device)
            chosen = [] if routing_out is not None else None
            lp, ent, *spi2 = per_token_logprobs(
                self.model,
                micro,
                self.temperature,
                self.remove_padding,
                with_entropy,
                sp=self.sp,
                with_sum_pi_squared=with_sum_pi_squared,
                routing=self.routing,
                routing_out=chosen,
            )
            if g:
                lps.append(lp.cpu())
                routes.append(chosen[0] if chosen else None)
                ents.append(ent.cpu() if with_entropy else None)
                spi2s.append(spi2[0].cpu() if with_sum_pi_squared else None)
                kept.append(g)
        lp = restore_order(lps, kept)[own]
        ent = restore_order(ents, kept)[own] if with_entropy else None
        if routing_out is not None:
            routing_out.append(restore_order(routes, kept)[own])
        if with_sum_pi_squared:
            return lp, ent, restore_order(spi2s, kept)[own]
        return lp, ent

    # ------------------------------------------------------------------------------ PPO update
    def update_policy(self, batch: Batch, mini_batch_rows: int, seed: int = 0) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches over this rank's rows; one optimizer step per
        mini-batch; the LR scheduler advances once per call (one training step).

        ``mini_batch_rows``: rows of this rank in one mini-batch (ppo_mini_batch_size x n / ranks).
        In verl's bypass mode (no old-log-prob pass ran) the rollout correction (``self.correction``)
        corrects each micro-batch, keeps the first mini-batch's log-probs (its forward still sees the
        pre-update weights) for its engine check, and that mini-batch reports ``actor/entropy``.
        On-policy (one epoch, one mini-batch; no pass ran either) each micro-batch's own forward,
        detached, is its pi_old, and is kept the same way.
        Returns metrics averaged over mini-batches and ranks (the same on every rank).
        """
        with optimizer_state_on(self.optimizer, next(self.model.parameters()).device, self.spec.optimizer_offload):
            return self._update_policy(batch, mini_batch_rows, seed)

    def _update_policy(self, batch: Batch, mini_batch_rows: int, seed: int = 0) -> dict[str, float]:
        cfg, bypass, in_update = self.cfg, self.bypass, self.in_update
        sp_rank = self.sp.rank if self.sp is not None else 0
        if in_update is not None:
            batch = in_update.begin_update(batch, sp_rank)

        def micro_loss(micro: Batch, kw: dict, metrics, weight: float) -> torch.Tensor:
            # the entropy only where the loss uses it (else actor/entropy comes from the old-log-prob
            # pass; in bypass mode and on-policy, without a gradient, from the first mini-batch)
            sample = in_update is not None and in_update.keeps_pre_update(metrics.n_mini)
            with_entropy = cfg.entropy_coeff != 0 or sample
            aux = [] if self.router_aux_loss_coef else None
            lp, ent = per_token_logprobs(
                self.model,
                micro,
                self.temperature,
                self.remove_padding,
                with_entropy=with_entropy,
                entropy_grad=cfg.entropy_coeff != 0,
                sp=self.sp,
                routing=self.routing,
                aux_loss=aux,
                routing_key=self.routing_key,
            )
            mask = micro["response_mask"]
            if sample and weight:
                in_update.keep_pre_update(micro, lp, sp_rank)
                if cfg.entropy_coeff == 0:
                    metrics.token_mean("actor/entropy", algos.masked_mean(ent, mask), mask.sum())
            pg_loss, pgm = self.policy_loss(micro, lp, mask, weight, kw)
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                ent_loss = algos.agg_loss(ent, mask, cfg.loss_agg_mode, **kw)
                loss = loss - cfg.entropy_coeff * ent_loss
                metrics.share("actor/entropy", weight * ent_loss)
            if cfg.use_kl_loss:
                kl_loss = algos.agg_loss(
                    algos.kl_penalty(lp, micro["ref_log_prob"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **kw
                )
                loss = loss + self.kl_loss_coef * kl_loss
                metrics.share("actor/kl_loss", weight * kl_loss)
            if aux:  # (a mean over this micro-batch: weighted by its share of the global response tokens)
                aux_loss = aux[0] * (mask.sum() / max(kw["global_tokens"], 1.0))
                loss = loss + self.router_aux_loss_coef * aux_loss
                metrics.share("actor/router_aux_loss", weight * aux_loss)
            metrics.share("actor/pg_loss", weight * pg_loss)
            for k, v in pgm.items():
                metrics.token_mean(f"actor/{k}", v, weight * mask.sum())
            return loss

        out = ppo_update(
            UpdateSpec(self.model, self.optimizer, self.scheduler, cfg, "actor", self.spec.norm_const, self.placement),
            batch,
            mini_batch_rows,
            micro_loss,
            seed,
        )
        if bypass is not None:  # verl reports the correction of the micro-batches it trained on
            out.update(bypass.update_metrics())
        return out

    def policy_loss(
        self, micro: Batch, lp: torch.Tensor, mask: torch.Tensor, weight: float, kw: dict
    ) -> tuple[torch.Tensor, dict]:
        """The micro-batch's policy-gradient loss: PPO's clipped ratio against ``old_log_probs``, times
        the rollout correction's IS weights where there are any (decoupled mode: ``rollout_is_weights``
        of the batch). In bypass mode the correction is computed here, current policy against the
        engine's log-probs: rejected tokens leave this loss (its normalisation stays the mini-batch's
        sampled tokens), and ``loss_type: reinforce`` trains -A log pi w instead (verl's). On-policy,
        pi_old is ``lp`` itself, detached (the ratio is exactly 1, its gradient the policy gradient)."""
        cfg, bypass = self.cfg, self.bypass
        is_weights = micro.get("rollout_is_weights")
        if self.correction is not None and self.correction.on_policy:
            return self.loss_fn(lp.detach(), lp, micro["advantages"], mask, cfg, is_weights=is_weights, **kw)
        if bypass is not None:
            is_weights, mask = bypass.micro_batch(micro, lp, mask, weight)
            if bypass.cfg.loss_type == "reinforce":
                return POLICY_LOSSES["reinforce"](
                    micro["old_log_probs"], lp, micro["advantages"], mask, cfg, is_weights=is_weights, **kw
                )
            is_weights = None  # PPO's ratio is already current / engine: the weights are reported only
        return self.loss_fn(micro["old_log_probs"], lp, micro["advantages"], mask, cfg, is_weights=is_weights, **kw)
