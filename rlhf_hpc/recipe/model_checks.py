"""Checks of the models a config names, by topic: LoRA keys (and the adapter against the model),
sequence parallelism against the models' heads, architectures, the model directories' weights and
tokenizers, the reward model's keys (``recipe.config_checks.validate`` collects them)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from rlhf_hpc.config.engines import AUTO, ENGINES, planned_engine
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config, CriticModelConfig, FSDPConfig, ModelConfig, RewardModelConfig
from rlhf_hpc.config.tree import flatten, get_key, to_dict
from rlhf_hpc.distributed.sequence_parallel import heads_problem
from rlhf_hpc.models.architectures import architecture_problems, causal_lm_class, moe_experts
from rlhf_hpc.models.hf import (
    build_causal_lm,
    build_critic,
    build_token_scorer,
    is_tiny,
    local_path,
    model_config,
    tiny_fields,
)
from rlhf_hpc.models.lora import (
    adapter_shape_problems,
    apply_lora,
    lora_enabled,
    saved_adapter,
    unmatched_target_modules,
)
from rlhf_hpc.models.moe_routing import REPLAYABLE
from rlhf_hpc.models.tokenizer import no_tokenizer_files, tokenizer_path, tokenizer_problems
from rlhf_hpc.models.weights import no_weight_files, weights_problems
from rlhf_hpc.tools.tool_config import run_tools, tool_schemas

__all__ = [
    "VLLM_CPU_HEAD_SIZES",
    "lora_problems",
    "lora_warnings",
    "model_architecture_problems",
    "model_file_problems",
    "reward_model_problems",
    "router_aux_loss_problems",
    "routing_replay_problems",
    "sequence_parallel_problems",
]


def lora_problems(cfg: Config) -> list[str]:
    """LoRA keys (verl's) that cannot work, or would change nothing in this config; where the model's
    config is readable here, ``target_modules`` and ``lora_adapter_path`` against the model."""
    arr, errors = cfg.actor_rollout_ref, []
    for key, m in (("actor_rollout_ref.model", arr.model), ("critic.model", cfg.critic.model)):
        if m.lora_rank < 0 or m.lora_alpha <= 0:
            errors.append(
                f"{key}.lora_rank={m.lora_rank} / lora_alpha={m.lora_alpha}: the rank must be >= 0 "
                f"(0: no LoRA) and alpha > 0"
            )
        elif not lora_enabled(m):
            errors += _lora_keys_without_lora(key, m)
    path = arr.model.lora_adapter_path
    adapter = None
    if path is not None and not (Path(path).expanduser() / "adapter_config.json").is_file():
        errors.append(
            f"actor_rollout_ref.model.lora_adapter_path={path}: no adapter_config.json there (a PEFT "
            f"adapter directory, e.g. an export's lora_adapter/)"
        )
    elif path is not None:
        adapter, adapter_errors = _saved_adapter_against_keys(arr.model)
        errors += adapter_errors
    engine = ENGINES.get(arr.rollout.name)
    rank = adapter.r if adapter is not None else arr.model.lora_rank
    if engine is not None and engine.adapter_max_rank is not None and rank > engine.adapter_max_rank:
        whose = " (the adapter at lora_adapter_path)" if adapter is not None else ""
        errors.append(
            f"actor_rollout_ref.model.lora_rank={rank}{whose}: the {engine.name} engine serves adapters up "
            f"to rank {engine.adapter_max_rank}"
        )
    if lora_enabled(cfg.critic.model) and not cfg.critic.enable:
        errors.append(
            f"critic.model.lora_rank={cfg.critic.model.lora_rank} has no effect: there is no critic "
            f"(critic.enable={cfg.critic.enable}, algorithm.adv_estimator={cfg.algorithm.adv_estimator})"
        )
    if lora_enabled(arr.model) and (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        # the reference runs as the actor does: a ref layout or precision of its own would be ignored
        ref, actor, default = (flatten(to_dict(f)) for f in (arr.ref.fsdp_config, arr.actor.fsdp_config, FSDPConfig()))
        changed = [
            f"actor_rollout_ref.ref.fsdp_config.{k}={v}"
            for k, v in ref.items()
            if v != default.get(k) and v != actor.get(k) and k not in LORA_REF_KEYS_VERL_IGNORES
        ]
        if changed:
            errors.append(
                f"{', '.join(changed)} has no effect with LoRA: the reference is the actor with its adapter "
                f"off, on the actor's mesh and precision (actor_rollout_ref.actor.fsdp_config); leave it "
                f"at its default or the actor's value"
            )
    if not errors and lora_enabled(arr.model):  # (the keys are sound: now against the model, where it is readable)
        errors += _lora_against_model("actor_rollout_ref.model", arr.model, adapter is not None)
    if not errors and cfg.critic.enable and lora_enabled(cfg.critic.model):
        errors += _lora_against_model("critic.model", cfg.critic.model, False, critic=True)
    return errors


def _lora_keys_without_lora(key: str, m) -> list[str]:
    """LoRA keys set on a model without LoRA (rank 0, no adapter): they would be accepted and ignored."""
    default = ModelConfig() if isinstance(m, ModelConfig) else CriticModelConfig()
    names = [
        n
        for n in ("lora_alpha", "target_modules", "exclude_modules")
        if getattr(m, n, None) != getattr(default, n, None)
    ]
    return [
        f"{key}.{n}={getattr(m, n)} has no effect: LoRA is off ({key}.lora_rank=0"
        + (", no lora_adapter_path" if isinstance(m, ModelConfig) else "")
        + f"); set {key}.lora_rank > 0, or remove the key"
        for n in names
    ]


def _saved_adapter_against_keys(m: ModelConfig) -> tuple[Optional[object], list[str]]:
    """(the adapter's LoraConfig, the LoRA keys that contradict it): with ``lora_adapter_path`` the
    adapter's own rank, alpha and target modules are what trains; a key saying otherwise is refused."""
    key = "actor_rollout_ref.model"
    try:
        adapter = saved_adapter(m.lora_adapter_path)
    except Exception as e:  # noqa: BLE001 - an unreadable adapter_config.json, in whatever way
        return None, [
            f"{key}.lora_adapter_path={m.lora_adapter_path}: adapter_config.json does not read as a PEFT "
            f"LoRA config ({type(e).__name__}: {e})"
        ]
    default, errors = ModelConfig(), []
    said = f"the adapter at {key}.lora_adapter_path={m.lora_adapter_path} has"
    if m.lora_rank > 0 and m.lora_rank != adapter.r:
        errors.append(
            f"{key}.lora_rank={m.lora_rank}, but {said} rank {adapter.r}, which is what trains; set "
            f"{key}.lora_rank={adapter.r}, or 0 to take the adapter's"
        )
    if m.lora_alpha != default.lora_alpha and m.lora_alpha != adapter.lora_alpha:
        errors.append(
            f"{key}.lora_alpha={m.lora_alpha}, but {said} lora_alpha={adapter.lora_alpha}, which is what "
            f"trains; set {key}.lora_alpha={adapter.lora_alpha}, or remove the key"
        )
    targets = adapter.target_modules
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    wanted = sorted(m.target_modules) if isinstance(m.target_modules, list) else m.target_modules
    if m.target_modules != default.target_modules and wanted != targets:
        errors.append(
            f"{key}.target_modules={m.target_modules}, but {said} target_modules={targets}, which are what "
            f"train; remove the key"
        )
    return adapter, errors


def _lora_against_model(key: str, m, from_adapter: bool, critic: bool = False) -> list[str]:
    """``target_modules`` (each name matches a module; PEFT accepts the set) or the saved adapter
    (its modules and shapes) against the model's meta-device build (the critic's: its backbone),
    where its config is readable here."""
    path, override, trust = m.path, m.override_config, bool(m.trust_remote_code)
    if _readable_model_config(path, override) is None:
        return []

    def check() -> list[str]:
        model = (
            build_critic(path, torch.float32, "meta", override, trust_remote_code=trust).model
            if critic
            else build_causal_lm(path, torch.float32, "meta", override, trust_remote_code=trust)
        )  # (structure only)
        if from_adapter:
            return [
                f"{key}.lora_adapter_path={m.lora_adapter_path}: {p}"
                for p in adapter_shape_problems(model, m.lora_adapter_path)
            ]
        unmatched = unmatched_target_modules(model, m.target_modules)
        if unmatched:
            return [
                f"{key}.target_modules: {', '.join(unmatched)} match{'es' if len(unmatched) == 1 else ''} no "
                f"module of {type(model).__name__} ({path}); its linear layers: {', '.join(_linear_names(model))}"
            ]
        try:
            apply_lora(model, m, seed=0, task_type=None)
        except ValueError as e:  # PEFT's NoMatchingPeftModuleError and its other refusals of a target
            return [f"{key}.target_modules={m.target_modules}: {' '.join(str(e).split())}"]
        return []

    return _memo(
        (
            "lora",
            key,
            path,
            override,
            trust,
            m.lora_rank,
            m.lora_alpha,
            m.target_modules,
            getattr(m, "exclude_modules", None),
            m.lora_adapter_path if from_adapter else None,
        ),
        check,
    )


def _linear_names(model: nn.Module) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if isinstance(mod, nn.Linear)})


