"""The split layout's step (``actor_rollout_ref.hybrid_engine=false``) and the dry run's comparison
with the colocated layout on the same ranks.

The trainer's step is the time plan of its own ranks (its phases and the weight send; no
generation). The rollout ranks generate the next batch beside it. When they may run ahead (the
sync window's other batches, or ``staleness_threshold``), the two overlap and the slower side
sets the step; at a sync with nothing ahead, the step waits for a whole generation."""

from __future__ import annotations

from typing import Callable, Optional

from rlhf_hpc.config.async_schema import AsyncTrainingConfig
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.planning.advice import with_value
from rlhf_hpc.planning.memory_plan import check_plan
from rlhf_hpc.planning.time_plan import TimeModel, TimePlan, build_time_plan

__all__ = ["colocated_step", "colocated_twin", "compare_layouts", "split_step", "split_step_s"]


def split_step_s(cfg: Config, trainer: TimePlan, gen_s: float) -> float:
    """The split layout's seconds a step: ``trainer`` (the trainer's plan) beside ``gen_s`` (one
    batch's generation on the rollout ranks). Per sync window of ``trigger`` steps with nothing
    ahead, the window's first batch waits for the weights and the others overlap; ahead, all do."""
    at = cfg.async_training
    trigger, ahead = at.trigger_parameter_sync_step, at.runs_ahead
    both = max(trainer.step_s, gen_s)
    if ahead >= 1:
        return both
    return (gen_s + trainer.step_s + (trigger - 1) * both) / trigger


def split_step(cfg: Config, trainer: TimePlan) -> tuple[float, float]:
    """(one batch's generation seconds on the rollout ranks, the split layout's step) for ``trainer``
    (the trainer's own plan)."""
    gen = TimeModel(cfg).generation(trainer.workload).seconds
    return gen, split_step_s(cfg, trainer, gen)


def colocated_twin(cfg: Config) -> Config:
    """``cfg`` in the colocated layout on the same ranks: trainer and rollout ranks all train and generate."""
    out = cfg
    for key, value in (
        ("actor_rollout_ref.hybrid_engine", True),
        ("trainer.n_gpus_per_node", cfg.procs_per_node),
        ("rollout.n_gpus_per_node", 0),
    ):
        out = with_value(out, key, value)  # (a copy)
    out.async_training = AsyncTrainingConfig()
    # a model sharded over a node stays sharded over a node (the layouts were resolved for the trainer's ranks)
    for fsdp in (
        out.actor_rollout_ref.actor.fsdp_config,
        out.actor_rollout_ref.ref.fsdp_config,
        out.critic.model.fsdp_config,
        out.reward_model.model.fsdp_config,
    ):
        if fsdp.fsdp_size == cfg.trainer.n_gpus_per_node:
            fsdp.fsdp_size = out.trainer.n_gpus_per_node
    return out


def colocated_step(
    cfg: Config, trainer: TimePlan, validate: Callable[[Config], object]
) -> tuple[Optional[float], int, str]:
    """(the colocated layout's step on the split layout's ranks, or None; those ranks; where None, why
    not: the config or the memory plan refuses that layout)."""
    twin = colocated_twin(cfg)
    try:
        validate(twin)
        memory, errors, _ = check_plan(twin)
    except (ConfigError, ValueError) as e:
        errors = [e.errors[0] if isinstance(e, ConfigError) else str(e)]
        memory = None
    if errors or memory is None:
        return None, twin.world_size, errors[0]
    return build_time_plan(twin, trainer.workload, memory=memory).step_s, twin.world_size, ""


def compare_layouts(cfg: Config, trainer: TimePlan, validate: Callable[[Config], object]) -> list[str]:
    """The dry run's lines: the split layout's step, its sides, and the colocated layout's step on
    the same ranks (where that layout is valid and fits), which is faster and by how much."""
    gen_s, step = split_step(cfg, trainer)
    at = cfg.async_training
    ahead = at.runs_ahead
    slower = "generation" if gen_s > trainer.step_s else "the trainer"
    how = (
        f"overlapped, {slower} sets the step"
        if ahead >= 1
        else f"a weight send every {at.trigger_parameter_sync_step} step(s), nothing ahead: "
        + ("each step waits for its generation" if at.trigger_parameter_sync_step == 1 else "the window's first waits")
    )
    engines = max(cfg.rollout_world_size // cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, 1)
    lines = [
        f"split layout, {cfg.world_size} trainer + {cfg.rollout_world_size} rollout rank(s): step {step:.3g} s "
        f"(the trainer {trainer.step_s:.3g} s; generation {gen_s:.3g} s on {engines} engine(s); {how})"
    ]
    colocated, ranks, why = colocated_step(cfg, trainer, validate)
    if colocated is None:
        lines.append(f"colocated on the same {ranks} ranks: not a layout this config allows ({why})")
        return lines
    ratio = colocated / step if step > 0 else 1.0
    verdict = (
        f"the split layout is {ratio:.2f}x faster"
        if ratio >= 1.005
        else f"the colocated layout is {1 / ratio:.2f}x faster"
        if ratio <= 1 / 1.005
        else "the same"
    )
    lines.append(f"colocated on the same {ranks} ranks: step {colocated:.3g} s; {verdict}")
    return lines
