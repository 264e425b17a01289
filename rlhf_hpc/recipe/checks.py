"""Cross-field checks of a resolved config, by topic: every problem with its key and, where
possible, the fix (``validate`` collects them)."""
from __future__ import annotations

import os
import re
from typing import Any, Optional

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.schema import ATTN_IMPLEMENTATIONS, ActorConfig, Config
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.config.engines import AUTO, ENGINES
from rlhf_hpc.config.trackers import TRACKERS
from rlhf_hpc.ops.batching import per_rank_mini_batch
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS
from rlhf_hpc.ops.policy_losses import POLICY_LOSSES
from rlhf_hpc.recipe.defaults import deprecated_key_warnings
from rlhf_hpc.recipe.model_checks import (lora_problems, lora_warnings, model_architecture_problems,
                                          reward_model_problems, sequence_parallel_problems)
from rlhf_hpc.ops.rollout_correction import parse_rejection
from rlhf_hpc.planning.hardware import hardware_problems
from rlhf_hpc.recipe.packages import config_package_problems

__all__ = ["validate"]


def _looks_like_hub_id(path: str) -> bool:
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None
            and not path.startswith((".", "~", "/")))


def profiler_problems(cfg: Config) -> list[str]:
    gp, problems = cfg.global_profiler, []
    if gp.tool != "torch":
        problems.append(f"global_profiler.tool={gp.tool!r}: rlhf-hpc traces steps with torch.profiler (tool torch); "
                        f"for Nsight Systems set launcher.nsys=true (the whole job, phases as NVTX ranges)")
    bad_steps = [s for s in gp.steps or [] if s < 1]
    if bad_steps:
        problems.append(f"global_profiler.steps: {bad_steps} are not global steps (they count from 1)")
    bad_ranks = [r for r in gp.ranks or [] if not 0 <= r < cfg.world_size]
    if bad_ranks:
        problems.append(f"global_profiler.ranks: {bad_ranks} are not ranks of this job (0..{cfg.world_size - 1})")
    if cfg.launcher.nsys and cfg.launcher.cluster == "local":
        problems.append("launcher.nsys=true wraps the nodes of a Slurm job (cluster=slurm); for a local run start "
                        "it under Nsight Systems yourself: nsys profile -t cuda,nvtx python launch.py ...")
    return problems