_memos: dict[str, list[str]] = {}


def _memo(key: tuple, compute: Callable[[], list[str]]) -> list[str]:
    """``compute()`` once per process for ``key``: validate runs again for every candidate the time
    plan's advice tries, and these checks build models and read files."""
    text = json.dumps(key, sort_keys=True, default=str)
    if text not in _memos:
        _memos[text] = compute()
    return list(_memos[text])


# ref.fsdp_config keys verl's LoRA scripts carry over from full fine-tuning (verl ignores them the
# same way): a warning, not a refusal
LORA_REF_KEYS_VERL_IGNORES = ("param_offload",)


def lora_warnings(cfg: Config) -> list[str]:
    """One line for a LoRA run's reference keys that verl's scripts set and verl ignores as well."""
    arr = cfg.actor_rollout_ref
    if not (lora_enabled(arr.model) and (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)):
        return []
    ref, actor, default = (to_dict(f) for f in (arr.ref.fsdp_config, arr.actor.fsdp_config, FSDPConfig()))
    ignored = [
        f"actor_rollout_ref.ref.fsdp_config.{k}={ref[k]}"
        for k in LORA_REF_KEYS_VERL_IGNORES
        if ref[k] != default[k] and ref[k] != actor[k]
    ]
    if not ignored:
        return []
    return [
        f"{', '.join(ignored)} has no effect with LoRA (as in verl): the reference is the actor with its adapter "
        f"off, on the actor's mesh and precision (actor_rollout_ref.actor.fsdp_config)"
    ]


