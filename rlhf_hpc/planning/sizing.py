"""Sizes of a model and of what a step keeps alive, from its config alone: the parameter counts
of the shape (built on the meta device), bytes per dtype, activations per token and layer, logits,
the largest micro-batch. Shared by the layout chooser (rlhf_hpc.planning.layout) and the memory plan
(rlhf_hpc.planning.memory_plan)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.distributed.fsdp import decoder_layers, tied_embeddings
from rlhf_hpc.models.architectures import moe_experts
from rlhf_hpc.models.hf import is_tiny, model_config
from rlhf_hpc.models.lora import apply_lora, is_adapter

__all__ = [
    "DEFAULT_GPU_MEMORY_GB",
    "DTYPE_BYTES",
    "GiB",
    "KNOWN_MODELS",
    "LOGITS_CHUNK",
    "ModelShape",
    "activation_bytes",
    "adapter_params",
    "engine_weight_segments",
    "forward_flops",
    "layer_activation_bytes",
    "logits_bytes",
    "matmul_shape",
    "model_shape",
    "pinned_bytes",
    "pinned_shard_bytes",
]

GiB = 1024**3
DEFAULT_GPU_MEMORY_GB = 80.0  # H100 / A100 80GB
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}

# published config.json fields of models the shipped recipes use, for dry runs away from the cluster
KNOWN_MODELS = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # NeMo-RL's published GRPO runs (benchmarks.published_runs)
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "llama-3.1-70b": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(  # 128 experts, 8 per token: 30.5B parameters, 3.35B of them active
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
# Qwen2.5-7B's shape with a 4k context (verl's DAPO and fully-async lines train it)
KNOWN_MODELS["qwen2.5-math-7b"] = {**KNOWN_MODELS["qwen2.5-7b"], "max_position_embeddings": 4096}


@dataclass
class ModelShape:
    """What the plan needs of a decoder-only model. Parameter counts are exact (meta build)."""

    params: int
    layer_params: int  # one decoder layer
    embed_params: int
    head_params: int  # 0 when tied to the embedding
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    source: str = ""
    # a mixture of experts: experts per layer, how many a token uses, their parameters (all layers);
    # ``intermediate`` is then what a token's MLP holds (its experts' widths together)
    experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    moe_layers: int = 0  # decoder layers with routed experts (Qwen3-MoE's mlp_only_layers are dense)
    # every parameter but an untied output head, as (dim-0 rows, elements): FSDP2 shards dim 0, and a
    # rank's pinned host copy of each shard is an allocation of its own (``pinned_shard_bytes``);
    # empty where the shape was not built (``matmul_shape``)
    tensor_rows: tuple[tuple[int, int], ...] = ()
    # tensors of the hub's checkpoint, what a weight sync sends one by one (each expert's three
    # matrices apart: rlhf_hpc.models.checkpoint_names); 0 where the shape was not built
    checkpoint_tensors: int = 0

    def rows_with_head(self, head: str = "lm") -> tuple[tuple[int, int], ...]:
        """``tensor_rows`` with the model's head: ``"lm"``, the output head (untied); ``"value"``, a
        critic's value head (hidden -> 1, with its bias)."""
        if not self.tensor_rows:
            return ()
        if head == "value":
            return self.tensor_rows + ((1, self.hidden), (1, 1))
        return self.tensor_rows + (((self.vocab, self.head_params),) if self.head_params else ())

    @property
    def param_tensors(self) -> int:
        """The trained parameters (tensors), the output head included: what FSDP gathers one by one."""
        return len(self.tensor_rows) + (1 if self.head_params else 0)

    @property
    def largest_group(self) -> int:
        """Parameters of the largest FSDP group (parallel.py: each layer, embedding, head, root)."""
        return max(self.layer_params, self.embed_params, self.head_params)

    @property
    def idle_expert_params(self) -> int:
        """Expert parameters a token does not use (0 for a dense model)."""
        return self.expert_params - self.expert_params * self.experts_per_token // self.experts if self.experts else 0

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all of a dense model's; a mixture of experts' own
        layers and the experts it is routed to. What FLOPs scale with; memory holds ``params``."""
        return self.params - self.idle_expert_params

    @property
    def active_layer_params(self) -> int:
        return self.layer_params - self.idle_expert_params // max(self.layers, 1)

    def touched_experts(self, tokens: float) -> float:
        """Experts of a routed layer that ``tokens`` tokens are routed to, with routing spread evenly:
        E x (1 - (1 - k/E)^tokens) (0 for a dense model)."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** max(tokens, 1))

    def read_params(self, tokens: float) -> float:
        """Parameters a forward over ``tokens`` tokens reads (a decode step's batch): a mixture of
        experts reads the experts any token is routed to."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (1 - self.touched_experts(tokens) / self.experts)


_shapes: dict[str, ModelShape] = {}


def model_shape(path: str, override: Optional[dict] = None, trust_remote_code: bool = False) -> ModelShape:
    """Shape of ``path`` from its config alone (no weights); remembered per process."""
    key = repr((path, sorted((override or {}).items()), trust_remote_code))
    if key not in _shapes:
        _shapes[key] = _model_shape(path, override, trust_remote_code)
    return _shapes[key]


def _meta_model(path: str, override: Optional[dict] = None, trust_remote_code: bool = False):
    """(the model built on the meta device, its config, where the config came from)."""
    import torch
    from transformers import (  # (seconds: only plans)
        AutoModelForCausalLM,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    expanded = Path(path).expanduser()
    if is_tiny(path) or (expanded / "config.json").is_file():
        config, source = model_config(path, override, trust_remote_code), f"config of {path}"
    else:
        key = next((k for k in KNOWN_MODELS if k in Path(path).name.lower()), None)
        if key is None:
            raise FileNotFoundError(
                f"no config.json at {path} and no published shape for it: run the dry run where the model directory is"
            )
        fields = dict(KNOWN_MODELS[key])
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[
            fields.pop("model_type", "qwen2")
        ](**fields)
        for k, v in (override or {}).items():
            if k != "attn_implementation":
                setattr(config, k, v)
        source = f"published {key} config (no config.json at {path} here)"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model, config, source


def _experts_fields(model, config) -> dict:
    """ModelShape's mixture-of-experts fields (none for a dense model): the routed experts'
    parameters are those under a layer's ``experts`` module (a shared expert is a dense MLP); the
    checkpoint holds each expert's gate, up and down matrices apart, whether the model fuses them
    (transformers 5: gate_up_proj, down_proj) or not."""
    moe = moe_experts(config)
    if moe is None:
        return {}
    routed = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    moe_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    moe_layers = len({n.partition(".experts.")[0] for n, _ in routed})
    return dict(
        experts=moe[0],
        experts_per_token=moe[1],
        expert_params=sum(p.numel() for _, p in routed),
        moe_layers=moe_layers,
        intermediate=moe[1] * moe_width + shared,
        checkpoint_tensors=sum(1 for _ in model.parameters()) - len(routed) + 3 * moe[0] * moe_layers,
    )


def _model_shape(path: str, override: Optional[dict] = None, trust_remote_code: bool = False) -> ModelShape:
    model, config, source = _meta_model(path, override, trust_remote_code)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    layers = decoder_layers(model)
    tied = tied_embeddings(model)
    heads = config.num_attention_heads
    fields = dict(intermediate=config.intermediate_size, checkpoint_tensors=sum(1 for _ in model.parameters()))
    fields |= _experts_fields(model, config)
    head = None if tied or model.get_output_embeddings() is None else model.get_output_embeddings().weight
    rows = tuple((p.shape[0] if p.dim() else 1, p.numel()) for p in model.parameters() if p is not head)
    return ModelShape(
        params=count(model),
        layer_params=max(count(layer) for layer in layers),
        embed_params=model.get_input_embeddings().weight.numel(),
        head_params=0
        if tied or model.get_output_embeddings() is None
        else model.get_output_embeddings().weight.numel(),
        hidden=config.hidden_size,
        layers=len(layers),
        vocab=config.vocab_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", heads),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        source=source,
        tensor_rows=rows,
        **fields,
    )


def _pow2(size: int) -> int:
    return 1 << (size - 1).bit_length() if size > 0 else 0


def pinned_shard_bytes(rows: tuple[tuple[int, int], ...], shards: int, element_bytes: int) -> int:
    """Host bytes of the largest rank's shards (FSDP2: ``ceil(rows / shards)`` rows of dim 0) of
    tensors ``rows`` (``ModelShape.tensor_rows``) in pinned memory, each its own allocation: torch's
    caching host allocator, behind ``pin_memory()`` and a non-blocking device-to-host copy alike,
    rounds every allocation up to a power of two (c10's ``CachingHostAllocator``:
    ``PowerOf2Ceil(size)``). A 7B model's shards on 8 ranks come to ~1.8x their bytes."""
    total = 0
    for n, numel in rows:
        total += _pow2(-(-n // shards) * (numel // max(n, 1)) * element_bytes)
    return total


# PyTorch's CUDA caching allocator: a request over 10 MiB is a segment of its own, rounded up to
# 2 MiB; one of 1-10 MiB is carved from 20 MiB segments, a smaller one from 2 MiB segments
_MiB = 2**20
_LARGE, _MEDIUM_SEGMENT, _SMALL, _ROUND = 10 * _MiB, 20 * _MiB, _MiB, 2 * _MiB


def engine_weight_segments(s: ModelShape, tp: int, element_bytes: int) -> list[int]:
    """The device segments one rank's vLLM weights occupy (``tp``: its tensor-parallel size), as
    vLLM lays them out: q/k/v fused, gate/up fused (a mixture of experts: every layer's experts in
    two fused tensors, w13 and w2), each sharded 1/TP, allocated through PyTorch's caching
    allocator, whose segments are what vLLM's sleep mode copies (one ``cudaMemcpy`` per
    allocation; rlhf_hpc.planning.host_memory.engine_sleep_copy). Norms and biases are packed in
    shared segments."""
    qkv, o = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim, s.heads * s.head_dim * s.hidden
    if s.experts:
        experts = s.expert_params // max(s.layers, 1)  # one layer's: w13 (gate and up) and w2 (down)
        matmuls = [qkv, o, 2 * experts // 3, experts // 3, s.experts * s.hidden]
    else:
        matmuls = [qkv, o, 2 * s.hidden * s.intermediate, s.hidden * s.intermediate]
    small = max(s.layer_params - sum(matmuls), 0)  # norms, biases
    tensors = [n for n in matmuls if n] * s.layers + [s.embed_params] + ([s.head_params] if s.head_params else [])
    sizes = [-(-n // tp) * element_bytes for n in tensors]
    segments = [-(-b // _ROUND) * _ROUND for b in sizes if b > _LARGE]
    medium = sum(b for b in sizes if _SMALL < b <= _LARGE)
    packed = sum(b for b in sizes if b <= _SMALL) + s.layers * -(-small // tp) * element_bytes
    segments += [_MEDIUM_SEGMENT] * -(-medium // _MEDIUM_SEGMENT) + [_ROUND] * -(-packed // _ROUND)
    return segments


def pinned_bytes(sizes: list[int]) -> int:
    """Host bytes of pinned buffers of ``sizes``, each its own allocation rounded up to a power of
    two by torch's caching host allocator (c10's ``CachingHostAllocator``: ``PowerOf2Ceil``)."""
    return sum(_pow2(b) for b in sizes)


def matmul_shape(config, source: str = "") -> ModelShape:
    """The shape of a transformers decoder config by arithmetic alone (no meta build, cheap enough
    for every step), ``layer_params`` counting a layer's matmul weights only (q/o: h x q_dim, k/v:
    h x kv_dim, MLP: 3 x h x i), as FLOPs count them (the MFU metric, rlhf_hpc.observability.perf)."""
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    moe = moe_experts(config)
    if moe is not None:  # the experts a token is routed to, and the router
        inter = moe[1] * (getattr(config, "moe_intermediate_size", None) or inter) + (
            getattr(config, "shared_expert_intermediate_size", None) or 0
        )
    per_layer = 2 * h * head_dim * heads + 2 * h * head_dim * kv_heads + 3 * h * inter + (h * moe[0] if moe else 0)
    head = 0 if getattr(config, "tie_word_embeddings", False) else vocab * h
    return ModelShape(
        params=layers * per_layer + vocab * h + head,
        layer_params=per_layer,
        embed_params=vocab * h,
        head_params=head,
        hidden=h,
        layers=layers,
        intermediate=inter,
        vocab=vocab,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        source=source or "matmul weights of the config",
    )


def forward_flops(
    s: ModelShape,
    tokens: float,
    seq_len: float,
    head_tokens: float,
    head_width: int,
    square_sum: Optional[float] = None,
) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens in sequences of ``seq_len`` tokens, each attending
    to itself only: 2 x the layers' parameters per token (``s.active_layer_params``: the plans' exact
    count, biases and norms too, a mixture of experts' routed experts only; the MFU metric's
    ``matmul_shape``, matmul weights alone), causal attention
    2 x layers x q_dim x L per token of a sequence of L (QK^T and AV, half of the L x L square), the
    head (``head_width`` outputs) on ``head_tokens`` tokens. ``square_sum``: the sum of the squared
    lengths of sequences of different lengths (then ``seq_len`` is not used). The one FLOP count of
    the time plan (rlhf_hpc.planning.time_plan) and the MFU metric."""
    q = s.heads * s.head_dim
    attention = 2 * s.layers * q * seq_len * tokens if square_sum is None else 2 * s.layers * q * square_sum
    return 2 * s.layers * s.active_layer_params * tokens + attention + 2 * s.hidden * head_width * head_tokens


_adapters: dict[str, int] = {}


def adapter_params(path: str, lora_cfg, override: Optional[dict] = None, trust_remote_code: bool = False) -> int:
    """Parameters of the LoRA adapter ``lora_cfg`` (a model config with verl's LoRA keys) would add
    to the model at ``path``: exact, PEFT applied to a meta build (where the config is readable;
    else the published shapes ``model_shape`` knows, as a Qwen2)."""
    key = repr(
        (
            path,
            sorted((override or {}).items()),
            trust_remote_code,
            lora_cfg.lora_rank,
            lora_cfg.lora_alpha,
            lora_cfg.target_modules,
            getattr(lora_cfg, "exclude_modules", None),
            getattr(lora_cfg, "lora_adapter_path", None),
        )
    )
    if key not in _adapters:
        model = apply_lora(_meta_model(path, override, trust_remote_code)[0], lora_cfg, seed=0)
        _adapters[key] = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    return _adapters[key]


def layer_activation_bytes(s: ModelShape, compute_bytes: int) -> int:
    """Bytes a decoder layer keeps for backward per token (Qwen2/Llama block, flash-style attention):
    RMSNorms keep their fp32 input and normalised value (2 x 2h fp32) and a cast output (2 x h);
    q/k/v and their rotary copies (2 x (q + 2kv) - kv), the attention output (q), o_proj output (h);
    gate, up, act(gate), act(gate) x up (4 x I); down_proj output (h)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return 4 * 4 * s.hidden + compute_bytes * (2 * s.hidden + 3 * q + 3 * kv + 2 * s.hidden + 4 * s.intermediate)


LOGITS_CHUNK = 1024  # rows algos.token_logprobs_chunked takes at a time


def logits_bytes(n_tokens: int, vocab: int, compute_bytes: int, with_grad: bool) -> int:
    """The head's output for ``n_tokens`` response tokens (compute dtype; with gradients also its
    gradient), and one chunk's fp32 temporaries (upcast, divided by the temperature, a logsumexp
    or softmax temporary; in backward the recomputed chunk and its gradient)."""
    full = n_tokens * vocab * compute_bytes * (2 if with_grad else 1)
    return full + min(n_tokens, LOGITS_CHUNK) * vocab * 4 * (4 if with_grad else 3)


def activation_bytes(s: ModelShape, tokens: int, b: int, checkpointing: bool, with_grad: bool) -> float:
    """Activations of ``tokens`` tokens through the decoder: a forward keeps one layer's temporaries;
    backward keeps every layer's (with checkpointing: each layer's input, one layer recomputed)."""
    per_layer = layer_activation_bytes(s, b)
    if not with_grad:  # a forward keeps one layer's temporaries at a time
        return float(tokens * per_layer)
    if checkpointing:  # each layer's input is kept, one layer is recomputed at a time
        return float(tokens * (s.layers * s.hidden * b + per_layer))
    return float(tokens * s.layers * per_layer)
