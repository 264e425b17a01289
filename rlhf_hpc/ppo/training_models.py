"""The models trained (actor, critic) and the reference, built from the config on their FSDP2 meshes
(the generation engine is rlhf_hpc.rollout)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.loading import build_sharded
from rlhf_hpc.distributed.process_group import DistContext, all_reduce_max_int, all_reduce_sum
from rlhf_hpc.distributed.sequence_parallel import KEYS as SP_KEYS
from rlhf_hpc.distributed.sequence_parallel import for_model as sequence_parallel_for
from rlhf_hpc.models.hf import (
    attn_implementation,
    build_causal_lm,
    build_critic,
    import_external_libs,
    is_tiny,
    torch_dtype,
)
from rlhf_hpc.models.lora import AdapterDisabled, apply_lora, lora_enabled
from rlhf_hpc.planning.layout import choose_checkpointing, resolved_fsdp_configs
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.critic import Critic, CriticSpec
from rlhf_hpc.ppo.optim import build_lr_scheduler, build_optimizer
from rlhf_hpc.ppo.rollout_correction import RolloutCorrection
from rlhf_hpc.ppo.update import Placement

__all__ = ["TrainingModels", "build_training_models"]


@dataclass
class TrainingModels:
    actor: Actor
    ref: Optional[Actor]  # None when no KL is used anywhere
    critic: Optional[Critic]  # None for critic-free estimators (grpo, rloo, ...)

    def free_gradients(self) -> None:
        """Drop the last update's gradients before generation (they would sit beside vLLM)."""
        for part in (self.actor, self.critic):
            if part is not None and part.optimizer is not None:
                part.optimizer.zero_grad(set_to_none=True)

    def checkpoint_components(self) -> dict:
        comps = {"actor": (self.actor.model, self.actor.optimizer)}
        if self.critic is not None:
            comps["critic"] = (self.critic.model, self.critic.optimizer)
        return comps