def sequence_parallel_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the three ``ulysses_sequence_parallel_size`` keys: the size must divide
    the ranks, the rows must be packed, attention must be ``varlen`` (the implementation that
    exchanges heads), and the model's heads must split over the group."""
    arr, tr, critic = cfg.actor_rollout_ref, cfg.trainer, cfg.critic
    errors, warnings = [], []
    uses_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    for key, size, model, used in (
        ("actor_rollout_ref.actor", arr.actor.ulysses_sequence_parallel_size, arr.model, True),
        ("actor_rollout_ref.ref", arr.ref.ulysses_sequence_parallel_size, arr.model, uses_ref),
        ("critic", critic.ulysses_sequence_parallel_size, critic.model, critic.enable),
    ):
        name = f"{key}.ulysses_sequence_parallel_size"
        if size is None or size < 1:
            errors.append(f"{name}={size} must be >= 1 (1: no sequence parallelism)")
            continue
        if size == 1 or not used:
            continue
        model_key = "actor_rollout_ref.model" if model is arr.model else "critic.model"
        if cfg.world_size > 0 and cfg.world_size % size:
            errors.append(
                f"{name}={size} must divide the ranks, trainer.nnodes x trainer.n_gpus_per_node = "
                f"{cfg.world_size} (a sequence-parallel group is {size} consecutive ranks)"
            )
        elif tr.n_gpus_per_node % size:
            warnings.append(
                f"{name}={size} does not divide trainer.n_gpus_per_node ({tr.n_gpus_per_node}): "
                f"sequence-parallel groups span nodes and every layer's all-to-all crosses the network"
            )
        if not model.use_remove_padding:
            errors.append(f"{name}={size} splits packed rows: set {model_key}.use_remove_padding=true")
        attn = model.override_config.get("attn_implementation")
        if attn not in (None, "varlen"):
            errors.append(
                f"{name}={size} runs attention through attn_implementation=varlen (it exchanges heads "
                f"for the whole sequence); remove {model_key}.override_config.attn_implementation="
                f"{attn} or set it to varlen"
            )
        problem = _heads_problem(model.path, model.override_config, size, name)
        if problem:
            errors.append(problem)
    return errors, warnings


