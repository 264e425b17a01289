"""verl's rollout correction for a run, as one object the actor owns (``Actor.correction``).

The engine samples from pi_rollout; the actor trains pi_old. ``algorithm.rollout_correction``
corrects the mismatch in one of two modes (the tensor math: ``rlhf_hpc.ops.rollout_corr_helper``):

- decoupled (the default): the old-log-prob pass computes pi_old; ``before_advantages`` adds IS
  weights pi_old / pi_rollout (``rollout_is_weights``, into the actor's loss) and drops rejected
  tokens from the response mask, over the whole step;
- bypass (``bypass_mode``): no old-log-prob pass, the engine's log-probs are the PPO anchor, and
  each micro-batch of the actor update corrects the current policy against them
  (``micro_batch``).

Without a correction, an on-policy update (``ops.step_shape.old_log_prob_source``: one epoch of
one mini-batch) also runs no old-log-prob pass: pi_old is the update's own forward, detached.

The standing rollout/actor log-prob check (``rollout.base.LogprobCheck``) runs once a step on the
same sampled tokens: after the old-log-prob pass, or (bypass, on-policy) on the update's first
mini-batch, whose forward still sees the pre-update weights.

The trainer calls one method per phase: ``after_old_log_probs`` (3), ``before_advantages`` (6),
``after_update`` (8); the actor's update calls ``begin_update``, ``keeps_pre_update``,
``keep_pre_update``, ``micro_batch`` and ``update_metrics``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config, RolloutCorrectionConfig
from rlhf_hpc.distributed.process_group import all_reduce_max, all_reduce_sum
from rlhf_hpc.ops.batching import Batch
from rlhf_hpc.ops.rollout_corr_helper import rollout_correction
from rlhf_hpc.ops.step_shape import old_log_prob_source
from rlhf_hpc.rollout.base import LogprobCheck, logprob_mismatch

__all__ = ["RolloutCorrection"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


class RolloutCorrection:
    """``cfg``: ``algorithm.rollout_correction``; ``engine_check``: the stop rule of the standing
    log-prob check; ``all_reduce_sum``/``all_reduce_max``: over the data-parallel ranks (every
    figure is global); ``log``: where the check's warnings go (the main rank's log); ``anchor``:
    where pi_old comes from (``old_log_prob_source``: pass, update or engine)."""

    def __init__(
        self,
        cfg: RolloutCorrectionConfig,
        engine_check: LogprobCheck,
        all_reduce_sum: Reduce = all_reduce_sum,
        all_reduce_max: Reduce = all_reduce_max,
        log: Callable[[str], None] = print,
        anchor: Optional[str] = None,
    ):
        self.cfg, self.bypass = cfg, cfg.bypass_mode
        self.anchor = anchor or ("engine" if cfg.bypass_mode else "pass")
        self.on_policy = self.anchor == "update"
        self.in_update = self.bypass or self.on_policy  # the engine check runs on the update's forward
        self.engine_check, self.log = engine_check, log
        self.all_reduce_sum, self.all_reduce_max = all_reduce_sum, all_reduce_max
        # bypass mode and on-policy, during one update: (engine log-probs, log-probs, mask, row index)
        # of the first mini-batch's micro-batches (pre-update weights); bypass mode: (log-probs, engine
        # log-probs, mask) of every one trained
        self.pre_update: list[tuple[torch.Tensor, ...]] = []
        self.trained: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # the split layout's step trains rows older weights generated: the engine check (same weights,
        # same tokens) does not apply; the figures still say how far the two policies are apart
        self.stale = False

    @classmethod
    def from_config(cls, cfg: Config, log: Callable[[str], None] = print) -> "RolloutCorrection":
        """The run's correction: global over all ranks, the check's limit by the engine's and the
        actor's precision."""
        arr = cfg.actor_rollout_ref
        check = LogprobCheck(arr.rollout.dtype, arr.actor.fsdp_config.mixed_precision.param_dtype)
        return cls(cfg.algorithm.rollout_correction, check, log=log, anchor=old_log_prob_source(cfg))

    # ------------------------------------------------------------------- the trainer's phases
    def after_old_log_probs(self, batch: dict, step: int, metrics: dict) -> None:
        """Phase 3. Bypass mode: the engine's log-probs become ``old_log_probs`` (no pass ran);
        on-policy: nothing yet (the update's forward gives them); else the engine check of the pass's
        ``old_log_probs``."""
        if self.bypass:
            batch["old_log_probs"] = batch["engine_log_probs"].clone()
        elif not self.on_policy:
            self.check_engine(batch["engine_log_probs"], batch["old_log_probs"], batch["response_mask"], step, metrics)

    def before_advantages(self, batch: dict, metrics: dict) -> None:
        """Phase 6, decoupled mode, over the whole step (global over ranks): IS weights pi_old /
        pi_rollout (``rollout_is_weights``, (B, R), into the actor's loss), the response mask after
        rejection sampling (the mask as sampled kept as ``sampled_response_mask``), and the
        ``rollout_corr/`` metrics. Nothing in bypass mode (the update corrects each micro-batch) nor
        on-policy (no correction is set; pi_old exists after the update: ``after_update``)."""
        rc = self.cfg
        if rc.bypass_mode or self.on_policy:
            return
        weights, mask, corr = rollout_correction(
            batch["old_log_probs"],
            batch["engine_log_probs"],
            batch["response_mask"],
            rc,
            self.all_reduce_sum,
            self.all_reduce_max,
        )
        if rc.rollout_rs is not None:  # lengths stay those sampled (data_metrics); training sees the rest
            if self.all_reduce_sum(mask.sum().double().reshape(1)).item() == 0:  # (global: every rank stops here)
                raise ConfigError(
                    f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs} rejected every response token of the "
                    f"step (rollout_corr/k3_kl {corr['rollout_corr/k3_kl']:.3g}, "
                    f"kl {corr['rollout_corr/kl']:.3g} between "
                    f"the actor and the engine): loosen rollout_rs_threshold={rc.rollout_rs_threshold}"
                )
            batch["sampled_response_mask"], batch["response_mask"] = batch["response_mask"], mask
        if weights is not None:
            batch["rollout_is_weights"] = weights
        metrics.update(corr)

    def after_update(self, batch: dict, step: int, metrics: dict) -> None:
        """Phase 8, after the actor's update. Bypass mode and on-policy: the engine check on the
        first mini-batch's forward (the pre-update weights). On-policy, that forward also becomes
        the batch's ``old_log_probs`` (in row order) for what reads them after the update, and gives
        the off-policy ``rollout_corr/`` figures the decoupled mode computes before the advantages."""
        if not self.in_update:
            return
        pre_update, self.pre_update = self.pre_update, []
        engine_lp, lp, mask, rows = (torch.cat(t) for t in zip(*pre_update))
        if not self.on_policy:
            self.check_engine(engine_lp, lp, mask, step, metrics)
            return
        own = rows >= 0  # (with sequence parallelism a rank also computed its group's rows)
        old = torch.zeros_like(batch["engine_log_probs"])
        if int(own.sum()) != old.shape[0]:
            raise RuntimeError(
                f"on-policy update: its first mini-batch held {int(own.sum())} of this rank's "
                f"{old.shape[0]} rows; pi_old of the others is unknown"
            )
        old[rows[own]] = lp[own]
        batch["old_log_probs"] = old
        self.check_engine(batch["engine_log_probs"], old, batch["response_mask"], step, metrics)
        metrics.update(
            rollout_correction(
                old,
                batch["engine_log_probs"],
                batch["response_mask"],
                self.cfg,
                self.all_reduce_sum,
                self.all_reduce_max,
            )[2]
        )

    def check_engine(
        self, engine_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor, step: int, metrics: dict
    ) -> None:
        """The standing rollout/actor log-prob check on the same tokens; raises when the engine is
        broken (rollout.base.LogprobCheck)."""
        metrics.update(logprob_mismatch(engine_lp, actor_lp, mask, self.all_reduce_sum, self.all_reduce_max))
        if self.stale:
            return
        warning = self.engine_check(metrics, step)
        if warning:
            self.log(f"[rlhf-hpc] WARNING {warning}")

    # -------------------------------------------- inside the actor's update (bypass, on-policy)
    def begin_update(self, batch: Batch, sp_rank: int = 0) -> Batch:
        """The batch the update trains on: on-policy, each row tagged with its index and this rank
        (``row_index``, ``row_owner``), so the update's forward can be put back in row order."""
        self.pre_update, self.trained = [], []
        if not self.on_policy:
            return batch
        rows = batch["responses"].shape[0]
        return {**batch, "row_index": torch.arange(rows), "row_owner": torch.full((rows,), sp_rank)}

    def keeps_pre_update(self, n_mini: int) -> bool:
        """Whether the micro-batches of the update's ``n_mini``-th mini-batch feed the engine check
        (bypass mode and on-policy, the first: its forward sees the pre-update weights)."""
        return self.in_update and n_mini == 1

    def keep_pre_update(self, micro: Batch, lp: torch.Tensor, sp_rank: int = 0) -> None:
        """A micro-batch of the first mini-batch, for ``after_update`` (host tensors)."""
        rows = (
            torch.where(micro["row_owner"] == sp_rank, micro["row_index"], -1).cpu()
            if self.on_policy
            else torch.full((lp.shape[0],), -1)
        )
        self.pre_update.append((micro["engine_log_probs"].cpu(), lp.detach().cpu(), micro["response_mask"].cpu(), rows))

    def micro_batch(
        self, micro: Batch, lp: torch.Tensor, mask: torch.Tensor, weight: float
    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Bypass mode: (IS weights or None, mask) of a micro-batch, current policy ``lp`` against the
        engine's log-probs (its ``old_log_probs``); rejected tokens leave the mask. A trained
        micro-batch (``weight`` 1) is kept for ``update_metrics``."""
        is_weights = micro.get("rollout_is_weights")
        if weight:
            self.trained.append((lp.detach().cpu(), micro["old_log_probs"].cpu(), micro["response_mask"].cpu()))
        if self.cfg.rollout_is is not None or self.cfg.rollout_rs is not None:  # (else weights 1, mask as is)
            is_weights, mask = rollout_correction(
                lp,
                micro["old_log_probs"],
                mask * bool(weight),
                self.cfg,
                self.all_reduce_sum,
                self.all_reduce_max,
                with_metrics=False,
            )[:2]
        return is_weights, mask

    def update_metrics(self) -> dict[str, float]:
        """Bypass mode: the ``rollout_corr/`` metrics of the micro-batches the update trained on (as
        verl reports them); {} otherwise."""
        if not self.bypass:
            return {}
        trained, self.trained = self.trained, []
        cur, eng, mask = (torch.cat(t) for t in zip(*trained)) if trained else (torch.zeros(0, 1),) * 3
        return rollout_correction(cur, eng, mask, self.cfg, self.all_reduce_sum, self.all_reduce_max)[2]
