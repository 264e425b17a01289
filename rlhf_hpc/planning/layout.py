"""The FSDP layout of each trained model, and its activation checkpointing, when the recipe
leaves them open.

``fsdp_size``, ``reshard_after_forward`` and ``forward_prefetch`` default to null: chosen here from
the models' size, the world and the memory a rank has; a value set in the recipe always wins.

- Small models (the actor's, critic's and reference's whole training state, unsharded, within
  ``REPLICATE_SHARE`` of a rank's memory): replicate on every rank (``fsdp_size=1``). Sharding
  buys no memory that is needed and costs an all-gather per layer in every forward and backward;
  replicated, a forward pass has no collective at all and an update one gradient all-reduce
  (BENCHMARKS.md, issue #19: "FSDP layout from the model size"). The
  unsharded parameters are kept between forward and backward (``reshard_after_forward=false``):
  nothing to gather again, and the memory is there.
- Larger models: shard inside a node, replicate across nodes (HSDP, ``fsdp_size`` = ranks per
  node): the all-gathers stay on the node's fast links. Parameters are freed after the forward
  (they come back for the backward). Explicit ``forward_prefetch`` stays off unless set: FSDP2
  already issues each all-gather ahead of the compute that waits for it on a GPU, and on the CPU
  (gloo) the collectives take the same cores as the compute.

Every rank and the launching machine decide alike (the same config, the same model config); the
choice and its reason are printed with the memory plan and in the run's log.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from rlhf_hpc.config.schema import Config, FSDPConfig
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.distributed.process_group import mesh_shape
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.step_shape import step_shape
from rlhf_hpc.planning.hardware import gpu_memory_gb
from rlhf_hpc.planning.sizing import DTYPE_BYTES, GiB, activation_bytes, adapter_params, logits_bytes, model_shape

__all__ = ["CHECKPOINT_SHARE", "Layout", "REPLICATE_SHARE", "SECTIONS", "choose_checkpointing", "choose_layouts",
           "describe", "rank_memory_bytes", "resolved_fsdp_configs", "shard_count", "training_state_bytes"]

# share of a rank's memory the models' whole training state may take before sharding is chosen
REPLICATE_SHARE = 0.2
# share of a rank's memory one micro-batch's activations may take before checkpointing is chosen
CHECKPOINT_SHARE = 0.1

SECTIONS = {"actor": "actor_rollout_ref.actor.fsdp_config", "ref": "actor_rollout_ref.ref.fsdp_config",
            "critic": "critic.model.fsdp_config"}


@dataclass
class Layout:
    fsdp_size: int
    reshard_after_forward: bool
    forward_prefetch: bool
    reason: str  # why, in words (empty when the recipe set all three)


def shard_count(world: int, fsdp: FSDPConfig) -> int:
    """Ranks one model's parameters are sharded over (the shard dimension of its mesh)."""
    return mesh_shape(world, fsdp.fsdp_size)[1]


def rank_memory_bytes(cfg: Config) -> float:
    """Memory of one rank: the GPU's (``hardware.hbm_gb``, or the preset's), or the host's share per rank."""
    if cfg.trainer.device == "cuda":
        return gpu_memory_gb(cfg)[0] * GiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(cfg.trainer.n_gpus_per_node, 1)