def _heads_problem(path: Optional[str], override: dict, size: int, key: str) -> Optional[str]:
    """The model's heads against the sp size, where its config can be read here (a tiny model, or a
    local directory); elsewhere the engine checks it when it builds the model."""
    config = _readable_model_config(path, override)
    if config is None:
        return None
    heads = config.num_attention_heads
    return heads_problem(heads, getattr(config, "num_key_value_heads", None) or heads, size, key)


def _readable_model_config(path: Optional[str], override: dict):
    """The transformers config of a tiny model or a local model directory; None elsewhere (a hub
    name resolved on the cluster, an unreadable directory: reported by the file checks / at build)."""
    if not path:
        return None
    local = os.path.expanduser(path)
    if not is_tiny(path) and not os.path.isfile(os.path.join(local, "config.json")):
        return None
    try:
        return model_config(path if is_tiny(path) else local, override)
    except Exception:  # noqa: BLE001 - see above
        return None


def model_architecture_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the policy's and the critic's architectures (rlhf_hpc.models.architectures),
    and the engine's context against the policy's positions, where their configs can be read here."""
    errors, warnings = [], []
    models = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if cfg.critic.enable and cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        models.append(("critic.model", cfg.critic.model))
    for key, model in models:
        if model.path and is_tiny(model.path):
            try:
                tiny_fields(model.path)
            except ValueError as e:
                errors.append(f"{key}.path: {e}")
                continue
        config = _readable_model_config(model.path, model.override_config)
        if config is not None:
            e, w = architecture_problems(config, key, model.override_config.get("attn_implementation"))
            if model is cfg.actor_rollout_ref.model:  # (the engine serves the policy)
                e2, w2 = _context_problems(cfg, config)
                e3 = _engine_head_dim_problems(cfg, config)
                e, w = e + e2 + e3, w + w2
            errors += e
            warnings += w
    return errors, warnings


def routing_replay_problems(cfg: Config) -> list[str]:
    """verl's routing replay keys (``actor.router_replay.mode``, ``rollout.enable_rollout_routing_replay``)
    against what records and replays routing here: the hf engine records (the rollout key alone: the
    trainer measures its agreement, rollout/router_topk_agreement), R3 replays the engine's routing,
    R2 the old-log-prob pass's (any engine), on the mixtures of experts whose router math
    rlhf_hpc.models.moe_routing reproduces."""
    arr = cfg.actor_rollout_ref
    mode, record = arr.actor.router_replay.mode, arr.rollout.enable_rollout_routing_replay
    key = "actor_rollout_ref.actor.router_replay.mode"
    interval = arr.rollout.moe_load_balance_metrics_interval
    if interval < 0 or (interval > 0 and not record):
        return [
            f"actor_rollout_ref.rollout.moe_load_balance_metrics_interval={interval}: the load-balance metrics "
            f"count the engine's recorded routing: a number of steps >= 0, with "
            f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True (0: no metrics)"
        ]
    if mode == "disabled" and not record:
        return []
    # enable_rollout_routing_replay alone: the engine records, the trainer measures its agreement
    # (rollout/router_topk_agreement) and routes on its own
    errors = []
    if mode == "R3" and not record:
        errors.append(
            f"{key}=R3 replays the engine's routing: set actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
        )
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(
            f"{key}=R2 replays the old-log-prob pass's routing in the update, and in bypass mode "
            f"(algorithm.rollout_correction.bypass_mode=true) no such pass runs: use R3 (the engine's routing)"
        )
    what = f"{key}={mode}" if mode != "disabled" else "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
    name = arr.rollout.name
    if name == AUTO:
        name = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if record and (name not in ("hf", "vllm") or (name == "vllm" and cfg.trainer.device == "cpu")):
        recording = "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
        errors.append(
            f"{recording} with actor_rollout_ref.rollout.name={arr.rollout.name} on trainer.device="
            f"{cfg.trainer.device}: the engine returns the experts it routed each token to with hf, or with vLLM "
            f"on a GPU (its enable_return_routed_experts needs its Model Runner V2, which its CPU build cannot "
            f"run); use actor_rollout_ref.rollout.name=hf"
            + (f", or {key}=R2 without it (the trainer records its own routing)" if mode != "R2" else "")
        )
    config = _readable_model_config(arr.model.path, arr.model.override_config)
    if config is not None:
        cls = causal_lm_class(config)
        if cls not in REPLAYABLE:
            errors.append(
                f"{what}: actor_rollout_ref.model.path={arr.model.path} is a {cls}; routing is recorded and "
                f"replayed in {', '.join(REPLAYABLE)}"
            )
    return errors


def router_aux_loss_problems(cfg: Config) -> list[str]:
    """transformers' router load-balancing loss (``override_config.output_router_logits``, weighed by
    ``router_aux_loss_coef``), which the actor's update adds to its loss: a mixture of experts only,
    without Ulysses (whose ranks see part of each sequence)."""
    arr = cfg.actor_rollout_ref
    if not arr.model.override_config.get("output_router_logits"):
        return []
    key = "actor_rollout_ref.model.override_config.output_router_logits=True"
    errors = []
    config = _readable_model_config(arr.model.path, arr.model.override_config)
    if config is not None and moe_experts(config) is None:
        errors.append(f"{key}: {arr.model.path} is not a mixture of experts (it has no router to balance)")
    if arr.actor.ulysses_sequence_parallel_size > 1:
        errors.append(f"{key} with Ulysses (actor.ulysses_sequence_parallel_size > 1) is not built: use 1")
    return errors


# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes; checked
# against the installed vLLM by tests/test_architectures.py): another head size passes the engine's
# start and crashes every rank at the first generation
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _engine_head_dim_problems(cfg: Config, config) -> list[str]:
    """The policy's head size against the attention kernels of the engine that serves it on this device."""
    rollout = cfg.actor_rollout_ref.rollout
    name = rollout.name
    if name == AUTO:  # (the first installed engine of AUTO_ORDER, on this machine where device=cpu)
        name = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if name != "vllm" or cfg.trainer.device != "cpu" or head_dim is None or head_dim in VLLM_CPU_HEAD_SIZES:
        return []
    return [
        f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}: head_dim {head_dim} is not among the "
        f"head sizes vLLM's CPU attention runs ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use "
        f"actor_rollout_ref.rollout.name=hf, or a model of one of those head sizes"
    ]


