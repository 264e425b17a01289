"""verl keys of features this project does not have, or does another way.

A verl user's command line carries keys for features that do not exist here (asynchronous and
multi-turn rollout, the reward loop, the Megatron backend, ...). Such a key is refused with a message that names
the feature, not as an unknown key; where its value switches nothing on (verl's "off" value, e.g.
``actor_rollout_ref.rollout.trace.token2text=False``), it is accepted and dropped, since it asks for
nothing this project would not do anyway (``OUT_OF_SCOPE``). A few verl values ask for something
this project does in its own way, to the same effect (the engine's log-probs, LoRA's weight
loading, ``rollout.mode=async`` on a single-turn run): they are accepted and dropped too, with the
reason (``SAME_EFFECT``; a ``note`` is printed at launch where the run differs from what a verl user
would picture). A value of a key this project has that names a verl feature it lacks
(``trainer.device=npu``) is refused by that name too (``OUT_OF_SCOPE_VALUES``), and verl's
deprecated global micro-batch sizes become the per-GPU sizes verl's workers compute from them
(``GLOBAL_MICRO_BATCHES``). Keys this project does have are in ``rlhf_hpc.config``; anything in
neither place is an unknown key.
"""

from __future__ import annotations

from typing import Any, Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import flatten

__all__ = ["GLOBAL_MICRO_BATCHES", "OUT_OF_SCOPE", "OUT_OF_SCOPE_VALUES", "SAME_EFFECT", "drop_out_of_scope_keys"]

# verl's megatron.* keys a verl command line sets, and what does that job under FSDP2 here
_MEGATRON_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "param_offload",
    "grad_offload",
    "optimizer_offload",
    "use_dist_checkpointing",
    "dist_checkpointing_path",
    "use_mbridge",
    "seed",
)


def _fsdp2_equivalent(section: str, key: str) -> str:
    fsdp = f"{section}.fsdp_config" if section != "critic" else "critic.model.fsdp_config"
    sp = (
        f"{section}.ulysses_sequence_parallel_size"
        if section != "actor_rollout_ref.ref"
        else "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    )
    if key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    ):
        return f"FSDP2 shards every weight, experts included, over {fsdp}.fsdp_size ranks (-1: all)"
    if key in ("context_parallel_size", "sequence_parallel"):
        return f"long sequences are split by Ulysses: {sp}"
    if key in ("param_offload", "optimizer_offload"):
        return f"{fsdp}.{key}"
    if key == "grad_offload":
        return f"{fsdp}.offload_policy offloads gradients with the parameters"
    if key == "seed":
        return "trainer.seed"
    return (
        "checkpoints are written by FSDP2's distributed checkpoint; python launch.py export writes a Hugging Face model"
    )


