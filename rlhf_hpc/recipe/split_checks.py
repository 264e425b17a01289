"""The split layout's keys (``actor_rollout_ref.hybrid_engine=false``, ``rollout.*``,
``async_training.*``: rlhf_hpc/config/async_schema.py) against what the split layout runs
(rlhf_hpc/ppo/split_rollout.py). What is not built with it yet is refused by name."""

from __future__ import annotations

import dataclasses

from rlhf_hpc.config.async_schema import AsyncTrainingConfig, RolloutPoolConfig
from rlhf_hpc.config.schema import Config
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS

__all__ = ["split_layout_problems", "split_layout_warnings"]


def _changed(section, defaults) -> list[str]:
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(defaults, f.name)]


def split_layout_problems(cfg: Config) -> list[str]:
    arr, at, pool, tr = cfg.actor_rollout_ref, cfg.async_training, cfg.rollout, cfg.trainer
    if not cfg.split:
        keys = [f"rollout.{k}" for k in _changed(pool, RolloutPoolConfig())]
        keys += [f"async_training.{k}" for k in _changed(at, AsyncTrainingConfig())]
        if keys:
            return [
                f"{', '.join(keys)} configure the split layout (rollout ranks apart from the trainer's): set "
                f"actor_rollout_ref.hybrid_engine=false, or remove them"
            ]
        return []
    errors = []
    if pool.n_gpus_per_node < 1 or pool.nnodes < 1:
        errors.append(
            f"actor_rollout_ref.hybrid_engine=false with rollout.nnodes={pool.nnodes} x rollout.n_gpus_per_node="
            f"{pool.n_gpus_per_node}: the split layout needs rollout ranks; set rollout.n_gpus_per_node to 1 or more"
        )
    if pool.nnodes != tr.nnodes:
        errors.append(
            f"rollout.nnodes={pool.nnodes} with trainer.nnodes={tr.nnodes}: here the rollout ranks share the "
            f"trainer's nodes (rollout.n_gpus_per_node of each); set rollout.nnodes={tr.nnodes}"
        )
    tp = arr.rollout.tensor_model_parallel_size
    if pool.n_gpus_per_node >= 1 and pool.n_gpus_per_node % tp:
        errors.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide rollout.n_gpus_per_node="
            f"{pool.n_gpus_per_node} (an engine's ranks are on one node)"
        )
    if at.trigger_parameter_sync_step < 1:
        errors.append(
            f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step}: the updates between "
            f"two weight sends, 1 or more"
        )
    elif at.staleness_threshold < 0 or abs(at.staleness_threshold * at.trigger_parameter_sync_step % 1) > 1e-9:
        allowed = ", ".join(f"{k / at.trigger_parameter_sync_step:g}" for k in range(4))
        errors.append(
            f"async_training.staleness_threshold={at.staleness_threshold}: the rollout ranks run ahead by "
            f"staleness_threshold x trigger_parameter_sync_step ({at.trigger_parameter_sync_step}) whole batches "
            f"(data.train_batch_size prompts; verl counts samples): set one of {allowed}, ..."
        )
    mini = arr.actor.ppo_mini_batch_size
    if at.require_batches < 1 or (at.require_batches != 1 and cfg.data.train_batch_size != at.require_batches * mini):
        errors.append(
            f"async_training.require_batches={at.require_batches} sets a step to require_batches x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size prompts where data.train_batch_size=0 (verl's fully-async "
            f"lines); with data.train_batch_size={cfg.data.train_batch_size} set it to 1"
        )
    steps = pool.total_rollout_steps
    if steps is not None and tr.total_training_steps != steps // max(cfg.data.train_batch_size, 1):
        errors.append(
            f"rollout.total_rollout_steps={steps} prompts is {steps // max(cfg.data.train_batch_size, 1)} steps of "
            f"data.train_batch_size={cfg.data.train_batch_size}, but trainer.total_training_steps="
            f"{tr.total_training_steps}: set one of them"
        )
    if at.use_rollout_log_probs is False and cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(
            "async_training.use_rollout_log_probs=false with algorithm.rollout_correction.bypass_mode=true: bypass "
            "mode trains with the engine's log-probs as the anchor; set one of them"
        )
    if at.partial_rollout:
        errors.append(
            "async_training.partial_rollout=true (a generation in flight continues with new weights) is not "
            "built: the rollout ranks take new weights between batches (docs/async.md); set it to false"
        )
    # what the split layout does not run yet, each by name
    not_built = [
        (arr.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=true (tools between turns)"),
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true (DAPO's dynamic sampling)"),
        (
            getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "needs_greedy_baseline", False),
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (a greedy baseline generated each step)",
        ),
        (lora_enabled(arr.model), "actor_rollout_ref.model.lora_rank > 0 (LoRA)"),
        (tr.preflight, "launch.py preflight"),
        (arr.rollout.enable_rollout_routing_replay, "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"),
        (
            (tr.inject_fault or "").startswith("wrong_weights"),
            f"trainer.inject_fault={tr.inject_fault} (a fault of the colocated weight sync)",
        ),
    ]
    for on, what in not_built:
        if on:
            errors.append(
                f"{what} is not built with the split layout (actor_rollout_ref.hybrid_engine=false) yet: "
                f"turn it off or use the colocated layout"
            )
    return errors


def split_layout_warnings(cfg: Config) -> list[str]:
    """Stale rows trained without a rollout correction."""
    at, rc = cfg.async_training, cfg.algorithm.rollout_correction
    if not cfg.split:
        return []
    most = at.trigger_parameter_sync_step - 1 + at.runs_ahead
    if most > 0 and rc.rollout_is is None and rc.rollout_rs is None and not rc.bypass_mode:
        return [
            f"the split layout trains rows up to {most} updates stale without a rollout correction: set "
            f"algorithm.rollout_correction.rollout_is=token (truncated importance weights, as verl's async recipes)"
        ]
    return []