def missing_files(cfg: Config) -> list[str]:
    """Files/directories the config names that do not exist on this machine."""
    problems = []

    def check(key: str, path: Optional[str], hub_ok: bool = False) -> None:
        if not path or path.startswith(("tiny://", "synthetic://")):
            return
        if os.path.exists(os.path.expanduser(path)):
            return
        if hub_ok and _looks_like_hub_id(path):
            return  # a hub name: resolved from HF_HOME's cache where the job runs
        problems.append(f"{key}: '{path}' does not exist")

    def check_files(key: str, value: Any) -> None:
        for i, p in enumerate([value] if isinstance(value, str) else (value or [])):
            check(key if isinstance(value, str) else f"{key}[{i}]", p)

    d, arr = cfg.data, cfg.actor_rollout_ref
    check_files("data.train_files", d.train_files)
    check_files("data.val_files", d.val_files)
    check("data.tokenizer", d.tokenizer, hub_ok=True)
    check("actor_rollout_ref.model.path", arr.model.path, hub_ok=True)
    check("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path, hub_ok=True)
    if cfg.critic.enable and cfg.critic.model.path != arr.model.path:
        check("critic.model.path", cfg.critic.model.path, hub_ok=True)
    if cfg.reward_model.enable:
        check("reward_model.model.path", cfg.reward_model.model.path, hub_ok=True)
    check("custom_reward_function.path", cfg.custom_reward_function.path)
    return problems


def validate(cfg: Config, check_files: bool = True) -> list[str]:
    """Cross-field checks on a resolved config, by topic. Raises ConfigError listing every problem;
    returns warnings (notes that do not stop a run). With ``check_files`` False (a dry run prepared
    away from the cluster) missing files are warnings too."""
    errors, warnings = rollout_correction_problems(cfg)
    size_errors, sizes_ok = size_problems(cfg)
    errors += size_errors
    if sizes_ok:  # the batch arithmetic needs positive sizes
        batch_errors, batch_warnings = batch_size_problems(cfg)
        errors += batch_errors
        warnings += batch_warnings
    errors += mesh_problems(cfg)
    errors += algorithm_problems(cfg)
    errors += profiler_problems(cfg)
    for topic in (sequence_parallel_problems, model_architecture_problems, config_package_problems):
        topic_errors, topic_warnings = topic(cfg)
        errors += topic_errors
        warnings += topic_warnings
    if cfg.launcher.cluster == "local" and cfg.trainer.nnodes > 1:
        errors.append(f"trainer.nnodes={cfg.trainer.nnodes} needs several machines: use cluster=slurm "
                      f"(launcher.cluster), or trainer.nnodes=1 to run here")
    errors += unsupported_values(cfg)
    errors += reward_model_problems(cfg)
    errors += lora_problems(cfg)
    errors += hardware_problems(cfg)
    warnings += algorithm_warnings(cfg)
    warnings += lora_warnings(cfg)
    warnings += strategy_warnings(cfg)
    warnings += deprecated_key_warnings(cfg)
    files = missing_files(cfg)
    if check_files:
        errors += files
    else:
        warnings += [f"{f} on this machine (it must exist where the job runs)" for f in files]
    if errors:
        raise ConfigError(errors)
    return warnings


def rollout_correction_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """``algorithm.rollout_correction``: values verl would refuse at run time are refused here, and a
    key that would change nothing in this config is refused rather than ignored."""
    rc, rollout, key = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout, "algorithm.rollout_correction"
    errors, warnings = [], []
    if rc.bypass_mode and (rollout.top_p < 1.0 or rollout.top_k > 0):
        errors.append(f"{key}.bypass_mode=true takes the engine's log-probs as the PPO anchor, "
                      f"but with actor_rollout_ref.rollout.top_p={rollout.top_p} / top_k={rollout.top_k} they are "
                      f"log-probs of the truncated sampling distribution, not of the policy the actor trains; set "
                      f"top_p=1.0 and top_k=-1, or bypass_mode=false")
    if rc.rollout_is_threshold <= 0:
        errors.append(f"{key}.rollout_is_threshold={rc.rollout_is_threshold}: the cap on the IS weights must be > 0 "
                      f"(verl's default 2.0; 2-5 is usual)")
    if rc.rollout_is is None:
        for name, value, default in (("rollout_is_threshold", rc.rollout_is_threshold, 2.0),
                                     ("rollout_is_batch_normalize", rc.rollout_is_batch_normalize, False)):
            if value != default:
                errors.append(f"{key}.{name}={value} has no effect without {key}.rollout_is (token or sequence): "
                              f"set rollout_is, or leave {name} at {default}")
    try:
        parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
    except ValueError as e:
        errors.append(f"{key}.{e}")
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        errors.append(f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold} has no effect without {key}.rollout_rs "
                      f"(e.g. seq_mean_k3): set rollout_rs, or leave the threshold at null")
    if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        errors.append(f"{key}.loss_type={rc.loss_type} applies in bypass mode only (verl ignores it otherwise): set "
                      f"{key}.bypass_mode=true, or leave loss_type at ppo_clip")
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        warnings.append(f"{key}.rollout_is={rc.rollout_is} with bypass_mode and loss_type=ppo_clip: the PPO ratio is "
                        f"already current / engine policy, so the IS weights are reported (rollout_corr/rollout_is_*) "
                        f"but not applied, as in verl; loss_type=reinforce applies them")
    return errors, warnings