# (key, or a prefix ending in "."; values that switch the feature off, or None: any value is refused;
#  the feature, as the message names it)
OUT_OF_SCOPE: list[tuple[str, Optional[tuple], str]] = [
    (
        "actor_rollout_ref.rollout.mode",
        ("sync",),
        "asynchronous rollout (verl's agent-loop rollout server); generation here runs synchronously inside "
        "every trainer rank (colocated vLLM)",
    ),
    ("actor_rollout_ref.rollout.agent.", None, "the agent loop (asynchronous multi-turn rollout)"),
    ("data.return_raw_chat", (False,), "raw chat prompts for the asynchronous / multi-turn rollout"),
    ("reward_model.use_reward_loop", (False,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.rollout.", None, "the reward loop (reward models served by their own rollout)"),
    ("reward_model.num_workers", None, "the reward loop (reward models served by their own rollout)"),
    (
        "reward_model.micro_batch_size",
        (None,),
        "the deprecated global micro-batch size: use reward_model.micro_batch_size_per_gpu",
    ),
    (
        "reward_model.enable_resource_pool",
        (False,),
        "a separate resource pool for the reward model (it shares the training mesh here)",
    ),
    (
        "reward_model.n_gpus_per_node",
        (0,),
        "a separate resource pool for the reward model (it shares the training mesh here)",
    ),
    ("reward_model.nnodes", (0,), "a separate resource pool for the reward model (it shares the training mesh here)"),
    ("reward_model.launch_reward_fn_async", (False,), "asynchronous reward functions"),
    ("reward_model.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallelism"),
    ("reward_model.model.use_shm", (False,), "loading the model through /dev/shm"),
    ("reward_model.model.use_fused_kernels", (False,), "verl's fused kernels"),
    ("reward_model.reward_loop_source", ("register",), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.reward_loop_module_path", (None,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.reward_loop_class_name", (None,), "the reward loop (reward models served by their own rollout)"),
    ("reward_model.profiler.", None, "per-worker profiler settings (use global_profiler)"),
    (
        "trainer.use_legacy_worker_impl",
        ("auto",),
        "verl's choice between its worker implementations (there is one here)",
    ),
    ("actor_rollout_ref.model.use_fused_kernels", (False,), "verl's fused log-prob kernels"),
    ("actor_rollout_ref.model.fused_kernel_options.", None, "verl's fused log-prob kernels"),
    ("actor_rollout_ref.model.use_shm", (False,), "loading the model through /dev/shm"),
    (
        "actor_rollout_ref.rollout.load_format",
        ("dummy",),
        "engine weight loading: the engine starts from dummy weights and receives the actor's by the weight sync",
    ),
    # verl's defaults of features not here (CheckpointConfig, TraceConfig, entropy memory savers)
    *[
        (f"{section}.checkpoint.{key}", (value,), feature)
        for section in ("actor_rollout_ref.actor", "critic")
        for key, value, feature in (("async_save", False, "asynchronous checkpoint writes"),)
    ],
    *[
        (f"actor_rollout_ref.rollout.trace.{key}", off, "rollout tracing (weave / mlflow traces of the agent loop)")
        for key, off in (
            ("backend", (None,)),
            ("token2text", (False,)),
            ("max_samples_per_step_per_worker", (None,)),
            ("", None),
        )
    ],
    (
        "actor_rollout_ref.rollout.over_sample_rate",
        (0,),
        "over-sampling in the asynchronous rollout (the slowest requests aborted)",
    ),
    (
        "actor_rollout_ref.rollout.data_parallel_size",
        (1,),
        "data parallelism inside the rollout engine "
        "(the engine's data-parallel groups here are the trainer's ranks over rollout.tensor_model_parallel_size)",
    ),
    ("actor_rollout_ref.rollout.expert_parallel_size", (1,), "expert parallelism in the rollout engine"),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        ("naive",),
        "verl's checkpoint engines (weight-transfer backends); the weights go to the engine in place here",
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs",
        ({},),
        "verl's checkpoint engines (weight-transfer backends); the weights go to the engine in place here",
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.",
        None,
        "verl's checkpoint engines (weight-transfer backends); the weights go to the engine in place here",
    ),
    *[
        (f"{model}.enable_activation_offload", (False,), "activation offloading")
        for model in ("actor_rollout_ref.model", "critic.model")
    ],
    ("actor_rollout_ref.actor.use_prefix_grouper", (False,), "the prefix grouper (one forward of a shared prompt)"),
    *[
        (f"{role}.profiler.{key}", (value,), "per-worker profiler settings (use global_profiler)")
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic")
        for key, value in (("enable", False), ("all_ranks", False), ("ranks", []))
    ],
    *[
        (f"{role}.profiler.", None, "per-worker profiler settings (use global_profiler)")
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic")
    ],
    ("global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries", (100000,), "the torch_memory profiler"),
    ("global_profiler.global_tool_config.torch_memory.stack_depth", (32,), "the torch_memory profiler"),
    (
        "global_profiler.global_tool_config.nsys.discrete",
        (False,),
        "per-phase Nsight Systems traces (launcher.nsys=true traces the whole job, phases as NVTX ranges)",
    ),
    ("global_profiler.global_tool_config.", None, "per-tool profiler settings (the profiler here is torch.profiler)"),
    ("global_profiler.profile_continuous_steps", (False,), "one profile over consecutive steps"),
    # multi-modal data
    ("data.image_key", ("images",), "multi-modal (image / video) prompts"),
    ("data.video_key", ("videos",), "multi-modal (image / video) prompts"),
    ("data.return_multi_modal_inputs", (True,), "multi-modal (image / video) prompts"),
    ("actor_rollout_ref.actor.freeze_vision_tower", (False,), "multi-modal (image / video) prompts"),
    (
        "data.trust_remote_code",
        (False,),
        "remote code for the data's processor (the tokenizer follows actor_rollout_ref.model.trust_remote_code)",
    ),
    ("data.sampler.class_path", (None,), "custom data samplers (curriculum learning)"),
    ("data.sampler.class_name", (None,), "custom data samplers (curriculum learning)"),
    # (DAPO: algorithm.filter_groups, data.gen_batch_size and reward_model.overlong_buffer are keys here;
    # verl's reward_model.reward_kwargs.{overlong_buffer_cfg.*, max_resp_len} become them: _dapo_reward_kwargs)
    (
        "reward_model.reward_kwargs.",
        None,
        "other keyword arguments of the reward manager (reward_kwargs: overlong_buffer_cfg.* and max_resp_len only)",
    ),
    # checkpoints and resuming, in this project's keys
    ("trainer.max_actor_ckpt_to_keep", (None,), "per-model checkpoint retention (use trainer.max_ckpt_to_keep)"),
    ("trainer.max_critic_ckpt_to_keep", (None,), "per-model checkpoint retention (use trainer.max_ckpt_to_keep)"),
    (
        "trainer.resume_from_path",
        (None,),
        "verl's resume_from_path (use trainer.resume_mode=<a global_step_N directory>)",
    ),
    (
        "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",
        None,
        "multi-modal (image / video) prompts",
    ),
    ("actor_rollout_ref.rollout.engine_kwargs", ({},), "engine-specific keyword arguments (rollout.engine_kwargs)"),
    ("actor_rollout_ref.rollout.engine_kwargs.", None, "engine-specific keyword arguments (rollout.engine_kwargs)"),
    ("actor_rollout_ref.actor.use_torch_compile", (False,), "torch.compile of the log-prob computation"),
    ("actor_rollout_ref.ref.use_torch_compile", (False,), "torch.compile of the log-prob computation"),
    # verl's Megatron backend: each key refused with what does its job under FSDP2 here
    *[
        (
            f"{section}.megatron.{key}",
            None,
            f"the Megatron backend (FSDP2 trains here; {_fsdp2_equivalent(section, key)})",
        )
        for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
        for key in _MEGATRON_KEYS
    ],
    *[
        (f"{section}.megatron.", None, "the Megatron backend (FSDP2 trains here: remove the megatron.* keys)")
        for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
    ],
    *[
        (
            f"{section}.optim.clip_grad",
            None,
            f"Megatron's optimizer key clip_grad (FSDP2 trains here; its gradient clip is {section}.grad_clip)",
        )
        for section in ("actor_rollout_ref.actor", "critic")
    ],
    ("reward_model.", None, "this reward-model option"),
    *[
        (
            f"actor_rollout_ref.actor.router_replay.{key}",
            (None,),
            "routing decisions recorded to or replayed from a file (routing replay here carries the "
            "engine's routing in the step's batch: actor.router_replay.mode=R3)",
        )
        for key in ("record_file", "replay_file")
    ],
]


def _dapo_reward_kwargs(tree: dict, flat: dict, errors: list[str]) -> dict:
    """verl's ``reward_model.reward_kwargs.overlong_buffer_cfg.*`` (the dapo reward manager's keyword
    arguments) as ``reward_model.overlong_buffer.*``; ``reward_kwargs.max_resp_len`` must be
    ``data.max_response_length``, which the shaping here always uses (as verl's DAPO recipe)."""
    prefix, max_key = "reward_model.reward_kwargs.overlong_buffer_cfg.", "reward_model.reward_kwargs.max_resp_len"
    keys = [k for k in flat if k.startswith(prefix)]
    if not keys and max_key not in flat:
        return tree
    tree = _copy(tree)
    for key in keys:
        _delete(tree, key.split("."))
        target = "reward_model.overlong_buffer." + key[len(prefix) :]
        if target in flat and flat[target] != flat[key]:
            errors.append(f"{key}={flat[key]!r} and {target}={flat[target]!r}: set one of them")
        else:
            _set(tree, target.split("."), flat[key])
    if max_key in flat:
        _delete(tree, max_key.split("."))
        max_len = flat.get("data.max_response_length", Config().data.max_response_length)
        if str(flat[max_key]) != str(max_len):
            errors.append(
                f"{max_key}={flat[max_key]!r}: the overlong shaping here measures against "
                f"data.max_response_length ({max_len}); set them equal or remove the key"
            )
    return tree


# verl's deprecated global micro-batch sizes (its workers divide them by the data-parallel ranks,
# world / Ulysses size): (global key, the per-GPU key here, the key of the Ulysses size verl divides by)
GLOBAL_MICRO_BATCHES = [
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ulysses_sequence_parallel_size"),
]


def _per_gpu_micro_batches(tree: dict, flat: dict, errors: list[str], said: list[str]) -> dict:
    """verl's global micro-batch sizes as the per-GPU sizes its workers compute from them."""
    if not any(key in flat for key, _, _ in GLOBAL_MICRO_BATCHES):
        return tree
    defaults = Config().trainer
    world = (flat.get("trainer.nnodes", defaults.nnodes) or 1) * (
        flat.get("trainer.n_gpus_per_node", defaults.n_gpus_per_node) or 1
    )
    for key, per_gpu_key, sp_key in GLOBAL_MICRO_BATCHES:
        value = flat.get(key)
        if key not in flat:
            continue
        tree = _copy(tree)
        _delete(tree, key.split("."))
        if value is None or str(value).lower() in ("none", "null"):
            continue
        sp = flat.get(sp_key) or 1
        ranks = world // sp if isinstance(world, int) and isinstance(sp, int) and sp > 0 else 0
        if flat.get(per_gpu_key) is not None:
            errors.append(
                f"{key}={value!r} and {per_gpu_key}={flat[per_gpu_key]!r}: set one of them (verl refuses "
                f"both as well); {key} is verl's deprecated global size"
            )
        elif not isinstance(value, int) or isinstance(value, bool) or ranks < 1 or value // ranks < 1:
            errors.append(
                f"{key}={value!r}: verl's deprecated global micro-batch size is divided by the "
                f"data-parallel ranks ({ranks}), which must leave at least 1; use {per_gpu_key}"
            )
        else:
            _set(tree, per_gpu_key.split("."), value // ranks)
            said.append(
                f"{key}={value} (verl's deprecated global size): {per_gpu_key}={value // ranks}, as verl "
                f"divides it over {ranks} data-parallel ranks"
            )
    return tree


# (key; the verl values accepted and dropped; why they change nothing here; print the reason at launch)
# -- values that ask for what this project does anyway, in its own way
SAME_EFFECT: list[tuple[str, tuple, str, bool]] = [
    (
        "actor_rollout_ref.rollout.mode",
        ("async",),
        "generation runs in the engines of this job's ranks, no rollout server: in every trainer rank (colocated), "
        "or in the rollout ranks with actor_rollout_ref.hybrid_engine=false; with multi_turn.enable it is the agent "
        "loop there, turn by turn, tools run between turns",
        True,
    ),
    (
        "actor_rollout_ref.rollout.calculate_log_probs",
        (True, False),
        "the engine always returns the sampled tokens' log-probs here (rollout correction and bypass mode read them)",
        False,
    ),
    (
        "actor_rollout_ref.rollout.load_format",
        ("safetensors", "auto"),
        "the engine starts from dummy weights and receives the actor's (with LoRA: the base weights once, then the "
        "adapter) by the weight sync before its first generation, so what it would load from disk is never used",
        False,
    ),
    (
        "data.return_raw_chat",
        (True,),
        "the prompts here are the chat template applied to the raw messages, as verl's agent loop makes them (with a "
        "reward model the conversation is re-encoded for it: reward_model.model.input_tokenizer)",
        False,
    ),
    *[
        (
            f"{model}.use_shm",
            (True,),
            "the model is read from its path, not copied to /dev/shm first (the same "
            "weights; only the loading time differs)",
            True,
        )
        for model in ("actor_rollout_ref.model", "reward_model.model")
    ],
    (
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        (True, False),
        "the engine wakes in two stages already: its weights before the weight sync, its KV cache after it",
        False,
    ),
    *[
        (
            f"{section}.fsdp_config.use_orig_params",
            (True, False),
            "FSDP2 (fully_shard, the engine here) always trains the original parameters",
            False,
        )
        for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
    ],
    # the entropy is always computed from the logits in chunks, and (where it has a gradient) recomputed
    # chunk by chunk in the backward pass (rlhf_hpc.ops.algos.token_logprobs_chunked)
    *[
        (
            f"actor_rollout_ref.{role}.entropy_checkpointing",
            (True, False),
            "the entropy's graph is always recomputed chunk by chunk in the backward pass here (activation "
            "checkpointing of the entropy, what entropy_checkpointing turns on in verl)",
            False,
        )
        for role in ("actor", "ref")
    ],
    *[
        (
            f"actor_rollout_ref.{role}.entropy_from_logits_with_chunking",
            (True, False),
            "the entropy (and the log-probs) are always computed from the logits in chunks of rows here",
            False,
        )
        for role in ("actor", "ref")
    ],
    (
        "actor_rollout_ref.rollout.layered_summon",
        (True, False),
        "the weight sync streams the actor's parameters in buckets (rollout.update_weights_bucket_mb), never the "
        "whole model at once, which is what layered summon does for LoRA",
        False,
    ),
]


# values of keys this project has that name a verl feature it does not have: refused by the feature's
# name rather than as a type error (a value the schema later accepts must leave this table)
OUT_OF_SCOPE_VALUES: list[tuple[str, tuple, str]] = [
    ("trainer.device", ("npu",), "Ascend NPUs (devices here: cuda, cpu)"),
    *[
        (f"{section}.strategy", ("megatron",), "the Megatron backend (strategy: fsdp or fsdp2, which both run FSDP2)")
        for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
    ],
    ("reward_model.reward_manager", ("prime",), "the prime reward manager (parallel verification of code and math)"),
    ("reward_model.reward_manager", ("batch",), "the batch reward manager (one reward call per batch)"),
]


def _raw_chat_for_reward_model(tree: dict, flat: dict, said: list[str]) -> dict:
    """``data.return_raw_chat=True`` with a reward model: verl re-encodes each conversation with the
    reward model's own chat template; here that is ``reward_model.model.input_tokenizer`` set to the
    actor's tokenizer (the responses are decoded with it), which this fills in where it is unset."""
    rm, raw = flat.get("reward_model.enable"), flat.get("data.return_raw_chat")
    on = [v is True or str(v).lower() == "true" for v in (rm, raw)]
    if not all(on) or flat.get("reward_model.model.input_tokenizer"):
        return tree
    actor = (
        flat.get("data.tokenizer")
        or flat.get("actor_rollout_ref.model.tokenizer_path")
        or "${actor_rollout_ref.model.path}"
    )
    tree = _copy(tree)
    _set(tree, "reward_model.model.input_tokenizer".split("."), actor)
    said.append(
        f"data.return_raw_chat=True with a reward model: each conversation is re-encoded with the reward "
        f"model's chat template (reward_model.model.input_tokenizer={actor}, as verl does)"
    )
    return tree


def _sleep_mode(tree: dict, flat: dict, errors: list[str], said: list[str]) -> dict:
    """verl's ``actor_rollout_ref.rollout.enable_sleep_mode`` (a ``+`` key of its fully-async lines):
    the engine freeing its memory between phases, which is ``free_cache_engine`` here. In the split
    layout the rollout ranks' engines generate all the time and never sleep: false asks for that."""
    key = "actor_rollout_ref.rollout.enable_sleep_mode"
    if key not in flat:
        return tree
    value, free = flat[key], flat.get("actor_rollout_ref.rollout.free_cache_engine")
    on = value is True or str(value).lower() == "true"
    split = str(flat.get("actor_rollout_ref.hybrid_engine", True)).lower() == "false"
    tree = _copy(tree)
    _delete(tree, key.split("."))
    if on and free is not None and str(free).lower() == "false":
        errors.append(f"{key}=True with actor_rollout_ref.rollout.free_cache_engine=False: the same switch; set one")
    elif not on and not split:
        _set(tree, "actor_rollout_ref.rollout.free_cache_engine".split("."), False)
        said.append(f"{key}=False: actor_rollout_ref.rollout.free_cache_engine=False (the engine keeps its memory)")
    elif not on:
        said.append(f"{key}=False: the split layout's rollout ranks never put their engines to sleep")
    return tree


def _same_effect(key: str, value: Any) -> Optional[tuple[str, tuple, str, bool]]:
    for rule in SAME_EFFECT:
        if rule[0] == key and _same(value, rule[1]):
            return rule
    return None


def _accepted(pattern: str, allowed: Optional[tuple]) -> tuple:
    return (*(allowed or ()), *(v for rule in SAME_EFFECT if rule[0] == pattern for v in rule[1]))


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
        if isinstance(value, list) and isinstance(a, list) and sorted(map(str, value)) == sorted(map(str, a)):
            return True
        if isinstance(value, str) and str(a).lower() == value.lower():
            return True
    return False


def drop_out_of_scope_keys(tree: dict, known: set[str], notes: Optional[list[str]] = None) -> dict:
    """The recipe tree without verl keys that switch off a feature missing here or ask for what this
    project does anyway; raises ``ConfigError`` naming the feature for any that would switch one on.
    ``known``: the dotted keys the config has (they are never touched). ``notes``: where the one-line
    notes of accepted values that change how the run looks (``SAME_EFFECT``) are appended."""
    errors, drop, said = [], [], []
    tree = _per_gpu_micro_batches(tree, flatten(tree), errors, said)
    tree = _dapo_reward_kwargs(tree, flatten(tree), errors)
    tree = _raw_chat_for_reward_model(tree, flatten(tree), said)
    tree = _sleep_mode(tree, flatten(tree), errors, said)
    flat = flatten(tree)
    for key, value in flat.items():
        if key in known:
            feature = next((f for k, values, f in OUT_OF_SCOPE_VALUES if k == key and _same(value, values)), None)
            if feature is not None:
                errors.append(f"{key}={value!r}: {feature} is not available in rlhf-hpc")
            continue
        same = _same_effect(key, value)
        if same is not None:
            drop.append(key)
            if same[3]:
                said.append(f"{key}={value}: {same[2]}")
            continue
        rule = _rule(key, known)
        if rule is None:
            continue
        pattern, allowed, feature = rule
        if allowed is not None and _same(value, allowed):
            drop.append(key)
        else:
            accepted = _accepted(pattern, allowed)
            hint = f" (accepted here: {pattern}={' or '.join(map(str, accepted))})" if accepted else " (remove the key)"
            errors.append(f"{key}={value!r}: {feature} is not available in rlhf-hpc{hint}")
    if errors:
        raise ConfigError(errors)
    if notes is not None:
        notes += said
    out = _copy(tree)
    for key in drop:
        _delete(out, key.split("."))
    return out


def _copy(tree: Any) -> Any:
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _set(node: dict, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _delete(node: dict, parts: list[str]) -> None:
    if len(parts) == 1:
        node.pop(parts[0], None)
        return
    child = node.get(parts[0])
    if isinstance(child, dict):
        _delete(child, parts[1:])
        if not child:
            node.pop(parts[0])
