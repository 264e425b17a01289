"""Defaults that depend on other keys: ``${a.b}`` interpolation, then the keys verl fills in from
others when left unset (critic batch sizes, clip ratios, log-prob micro-batches ...), so the written
config is explicit. The layout keys left at null are chosen later, from the model
(``rlhf_hpc.planning.layout``).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from typing import Any

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.batching import per_rank_mini_batch
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS
from rlhf_hpc.recipe.build import all_keys

__all__ = ["DEPRECATED_KEYS", "copy_deprecated_keys", "deprecated_key_warnings", "resolve"]


_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")

# deprecated keys -> the key that stays: still accepted, copied onto it when that one is unset
# (``copy_deprecated_keys``), each named in a warning (``deprecated_key_warnings``, rlhf_hpc.recipe.config_checks)
DEPRECATED_KEYS = {"trainer.gpu_memory_gb": "hardware.hbm_gb", "trainer.peak_tflops": "hardware.bf16_tflops"}


def copy_deprecated_keys(cfg: Config) -> list[str]:
    """Copy each deprecated key that is set onto the key that stays; the errors of the two set to
    different values."""
    errors = []
    for old, new in DEPRECATED_KEYS.items():
        value, kept = get_key(cfg, old), get_key(cfg, new)
        if value is None:
            continue
        if kept is None:
            parent, _, leaf = new.rpartition(".")
            setattr(get_key(cfg, parent), leaf, value)
        elif kept != value:
            errors.append(f"{old}={value} and {new}={kept} are one figure: {old} is deprecated, set {new} alone")
    return errors


def deprecated_key_warnings(cfg: Config) -> list[str]:
    """One line per deprecated key that is set, naming the key that stays."""
    return [
        f"{old} is deprecated: set {new} instead (its value was copied there)"
        for old, new in DEPRECATED_KEYS.items()
        if get_key(cfg, old) is not None
    ]


def _interpolate(cfg: Config, errors: list[str]) -> None:
    def resolve_str(s: str, where: str, depth: int = 0) -> str:
        def sub(m: re.Match) -> str:
            ref = m.group(1)
            try:
                val = get_key(cfg, ref)
            except AttributeError:
                if depth == 0:  # reported once, at the key that holds the bad reference
                    errors.append(f"{where}: '${{{ref}}}' refers to an unknown key{did_you_mean(ref, all_keys())}")
                return m.group(0)
            if isinstance(val, str) and depth < 10:
                return resolve_str(val, where, depth + 1)
            return str(val)

        return _INTERP.sub(sub, s)

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            key = f"{prefix}.{f.name}" if prefix else f.name
            val = getattr(node, f.name)
            if dataclasses.is_dataclass(val):
                walk(val, key)
            elif isinstance(val, str) and "${" in val:
                setattr(node, f.name, resolve_str(val, key))
            elif isinstance(val, list) and any(isinstance(v, str) and "${" in v for v in val):
                setattr(node, f.name, [resolve_str(v, key) if isinstance(v, str) else v for v in val])

    walk(cfg, "")


def _split_layout_sizes(cfg: Config) -> None:
    """verl's fully-async sizes, in this project's keys: a step of ``require_batches x
    ppo_mini_batch_size`` prompts where ``data.train_batch_size=0``; ``rollout.total_rollout_steps``
    prompts and ``rollout.total_epochs`` as the run's length; ``use_rollout_log_probs`` as bypass mode;
    validation every ``rollout.test_freq`` weight syncs, and, where ``data.train_batch_size=0``, every
    ``trainer.test_freq`` syncs, as verl's fully-async trainer counts it."""
    at, pool, d, tr = cfg.async_training, cfg.rollout, cfg.data, cfg.trainer
    fully_async = d.train_batch_size == 0
    syncs = tr.test_freq if fully_async and tr.test_freq > 0 else None
    if pool.test_freq is not None and syncs is not None and pool.test_freq != syncs:
        raise ConfigError(
            [
                f"rollout.test_freq={pool.test_freq} and trainer.test_freq={tr.test_freq} both set the validation's "
                f"interval in weight syncs (verl's fully-async); set one"
            ]
        )
    syncs = pool.test_freq if pool.test_freq is not None else syncs
    if syncs is not None:
        tr.test_freq = syncs * at.trigger_parameter_sync_step if syncs > 0 else syncs
    if fully_async:
        d.train_batch_size = at.require_batches * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if pool.total_rollout_steps is not None and tr.total_training_steps is None and d.train_batch_size > 0:
        tr.total_training_steps = pool.total_rollout_steps // d.train_batch_size
    if pool.total_epochs is not None:
        tr.total_epochs = pool.total_epochs
    if at.use_rollout_log_probs:
        cfg.algorithm.rollout_correction.bypass_mode = True