def size_problems(cfg: Config) -> tuple[list[str], bool]:
    """(errors, whether the sizes the batch arithmetic divides by are positive): counts, lengths,
    learning rates that must be > 0, and the attention implementations named."""
    errors: list[str] = []
    d, arr, tr = cfg.data, cfg.actor_rollout_ref, cfg.trainer
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic

    def positive(key: str, value: Optional[float], allow_zero: bool = False) -> bool:
        if value is None or value > 0 or (allow_zero and value == 0):
            return True
        errors.append(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
        return False

    ok = all([positive("trainer.nnodes", tr.nnodes), positive("trainer.n_gpus_per_node", tr.n_gpus_per_node),
              positive("data.train_batch_size", d.train_batch_size),
              positive("actor_rollout_ref.rollout.n", rollout.n),
              positive("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
              positive("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size)])
    for key, override in (("actor_rollout_ref.model", arr.model.override_config), ("critic.model", critic.model.override_config),
                          ("reward_model.model", cfg.reward_model.model.override_config)):
        attn = override.get("attn_implementation")
        if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
            errors.append(f"{key}.override_config.attn_implementation={attn!r} is not one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}{did_you_mean(str(attn), ATTN_IMPLEMENTATIONS)}")
    for key in ("data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.actor.ppo_epochs",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "critic.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.update_weights_bucket_mb",
                "actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.total_epochs",
                "trainer.total_training_steps", "actor_rollout_ref.actor.optim.lr", "critic.optim.lr"):
        ok &= positive(key, get_key(cfg, key))
    return errors, ok


def batch_size_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the batch sizes, as verl accepts them: prompts x n responses are
    spread evenly over the ranks (rlhf_hpc.distributed.rows), each rank's share is cut into mini-batches
    of ppo_mini_batch_size x n / ranks rows (rounded down; the last one may be smaller), those into
    micro-batches. Sizes are positive here (size_problems)."""
    errors: list[str] = []
    warnings: list[str] = []
    d, arr, world = cfg.data, cfg.actor_rollout_ref, cfg.world_size
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic
    if d.train_batch_size * rollout.n % world:
        errors.append(f"data.train_batch_size ({d.train_batch_size}) x actor_rollout_ref.rollout.n "
                      f"({rollout.n}) = {d.train_batch_size * rollout.n} responses must be divisible by "
                      f"the number of ranks, trainer.nnodes x trainer.n_gpus_per_node = {world}, so every "
                      f"rank trains on the same number of responses")
    for who, mbs, micro, dyn in (
            ("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
             actor.use_dynamic_bsz),
            ("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz)):
        if who == "critic" and not critic.enable:
            continue
        per_rank = per_rank_mini_batch(mbs, rollout.n, world)
        if mbs > d.train_batch_size:
            errors.append(f"{who}.ppo_mini_batch_size ({mbs}) is larger than data.train_batch_size "
                          f"({d.train_batch_size}): a step holds at most one mini-batch")
        elif per_rank == 0:
            errors.append(f"{who}.ppo_mini_batch_size ({mbs}) x actor_rollout_ref.rollout.n ({rollout.n}) "
                          f"must be at least the number of ranks ({world}): each rank needs a row per "
                          f"mini-batch")
        else:
            if d.train_batch_size % mbs:
                warnings.append(f"{who}.ppo_mini_batch_size ({mbs}) does not divide data.train_batch_size "
                                f"({d.train_batch_size}): the last mini-batch of each epoch is smaller")
            if mbs * rollout.n % world:
                warnings.append(f"{who}.ppo_mini_batch_size ({mbs}) x rollout.n ({rollout.n}) is not divisible "
                                f"by the {world} ranks: mini-batches hold {per_rank} rows per rank, "
                                f"{per_rank * world} in all")
            if not dyn and micro > per_rank:
                warnings.append(f"{who}.ppo_micro_batch_size_per_gpu ({micro}) is larger than the per-rank "
                                f"mini-batch ({per_rank}): each mini-batch runs as one micro-batch")
            elif not dyn and per_rank % micro:
                errors.append(f"{who}.ppo_micro_batch_size_per_gpu ({micro}) must divide the per-rank "
                              f"mini-batch, {who}.ppo_mini_batch_size x rollout.n / ranks = {per_rank}")
    seq_len = d.max_prompt_length + d.max_response_length
    for key in ("actor_rollout_ref.actor", "critic"):
        section = get_key(cfg, key)
        if section.use_dynamic_bsz and section.ppo_max_token_len_per_gpu < seq_len:
            errors.append(f"{key}.ppo_max_token_len_per_gpu ({section.ppo_max_token_len_per_gpu}) is smaller "
                          f"than one full sequence, data.max_prompt_length + data.max_response_length = {seq_len}")
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.ref"):
        section = get_key(cfg, key)
        if section.log_prob_use_dynamic_bsz and section.log_prob_max_token_len_per_gpu < seq_len:
            errors.append(f"{key}.log_prob_max_token_len_per_gpu ({section.log_prob_max_token_len_per_gpu}) "
                          f"is smaller than one full sequence ({seq_len} tokens)")
    return errors, warnings


def mesh_problems(cfg: Config) -> list[str]:
    """Meshes: (replicate, shard) must multiply to the world size; a tensor-parallel group of the
    rollout stays inside one node."""
    errors: list[str] = []
    world, tr, rollout = cfg.world_size, cfg.trainer, cfg.actor_rollout_ref.rollout
    if world > 0:
        for key in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config",
                    "critic.model.fsdp_config", "reward_model.model.fsdp_config"):
            size = get_key(cfg, key).fsdp_size
            if size == -1 or (size is None and not key.startswith("reward_model")):  # null: rlhf_hpc.planning.layout
                continue
            if size is None or size <= 0 or world % size:
                errors.append(f"{key}.fsdp_size ({size}) must divide the world size, trainer.nnodes x "
                              f"trainer.n_gpus_per_node = {world}, giving a (replicate, shard) mesh; "
                              f"use -1 to shard over all ranks")
        tp = rollout.tensor_model_parallel_size
        if tp and tp > 0 and (tp > tr.n_gpus_per_node or tr.n_gpus_per_node % tp):
            errors.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide "
                          f"trainer.n_gpus_per_node ({tr.n_gpus_per_node}): a tensor-parallel group stays "
                          f"inside one node")
    return errors


def registry_problems(cfg: Config) -> list[str]:
    """Names looked up in a registry (estimator, policy loss, engine, loggers): unknown ones are
    refused with the registry's names."""
    arr = cfg.actor_rollout_ref
    lookups = [(ADV_ESTIMATORS, cfg.algorithm.adv_estimator), (POLICY_LOSSES, arr.actor.policy_loss.loss_mode),
               *((TRACKERS, name) for name in cfg.trainer.logger)]
    if arr.rollout.name != AUTO:
        lookups.append((ENGINES, arr.rollout.name))
    errors = []
    for registry, name in lookups:
        try:
            registry[name]
        except ConfigError as e:
            errors += e.errors
    return errors


def policy_loss_problems(actor: ActorConfig) -> list[str]:
    """The clip ratios in the range of what they bound for the selected loss (its entry's ``clip``:
    PPO's ratio, GMPO's log-ratio, CISPO's importance weight), and no key that only another loss
    reads (an entry's ``keys``) set away from its default: it would be ignored."""
    loss = POLICY_LOSSES.get(actor.policy_loss.loss_mode)
    if loss is None:  # refused by registry_problems
        return []
    errors, low, high, clip = [], actor.clip_ratio_low, actor.clip_ratio_high, loss.clip
    if low < 0 or (clip.low_below is not None and low >= clip.low_below):
        limit = ">= 0" if clip.low_below is None else f"in [0, {clip.low_below:g})"
        errors.append(f"actor_rollout_ref.actor.clip_ratio_low ({low}) must be {limit} with "
                      f"policy_loss.loss_mode={loss.name}: it bounds {clip.meaning}")
    if high < 0:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_high ({high}) must be >= 0")
    defaults, reported = ActorConfig(), set(loss.keys)
    for other in POLICY_LOSSES.values():
        for key in other.keys:
            value, default = get_key(actor, key), get_key(defaults, key)
            if key not in reported and value != default:
                reported.add(key)
                errors.append(f"actor_rollout_ref.actor.{key}={value} is read only by policy_loss.loss_mode="
                              f"{other.name}, but the selected loss is {loss.name}: select {other.name} or "
                              f"leave the key at its default ({default})")
    return errors


def algorithm_problems(cfg: Config) -> list[str]:
    """The algorithm's and the sampler's values: clip ratios, estimators against n and the critic,
    gamma and lambda; the engine's memory share; resume_mode (what runs but is odd:
    ``algorithm_warnings``)."""
    errors: list[str] = []
    arr, tr, critic = cfg.actor_rollout_ref, cfg.trainer, cfg.critic
    actor, rollout = arr.actor, arr.rollout
    if actor.clip_ratio_c <= 1.0:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_c ({actor.clip_ratio_c}) must be > 1.0 "
                      f"(the dual-clip lower bound on the loss of negative advantages)")
    errors += registry_problems(cfg)
    errors += policy_loss_problems(actor)
    errors += dapo_problems(cfg)
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.grouped and rollout.n < 2 and est.alone == "error":
        errors.append(f"algorithm.adv_estimator={est.name} needs at least 2 responses per prompt: set "
                      f"actor_rollout_ref.rollout.n >= 2 (it is {rollout.n})")
    if est is not None and est.needs_critic and critic.enable is False:
        errors.append(f"algorithm.adv_estimator={est.name} needs a critic: set critic.enable=true (or pick one "
                      f"without: {', '.join(e.name for e in ADV_ESTIMATORS.values() if not e.needs_critic)})")
    errors += sum_pi_squared_problems(cfg, est)
    if not 0 <= cfg.algorithm.gamma <= 1 or not 0 <= cfg.algorithm.lam <= 1:
        errors.append(f"algorithm.gamma ({cfg.algorithm.gamma}) and algorithm.lam ({cfg.algorithm.lam}) "
                      f"must be in [0, 1]")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(f"actor_rollout_ref.rollout.gpu_memory_utilization ({rollout.gpu_memory_utilization}) "
                      f"must be in (0, 1]")
    if tr.resume_mode not in ("auto", "disable") and not os.path.isdir(os.path.expanduser(tr.resume_mode)):
        errors.append(f"trainer.resume_mode: '{tr.resume_mode}' is neither auto, disable nor an existing "
                      f"checkpoint directory")
    return errors


def sum_pi_squared_problems(cfg: Config, est) -> list[str]:
    """``actor.calculate_sum_pi_squared`` against the estimator (``est``: its entry, or None): one
    declaring ``needs_sum_pi_squared`` requires it (as verl does) and the old-log-prob pass that
    computes it (none in bypass mode); set without such an estimator it would only cost compute
    (verl's ``variance_proxy/`` metrics from it are not here)."""
    actor, key = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor"
    errors = []
    needs = est is not None and est.needs_sum_pi_squared
    if needs and not actor.calculate_sum_pi_squared:
        errors.append(f"algorithm.adv_estimator={est.name} weights its baseline with sum_v pi(v)^2 of the actor's "
                      f"old-log-prob pass: set {key}.calculate_sum_pi_squared=true (verl requires it as well)")
    if needs and cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(f"algorithm.adv_estimator={est.name} reads the actor's old-log-prob pass (sum_v pi(v)^2), which "
                      f"algorithm.rollout_correction.bypass_mode=true skips: set bypass_mode=false, or pick an "
                      f"estimator without it")
    if actor.calculate_sum_pi_squared and est is not None and not needs:
        errors.append(f"{key}.calculate_sum_pi_squared=true: only "
                      f"{', '.join(e.name for e in ADV_ESTIMATORS.values() if e.needs_sum_pi_squared)} read it "
                      f"(verl's variance_proxy/ metrics from it are not available here); remove the key")
    if actor.sum_pi_squared_checkpointing:
        errors.append(f"{key}.sum_pi_squared_checkpointing=true: sum_v pi(v)^2 is computed only in the old-log-prob "
                      f"pass, without gradients, one chunk of tokens at a time, so there is nothing to checkpoint; "
                      f"remove the key")
    return errors


def dapo_problems(cfg: Config) -> list[str]:
    """DAPO: the dapo reward manager's overlong shaping (reward_model.overlong_buffer) and dynamic
    sampling (algorithm.filter_groups, data.gen_batch_size; rlhf_hpc/ppo/dynamic_sampling.py)."""
    errors: list[str] = []
    rm, fg, d = cfg.reward_model, cfg.algorithm.filter_groups, cfg.data
    ob = rm.overlong_buffer
    if ob.enable and rm.reward_manager != "dapo":
        errors.append("reward_model.overlong_buffer.enable=true is the dapo reward manager's shaping: set "
                      "reward_model.reward_manager=dapo")
    if ob.enable and not 0 < ob.len <= d.max_response_length:
        errors.append(f"reward_model.overlong_buffer.len ({ob.len}) must be in (0, data.max_response_length = "
                      f"{d.max_response_length}] (the penalty grows over the last len tokens)")
    if not fg.enable:
        if d.gen_batch_size is not None and d.gen_batch_size != d.train_batch_size:
            errors.append(f"data.gen_batch_size={d.gen_batch_size} without algorithm.filter_groups.enable=true: "
                          f"a step generates data.train_batch_size prompts; set filter_groups.enable=true (DAPO's "
                          f"dynamic sampling) or remove the key")
        return errors
    if fg.metric is None:
        errors.append("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: acc, score, "
                      "seq_reward or seq_final_reward (the value whose variance over a group keeps it)")
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        errors.append(f"data.gen_batch_size ({d.gen_batch_size}) must be >= 1")
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        errors.append("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the "
                      "groups are chosen before the log-probs the KL needs exist (verl's DAPO trainer cannot run "
                      "it either); use seq_reward, or use_kl_in_reward=false")
    if cfg.reward_model.enable:
        errors.append("algorithm.filter_groups.enable=true with reward_model.enable=true: dynamic sampling scores "
                      "with the rule/custom reward function only here")
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.needs_greedy_baseline:
        errors.append(f"algorithm.filter_groups.enable=true with algorithm.adv_estimator={est.name}: dynamic "
                      f"sampling does not generate the greedy baseline responses")
    return errors


def algorithm_warnings(cfg: Config) -> list[str]:
    """Values verl runs as they are, though they are rarely meant: one line each."""
    warnings: list[str] = []
    rollout = cfg.actor_rollout_ref.rollout
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.grouped and rollout.n < 2 and est.alone != "error":
        what = ("every advantage is 0 (nothing is learned)" if est.alone == "zero" else
                "the advantages come from each response's own score, with no baseline")
        warnings.append(f"algorithm.adv_estimator={est.name} with actor_rollout_ref.rollout.n={rollout.n}: every "
                        f"group holds one response, so its baseline is 0 (as in verl) and {what}; set "
                        f"actor_rollout_ref.rollout.n >= 2 to compare responses to one prompt")
    # greedy decoding gives n identical responses: the engine generates each once and repeats it
    # (vLLM refuses n > 1 with greedy sampling), as verl's n requests of one response each would
    for key, section in (("actor_rollout_ref.rollout", rollout), ("actor_rollout_ref.rollout.val_kwargs", rollout.val_kwargs)):
        greedy = not section.do_sample or section.temperature == 0
        if greedy and section.n > 1:
            why = f"{key}.do_sample=false" if not section.do_sample else f"{key}.temperature=0"
            what = ("the validation scores equal n=1's, at n times the reward calls" if section is rollout.val_kwargs
                    else "a grouped estimator gives them all advantage 0")
            warnings.append(f"{why} (greedy decoding) with {key}.n={section.n}: the {section.n} responses to a prompt "
                            f"are one greedy response repeated; {what} (set {key}.n=1, or {key}.do_sample=true with "
                            f"{key}.temperature > 0)")
    return warnings


def strategy_warnings(cfg: Config) -> list[str]:
    fsdp1 = [key for key in ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
             if get_key(cfg, key) == "fsdp"]
    fsdp1 += ["reward_model.strategy"] if cfg.reward_model.enable and cfg.reward_model.strategy == "fsdp" else []
    if not fsdp1:
        return []
    return [f"{', '.join(k + '=fsdp' for k in fsdp1)}: the engine here is FSDP2 (fully_shard) whatever "
            f"the strategy; verl's fsdp would be FSDP1. Set fsdp2 to say what runs"]


def unsupported_values(cfg: Config) -> list[str]:
    """Keys the config has (verl's names) for features this project does not have: their default
    is accepted, any other value refused here, so no key is taken and then ignored."""
    errors = []
    d, arr = cfg.data, cfg.actor_rollout_ref
    # inference-only models: no gradients to reduce, no optimizer to offload
    for key in ("actor_rollout_ref.ref.fsdp_config", "reward_model.model.fsdp_config"):
        fsdp = get_key(cfg, key)
        if fsdp.mixed_precision.reduce_dtype not in ("float32", "fp32"):
            errors.append(f"{key}.mixed_precision.reduce_dtype={fsdp.mixed_precision.reduce_dtype}: this model only "
                          f"runs forward passes, so no gradient is ever reduced; remove the key")
    if arr.ref.fsdp_config.optimizer_offload:
        errors.append("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true: the reference model has no optimizer; "
                      "use actor_rollout_ref.ref.fsdp_config.param_offload to move its weights to the host")
    if d.dataloader_num_workers != 0:
        errors.append(f"data.dataloader_num_workers={d.dataloader_num_workers}: there is no data loader pool here "
                      f"(prompts are tokenised once at start-up); remove the key or set it to 0")
    if d.reward_fn_key != "data_source":
        errors.append(f"data.reward_fn_key={d.reward_fn_key!r}: rewards are chosen by the data_source column only; "
                      f"remove the key")
    if not arr.hybrid_engine:
        errors.append("actor_rollout_ref.hybrid_engine=false: only the hybrid engine exists here (actor and rollout "
                      "share the GPUs); remove the key")
    if cfg.trainer.log_val_generations < 0:
        errors.append(f"trainer.log_val_generations={cfg.trainer.log_val_generations}: the number of validation "
                      f"generations to log must be 0 (none) or more")
    if cfg.trainer.val_only and not d.val_files:
        errors.append("trainer.val_only=true: an evaluation run needs a validation set; set data.val_files")
    for key in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config",
                "critic.model.fsdp_config", "reward_model.model.fsdp_config"):
        if get_key(cfg, key).mixed_precision.buffer_dtype not in ("float32", "fp32"):
            errors.append(f"{key}.mixed_precision.buffer_dtype: FSDP2 keeps buffers in the model's dtype; only "
                          f"float32 is accepted")
    template = arr.model.custom_chat_template
    if template is not None:
        import jinja2
        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            errors.append(f"actor_rollout_ref.model.custom_chat_template: not a valid Jinja template ({e})")
    for key in ("actor_rollout_ref.model.external_lib", "critic.model.external_lib", "reward_model.model.external_lib"):
        lib = get_key(cfg, key)
        if lib and _module_missing(lib):
            errors.append(f"{key}={lib!r}: no such Python module here (it must be importable by the workers)")
    return errors


def _module_missing(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


# ---------------------------------------------------------------------------------- entry points
