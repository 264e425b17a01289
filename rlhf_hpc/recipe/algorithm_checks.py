"""The algorithm's keys checked together: estimator, policy loss, clip ratios, DAPO, the rollout
correction's thresholds; names looked up in their registries. Part of ``recipe.config_checks.validate``."""

from __future__ import annotations

import os

from rlhf_hpc.config.engines import AUTO, ENGINES
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import ActorConfig, Config
from rlhf_hpc.config.trackers import TRACKERS
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS
from rlhf_hpc.ops.policy_losses import POLICY_LOSSES
from rlhf_hpc.ops.rollout_corr_helper import parse_is_threshold, parse_rejection

__all__ = ["algorithm_problems", "algorithm_warnings", "rollout_correction_problems"]


def rollout_correction_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """``algorithm.rollout_correction``: values verl would refuse at run time are refused here, and a
    key that would change nothing in this config is refused rather than ignored."""
    rc, rollout, key = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout, "algorithm.rollout_correction"
    errors, warnings = [], []
    if rc.bypass_mode and (rollout.top_p < 1.0 or rollout.top_k > 0):
        errors.append(
            f"{key}.bypass_mode=true takes the engine's log-probs as the PPO anchor, "
            f"but with actor_rollout_ref.rollout.top_p={rollout.top_p} / top_k={rollout.top_k} they are "
            f"log-probs of the truncated sampling distribution, not of the policy the actor trains; set "
            f"top_p=1.0 and top_k=-1, or bypass_mode=false"
        )
    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        errors.append(f"{key}.{e}")
    if rc.rollout_is is None:
        for name, value, default in (
            ("rollout_is_threshold", rc.rollout_is_threshold, 2.0),
            ("rollout_is_batch_normalize", rc.rollout_is_batch_normalize, False),
        ):
            if value != default:
                errors.append(
                    f"{key}.{name}={value} has no effect without {key}.rollout_is (token or sequence): "
                    f"set rollout_is, or leave {name} at {default}"
                )
    try:
        parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
    except ValueError as e:
        errors.append(f"{key}.{e}")
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        errors.append(
            f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold} has no effect without {key}.rollout_rs "
            f"(e.g. seq_mean_k3): set rollout_rs, or leave the threshold at null"
        )
    if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        errors.append(
            f"{key}.loss_type={rc.loss_type} applies in bypass mode only (verl ignores it otherwise): set "
            f"{key}.bypass_mode=true, or leave loss_type at ppo_clip"
        )
    loss = POLICY_LOSSES.get(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
    if loss is not None and loss.bypass_only and not rc.bypass_mode:
        errors.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss.name} is the loss of {key}.bypass_mode=true "
            f"(verl's trainer selects it there itself): set {key}.bypass_mode=true, or another loss_mode"
        )
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        warnings.append(
            f"{key}.rollout_is={rc.rollout_is} with bypass_mode and loss_type=ppo_clip: the PPO ratio is "
            f"already current / engine policy, so the IS weights are reported (rollout_corr/rollout_is_*) "
            f"but not applied, as in verl; loss_type=reinforce applies them"
        )
    return errors, warnings


def registry_problems(cfg: Config) -> list[str]:
    """Names looked up in a registry (estimator, policy loss, engine, loggers): unknown ones are
    refused with the registry's names."""
    arr = cfg.actor_rollout_ref
    lookups = [
        (ADV_ESTIMATORS, cfg.algorithm.adv_estimator),
        (POLICY_LOSSES, arr.actor.policy_loss.loss_mode),
        *((TRACKERS, name) for name in cfg.trainer.logger),
    ]
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
        errors.append(
            f"actor_rollout_ref.actor.clip_ratio_low ({low}) must be {limit} with "
            f"policy_loss.loss_mode={loss.name}: it bounds {clip.meaning}"
        )
    if high < 0:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_high ({high}) must be >= 0")
    if loss.check is not None:
        errors += loss.check(actor)
    defaults, reported = ActorConfig(), set(loss.keys)
    for other in POLICY_LOSSES.values():
        for key in other.keys:
            value, default = get_key(actor, key), get_key(defaults, key)
            if key not in reported and value != default:
                reported.add(key)
                errors.append(
                    f"actor_rollout_ref.actor.{key}={value} is read only by policy_loss.loss_mode="
                    f"{other.name}, but the selected loss is {loss.name}: select {other.name} or "
                    f"leave the key at its default ({default})"
                )
    return errors