def _context_problems(cfg: Config, config) -> tuple[list[str], list[str]]:
    """The engine's context (``rollout.max_model_len``, else prompt + response) against the positions
    the policy was built for, where its RoPE does not stretch them (vLLM refuses a longer context at
    start, after the job has queued; transformers would run positions it never saw)."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not limit or rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3"):
        return [], []
    d, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    length = rollout.max_model_len or d.max_prompt_length + d.max_response_length
    if length <= limit:
        return [], []
    what = (
        f"actor_rollout_ref.rollout.max_model_len={length}"
        if rollout.max_model_len
        else f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length}"
    )
    text = (
        f"{what} is longer than the {limit} positions of actor_rollout_ref.model.path="
        f"{cfg.actor_rollout_ref.model.path} (its max_position_embeddings)"
    )
    engine = planned_engine(rollout.name) if rollout.name == AUTO else ENGINES.get(rollout.name)
    if engine is None:  # (an unknown engine: its own check names it)
        return [], []
    if engine.bounded_context:
        return [f"{text}: the {engine.name} engine refuses a longer context; shorten the lengths to {limit} in all"], []
    return [], [f"{text}: the model would run positions it was not trained on"]


def model_file_problems(cfg: Config, check_files: bool = True) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the model directories and the tokenizer a config names, where they are on
    this machine (a hub name is resolved where the job runs): each model's weights are there and of
    the shapes its config.json makes (rlhf_hpc.models.weights); the tokenizer encodes a chat prompt
    (rlhf_hpc.models.tokenizer.tokenizer_problems), with the chat template the run uses. Without
    ``check_files`` (a dry run, a plan) a directory holding a config.json and no weights is what a
    user has before the download: it is planned from its config, in one warning line, and its missing
    weights and tokenizer files are left to the run."""
    arr, rm, errors, warnings = cfg.actor_rollout_ref, cfg.reward_model, [], []
    config_only = set()
    models = [
        (
            "actor_rollout_ref.model.path",
            arr.model.path,
            arr.model.override_config,
            arr.model.trust_remote_code,
            "causal_lm",
        )
    ]
    if cfg.critic.enable and cfg.critic.model.path != arr.model.path:
        models.append(
            (
                "critic.model.path",
                cfg.critic.model.path,
                cfg.critic.model.override_config,
                bool(cfg.critic.model.trust_remote_code),
                "backbone",
            )
        )
    if rm.enable:
        models.append(
            (
                "reward_model.model.path",
                rm.model.path,
                rm.model.override_config,
                bool(rm.model.trust_remote_code),
                "token_scorer",
            )
        )
    for key, path, override, trust, kind in models:
        if path and not is_tiny(path) and _readable_model_config(path, override) is not None:
            if not check_files and no_weight_files(Path(local_path(path))):
                config_only.add(path)
                no_tokenizer = ", no tokenizer" if no_tokenizer_files(path) else ""
                warnings.append(
                    f"{key}={path}: config.json only here (no weights{no_tokenizer}): "
                    f"planned from its config; the run needs the weights where it runs"
                )
                continue
            errors += [
                f"{key}={path}: {p}"
                for p in _memo(
                    ("weights", path, override, trust, kind), lambda: _weights_problems(path, override, trust, kind)
                )
            ]
    if not (tokenizer_path(cfg) in config_only and no_tokenizer_files(tokenizer_path(cfg))):
        errors += _tokenizer_problems(cfg)
    return errors, warnings


