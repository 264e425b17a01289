"""Packed-sequence attention without the flash-attn package: ``attn_implementation="varlen"``.

A packed row holds several sequences, position ids restarting at 0 for each. With sdpa,
transformers gives the kernel a dense block-diagonal mask over the whole row: every pair of the
row's N tokens is computed (N^2, and a masked sdpa cannot use its flash kernel) where the sequences
need only the sum of L_i^2. "varlen" gives each sequence its own causal attention:

- on a GPU in fp16/bf16: torch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``, part of torch, no extra package);
- elsewhere: causal sdpa per sequence, batched over sequences of equal length (the reference the
  kernel is checked against, and the CPU default: cheaper than sdpa's dense mask over the row).

Calls that carry a padding mask (padded batches) go to sdpa unchanged, and so does decoding with a
KV cache. Select it with ``actor_rollout_ref.model.override_config.attn_implementation: varlen``
(verl's key); the default is flash_attention_2 where flash-attn is installed, else varlen.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "kernel_arguments",
    "packing_metadata",
    "per_sequence_attention",
    "register",
    "sequence_starts",
    "varlen_attention_forward",
]

NAME = "varlen"

# one forward passes the same position_ids tensor to every layer: where the caller gave no packing
# metadata (``cu_seq_lens_q``), its sequences are found once per forward, not once per layer
_cached: tuple[Optional[torch.Tensor], Optional[torch.Tensor], int] = (None, None, 0)


def register() -> str:
    """Make ``NAME`` a transformers attention implementation (idempotent); returns ``NAME``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME


def varlen_mask(*args, **kwargs):
    """No mask where the position ids say where sequences start (packed or unpadded rows); the sdpa
    mask where a padding mask is given."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def sequence_starts(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, L) position ids -> (cu_seqlens (S+1,) int32 over the flattened B*L tokens, longest
    sequence). A sequence starts where its position id is 0, and at every row start. Two host
    syncs (the starts' count, the longest): callers that know the lengths pass them instead
    (``batching.Packed.attention_kwargs``)."""
    B, L = position_ids.shape
    start = position_ids == 0
    start[:, 0] = True
    starts = start.reshape(-1).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    return cu, int(cu.diff().max())


