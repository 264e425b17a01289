"""The engine ``actor_rollout_ref.rollout.name`` asks for, beside the engines (rlhf_hpc.rollout.base
is the interface they share and imports none of them)."""
from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from rlhf_hpc.rollout.base import RolloutEngine


def make_engine(cfg, model_path: str, device: torch.device, tp_group=None) -> RolloutEngine:
    """The engine ``actor_rollout_ref.rollout.name`` asks for."""
    rollout = cfg.actor_rollout_ref.rollout
    name = rollout.name
    from rlhf_hpc.recipe.packages import cpu_only_builds
    cpu_vllm = cpu_only_builds().get("vllm") if device.type == "cuda" else None  # cannot serve a GPU rank
    if name == "auto":
        name = "vllm" if importlib.util.find_spec("vllm") is not None and not cpu_vllm else "hf"
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[rlhf-hpc] actor_rollout_ref.rollout.name=auto: using the {name} engine"
                  + (f" ({cpu_vllm} is vLLM's CPU build)" if cpu_vllm else ""), flush=True)
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("actor_rollout_ref.rollout.name=vllm but vLLM is not installed here: install it "
                               "(env/setup.sh) or set actor_rollout_ref.rollout.name=hf")
        if cpu_vllm:
            raise RuntimeError(f"actor_rollout_ref.rollout.name=vllm on a GPU, but {cpu_vllm} is vLLM's CPU build: "
                               f"install the GPU build (bash env/setup.sh gpu) or set actor_rollout_ref.rollout.name=hf")
        from rlhf_hpc.rollout.vllm_engine import VLLMEngine
        return VLLMEngine(cfg, model_path, device, tp_group)
    from rlhf_hpc.rollout.hf_engine import HFEngine
    return HFEngine(cfg, model_path, device)
