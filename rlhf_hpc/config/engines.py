"""The rollout engines: the one table of ``actor_rollout_ref.rollout.name``.

Each entry says what the other layers need to know of an engine without importing it: the class
(built by ``rlhf_hpc.rollout.factory``), the optional package it needs (checked at dry run by
``rlhf_hpc.recipe.packages``), and how the memory and time plans model it. A new engine is a class
implementing ``rlhf_hpc.rollout.base.RolloutEngine`` and one ``register_engine`` line here
(docs/extending.md). ``auto`` is not an engine: the first installed engine of ``AUTO_ORDER``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf_hpc.config.registry import Registry

__all__ = ["AUTO", "AUTO_ORDER", "ENGINES", "EngineSpec", "planned_engine", "register_engine"]

AUTO = "auto"


@dataclass(frozen=True)
class EngineSpec:
    """What the layers below the engine know of it.

    ``entry``: ``"module:Class"``, the engine's class. ``package``: the feature name in
    ``rlhf_hpc.recipe.packages.PACKAGES`` it needs (None: torch and transformers only).
    ``paged``: the memory/time model: True for a server-style engine (a preallocated paged KV cache
    of ``gpu_memory_utilization``, continuous batching, sleep mode between generations), False for a
    plain forward per new token (its own copy of the weights, a KV cache that grows with the batch).
    ``lora``: serves LoRA adapters (``adapter_max_rank``: the largest rank it serves, None: any).
    ``bounded_context``: refuses a context longer than the model's positions (vLLM's max_model_len
    check at its start; transformers runs them)."""

    name: str
    entry: str
    package: Optional[str]
    paged: bool
    adapter_max_rank: Optional[int] = None
    bounded_context: bool = False


ENGINES: Registry[EngineSpec] = Registry("rollout engine", "actor_rollout_ref.rollout.name")


def register_engine(spec: EngineSpec) -> EngineSpec:
    if spec.name == AUTO:
        raise ValueError(f"'{AUTO}' is not an engine name: it picks the first installed of AUTO_ORDER")
    return ENGINES.register(spec.name, spec)


def planned_engine(name: str) -> EngineSpec:
    """The engine the plans assume: ``auto`` is planned as the first of ``AUTO_ORDER`` (the one a GPU
    node runs once installed)."""
    return ENGINES[AUTO_ORDER[0] if name == AUTO else name]


register_engine(
    EngineSpec(
        "vllm",
        "rlhf_hpc.rollout.vllm_engine:VLLMEngine",
        package="vllm",
        paged=True,
        adapter_max_rank=512,
        bounded_context=True,
    )
)  # rlhf_hpc.models.lora.VLLM_LORA_RANKS
register_engine(EngineSpec("hf", "rlhf_hpc.rollout.hf_engine:HFEngine", package=None, paged=False))
AUTO_ORDER = ("vllm", "hf")  # auto: the first whose package is installed (and can serve the device)