def packing_metadata(position_ids: torch.Tensor, batch: int, length: int, kwargs: dict) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of a forward's rows: the caller's (transformers' ``cu_seq_lens_q``
    and ``max_length_q``), else found from ``position_ids`` once per forward (the same tensor
    reaches every layer; (1, L) position ids, transformers' default, stand for every row)."""
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q"):
        return kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    global _cached
    if _cached[0] is not position_ids:
        _cached = (position_ids, *sequence_starts(position_ids.reshape(-1, length).expand(batch, length)))
    return _cached[1], _cached[2]


def _kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel_arguments(
    kernel, scaling: Optional[float], heads: int, kv_heads: int, window: Optional[int] = None
) -> tuple[dict, int]:
    """Keyword arguments for this torch's ``varlen_attn`` (its causal switch and GQA support
    changed between releases), and how many times to repeat each key/value head without GQA.
    ``window``: a sliding window of that many tokens (flash's (left, right) = (window - 1, 0))."""
    params = inspect.signature(kernel).parameters
    kw = {"scale": scaling}
    if window is not None:
        if "window_size" not in params:
            raise ValueError(
                "attn_implementation=varlen: this torch's varlen_attn has no sliding window; install "
                "flash-attn (attn_implementation=flash_attention_2) for this model"
            )
        kw["window_size"] = (window - 1, 0)
    else:
        kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if kv_heads != heads and "enable_gqa" in params:
        kw["enable_gqa"] = True
        return kw, 1
    return kw, heads // kv_heads


def varlen_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None,
    ulysses=None,
    softcap: Optional[float] = None,
    **kwargs,
):
    """transformers attention function. query (B, H, L, D), key/value (B, Hkv, L, D) ->
    ((B, L, H, D), None). ``ulysses`` (a ``rlhf_hpc.distributed.sequence_parallel.UlyssesAttention``): the
    rows are one slice of a sequence split over ranks; it exchanges heads for the whole sequence
    and calls back here. ``sliding_window`` W (Gemma 2/3's local layers, Mistral v0.1): a token
    sees itself and the W - 1 before it, as transformers' masks; ``softcap`` (Gemma 2): scores
    become softcap x tanh(score / softcap) before the softmax."""
    if ulysses is not None:
        return ulysses(
            module,
            query,
            key,
            value,
            varlen_attention_forward,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **kwargs,
        )
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        if softcap is not None:  # sdpa has no soft-capping: the model's own eager attention has
            eager = sys.modules[type(module).__module__].eager_attention_forward
            if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds its mask
                attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min
                )
            return eager(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                sliding_window=sliding_window,
                softcap=softcap,
                **kwargs,
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(
            "attn_implementation=varlen does not support attention dropout; use sdpa or "
            "flash_attention_2 for this model"
        )
    B, H, L, D = query.shape
    kv_heads = key.shape[1]
    cu, longest = packing_metadata(position_ids, B, L, kwargs)
    window = sliding_window if sliding_window is not None and longest > sliding_window else None
    q = query.transpose(1, 2).reshape(B * L, H, D)
    k = key.transpose(1, 2).reshape(B * L, kv_heads, D)
    v = value.transpose(1, 2).reshape(B * L, kv_heads, D)
    kernel = _kernel()
    if kernel is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and softcap is None:
        kw, repeat = kernel_arguments(kernel, scaling, H, kv_heads, window)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = kernel(q, k, v, cu, cu, longest, longest, **kw)
    elif q.dtype in (torch.float16, torch.bfloat16) and not q.is_cuda:
        # the host's sdpa backward in bf16 takes ~3x as long as in fp32 (measured: 14.6 vs 5.2 ms per
        # layer, 8 x 58 tokens); attention is a small share of the FLOPs, so compute it in fp32
        out = per_sequence_attention(q.float(), k.float(), v.float(), cu, scaling, window, softcap).to(q.dtype)
    else:
        out = per_sequence_attention(q, k, v, cu, scaling, window, softcap)
    return out.reshape(B, L, H, D), None


def _causal(length: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """(length, length) True where a query may attend: causal, within ``window`` when given; None
    for plain causal attention (sdpa's own ``is_causal``)."""
    if window is None:
        return None
    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: Optional[float],
    window: Optional[int],
    softcap: Optional[float],
) -> torch.Tensor:
    """Causal attention over a batch of equal-length sequences: (n, H, L, D) q, (n, Hkv, L, D) k/v."""
    gqa = k.shape[1] != q.shape[1]
    allowed = _causal(q.shape[2], window, q.device)
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scaling, enable_gqa=gqa
        )
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if allowed is None:
        allowed = _causal(q.shape[2], q.shape[2], q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores.float(), -1).to(v.dtype) @ v


def per_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scaling: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention inside each sequence of a packed batch (within ``window`` tokens, with
    ``softcap`` when given): q (N, H, D), k/v (N, Hkv, D), ``cu`` (S+1,) sequence bounds ->
    (N, H, D). Sequences of equal length go through one batched call (one call per distinct length,
    not per sequence): rollouts often share lengths (responses cut at the limit), and small
    per-sequence calls cost more than they compute."""
    N, H, D = q.shape
    lens = cu.diff().long()
    starts = cu[:-1].long()
    distinct = lens.unique()
    if len(distinct) == 1:  # every sequence the same length: the packed row is already a batch
        n, length = len(lens), int(distinct[0])
        o = _attend(*(t.view(n, length, t.shape[1], D).transpose(1, 2) for t in (q, k, v)), scaling, window, softcap)
        return o.transpose(1, 2).reshape(N, H, D)
    outs, order = [], []
    for length in distinct.tolist():
        first = starts[lens == length]  # (n,) the first token of each sequence of this length
        n = len(first)
        idx = (first[:, None] + torch.arange(length, device=q.device)).reshape(-1)  # (n * length,)
        o = _attend(
            *(t[idx].view(n, length, t.shape[1], D).transpose(1, 2) for t in (q, k, v)), scaling, window, softcap
        )
        outs.append(o.transpose(1, 2).reshape(n * length, H, D))
        order.append(idx)
    # the outputs grouped by length -> back in token order
    return torch.cat(outs)[torch.cat(order).argsort()]
