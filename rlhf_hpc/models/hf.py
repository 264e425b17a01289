"""Building the actor, critic, reference and reward models (and tiny random-weight test models).

``model.path`` is a Hugging Face directory or hub name (resolved from the local cache; nothing is
downloaded at run time), or ``tiny://<architecture>`` (``TINY_MODELS``: qwen2, qwen3, llama, mistral,
gemma2, gemma3, and the mixtures of experts qwen3_moe and mixtral) for a small model built in code
with random weights: query parameters set config fields, e.g. ``tiny://qwen2?hidden_size=128&num_hidden_layers=4&tie_word_embeddings=true``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import warnings
from typing import Any, Optional
from urllib.parse import parse_qsl, urlparse

import torch
from torch import nn

from rlhf_hpc.models import attention

__all__ = [
    "TINY_MODELS",
    "TokenScorer",
    "attn_implementation",
    "build_causal_lm",
    "build_critic",
    "build_token_scorer",
    "flash_attn_problem",
    "import_external_libs",
    "is_tiny",
    "local_path",
    "model_config",
    "tiny_fields",
    "torch_dtype",
]

# Tiny random-weight models of the architectures the project is tested on (tests/test_architectures.py),
# each shaped like the checkpoints users train (tied where those are). head_dim 32: vLLM's CPU attention
# kernels do not support head_dim 16.
TINY_QWEN2 = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
_TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)
TINY_MODELS: dict[str, tuple[str, dict]] = {  # tiny://<name> -> (transformers model_type, config fields)
    "qwen2": ("qwen2", TINY_QWEN2),  # Qwen2.5-7B (untied); ?tie_word_embeddings=true: Qwen2.5-0.5B-3B
    "qwen3": ("qwen3", dict(_TINY, tie_word_embeddings=True)),  # q/k norms; Qwen3-0.6B-4B are tied
    "llama": (
        "llama",
        dict(
            _TINY,
            tie_word_embeddings=True,
            rope_parameters=dict(  # Llama-3.2-1B/3B
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
        ),
    ),
    "mistral": ("mistral", dict(_TINY, tie_word_embeddings=False, sliding_window=None)),  # Mistral-7B-v0.3
    # sliding-window layers (window 32, so tests' sequences cross it) and logit soft-capping; always tied
    "gemma2": (
        "gemma2",
        dict(
            _TINY, query_pre_attn_scalar=32, sliding_window=32, attn_logit_softcapping=1.0, final_logit_softcapping=3.0
        ),
    ),  # caps that bite at tiny scales
    "gemma3": (
        "gemma3_text",
        dict(_TINY, query_pre_attn_scalar=32, sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
    ),
    # mixture of experts: 8 experts, 2 per token, in every layer (Qwen3-30B-A3B: 128 and 8, untied,
    # the top-k weights renormalised); transformers 5 holds the experts fused, (E, 2I, H) and (E, H, I)
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            _TINY,
            tie_word_embeddings=False,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "mixtral": (  # Mixtral-8x7B: 8 experts, 2 per token, untied
        "mixtral",
        dict(_TINY, intermediate_size=64, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2),
    ),
}


def tiny_fields(path: str) -> tuple[str, dict]:
    """(transformers model_type, config fields) of a ``tiny://<name>?field=value&...`` address: the
    built-in fields of ``<name>`` (``TINY_MODELS``) with the query's on top."""
    url = urlparse(path)
    if url.netloc not in TINY_MODELS:
        raise ValueError(
            f"unknown tiny model '{path}'; the built-in ones are {', '.join('tiny://' + n for n in TINY_MODELS)}"
        )
    model_type, fields = TINY_MODELS[url.netloc]
    return model_type, {**fields, **{k: _parse_value(v) for k, v in parse_qsl(url.query)}}


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def is_tiny(path: str) -> bool:
    return path.startswith("tiny://")


def local_path(path: str) -> str:
    """A model directory given from the home directory (``~/...``) expanded: transformers and vLLM
    would take it for a hub name."""
    return os.path.expanduser(path) if path.startswith("~") else path


