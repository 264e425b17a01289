"""The model architectures rlhf-hpc trains, and the check a model's config gets at dry run.

``TESTED`` are the architectures that go through the whole matrix on CPU (tests/test_architectures.py,
with the tiny configs of ``rlhf_hpc.models.hf.TINY_MODELS``): actor log-probs against plain
transformers, FSDP2 on 2 ranks against one process, Ulysses against sp=1, the weight sync into vLLM
and its log-probs, checkpoint, resume and Hugging Face export. Another decoder-only causal LM that
transformers builds is accepted with a warning; anything else is refused before a job is queued.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["architecture_problems", "causal_lm_class", "moe_experts"]

# transformers class -> what makes it different from a plain Llama block, for the record
TESTED = {
    "Qwen2ForCausalLM": "q/k/v biases; Qwen2.5 0.5B-3B tie the head to the embedding, 7B does not",
    "Qwen3ForCausalLM": "q/k RMSNorm before rotary; 0.6B-4B tied",
    "LlamaForCausalLM": "llama3 rope scaling; Llama-3.2 1B/3B tied",
    "MistralForCausalLM": "sliding window (null in v0.3)",
    "Gemma2ForCausalLM": "sliding-window layers, attention and final-logit soft-capping, scaled embedding; tied",
    "Gemma3ForCausalLM": "q/k RMSNorm, sliding-window layers with their own rope; tied",
    "Qwen3MoeForCausalLM": "mixture of experts (128, 8 per token in Qwen3-30B-A3B), q/k RMSNorm; untied",
    "MixtralForCausalLM": "mixture of experts (8, 2 per token); untied",
}


def moe_experts(config) -> Optional[tuple[int, int]]:
    """(experts per layer, experts per token) of a mixture-of-experts ``config``; None for a dense one."""
    total = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    per_token = getattr(config, "num_experts_per_tok", None)
    return (int(total), int(per_token)) if total and per_token else None


def causal_lm_class(config) -> Optional[str]:
    """The class ``AutoModelForCausalLM`` builds for ``config`` (None: it builds none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = [a for a in (getattr(config, "architectures", None) or []) if a.endswith("ForCausalLM")]
    return named[0] if named else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)


def architecture_problems(config, key: str, attn: Optional[str] = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a policy or critic model of transformers ``config`` named by ``key``
    (``actor_rollout_ref.model`` or ``critic.model``); ``attn``: its ``override_config.attn_implementation``."""
    errors: list[str] = []
    warnings: list[str] = []
    tested = ", ".join(TESTED)
    cls = causal_lm_class(config)
    named = (getattr(config, "architectures", None) or [config.model_type])[0]
    if getattr(config, "vision_config", None) is not None or getattr(config, "text_config", None) is not None:
        errors.append(
            f"{key}.path: {named} is a multimodal model; rlhf-hpc trains text-only causal LMs ({tested}): "
            f"use the text model's checkpoint (for Gemma 3: model_type gemma3_text, Gemma3ForCausalLM)"
        )
        return errors, warnings
    if cls is None or not cls.endswith("ForCausalLM") or getattr(config, "is_encoder_decoder", False):
        built = f" (AutoModelForCausalLM would build {cls})" if cls else ""
        errors.append(
            f"{key}.path: {named} (model_type {config.model_type}) is not a decoder-only causal language "
            f"model{built}; rlhf-hpc trains causal LMs ({tested})"
        )
        return errors, warnings
    if cls not in TESTED:
        warnings.append(
            f"{key}.path: {cls} is not among the architectures tested end to end here ({tested}); "
            f"it may train, but nothing here has checked its weight sync or its log-probs"
        )
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap and attn == "sdpa":
        errors.append(
            f"{key}.override_config.attn_implementation=sdpa: {cls} soft-caps its attention scores "
            f"(attn_logit_softcapping={cap}), which sdpa ignores; use varlen (the default without "
            f"flash-attn), eager or flash_attention_2"
        )
    return errors, warnings