def build_training_models(
    cfg: Config, ctx: DistContext, total_steps: int, log: Optional[Callable[[str], None]] = None
) -> TrainingModels:
    """Build and shard the models on every rank (collective). ``total_steps`` sizes the LR schedules;
    ``log``: where the actor's rollout correction warns (default: printed by the main rank).

    A pretrained checkpoint is read once, by rank 0, and sent to the others' shards
    (rlhf_hpc.distributed.loading); a tiny random model is built from the same seed on every rank.
    """
    arr, actor_cfg = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor
    mcfg, seed = arr.model, cfg.trainer.seed
    import_external_libs(mcfg.external_lib, cfg.critic.model.external_lib if cfg.critic.enable else None)
    attn = attn_implementation(ctx.device, mcfg.override_config)
    if actor_cfg.ulysses_sequence_parallel_size > 1 or arr.ref.ulysses_sequence_parallel_size > 1:
        attn = "varlen"  # the implementation that exchanges heads (rlhf_hpc.distributed.sequence_parallel)
    sync_max = lambda k: all_reduce_max_int(k, ctx.device)  # noqa: E731
    fsdp = resolved_fsdp_configs(cfg)  # the layouts left at null, chosen by the plans
    size = fsdp["actor"].fsdp_size
    if sync_max(size) != size or -sync_max(-size) != size:  # (the plans read each node's memory and figures)
        raise RuntimeError(
            f"the ranks chose different FSDP layouts (this rank fsdp_size={size}): set "
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size (and the ref's and critic's) in the recipe"
        )
    recompute = {name: on for name, (on, _) in choose_checkpointing(cfg).items()}  # likewise checkpointing
    norm_const = float(cfg.data.max_response_length)
    placement = Placement(dp_size=ctx.world_size, all_reduce=all_reduce_sum, sync_max=sync_max, device=ctx.device)

    pretrained = not is_tiny(mcfg.path)

    def policy(dtype_name: str, lora: bool = False):
        def build(device):
            model = build_causal_lm(
                mcfg.path, torch_dtype(dtype_name), device, mcfg.override_config, seed, mcfg.trust_remote_code, attn
            )
            return apply_lora(model, mcfg, seed) if lora else model

        return build

    actor_lora = lora_enabled(mcfg)
    model = build_sharded(
        policy(actor_cfg.fsdp_config.model_dtype, actor_lora), fsdp["actor"], ctx, recompute["actor"], pretrained
    )
    actor_sp = sequence_parallel_for(actor_cfg.ulysses_sequence_parallel_size, model.config, SP_KEYS[0])
    opt = build_optimizer(model, actor_cfg.optim)
    on_gpu = ctx.device.type == "cuda"
    if log is None:
        log = (lambda line: print(line, flush=True)) if ctx.is_main else (lambda line: None)
    actor = Actor(
        model,
        actor_cfg,
        ActorSpec(
            temperature=arr.rollout.temperature,
            remove_padding=mcfg.use_remove_padding,
            optimizer=opt,
            scheduler=build_lr_scheduler(opt, actor_cfg.optim, total_steps),
            optimizer_offload=on_gpu and actor_cfg.fsdp_config.optimizer_offload,
            norm_const=norm_const,
            placement=dataclasses.replace(placement, sp=actor_sp),
            correction=RolloutCorrection.from_config(cfg, log),
            # (a reference routes on its own)
            routing=(
                "record"
                if actor_cfg.router_replay.mode == "R2"
                else ("replay" if actor_cfg.router_replay.mode == "R3" else "measure")
                if arr.rollout.enable_rollout_routing_replay
                else None
            ),
        ),
    )

    ref = None
    ref_spec = ActorSpec(
        temperature=arr.rollout.temperature, remove_padding=mcfg.use_remove_padding, norm_const=norm_const
    )
    if (actor_cfg.use_kl_loss or cfg.algorithm.use_kl_in_reward) and actor_lora:
        # the base model is the reference: the actor's own weights with the adapter off (verl's ref_in_actor)
        ref = Actor(
            AdapterDisabled(model),
            actor_cfg,
            dataclasses.replace(ref_spec, placement=dataclasses.replace(placement, sp=actor_sp)),
        )
    elif actor_cfg.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref_model = build_sharded(
            policy(arr.ref.fsdp_config.model_dtype), fsdp["ref"], ctx, False, pretrained, frozen=True
        )
        ref_sp = sequence_parallel_for(arr.ref.ulysses_sequence_parallel_size, ref_model.config, SP_KEYS[1])
        ref = Actor(
            ref_model, actor_cfg, dataclasses.replace(ref_spec, placement=dataclasses.replace(placement, sp=ref_sp))
        )

    critic = None
    if cfg.critic.enable:
        ccfg = cfg.critic
        # a random tiny actor has no checkpoint to share: copy its backbone so both start equal
        init_from = (
            build_causal_lm(mcfg.path, torch.float32, "cpu", mcfg.override_config, seed, mcfg.trust_remote_code, attn)
            if is_tiny(ccfg.model.path)
            else None
        )
        critic_attn = (
            "varlen"
            if ccfg.ulysses_sequence_parallel_size > 1
            else attn_implementation(ctx.device, ccfg.model.override_config)
        )

        def value_model(device):
            critic_model = build_critic(
                ccfg.model.path,
                torch_dtype(ccfg.model.fsdp_config.model_dtype),
                device,
                ccfg.model.override_config,
                seed + 1,
                ccfg.model.trust_remote_code,
                critic_attn,
                init_from=init_from,
            )
            if lora_enabled(ccfg.model):  # the backbone gets the adapter; the value head trains in full
                critic_model.model = apply_lora(critic_model.model, ccfg.model, seed + 1, task_type=None)
            return critic_model

        cmodel = build_sharded(value_model, fsdp["critic"], ctx, recompute["critic"], not is_tiny(ccfg.model.path))
        del init_from
        copt = build_optimizer(cmodel, ccfg.optim)
        critic_sp = sequence_parallel_for(ccfg.ulysses_sequence_parallel_size, cmodel.config, SP_KEYS[2])
        critic = Critic(
            cmodel,
            ccfg,
            CriticSpec(
                remove_padding=ccfg.model.use_remove_padding,
                optimizer=copt,
                scheduler=build_lr_scheduler(copt, ccfg.optim, total_steps),
                optimizer_offload=on_gpu and ccfg.model.fsdp_config.optimizer_offload,
                norm_const=norm_const,
                placement=dataclasses.replace(placement, sp=critic_sp),
            ),
        )
    return TrainingModels(actor=actor, ref=ref, critic=critic)
