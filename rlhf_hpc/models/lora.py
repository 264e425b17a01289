"""LoRA adapters (PEFT) on the actor and the critic, with verl's keys and meaning
(``actor_rollout_ref.model.lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``,
``lora_adapter_path``; ``critic.model.lora_rank``, ``lora_alpha``, ``target_modules``).

The base weights are frozen (no gradients, no optimizer state); FSDP2 shards base and adapter alike
and trains the adapter. The reference policy is the actor with its adapter switched off
(``AdapterDisabled``: no second copy of the weights), as verl's ``ref_in_actor``. The engines get
the merged weights W + (alpha / r) B A under the base model's names (``merged_weights``), so vLLM
and the hf engine load them like any checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from rlhf_hpc.models.weights import safetensors_shapes

__all__ = [
    "AdapterDisabled",
    "VLLM_LORA_RANKS",
    "adapter_config",
    "adapter_file_name",
    "adapter_rank",
    "adapter_shape_problems",
    "apply_lora",
    "base_name",
    "is_adapter",
    "lora_enabled",
    "lora_scaling",
    "merged_state_dict",
    "merged_weights",
    "saved_adapter",
    "unmatched_target_modules",
    "vllm_lora_rank",
]

# PEFT's names inside a LoRA-wrapped model: the wrapper prefix, the frozen linear, the adapter's
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer"
_ADAPTER = "default"


def lora_enabled(model_cfg) -> bool:
    """verl's rule: LoRA when ``lora_rank > 0`` or an adapter is loaded (``lora_adapter_path``)."""
    return model_cfg.lora_rank > 0 or getattr(model_cfg, "lora_adapter_path", None) is not None


def adapter_rank(model_cfg) -> int:
    """The adapter's rank: ``lora_rank``, or the rank stored with ``lora_adapter_path``."""
    path = getattr(model_cfg, "lora_adapter_path", None)
    if path is not None:
        return saved_adapter(path).r
    return model_cfg.lora_rank


def saved_adapter(path: str):
    """The ``LoraConfig`` stored with a PEFT adapter directory (its ``adapter_config.json``)."""
    from peft import LoraConfig  # (peft imports in seconds: only LoRA runs pay for it)

    return LoraConfig.from_pretrained(str(Path(path).expanduser()))


def unmatched_target_modules(model: nn.Module, target_modules: Union[str, list[str]]) -> list[str]:
    """The names of a ``target_modules`` list that match no module of ``model`` by PEFT's rule (the
    module's full name, or its last dotted parts); PEFT would adapt the others and ignore these, or
    fail when none matches. A string (a regex, ``all-linear``) is PEFT's to judge (``apply_lora``)."""
    if isinstance(target_modules, str):
        return []
    names = [n for n, _ in model.named_modules() if n]
    return [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]


def adapter_shape_problems(model: nn.Module, adapter_dir: str, limit: int = 3) -> list[str]:
    """What keeps the PEFT adapter in ``adapter_dir`` from loading into ``model`` (the base model,
    built on the meta device; it gets the adapter's structure): PEFT finds none of its target
    modules, or its ``adapter_model.safetensors`` holds tensors of modules the model lacks or of
    other shapes (an adapter made for another model). Read from the headers: no tensor is loaded."""
    directory = Path(adapter_dir).expanduser()
    config = saved_adapter(str(directory))
    try:
        peft = apply_lora(model, _AdapterKeys(str(directory)), seed=0)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError and its other refusals of a target
        return [f"its target modules {sorted(config.target_modules or [])} are not in this model ({e})"]
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        return []  # (adapter_model.bin: PyTorch's format, not readable without loading it)
    expected = {adapter_file_name(n): tuple(p.shape) for n, p in peft.named_parameters() if is_adapter(n)}
    found = safetensors_shapes([weights])
    foreign = [k for k in found if k not in expected]
    wrong = [
        f"{k} is {list(found[k])}, this model makes {list(expected[k])}"
        for k in found
        if k in expected and found[k] != expected[k]
    ]
    problems = []
    if foreign:
        problems.append(
            f"{len(foreign)} of its {len(found)} tensors are for modules this model lacks "
            f"({', '.join(foreign[:limit])}{' ...' if len(foreign) > limit else ''})"
        )
    if wrong:
        problems.append(
            f"its tensors have other shapes than this model's layers make ({'; '.join(wrong[:limit])}"
            f"{f' and {len(wrong) - limit} more' if len(wrong) > limit else ''}): an adapter of another "
            f"model"
        )
    return problems


class _AdapterKeys:
    """Model keys that say only ``lora_adapter_path``: ``apply_lora`` builds that adapter's structure."""

    def __init__(self, path: str):
        self.lora_adapter_path, self.lora_rank = path, 0


# the ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank`` (as verl rounds up)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora_rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")