def algorithm_problems(cfg: Config) -> list[str]:
    """The algorithm's and the sampler's values: clip ratios, estimators against n and the critic,
    gamma and lambda; the engine's memory share; resume_mode (what runs but is odd:
    ``algorithm_warnings``)."""
    errors: list[str] = []
    arr, tr, critic = cfg.actor_rollout_ref, cfg.trainer, cfg.critic
    actor, rollout = arr.actor, arr.rollout
    if actor.clip_ratio_c <= 1.0:
        errors.append(
            f"actor_rollout_ref.actor.clip_ratio_c ({actor.clip_ratio_c}) must be > 1.0 "
            f"(the dual-clip lower bound on the loss of negative advantages)"
        )
    errors += registry_problems(cfg)
    errors += policy_loss_problems(actor)
    errors += dapo_problems(cfg)
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.grouped and rollout.n < 2 and est.alone == "error":
        errors.append(
            f"algorithm.adv_estimator={est.name} needs at least 2 responses per prompt: set "
            f"actor_rollout_ref.rollout.n >= 2 (it is {rollout.n})"
        )
    if est is not None and est.needs_critic and critic.enable is False:
        errors.append(
            f"algorithm.adv_estimator={est.name} needs a critic: set critic.enable=true (or pick one "
            f"without: {', '.join(e.name for e in ADV_ESTIMATORS.values() if not e.needs_critic)})"
        )
    errors += sum_pi_squared_problems(cfg, est)
    errors += reward_component_problems(cfg, est)
    pf = cfg.algorithm.pf_ppo
    if cfg.algorithm.use_pf_ppo and est is not None and not est.needs_critic:
        errors.append(
            f"algorithm.use_pf_ppo=true resamples after GAE's advantages only (verl ignores it with other "
            f"estimators): set algorithm.adv_estimator=gae, or use_pf_ppo=false (adv_estimator is {est.name})"
        )
    if (pf.reweight_method != "pow" or pf.weight_pow != 2.0) and not cfg.algorithm.use_pf_ppo:
        errors.append(
            "algorithm.pf_ppo.* is read only with algorithm.use_pf_ppo=true: set it, or leave pf_ppo at its defaults"
        )
    if not 0 <= cfg.algorithm.gamma <= 1 or not 0 <= cfg.algorithm.lam <= 1:
        errors.append(
            f"algorithm.gamma ({cfg.algorithm.gamma}) and algorithm.lam ({cfg.algorithm.lam}) must be in [0, 1]"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"actor_rollout_ref.rollout.gpu_memory_utilization ({rollout.gpu_memory_utilization}) must be in (0, 1]"
        )
    if tr.resume_mode not in ("auto", "disable") and not os.path.isdir(os.path.expanduser(tr.resume_mode)):
        errors.append(
            f"trainer.resume_mode: '{tr.resume_mode}' is neither auto, disable nor an existing checkpoint directory"
        )
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
        errors.append(
            f"algorithm.adv_estimator={est.name} weights its baseline with sum_v pi(v)^2 of the actor's "
            f"old-log-prob pass: set {key}.calculate_sum_pi_squared=true (verl requires it as well)"
        )
    if needs and cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(
            f"algorithm.adv_estimator={est.name} reads the actor's old-log-prob pass (sum_v pi(v)^2), which "
            f"algorithm.rollout_correction.bypass_mode=true skips: set bypass_mode=false, or pick an "
            f"estimator without it"
        )
    if actor.calculate_sum_pi_squared and est is not None and not needs:
        errors.append(
            f"{key}.calculate_sum_pi_squared=true: only "
            f"{', '.join(e.name for e in ADV_ESTIMATORS.values() if e.needs_sum_pi_squared)} read it "
            f"(verl's variance_proxy/ metrics from it are not available here); remove the key"
        )
    if actor.sum_pi_squared_checkpointing:
        errors.append(
            f"{key}.sum_pi_squared_checkpointing=true: sum_v pi(v)^2 is computed only in the old-log-prob "
            f"pass, without gradients, one chunk of tokens at a time, so there is nothing to checkpoint; "
            f"remove the key"
        )
    return errors


def reward_component_problems(cfg: Config, est) -> list[str]:
    """gdpo's keys (``est``: the estimator's entry, or None): an estimator declaring
    ``needs_reward_components`` needs ``algorithm.gdpo_reward_keys`` (verl asserts them) from the reward
    function's dict (no reward model: its score is one number), weights one per key; the keys set
    with another estimator would be ignored."""
    alg, errors = cfg.algorithm, []
    needs = est is not None and est.needs_reward_components
    keys, weights = alg.gdpo_reward_keys, alg.gdpo_reward_weights
    if needs and not keys:
        errors.append(
            f"algorithm.adv_estimator={est.name} normalises each reward component apart: set "
            f"algorithm.gdpo_reward_keys to the keys of your reward function's dict result (e.g. "
            f"[format_reward,accuracy_reward]; verl requires them as well)"
        )
    if needs and keys and cfg.reward_model.enable:
        errors.append(
            f"algorithm.adv_estimator={est.name} reads its components from the reward function's dict, "
            f"but reward_model.enable=true scores with a reward model (one number per response): disable "
            f"the reward model, or pick another estimator"
        )
    if needs and keys and weights is not None and len(weights) != len(keys):
        errors.append(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} "
            f"gdpo_reward_keys: give one weight per key, or null (1 each)"
        )
    if not needs and est is not None and (keys or weights is not None):
        errors.append(
            f"algorithm.gdpo_reward_keys / gdpo_reward_weights are read only by adv_estimator=gdpo, "
            f"but the estimator is {est.name}: select gdpo or remove them"
        )
    return errors


