"""The engine ``actor_rollout_ref.rollout.name`` asks for, built from its entry in
``rlhf_hpc.config.engines.ENGINES`` (rlhf_hpc.rollout.base is the interface the engines share)."""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.distributed as dist

from rlhf_hpc.config.engines import AUTO, AUTO_ORDER, ENGINES, EngineSpec
from rlhf_hpc.recipe.packages import PACKAGES, cpu_only_builds
from rlhf_hpc.rollout.base import RolloutEngine

__all__ = ["engine_class", "make_engine", "resolve_engine"]


def installed(spec: EngineSpec) -> bool:
    return spec.package is None or importlib.util.find_spec(PACKAGES[spec.package][0]) is not None


def resolve_engine(name: str, device: torch.device) -> EngineSpec:
    """The entry of ``name``; ``auto``: the first of ``AUTO_ORDER`` installed here that can serve
    ``device`` (vLLM's CPU build cannot serve a GPU rank)."""
    cpu_vllm = cpu_only_builds().get("vllm") if device.type == "cuda" else None
    if name == AUTO:
        spec = next(ENGINES[n] for n in AUTO_ORDER if installed(ENGINES[n]) and not (n == "vllm" and cpu_vllm))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"[rlhf-hpc] actor_rollout_ref.rollout.name=auto: using the {spec.name} engine"
                + (f" ({cpu_vllm} is vLLM's CPU build)" if cpu_vllm else ""),
                flush=True,
            )
        return spec
    spec = ENGINES[name]
    if not installed(spec):
        raise RuntimeError(
            f"actor_rollout_ref.rollout.name={name} but its package ({spec.package}) is not installed "
            f"here: {PACKAGES[spec.package][3]}, or set actor_rollout_ref.rollout.name to one of "
            f"{', '.join(n for n in ENGINES if installed(ENGINES[n]))}"
        )
    if name == "vllm" and cpu_vllm:
        raise RuntimeError(
            f"actor_rollout_ref.rollout.name=vllm on a GPU, but {cpu_vllm} is vLLM's CPU build: "
            f"install the GPU build (bash env/setup.sh gpu) or set actor_rollout_ref.rollout.name=hf"
        )
    return spec


def engine_class(spec: EngineSpec) -> type:
    """The class of an entry (imported only when built: importing vLLM takes seconds)."""
    module, _, cls = spec.entry.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(cfg, model_path: str, device: torch.device, tp_group=None) -> RolloutEngine:
    """The engine ``actor_rollout_ref.rollout.name`` asks for."""
    spec = resolve_engine(cfg.actor_rollout_ref.rollout.name, device)
    return engine_class(spec)(cfg, model_path, device, tp_group=tp_group)