def _weights_problems(path: str, override: dict, trust: bool, kind: str) -> list[str]:
    try:  # the structure the config makes: the model the weights must fill (on the meta device, no memory)
        if kind == "causal_lm":
            model = build_causal_lm(path, torch.float32, "meta", override, trust_remote_code=trust)
        elif kind == "backbone":
            model = build_critic(path, torch.float32, "meta", override, trust_remote_code=trust).model
        else:
            model = build_token_scorer(path, torch.float32, override, trust_remote_code=trust, device="meta")
    except Exception:  # noqa: BLE001 - a config transformers cannot build: other checks (architectures) say so
        model = None
    return weights_problems(local_path(path), model)


def _tokenizer_problems(cfg: Config) -> list[str]:
    """The run's tokenizer (data.tokenizer, else the model's tokenizer_path, else its path), where it
    is built in (tiny://chars) or a directory here."""
    m, d = cfg.actor_rollout_ref.model, cfg.data
    path = tokenizer_path(cfg)
    key = (
        "data.tokenizer"
        if d.tokenizer
        else "actor_rollout_ref.model.tokenizer_path"
        if m.tokenizer_path
        else "actor_rollout_ref.model.path"
    )
    if not (is_tiny(path) or os.path.isdir(local_path(path))):
        return []
    config = _readable_model_config(m.path, m.override_config)
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    try:  # a multi-turn run's tools: its template must show them and the tools' answers
        tools = tool_schemas(run_tools(cfg)) or None
    except ConfigError:  # (the tool config's own problems: multi_turn_checks)
        tools = None
    problems = _memo(
        (
            "tokenizer",
            path,
            m.trust_remote_code,
            m.custom_chat_template,
            d.apply_chat_template_kwargs,
            vocab,
            json.dumps(tools, sort_keys=True),
        ),
        lambda: tokenizer_problems(
            path, m.trust_remote_code, m.custom_chat_template, d.apply_chat_template_kwargs, vocab, tools
        ),
    )
    template_key = "actor_rollout_ref.model.custom_chat_template"
    return [
        f"{template_key}: {p}" if m.custom_chat_template is not None and "chat template" in p else f"{key}={path}: {p}"
        for p in problems
    ]


