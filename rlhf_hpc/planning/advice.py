"""The changes the time plan's advice tries (rlhf_hpc.planning.time_plan.advice_for re-plans each):
larger micro-batches, Ulysses where communication passes the reference design's rule, another
rollout TP, another FSDP layout, less recompute and offloading."""

from __future__ import annotations

import copy

from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.planning.layout import choose_layouts
from rlhf_hpc.planning.sizing import model_shape

__all__ = ["COMM_RULE", "candidate_changes", "plan_layouts", "value_text", "with_value"]

# the reference design's rule: communication above this share of a step calls for another layout
COMM_RULE = 0.2


def with_value(cfg: Config, key: str, value) -> Config:
    """A copy of ``cfg`` with ``key`` set (the planning caches key on values, so a copy is safe)."""
    out = copy.deepcopy(cfg)
    parent, _, leaf = key.rpartition(".")
    setattr(get_key(out, parent), leaf, value)
    return out


def candidate_changes(cfg: Config, comm_share: float) -> list[tuple[list[tuple[str, object]], str]]:
    """Layout changes worth planning: ([(key, value), ...], why); ``comm_share``: the communication's
    share of the planned step."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    out = []
    for prefix, section in (("actor_rollout_ref.actor", arr.actor), ("critic", critic)):
        if prefix == "critic" and not critic.enable:
            continue
        if section.use_dynamic_bsz:
            out.append(
                (
                    [(f"{prefix}.ppo_max_token_len_per_gpu", section.ppo_max_token_len_per_gpu * 2)],
                    "fewer, larger micro-batches",
                )
            )
        elif section.ppo_micro_batch_size_per_gpu:
            out.append(
                (
                    [(f"{prefix}.ppo_micro_batch_size_per_gpu", section.ppo_micro_batch_size_per_gpu * 2)],
                    "fewer, larger micro-batches",
                )
            )
        if comm_share > COMM_RULE and section.ulysses_sequence_parallel_size == 1:
            out.append(
                (
                    [(f"{prefix}.ulysses_sequence_parallel_size", 2)],
                    f"communication is {comm_share:.0%} of the step (the {COMM_RULE:.0%} rule)",
                )
            )
    rollout = arr.rollout
    if rollout.log_prob_use_dynamic_bsz:
        out.append(
            (
                [
                    (
                        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                        rollout.log_prob_max_token_len_per_gpu * 2,
                    )
                ],
                "fewer log-prob micro-batches",
            )
        )
    tp, kv = (
        rollout.tensor_model_parallel_size,
        max(1, model_shape(arr.model.path, arr.model.override_config, arr.model.trust_remote_code).kv_heads),
    )
    for t in (tp // 2, tp * 2):
        if (
            1 <= t <= cfg.trainer.n_gpus_per_node
            and t != tp
            and cfg.world_size % t == 0
            and (kv % t == 0 or t % kv == 0)
        ):
            out.append(([("actor_rollout_ref.rollout.tensor_model_parallel_size", t)], "another rollout TP"))
    sizes = {1, cfg.trainer.n_gpus_per_node, cfg.world_size} - {None}
    layouts = plan_layouts(cfg)
    for size in sorted(sizes):
        if size != layouts["actor"] and cfg.world_size % size == 0:
            out.append(
                (
                    [
                        (f"{p}.fsdp_config.fsdp_size", size)
                        for p in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
                    ],
                    "another FSDP layout",
                )
            )
    for key, on in (
        ("actor_rollout_ref.model.enable_gradient_checkpointing", True),
        ("critic.model.enable_gradient_checkpointing", True),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", True),
        ("actor_rollout_ref.actor.fsdp_config.param_offload", True),
        ("critic.model.fsdp_config.optimizer_offload", True),
    ):
        if get_key(cfg, key) is on and (critic.enable or not key.startswith("critic")):
            out.append(([(key, False)], "less work"))
    return out


def plan_layouts(cfg: Config) -> dict[str, int]:
    """The ``fsdp_size`` each model gets (``rlhf_hpc.planning.layout.choose_layouts``)."""
    return {n: lay.fsdp_size for n, lay in choose_layouts(cfg).items()}


def value_text(v) -> str:
    """A value as an override writes it (booleans lower case)."""
    return str(v).lower() if isinstance(v, bool) else str(v)
