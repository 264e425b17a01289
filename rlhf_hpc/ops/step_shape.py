"""The shape of one PPO step, computed once from the config: the rows a step and each rank hold, and
per phase its micro-batches (fixed rows or a token budget), its mini-batches (the updates), its
sequence-parallel group. The runtime (``rlhf_hpc.ppo.trainer.PPOTrainer``: each phase's micro- and
mini-batches), the memory plan, the time plan and the layout chooser (``rlhf_hpc.planning``) read
it, so they cannot disagree on what a phase processes.

Rows: ``data.train_batch_size`` prompts x ``rollout.n`` responses, spread evenly over the ranks
(``rlhf_hpc.distributed.rows``); an update cuts a rank's rows into mini-batches of
``ppo_mini_batch_size x n / ranks`` rows (rounded down), each into micro-batches.

pi_old, the PPO ratio's anchor (``old_log_prob_source``): the actor's old-log-prob pass; or, when
the update is on-policy (one epoch of one mini-batch) and nothing reads pi_old before it, the
update's own first forward, detached: the same numbers without a second forward over the batch
(TRL's GRPO does the same); or in rollout correction's bypass mode the engine's log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rlhf_hpc.config.schema import Config
from rlhf_hpc.ops.batching import per_rank_mini_batch
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS

__all__ = [
    "FORWARD_PHASES",
    "PhaseShape",
    "StepShape",
    "UPDATE_PHASES",
    "micro_tokens",
    "old_log_prob_source",
    "step_shape",
]

FORWARD_PHASES = ("old_log_prob", "ref", "values", "reward_model")
UPDATE_PHASES = ("update_actor", "update_critic")


def old_log_prob_source(cfg: Config) -> str:
    """Where a step's pi_old comes from: ``engine`` (``rollout_correction.bypass_mode``), ``update``
    (one epoch, one mini-batch, the actor trains every step, and neither the KL in the reward, the
    decoupled rollout correction nor an estimator reads pi_old before the update), else ``pass``."""
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    rc, actor = alg.rollout_correction, arr.actor
    if rc.bypass_mode:
        return "engine"
    est = ADV_ESTIMATORS.get(alg.adv_estimator)
    read_before_update = (
        alg.use_kl_in_reward
        or rc.rollout_is is not None
        or rc.rollout_rs is not None
        or actor.calculate_sum_pi_squared
        or (est is not None and est.needs_sum_pi_squared)
    )
    one_update = (
        actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size == cfg.data.train_batch_size
        and cfg.trainer.critic_warmup == 0
    )
    return "update" if one_update and not read_before_update else "pass"


def micro_tokens(
    rows: Optional[int],
    per_rank_rows: int,
    dynamic: bool,
    max_token_len: int,
    prompt_len: int,
    response_len: int,
    sp: int = 1,
) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch on one rank: a token budget caps both
    (a budget filled by short prompts is almost all response); fixed rows hold at most rows x full
    length. With sequence parallelism (``sp`` > 1) a micro-batch holds the rows of sp ranks, each
    rank 1/sp of its tokens (the budget is per rank, as verl's)."""
    if dynamic:
        return max_token_len, max_token_len
    rows = min(rows or per_rank_rows, per_rank_rows * sp)
    return -(-rows * (prompt_len + response_len) // sp), -(-rows * response_len // sp)


@dataclass(frozen=True)
class PhaseShape:
    """How one phase cuts a rank's rows. ``micro_rows``: rows per micro-batch (None: all of them);
    ``dynamic``: micro-batches by ``token_budget`` tokens per GPU instead; ``sp``: the Ulysses group;
    ``mini_rows``: rows per rank in one mini-batch (updates; None for a forward phase), ``epochs``
    passes over them; ``remove_padding``: packed rows (no padding computed)."""

    name: str
    micro_rows: Optional[int]
    dynamic: bool
    token_budget: Optional[int]
    sp: int = 1
    mini_rows: Optional[int] = None
    epochs: int = 1
    remove_padding: bool = True

    def micro_tokens(
        self, per_rank_rows: int, prompt_len: int, response_len: int, sequence_parallel: bool = True
    ) -> tuple[int, int]:
        """(tokens, response tokens) of this phase's largest micro-batch on a rank (``micro_tokens``)."""
        return micro_tokens(
            self.micro_rows,
            per_rank_rows,
            bool(self.dynamic),
            self.token_budget,
            prompt_len,
            response_len,
            self.sp if sequence_parallel else 1,
        )

    def micro_batches(self, rows: float, tokens: float) -> int:
        """Micro-batches of ``rows`` rows (``tokens`` tokens) on a rank: by the token budget, or
        ``micro_rows`` rows of the sequence-parallel group's."""
        if self.dynamic:
            return max(1, math.ceil(tokens / self.token_budget))
        return max(1, math.ceil(rows * self.sp / (self.micro_rows or rows * self.sp)))


@dataclass(frozen=True)
class StepShape:
    """One step: ``prompts`` x ``n`` rows of ``prompt_len`` + ``response_len`` tokens at most over
    ``world`` ranks, and the shape of each phase (``phase(name)``)."""

    prompts: int
    n: int
    world: int
    prompt_len: int
    response_len: int
    old_log_prob: PhaseShape
    ref: PhaseShape
    values: PhaseShape
    reward_model: PhaseShape
    update_actor: PhaseShape
    update_critic: PhaseShape
    old_log_probs: str = "pass"  # old_log_prob_source: pass, update or engine

    @property
    def rows(self) -> int:
        """Responses in one step (``data.train_batch_size`` x ``rollout.n``)."""
        return self.prompts * self.n

    @property
    def rows_per_rank(self) -> int:
        return self.rows // max(self.world, 1)

    @property
    def seq_len(self) -> int:
        """A padded row's length."""
        return self.prompt_len + self.response_len

    def phase(self, name: str) -> PhaseShape:
        if name not in FORWARD_PHASES + UPDATE_PHASES:
            raise KeyError(f"no phase '{name}' in a step shape: {', '.join(FORWARD_PHASES + UPDATE_PHASES)}")
        return getattr(self, name)


def step_shape(cfg: Config) -> StepShape:
    """The step shape of a resolved ``cfg`` (``rlhf_hpc.recipe.defaults.resolve`` filled the keys
    that default to others)."""
    arr, critic, rm = cfg.actor_rollout_ref, cfg.critic, cfg.reward_model
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    n, world = rollout.n, cfg.world_size

    def update(name: str, section, remove_padding: bool) -> PhaseShape:
        return PhaseShape(
            name,
            section.ppo_micro_batch_size_per_gpu,
            section.use_dynamic_bsz,
            section.ppo_max_token_len_per_gpu,
            section.ulysses_sequence_parallel_size,
            per_rank_mini_batch(section.ppo_mini_batch_size, n, world) if world else 0,
            section.ppo_epochs,
            remove_padding,
        )

    return StepShape(
        cfg.data.train_batch_size,
        n,
        world,
        cfg.data.max_prompt_length,
        cfg.data.max_response_length,
        old_log_prob=PhaseShape(
            "old_log_prob",
            rollout.log_prob_micro_batch_size_per_gpu,
            rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu,
            actor.ulysses_sequence_parallel_size,
            remove_padding=arr.model.use_remove_padding,
        ),
        ref=PhaseShape(
            "ref",
            ref.log_prob_micro_batch_size_per_gpu,
            ref.log_prob_use_dynamic_bsz,
            ref.log_prob_max_token_len_per_gpu,
            ref.ulysses_sequence_parallel_size or 1,
            remove_padding=arr.model.use_remove_padding,
        ),
        values=PhaseShape(
            "values",
            critic.ppo_micro_batch_size_per_gpu,
            critic.use_dynamic_bsz,
            critic.forward_max_token_len_per_gpu,
            critic.ulysses_sequence_parallel_size,
            remove_padding=critic.model.use_remove_padding,
        ),
        reward_model=PhaseShape(
            "reward_model",
            rm.micro_batch_size_per_gpu,
            rm.use_dynamic_bsz,
            rm.forward_max_token_len_per_gpu,
            1,
            remove_padding=rm.model.use_remove_padding,
        ),
        update_actor=update("update_actor", actor, arr.model.use_remove_padding),
        update_critic=update("update_critic", critic, critic.model.use_remove_padding),
        old_log_probs=old_log_prob_source(cfg),
    )
