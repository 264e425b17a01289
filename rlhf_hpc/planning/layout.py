"""The FSDP layout of each trained model, and its activation checkpointing, when the recipe
leaves them open.

``fsdp_size``, ``reshard_after_forward`` and ``forward_prefetch`` default to null: chosen here; a
value set in the recipe always wins.

- ``fsdp_size``: by the plans (rlhf_hpc.planning.layout_search), the fastest shard group the time
  plan finds whose memory plan fits. A small model comes out replicated (``fsdp_size=1``): sharding
  buys no memory that is needed and costs an all-gather per layer in every forward and backward;
  replicated, a forward pass has no collective at all and an update one gradient all-reduce
  (BENCHMARKS.md, "FSDP layout from the model size"). A large one comes out sharded, inside a node
  where that fits (HSDP), over several nodes where it does not. Where a model's size is unknown (no
  config here): inside a node.
- ``reshard_after_forward``: sharded, the parameters are freed after the forward (they come back
  for the backward); replicated, they are kept between forward and backward (nothing to gather).
- ``forward_prefetch`` stays off unless set: FSDP2 already issues each all-gather ahead of the
  compute that waits for it on a GPU, and on the CPU (gloo) the collectives take the same cores as
  the compute.

Every rank and the launching machine decide alike (the same config, model config and hardware
figures; the ranks check it, rlhf_hpc.ppo.training_models); the
choice and its reason are printed with the memory plan and in the run's log.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from rlhf_hpc.config.schema import Config, FSDPConfig
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.distributed.process_group import mesh_shape
from rlhf_hpc.ops.step_shape import step_shape
from rlhf_hpc.planning.hardware import gpu_memory_gb
from rlhf_hpc.planning.sizing import DTYPE_BYTES, GiB, activation_bytes, logits_bytes, model_shape

__all__ = [
    "CHECKPOINT_SHARE",
    "Layout",
    "SECTIONS",
    "SizeSearch",
    "choose_checkpointing",
    "choose_layouts",
    "describe",
    "rank_memory_bytes",
    "resolved_fsdp_configs",
    "shard_count",
    "use_size_search",
]

# share of a rank's memory one micro-batch's activations may take before checkpointing is chosen
CHECKPOINT_SHARE = 0.1

SECTIONS = {
    "actor": "actor_rollout_ref.actor.fsdp_config",
    "ref": "actor_rollout_ref.ref.fsdp_config",
    "critic": "critic.model.fsdp_config",
}


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


def choose_layouts(cfg: Config) -> dict[str, Layout]:
    """The layout of ``actor``, ``ref`` and ``critic`` (each section's explicit values kept)."""
    world, per_node = cfg.world_size, cfg.trainer.n_gpus_per_node
    open_keys = [key for key in SECTIONS.values() if get_key(cfg, key).fsdp_size is None]
    chosen, why = _chosen_size(cfg, open_keys) if open_keys else (per_node, "")
    out = {}
    for name, key in SECTIONS.items():
        fsdp = get_key(cfg, key)
        size = fsdp.fsdp_size if fsdp.fsdp_size is not None else chosen
        shard = world if size == -1 else size
        auto = [k for k in ("fsdp_size", "reshard_after_forward", "forward_prefetch") if getattr(fsdp, k) is None]
        reshard = fsdp.reshard_after_forward if fsdp.reshard_after_forward is not None else shard > 1
        prefetch = bool(fsdp.forward_prefetch)  # null: off (FSDP2 overlaps the next all-gather implicitly)
        if "fsdp_size" not in auto and auto:
            reason = f"fsdp_size={size} as set: parameters " + (
                "freed after the forward (sharded)" if shard > 1 else "kept from forward to backward (replicated)"
            )
        else:
            reason = why if auto else ""
        out[name] = Layout(size, reshard, prefetch, reason)
    return out


# How a null fsdp_size is chosen: rlhf_hpc.planning.layout_search plans every size and hands its
# search here (use_size_search) when the package rlhf_hpc.planning is imported. It imports the
# memory and time plans, which import this module for the layouts they plan: the search cannot be
# imported from here.
SizeSearch = Callable[[Config, list[str]], tuple[int, str]]
_size_search: list[SizeSearch] = []
_chosen: dict[str, tuple[int, str]] = {}


def use_size_search(search: SizeSearch) -> None:
    _size_search[:] = [search]


def _chosen_size(cfg: Config, keys: list[str]) -> tuple[int, str]:
    """(fsdp_size, why) for the sections ``keys`` left at null: by the plans (the size search),
    remembered per config; sharded inside a node where a model's size is unknown."""
    key = repr((cfg, keys, os.environ.get("RLHF_HPC_CACHE")))
    if key not in _chosen:
        try:
            _chosen[key] = _size_search[0](cfg, keys)
        except (FileNotFoundError, OSError, ValueError) as e:
            per_node = cfg.trainer.n_gpus_per_node
            _chosen[key] = (
                per_node,
                f"the model's size is unknown here ({e}): sharded inside a node (fsdp_size={per_node})",
            )
    return _chosen[key]


def resolved_fsdp_configs(cfg: Config) -> dict[str, FSDPConfig]:
    """The fsdp_config of ``actor``, ``ref`` and ``critic`` with the layout filled in."""
    return {
        name: dataclasses.replace(
            get_key(cfg, SECTIONS[name]),
            fsdp_size=layout.fsdp_size,
            reshard_after_forward=layout.reshard_after_forward,
            forward_prefetch=layout.forward_prefetch,
        )
        for name, layout in choose_layouts(cfg).items()
    }


def describe(cfg: Config) -> list[str]:
    """What was chosen for the models whose layout the recipe left open, and why (one line per
    distinct layout)."""
    chosen: dict[tuple, list[str]] = {}
    for name, layout in choose_layouts(cfg).items():
        if layout.reason and _used(cfg, name):
            chosen.setdefault(
                (layout.fsdp_size, layout.reshard_after_forward, layout.forward_prefetch, layout.reason), []
            ).append(name)
    lines = [
        f"FSDP layout of {', '.join(names)}: fsdp_size={size}, reshard_after_forward={str(reshard).lower()}, "
        f"forward_prefetch={str(prefetch).lower()}; {reason} (set {SECTIONS[names[0]]}.* to choose)"
        for (size, reshard, prefetch, reason), names in chosen.items()
    ]
    keys = {
        "actor": "actor_rollout_ref.model.enable_gradient_checkpointing",
        "critic": "critic.model.enable_gradient_checkpointing",
    }
    for name, (on, reason) in choose_checkpointing(cfg).items():
        if reason and _used(cfg, name):
            lines.append(
                f"activation checkpointing of the {name}: {'on' if on else 'off'}; {reason} "
                f"(set {keys[name]} to choose)"
            )
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
        ("actor", arr.model, arr.actor, arr.model.path, arr.model.override_config, arr.model.trust_remote_code, True),
        (
            "critic",
            critic.model,
            critic,
            critic.model.path or arr.model.path,
            critic.model.override_config,
            bool(critic.model.trust_remote_code),
            False,
        ),
    ):
        if model.enable_gradient_checkpointing is not None:
            out[name] = (model.enable_gradient_checkpointing, "")
            continue
        try:
            shape = model_shape(path, override, trust)
        except (FileNotFoundError, OSError, ValueError) as e:
            out[name] = (True, f"the model's size is unknown here ({e}): on")
            continue
        # (per rank without sequence parallelism, as first chosen; the memory plan divides by the group)
        tokens, resp = step.phase(f"update_{name}").micro_tokens(
            per_rank_rows, step.prompt_len, step.response_len, sequence_parallel=False
        )
        b = DTYPE_BYTES[
            section.fsdp_config.mixed_precision.param_dtype
            if name == "actor"
            else critic.model.fsdp_config.mixed_precision.param_dtype
        ]
        act = activation_bytes(shape, tokens, b, checkpointing=False, with_grad=True)
        act += logits_bytes(resp, shape.vocab, b, with_grad=True) if vocab else 0
        small = act <= CHECKPOINT_SHARE * memory
        out[name] = (
            not small,
            f"a micro-batch's activations ({act / GiB:.2f} GiB, {tokens} tokens) "
            + (
                f"fit in {CHECKPOINT_SHARE:.0%} of {memory / GiB:.0f} GiB per rank: off (no recompute)"
                if small
                else f"exceed {CHECKPOINT_SHARE:.0%} of {memory / GiB:.0f} GiB per rank: on"
            ),
        )
    return out


def _used(cfg: Config, name: str) -> bool:
    if name == "critic":
        return bool(cfg.critic.enable)
    if name == "ref":
        return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    return True