def dapo_problems(cfg: Config) -> list[str]:
    """DAPO: the dapo reward manager's overlong shaping (reward_model.overlong_buffer) and dynamic
    sampling (algorithm.filter_groups, data.gen_batch_size; rlhf_hpc/ppo/dynamic_sampling.py)."""
    errors: list[str] = []
    rm, fg, d = cfg.reward_model, cfg.algorithm.filter_groups, cfg.data
    ob = rm.overlong_buffer
    if ob.enable and rm.reward_manager != "dapo":
        errors.append(
            "reward_model.overlong_buffer.enable=true is the dapo reward manager's shaping: set "
            "reward_model.reward_manager=dapo"
        )
    if ob.enable and not 0 < ob.len <= d.max_response_length:
        errors.append(
            f"reward_model.overlong_buffer.len ({ob.len}) must be in (0, data.max_response_length = "
            f"{d.max_response_length}] (the penalty grows over the last len tokens)"
        )
    if not fg.enable:
        if d.gen_batch_size is not None and d.gen_batch_size != d.train_batch_size and cfg.split:
            errors.append(
                f"data.gen_batch_size={d.gen_batch_size} in the split layout (verl's fully-async streaming, "
                f"{d.gen_batch_size} prompt(s) at a time) is not built: the rollout ranks generate a step's "
                f"data.train_batch_size prompts together; remove the key"
            )
        elif d.gen_batch_size is not None and d.gen_batch_size != d.train_batch_size:
            errors.append(
                f"data.gen_batch_size={d.gen_batch_size} without algorithm.filter_groups.enable=true: "
                f"a step generates data.train_batch_size prompts; set filter_groups.enable=true (DAPO's "
                f"dynamic sampling) or remove the key"
            )
        return errors
    if fg.metric is None:
        errors.append(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: acc, score, "
            "seq_reward or seq_final_reward (the value whose variance over a group keeps it)"
        )
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        errors.append(f"data.gen_batch_size ({d.gen_batch_size}) must be >= 1")
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        errors.append(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the "
            "groups are chosen before the log-probs the KL needs exist (verl's DAPO trainer cannot run "
            "it either); use seq_reward, or use_kl_in_reward=false"
        )
    if cfg.reward_model.enable:
        errors.append(
            "algorithm.filter_groups.enable=true with reward_model.enable=true: dynamic sampling scores "
            "with the rule/custom reward function only here"
        )
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.needs_greedy_baseline:
        errors.append(
            f"algorithm.filter_groups.enable=true with algorithm.adv_estimator={est.name}: dynamic "
            f"sampling does not generate the greedy baseline responses"
        )
    return errors


def algorithm_warnings(cfg: Config) -> list[str]:
    """Values verl runs as they are, though they are rarely meant: one line each."""
    warnings: list[str] = []
    rollout = cfg.actor_rollout_ref.rollout
    est = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if est is not None and est.grouped and rollout.n < 2 and est.alone != "error":
        what = (
            "every advantage is 0 (nothing is learned)"
            if est.alone == "zero"
            else "the advantages come from each response's own score, with no baseline"
        )
        warnings.append(
            f"algorithm.adv_estimator={est.name} with actor_rollout_ref.rollout.n={rollout.n}: every "
            f"group holds one response, so its baseline is 0 (as in verl) and {what}; set "
            f"actor_rollout_ref.rollout.n >= 2 to compare responses to one prompt"
        )
    # greedy decoding gives n identical responses: the engine generates each once and repeats it
    # (vLLM refuses n > 1 with greedy sampling), as verl's n requests of one response each would
    for key, section in (
        ("actor_rollout_ref.rollout", rollout),
        ("actor_rollout_ref.rollout.val_kwargs", rollout.val_kwargs),
    ):
        # (a multi-turn run reads no do_sample, as verl's agent loop: step_batch.sampling_for)
        by_flag = not section.do_sample and not rollout.multi_turn.enable
        if (by_flag or section.temperature == 0) and section.n > 1:
            why = f"{key}.do_sample=false" if by_flag else f"{key}.temperature=0"
            what = (
                "the validation scores equal n=1's, at n times the reward calls"
                if section is rollout.val_kwargs
                else "a grouped estimator gives them all advantage 0"
            )
            warnings.append(
                f"{why} (greedy decoding) with {key}.n={section.n}: the {section.n} responses to a prompt "
                f"are one greedy response repeated; {what} (set {key}.n=1, or {key}.do_sample=true with "
                f"{key}.temperature > 0)"
            )
    return warnings
