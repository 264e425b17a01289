"""The keys of the split layout (verl's fully-async / one-step-off names): ``rollout`` (the rollout
ranks' pool, apart from the trainer's) and ``async_training`` (how far generation may run ahead
of the update). Sections of ``rlhf_hpc.config.schema.Config``; they take effect with
``actor_rollout_ref.hybrid_engine=false`` (rlhf_hpc/distributed/split_layout.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["AsyncTrainingConfig", "RolloutPoolConfig"]


@dataclass
class RolloutPoolConfig:
    """verl's top-level ``rollout``: the rollout ranks, apart from the trainer's
    (``trainer.nnodes x trainer.n_gpus_per_node``). On a node, its trainer ranks come first."""

    nnodes: int = 1
    n_gpus_per_node: int = 0  # differs from verl (8): 0 is the colocated layout's "none"
    # verl's fully-async run length, in prompts: the steps are total_rollout_steps / data.train_batch_size
    total_rollout_steps: Optional[int] = None
    total_epochs: Optional[int] = None  # verl's fully-async epochs (trainer.total_epochs here: set from it)
    test_freq: Optional[int] = None  # verl's: validation every N weight syncs (trainer.test_freq = N x trigger)


@dataclass
class AsyncTrainingConfig:
    """verl's ``async_training``, counted in steps (``data.train_batch_size`` prompts each).

    The rollout ranks generate step j's batch with the newest weights they hold. The trainer sends
    weights after every ``trigger_parameter_sync_step`` updates. Between two sends the rollout ranks
    generate ``trigger_parameter_sync_step`` batches, and ``staleness_threshold`` times as many
    again ahead: 0 is a synchronous hand-off, 1 with a sync every step is one-step-off. A row's
    staleness is the number of updates between the weights that generated it and the policy
    that trains on it."""

    staleness_threshold: float = 0.0  # differs from verl (0.1): a whole number of batches here
    trigger_parameter_sync_step: int = 1  # differs from verl (4): verl's step is a mini-batch
    # with data.train_batch_size=0 (verl's fully-async lines), a step is require_batches x ppo_mini_batch_size
    # prompts, as verl's trainer fetches them; otherwise 1
    require_batches: int = 1
    partial_rollout: bool = False  # differs from verl (True): not built (see docs/async.md)
    # the engine's log-probs as the PPO anchor: algorithm.rollout_correction.bypass_mode (verl's async default)
    use_rollout_log_probs: Optional[bool] = None

    @property
    def runs_ahead(self) -> int:
        """Batches the rollout ranks may generate beyond the sync window: ``staleness_threshold x
        trigger_parameter_sync_step``, a whole number (the checks refuse others)."""
        return round(self.staleness_threshold * self.trigger_parameter_sync_step)
