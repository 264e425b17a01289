"""verl keys of features this project does not have.

A verl user's command line carries keys for features that do not exist here (asynchronous and
multi-turn rollout, the reward loop, LoRA, ...). Such a key is refused with
a message that names the feature, not as an unknown key; where its value switches nothing on
(verl's "off" value, e.g. ``actor_rollout_ref.rollout.mode=sync``), it is accepted and dropped,
since it asks for nothing this project would not do anyway. Keys this project does have are in
``rlhf_hpc.config``; anything in neither place is an unknown key.
"""
from __future__ import annotations

from typing import Any, Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.tree import flatten

__all__ = ["drop_out_of_scope_keys"]

# (key, or a prefix ending in "."; values that switch the feature off, or None: any value is refused;
#  the feature, as the message names it)
OUT_OF_SCOPE: list[tuple[str, Optional[tuple], str]] = [
    ("actor_rollout_ref.rollout.mode", ("sync",),
     "asynchronous rollout (verl's agent-loop rollout server); generation here runs synchronously inside "
     "every trainer rank (colocated vLLM)"),
    ("actor_rollout_ref.rollout.multi_turn.enable", (False,), "multi-turn rollout with tools"),
    ("actor_rollout_ref.rollout.multi_turn.format", ("hermes",), "multi-turn rollout with tools"),
    ("actor_rollout_ref.rollout.multi_turn.", None, "multi-turn rollout with tools"),
    ("actor_rollout_ref.rollout.agent.", None, "the agent loop (asynchronous multi-turn rollout)"),
    ("data.return_raw_chat", (False,), "raw chat prompts for the asynchronous / multi-turn rollout"),
    ("reward_model.use_reward_loop", (False,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.rollout.", None, "the reward loop (reward models served by their own rollout)"),
    ("reward_model.num_workers", None, "the reward loop (reward models served by their own rollout)"),
    ("reward_model.sandbox_fusion.", None, "sandbox fusion (rewards from executing code)"),
    ("reward_model.micro_batch_size", (None,),
     "the deprecated global micro-batch size: use reward_model.micro_batch_size_per_gpu"),
    ("reward_model.enable_resource_pool", (False,),
     "a separate resource pool for the reward model (it shares the training mesh here)"),
    ("reward_model.n_gpus_per_node", (0,), "a separate resource pool for the reward model (it shares the training mesh here)"),
    ("reward_model.nnodes", (0,), "a separate resource pool for the reward model (it shares the training mesh here)"),
    ("reward_model.launch_reward_fn_async", (False,), "asynchronous reward functions"),
    ("reward_model.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallelism"),
    ("reward_model.model.use_shm", (False,), "loading the model through /dev/shm"),
    ("reward_model.model.use_fused_kernels", (False,), "verl's fused kernels"),
    ("reward_model.reward_loop_source", ("register",), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.reward_loop_module_path", (None,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.reward_loop_class_name", (None,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.profiler.", None, "per-worker profiler settings (use global_profiler)"),
    ("reward_model.", None, "this reward-model option"),
    ("trainer.use_legacy_worker_impl", ("auto",),
     "verl's choice between its worker implementations (there is one here)"),
    ("actor_rollout_ref.model.use_fused_kernels", (False,), "verl's fused log-prob kernels"),
    ("actor_rollout_ref.model.fused_kernel_options.", None, "verl's fused log-prob kernels"),
    ("actor_rollout_ref.rollout.layered_summon", (False,), "LoRA training (layered summon)"),
    ("actor_rollout_ref.model.use_shm", (False,), "loading the model through /dev/shm"),
    ("actor_rollout_ref.rollout.load_format", ("dummy",),
     "engine weight loading: the engine starts from dummy weights and receives the actor's by the weight sync"),
    ("actor_rollout_ref.rollout.engine_kwargs", ({},), "engine-specific keyword arguments (rollout.engine_kwargs)"),
    ("actor_rollout_ref.rollout.engine_kwargs.", None, "engine-specific keyword arguments (rollout.engine_kwargs)"),
    ("actor_rollout_ref.actor.use_torch_compile", (False,), "torch.compile of the log-prob computation"),
    ("actor_rollout_ref.ref.use_torch_compile", (False,), "torch.compile of the log-prob computation"),
    ("algorithm.use_pf_ppo", (False,), "PF-PPO (reweighted sampling of the batch)"),
    ("algorithm.pf_ppo.", None, "PF-PPO (reweighted sampling of the batch)"),
    ("trainer.val_only", (False,), "validation-only runs"),
    # verl's deprecated global micro-batch sizes: the per-GPU keys are the ones that exist here
    ("actor_rollout_ref.actor.ppo_micro_batch_size", (None,),
     "the deprecated global micro-batch size: use actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("critic.ppo_micro_batch_size", (None,),
     "the deprecated global micro-batch size: use critic.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size", (None,),
     "the deprecated global micro-batch size: use actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", (None,),
     "the deprecated global micro-batch size: use actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
]


def _rule(key: str, known: set[str]) -> Optional[tuple[str, Optional[tuple], str]]:
    for rule in OUT_OF_SCOPE:
        pattern = rule[0]
        if key == pattern or (pattern.endswith(".") and key.startswith(pattern) and key not in known):
            return rule
    return None


def _same(value: Any, allowed: tuple) -> bool:
    # YAML gives True/False/None; a command line may say "False"/"none" as strings
    for a in allowed:
        if value == a and type(value) is type(a):
            return True
        if isinstance(value, str) and str(a).lower() == value.lower():
            return True
    return False


def drop_out_of_scope_keys(tree: dict, known: set[str]) -> dict:
    """The recipe tree without verl keys that switch off a feature missing here; raises
    ``ConfigError`` naming the feature for any that would switch one on. ``known``: the dotted
    keys the config has (they are never touched)."""
    errors, drop = [], []
    for key, value in flatten(tree).items():
        if key in known:
            continue
        rule = _rule(key, known)
        if rule is None:
            continue
        pattern, allowed, feature = rule
        if allowed is not None and _same(value, allowed):
            drop.append(key)
        else:
            hint = f" (accepted here: {pattern}={allowed[0]})" if allowed else " (remove the key)"
            errors.append(f"{key}={value!r}: {feature} is not available in rlhf-hpc{hint}")
    if errors:
        raise ConfigError(errors)
    out = _copy(tree)
    for key in drop:
        _delete(out, key.split("."))
    return out


def _copy(tree: Any) -> Any:
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _delete(node: dict, parts: list[str]) -> None:
    if len(parts) == 1:
        node.pop(parts[0], None)
        return
    child = node.get(parts[0])
    if isinstance(child, dict):
        _delete(child, parts[1:])
        if not child:
            node.pop(parts[0])