def training_state_bytes(cfg: Config, params: int, critic_params: Optional[int] = None) -> float:
    """Unsharded bytes of everything the models keep between steps: the actor's (and critic's)
    master weights, gradients and Adam moments (a LoRA model's: of its adapter only), the
    reference's weights (none with a LoRA actor: the reference is the actor, adapter off)."""
    arr = cfg.actor_rollout_ref

    def trained(n: int, fsdp: FSDPConfig, model_cfg, path: str) -> float:
        trainable = adapter_params(path, model_cfg, model_cfg.override_config, bool(model_cfg.trust_remote_code)) \
            if lora_enabled(model_cfg) else n
        return n * DTYPE_BYTES[fsdp.model_dtype] + trainable * (DTYPE_BYTES[fsdp.model_dtype] + 8)

    total = trained(params, arr.actor.fsdp_config, arr.model, arr.model.path)
    if (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora_enabled(arr.model):
        total += params * DTYPE_BYTES[arr.ref.fsdp_config.model_dtype]
    if cfg.critic.enable:
        total += trained(critic_params if critic_params is not None else params, cfg.critic.model.fsdp_config,
                         cfg.critic.model, cfg.critic.model.path or arr.model.path)
    return total


def _model_params(cfg: Config) -> tuple[Optional[int], Optional[int], str]:
    """(actor params, critic params, "") from the models' configs, or (None, None, why not)."""
    arr = cfg.actor_rollout_ref
    try:
        s = model_shape(arr.model.path, arr.model.override_config, arr.model.trust_remote_code)
        c = s
        if cfg.critic.enable and cfg.critic.model.path != arr.model.path:
            c = model_shape(cfg.critic.model.path, cfg.critic.model.override_config, cfg.critic.model.trust_remote_code)
    except (FileNotFoundError, OSError, ValueError) as e:
        return None, None, f"the model's size is unknown here ({e})"
    return s.params, c.params - c.head_params + c.hidden + 1, ""


def choose_layouts(cfg: Config) -> dict[str, Layout]:
    """The layout of ``actor``, ``ref`` and ``critic`` (each section's explicit values kept)."""
    world, per_node = cfg.world_size, cfg.trainer.n_gpus_per_node
    params, critic_params, unknown = _model_params(cfg)
    memory = rank_memory_bytes(cfg)
    replicate = False
    if unknown:
        why = f"{unknown}: sharded inside a node (fsdp_size={per_node})"
    else:
        state = training_state_bytes(cfg, params, critic_params)
        replicate = state <= REPLICATE_SHARE * memory
        where = f"{memory / GiB:.0f} GiB per rank"
        if replicate:
            why = (f"the whole training state ({state / GiB:.2f} GiB, {params / 1e6:.1f}M parameters) fits in "
                   f"{REPLICATE_SHARE:.0%} of {where}: replicated on every rank (fsdp_size=1), no all-gathers")
        else:
            why = (f"the training state ({state / GiB:.1f} GiB, {params / 1e9:.2f}B parameters) needs more than "
                   f"{REPLICATE_SHARE:.0%} of {where}: sharded inside a node (fsdp_size={per_node})")
    out = {}
    for name, key in SECTIONS.items():
        fsdp = get_key(cfg, key)
        size = fsdp.fsdp_size if fsdp.fsdp_size is not None else (1 if replicate else per_node)
        shard = world if size == -1 else size
        auto = [k for k in ("fsdp_size", "reshard_after_forward", "forward_prefetch") if getattr(fsdp, k) is None]
        reshard = fsdp.reshard_after_forward if fsdp.reshard_after_forward is not None else shard > 1
        prefetch = bool(fsdp.forward_prefetch)  # null: off (FSDP2 overlaps the next all-gather implicitly)
        if "fsdp_size" not in auto and auto:
            reason = (f"fsdp_size={size} as set: parameters " + ("freed after the forward (sharded)" if shard > 1 else
                                                                 "kept from forward to backward (replicated)"))
        else:
            reason = why if auto else ""
        out[name] = Layout(size, reshard, prefetch, reason)
    return out


def resolved_fsdp_configs(cfg: Config) -> dict[str, FSDPConfig]:
    """The fsdp_config of ``actor``, ``ref`` and ``critic`` with the layout filled in."""
    return {name: dataclasses.replace(get_key(cfg, SECTIONS[name]), fsdp_size=layout.fsdp_size,
                                      reshard_after_forward=layout.reshard_after_forward,
                                      forward_prefetch=layout.forward_prefetch)
            for name, layout in choose_layouts(cfg).items()}


def describe(cfg: Config) -> list[str]:
    """What was chosen for the models whose layout the recipe left open, and why (one line per
    distinct layout)."""
    chosen: dict[tuple, list[str]] = {}
    for name, layout in choose_layouts(cfg).items():
        if layout.reason and _used(cfg, name):
            chosen.setdefault((layout.fsdp_size, layout.reshard_after_forward, layout.forward_prefetch,
                               layout.reason), []).append(name)
    lines = [f"FSDP layout of {', '.join(names)}: fsdp_size={size}, reshard_after_forward={str(reshard).lower()}, "
             f"forward_prefetch={str(prefetch).lower()}; {reason} (set {SECTIONS[names[0]]}.* to choose)"
             for (size, reshard, prefetch, reason), names in chosen.items()]
    keys = {"actor": "actor_rollout_ref.model.enable_gradient_checkpointing",
            "critic": "critic.model.enable_gradient_checkpointing"}
    for name, (on, reason) in choose_checkpointing(cfg).items():
        if reason and _used(cfg, name):
            lines.append(f"activation checkpointing of the {name}: {'on' if on else 'off'}; {reason} "
                         f"(set {keys[name]} to choose)")
    return lines


def choose_checkpointing(cfg: Config) -> dict[str, tuple[bool, str]]:
    """``actor`` and ``critic``: (activation checkpointing on, why). A value set in the recipe is
    kept (why = ""). Left at null: off when one micro-batch's activations without it (the memory
    plan's estimate, ``rlhf_hpc.planning.memory_plan``) stay within ``CHECKPOINT_SHARE`` of a rank's
    memory, since recomputing them costs a third more compute in every update; on otherwise."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    memory = rank_memory_bytes(cfg)
    step = step_shape(cfg)
    per_rank_rows = max(1, step.rows_per_rank)
    out = {}
    for name, model, section, path, override, trust, vocab in (
            ("actor", arr.model, arr.actor, arr.model.path, arr.model.override_config, arr.model.trust_remote_code,
             True),
            ("critic", critic.model, critic, critic.model.path or arr.model.path, critic.model.override_config,
             bool(critic.model.trust_remote_code), False)):
        if model.enable_gradient_checkpointing is not None:
            out[name] = (model.enable_gradient_checkpointing, "")
            continue
        try:
            shape = model_shape(path, override, trust)
        except (FileNotFoundError, OSError, ValueError) as e:
            out[name] = (True, f"the model's size is unknown here ({e}): on")
            continue
        # (per rank without sequence parallelism, as first chosen; the memory plan divides by the group)
        tokens, resp = step.phase(f"update_{name}").micro_tokens(per_rank_rows, step.prompt_len, step.response_len,
                                                                 sequence_parallel=False)
        b = DTYPE_BYTES[section.fsdp_config.mixed_precision.param_dtype if name == "actor"
                       else critic.model.fsdp_config.mixed_precision.param_dtype]
        act = activation_bytes(shape, tokens, b, checkpointing=False, with_grad=True)
        act += logits_bytes(resp, shape.vocab, b, with_grad=True) if vocab else 0
        small = act <= CHECKPOINT_SHARE * memory
        out[name] = (not small, f"a micro-batch's activations ({act / GiB:.2f} GiB, {tokens} tokens) "
                                + (f"fit in {CHECKPOINT_SHARE:.0%} of {memory / GiB:.0f} GiB per rank: off (no recompute)"
                                   if small else f"exceed {CHECKPOINT_SHARE:.0%} of {memory / GiB:.0f} GiB per rank: on"))
    return out


def _used(cfg: Config, name: str) -> bool:
    if name == "critic":
        return bool(cfg.critic.enable)
    if name == "ref":
        return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    return True