def resolve(cfg: Config) -> Config:
    """Interpolate ``${...}`` and fill keys that default to other keys (in place; returns cfg)."""
    errors: list[str] = []
    _interpolate(cfg, errors)
    errors += copy_deprecated_keys(cfg)
    if errors:
        raise ConfigError(errors)
    if cfg.launcher.cluster == "auto":
        # decided where the launch command runs (the login node), then fixed in the written config
        cfg.launcher.cluster = "slurm" if shutil.which("sbatch") else "local"
    arr, actor, critic = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.critic
    if cfg.split:
        _split_layout_sizes(cfg)
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if critic.enable is None:
        est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)  # (an unknown one is refused by the checks)
        critic.enable = est is not None and est.needs_critic
    if critic.model.path is None:
        critic.model.path = arr.model.path
    if critic.model.tokenizer_path is None:
        critic.model.tokenizer_path = arr.model.tokenizer_path
    # keys verl interpolates from the actor's (or another key) when they are left unset
    for section, key, source in (
        (critic, "ppo_mini_batch_size", actor),
        (critic, "ppo_epochs", actor),
        (critic, "use_dynamic_bsz", actor),
        (critic, "shuffle", actor),
        (critic, "loss_agg_mode", actor),
        (critic.model, "trust_remote_code", arr.model),
        (critic.model, "external_lib", arr.model),
    ):
        if getattr(section, key) is None:
            setattr(section, key, getattr(source, key))
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    # frozen models are kept in their compute dtype (verl: bf16); with LoRA the reference is the actor
    # (adapter off), so it is the actor's
    ref_fsdp = arr.ref.fsdp_config
    if ref_fsdp.model_dtype is None:
        ref_fsdp.model_dtype = (
            actor.fsdp_config.model_dtype if lora_enabled(arr.model) else ref_fsdp.mixed_precision.param_dtype
        )
    for trained in (actor.fsdp_config, critic.model.fsdp_config):
        if trained.model_dtype is None:
            trained.model_dtype = "float32"  # a trained model's master weights
    if arr.ref.ulysses_sequence_parallel_size is None:
        arr.ref.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size
    # the reward model's keys are filled only when it runs: while disabled, a key set is a key ignored
    # (refused by reward_model_problems)
    rm = cfg.reward_model
    if rm.enable:
        for section, key, value in (
            (rm, "use_dynamic_bsz", critic.use_dynamic_bsz),
            (rm, "forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu),
            (rm.model, "external_lib", arr.model.external_lib),
            (rm.model.fsdp_config, "model_dtype", rm.model.fsdp_config.mixed_precision.param_dtype),
        ):
            if getattr(section, key) is None:
                setattr(section, key, value)
    for section in (arr.rollout, arr.ref):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    for optim in (actor.optim, critic.optim):
        if optim.warmup_style is not None:  # verl's deprecated name wins, as in verl
            optim.lr_scheduler_type, optim.warmup_style = optim.warmup_style, None
    # the actor's, reference's and critic's layout left at null is chosen where models are built
    # (rlhf_hpc.planning.layout: from the model size); the reward model shards inside a node
    if cfg.reward_model.model.fsdp_config.fsdp_size is None:
        cfg.reward_model.model.fsdp_config.fsdp_size = cfg.trainer.n_gpus_per_node
    n, world = arr.rollout.n, cfg.world_size
    if world > 0:
        if actor.ppo_micro_batch_size_per_gpu is None:
            actor.ppo_micro_batch_size_per_gpu = max(1, per_rank_mini_batch(actor.ppo_mini_batch_size, n, world))
        if critic.ppo_micro_batch_size_per_gpu is None:
            critic.ppo_micro_batch_size_per_gpu = max(1, per_rank_mini_batch(critic.ppo_mini_batch_size, n, world))
        # forward-only passes default to the training micro-batch: same activation budget, no grads
        if arr.rollout.log_prob_micro_batch_size_per_gpu is None:
            arr.rollout.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if arr.ref.log_prob_micro_batch_size_per_gpu is None:
            arr.ref.log_prob_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu
        if rm.enable and rm.micro_batch_size_per_gpu is None:
            rm.micro_batch_size_per_gpu = arr.ref.log_prob_micro_batch_size_per_gpu
    return cfg