def apply_lora(model: nn.Module, model_cfg, seed: int, task_type: Optional[str] = "CAUSAL_LM") -> nn.Module:
    """``model`` with LoRA adapters (a PEFT model; the base frozen, the adapter trainable).

    ``model_cfg``: the actor's ``ModelConfig`` or the critic's ``CriticModelConfig``. The adapter is
    verl's ``LoraConfig(r, lora_alpha, target_modules, exclude_modules, bias="none")``, or the one
    stored at ``lora_adapter_path`` (its weights loaded where the model has real weights; a model
    on the meta device gets the structure, its weights arrive from rank 0). ``lora_A`` is
    initialised from ``seed`` (``lora_B`` is zero: the adapter starts as the identity), so ranks
    that build a tiny model each get the same adapter.
    """
    from peft import LoraConfig, PeftModel, get_peft_model  # (peft imports in seconds: only LoRA runs pay for it)

    adapter_path = getattr(model_cfg, "lora_adapter_path", None)
    on_meta = next(model.parameters()).device.type == "meta"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if adapter_path is not None and not on_meta:
            peft = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
        else:
            config = (
                LoraConfig.from_pretrained(adapter_path)
                if adapter_path is not None
                else LoraConfig(
                    r=model_cfg.lora_rank,
                    lora_alpha=model_cfg.lora_alpha,
                    target_modules=model_cfg.target_modules,
                    exclude_modules=getattr(model_cfg, "exclude_modules", None),
                    bias="none",
                )
            )
            config.task_type = task_type
            config.inference_mode = False
            peft = get_peft_model(model, config)
    return peft


def lora_scaling(model: nn.Module) -> float:
    """alpha / r of the model's adapter (PEFT's scaling of B A)."""
    config = model.peft_config[_ADAPTER]
    return config.lora_alpha / config.r


def base_name(name: str) -> str:
    """A PEFT model's parameter name -> the base model's (what a checkpoint and the engines use)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(_BASE_LAYER + ".", ".")


def is_adapter(name: str) -> bool:
    """A PEFT model's parameter that belongs to the adapter (``lora_A``/``lora_B``)."""
    return f".lora_A.{_ADAPTER}." in name or f".lora_B.{_ADAPTER}." in name


def adapter_file_name(name: str) -> str:
    """A PEFT model's adapter parameter name -> its key in ``adapter_model.safetensors`` (PEFT's
    saved format drops the adapter's name: what PEFT and vLLM read)."""
    return name.replace(f".{_ADAPTER}.", ".")


def adapter_config(model: nn.Module) -> dict:
    """The adapter's ``adapter_config.json`` content (PEFT's ``LoraConfig``, JSON-ready)."""
    config = model.peft_config[_ADAPTER].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def merged_weights(stream: Iterator[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, full tensor)`` in parameter order -> ``(base name, tensor)`` with every adapted
    linear merged, W + scaling * B @ A (computed in fp32, returned in W's dtype). A base weight waits
    for its ``lora_A`` and ``lora_B``, which follow it in parameter order; nothing else is held.

    Shapes: W (out, in), A (r, in), B (out, r)."""
    held: dict[str, torch.Tensor] = {}  # module prefix -> its base weight, then its A
    for name, tensor in stream:
        if f"{_BASE_LAYER}.weight" in name:
            held[name.split(_BASE_LAYER + ".")[0]] = tensor
            continue
        for part in ("lora_A", "lora_B"):
            tag = f".{part}.{_ADAPTER}.weight"
            if name.endswith(tag):
                module = name[: -len(tag)]
                break
        else:
            yield base_name(name), tensor
            continue
        if part == "lora_A":
            held[module + "#A"] = tensor
            continue
        weight, a = held.pop(module), held.pop(module + "#A")
        merged = (weight.float() + scaling * (tensor.float() @ a.float())).to(weight.dtype)
        yield base_name(module + ".weight"), merged
    if held:
        raise RuntimeError(f"LoRA merge: no adapter arrived for {sorted(held)[:3]}")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model's state dict under the base names, adapters merged."""
    state = {n: t.detach() for n, t in model.state_dict().items()}
    return dict(merged_weights(iter(state.items()), lora_scaling(model)))


class AdapterDisabled(nn.Module):
    """The base model of a LoRA-wrapped ``peft_model``, computed with its adapter switched off:
    the reference policy without a second copy of the weights (verl's ``ref_in_actor``). Holds no
    parameters of its own (the actor's are not registered twice)."""

    def __init__(self, peft_model: nn.Module):
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)  # (not a submodule: no shared parameters)

    @property
    def config(self):
        return self.peft_model.config

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def train(self, mode: bool = True):  # the actor's modes are the actor's
        return self

    def parameters(self, recurse: bool = True):  # (where callers ask for a device or dtype)
        return self.peft_model.parameters(recurse)