def reward_model_problems(cfg: Config) -> list[str]:
    """The reward model's keys: consistent when it is enabled, at their defaults when it is not
    (a key of a disabled reward model would be accepted and ignored)."""
    rm, off, errors = cfg.reward_model, RewardModelConfig(), []
    if not rm.enable:
        fsdp = rm.model.fsdp_config
        fsdp_default = dataclasses.replace(
            off.model.fsdp_config, fsdp_size=fsdp.fsdp_size
        ) == fsdp and fsdp.fsdp_size in (None, cfg.trainer.n_gpus_per_node)
        set_keys = [
            key
            for key in (
                "strategy",
                "model.path",
                "model.input_tokenizer",
                "model.trust_remote_code",
                "model.external_lib",
                "model.override_config",
                "model.use_remove_padding",
                "micro_batch_size_per_gpu",
                "use_dynamic_bsz",
                "forward_max_token_len_per_gpu",
                "max_length",
            )
            if get_key(rm, key) != get_key(off, key)
        ]
        set_keys += [] if fsdp_default else ["model.fsdp_config"]
        if set_keys:
            errors.append(
                f"reward_model.{set_keys[0]} is set but reward_model.enable=false, so it would have no "
                f"effect; set reward_model.enable=true to score with a reward model, or remove the key"
            )
        return errors
    p = "reward_model"
    if rm.micro_batch_size_per_gpu is not None and rm.micro_batch_size_per_gpu <= 0:
        errors.append(f"{p}.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must be > 0")
    if rm.max_length is not None and rm.model.input_tokenizer is None:
        errors.append(
            f"{p}.max_length={rm.max_length} cuts re-encoded sequences only, and with "
            f"{p}.model.input_tokenizer=null the reward model reads the actor's sequences as they are "
            f"(at most data.max_prompt_length + data.max_response_length tokens); remove the key, or set "
            f"{p}.model.input_tokenizer to the actor's tokenizer to re-encode"
        )
    elif rm.max_length is not None and rm.max_length <= 0:
        errors.append(f"{p}.max_length={rm.max_length} must be > 0")
    seq_len = rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    if (
        rm.use_dynamic_bsz
        and rm.forward_max_token_len_per_gpu is not None
        and rm.forward_max_token_len_per_gpu < seq_len
    ):
        errors.append(
            f"{p}.forward_max_token_len_per_gpu ({rm.forward_max_token_len_per_gpu}) is smaller than one "
            f"full sequence ({seq_len} tokens)"
        )
    if rm.model.input_tokenizer is not None:
        arr = cfg.actor_rollout_ref
        actor_side = {
            os.path.expanduser(x)
            for x in (tokenizer_path(cfg), arr.model.path, arr.model.tokenizer_path, cfg.data.tokenizer)
            if x
        }
        if os.path.expanduser(rm.model.input_tokenizer) not in actor_side:
            errors.append(
                f"{p}.model.input_tokenizer={rm.model.input_tokenizer!r} must be the tokenizer the responses "
                f"were generated with, the actor's ({tokenizer_path(cfg)}): responses are decoded with it "
                f"and re-encoded with the reward model's; set it to {tokenizer_path(cfg)}, or null when the "
                f"reward model reads the actor's tokens as they are"
            )
    if rm.model.fsdp_config.optimizer_offload:
        errors.append(
            f"{p}.model.fsdp_config.optimizer_offload=true: the reward model has no optimizer (inference "
            f"only); use {p}.model.fsdp_config.param_offload to keep its parameters on the host"
        )
    return errors