def flash_attn_problem() -> Optional[str]:
    """None when the flash-attn package imports, else why not (missing, or a broken build)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a build against another torch fails in many ways
        return f"flash-attn does not import ({type(e).__name__}: {e})"
    return None


def attn_implementation(device: torch.device, override: Optional[dict] = None) -> str:
    """``override_config.attn_implementation`` when set (verl's key; ``varlen``: rlhf_hpc.models.attention),
    else on a GPU flash_attention_2 where flash-attn imports, or ``varlen`` (torch's own
    variable-length flash kernel) with a warning where it does not: never sdpa on a GPU, whose
    packed rows get a dense block-diagonal mask. On the CPU: ``varlen`` too, its per-sequence sdpa
    batched by length (1.6x faster than sdpa's masked row for 32 packed rows of 58 tokens)."""
    if override and override.get("attn_implementation"):
        return override["attn_implementation"]
    if device.type == "cuda":
        problem = flash_attn_problem()
        if problem is None:
            return "flash_attention_2"
        warnings.warn(
            f"{problem}: packed rows use attn_implementation=varlen (torch's variable-length flash "
            f"kernel) instead; set actor_rollout_ref.model.override_config.attn_implementation to "
            f"choose explicitly",
            stacklevel=2,
        )
    return "varlen"


def _use_attn(config, attn: str) -> None:
    if attn == "varlen":
        attention.register()
    config._attn_implementation = attn


def model_config(path: str, override: Optional[dict] = None, trust_remote_code: bool = False):
    """The transformers config for ``path`` with ``override`` applied."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if is_tiny(path):
        model_type, fields = tiny_fields(path)
        config = AutoConfig.for_model(model_type, **fields)
        # engines read the class to build from the config (vLLM would otherwise pick a pooling model)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    else:
        config = AutoConfig.from_pretrained(local_path(path), trust_remote_code=trust_remote_code)
    for k, v in (override or {}).items():
        if k != "attn_implementation":  # chosen per build (attn_implementation()), not a config field
            setattr(config, k, v)
    return config


def build_causal_lm(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    override: Optional[dict] = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    attn: str = "sdpa",
) -> nn.Module:
    """Actor / reference model in ``dtype`` on ``device`` ("meta" builds the structure only)."""
    from transformers import AutoModelForCausalLM

    config = model_config(path, override, trust_remote_code)
    _use_attn(config, attn)
    if is_tiny(path) or str(device) == "meta":
        with torch.device(device):
            torch.manual_seed(seed)  # same random weights on every rank
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            local_path(path), config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    model.config.use_cache = False
    return model


class BackboneWithHead(nn.Module):
    """A transformers backbone (``self.model``) under a small head of ours: the parts of the model
    interface that parallelize() and the engine use, taken from the backbone."""

    @property
    def config(self):
        return self.model.config

    @property
    def _no_split_modules(self):
        return self.model._no_split_modules

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> None:
        return None  # the head is ours, not an LM head

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


class CriticModel(BackboneWithHead):
    """A causal LM's backbone with a scalar value head: (B, L) tokens -> (B, L) values."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    def init_value_head(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = torch.randn(self.value_head.weight.shape, generator=g) / math.sqrt(self.value_head.in_features + 1)
            self.value_head.weight.copy_(w.to(self.value_head.weight.dtype))
            self.value_head.bias.zero_()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state
        # a fresh tensor, not a view: FSDP2 hooks on a view can be dropped by in-place ops
        return self.value_head(hidden).squeeze(-1).float().clone()


def build_critic(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    override: Optional[dict] = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    attn: str = "sdpa",
    init_from: Optional[nn.Module] = None,
) -> CriticModel:
    """Value model: the backbone of ``path`` (or a copy of ``init_from``'s backbone, e.g. the
    freshly built tiny actor) and a new value head."""
    from transformers import AutoModel

    config = model_config(path, override, trust_remote_code)
    _use_attn(config, attn)
    if is_tiny(path) or str(device) == "meta":
        with torch.device(device):
            torch.manual_seed(seed)
            backbone = AutoModel.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        backbone = AutoModel.from_pretrained(
            local_path(path), config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    if init_from is not None:
        backbone.load_state_dict(init_from.model.state_dict())
    with torch.device(device):
        critic = CriticModel(backbone, config.hidden_size).to(dtype)
    if str(device) != "meta":
        critic.init_value_head(seed)
    return critic


class TokenScorer(BackboneWithHead):
    """A sequence classifier's backbone and one-label ``score`` head applied at every token:
    (B, L) tokens -> (B, L) float32 scores."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        head = getattr(classifier, "score", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"{type(classifier).__name__}: a reward model needs a one-label linear 'score' head "
                f"(AutoModelForSequenceClassification with num_labels=1)"
            )
        self.model = getattr(classifier, classifier.base_model_prefix)
        self.score = head

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def build_token_scorer(
    path: str,
    dtype: torch.dtype,
    override: Optional[dict] = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    attn: str = "sdpa",
    device: torch.device | str = "cpu",
) -> TokenScorer:
    """The reward model of ``path`` on the host (``tiny://qwen2?...``: random weights, seeded;
    ``device="meta"``: the structure only)."""
    from transformers import AutoModelForSequenceClassification

    config = model_config(path, override, trust_remote_code)
    if is_tiny(path):
        config.num_labels = 1
    if config.num_labels != 1:
        raise ValueError(
            f"reward_model.model.path: {path} has {config.num_labels} labels; a reward model scores "
            f"with one (num_labels=1)"
        )
    _use_attn(config, attn)
    if is_tiny(path) or str(device) == "meta":
        with torch.device(device):
            torch.manual_seed(seed)  # same random weights on every rank
            classifier = AutoModelForSequenceClassification.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
    else:
        classifier = AutoModelForSequenceClassification.from_pretrained(
            local_path(path), config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    classifier.requires_grad_(False)
    return TokenScorer(classifier)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def import_external_libs(*names: Optional[str]) -> list[str]:
    """``model.external_lib`` (verl's key): import each named module before any model is built,
    so it can register custom architectures with transformers' Auto classes. Returns the names
    imported."""
    done = []
    for name in names:
        if name and name not in done:
            importlib.import_module(name)
            done.append(name)
    return done
