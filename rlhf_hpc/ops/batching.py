"""Padding, packing and micro-batching of prompt+response sequences.

Layout of a padded batch (the reference system's): ``input_ids``/``attention_mask``/``position_ids``
are ``(B, L)`` with ``L = P + R``: the prompt left-padded to ``P`` tokens, then the response
right-padded to ``R``. ``responses`` = ``input_ids[:, P:]`` and ``response_mask`` are ``(B, R)``.
A row's valid tokens are therefore contiguous: ``[pad.. prompt response ..pad]``.

Packing (``use_remove_padding``) concatenates the valid tokens of every row into one row ``(1, N)``
with position ids that restart at 0 per sequence. transformers then attends within each
sequence only -- provided the call passes ``attention_mask=None`` and ``use_cache=False`` (with
either, the logits are silently wrong).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "Batch",
    "Packed",
    "dummy_rows",
    "fixed_micro_batches",
    "make_padded_batch",
    "micro_batch_groups",
    "pack",
    "per_rank_mini_batch",
    "position_ids_from_mask",
    "restore_order",
    "select_rows",
    "to_device",
    "token_budget_micro_batches",
    "unpack_per_token",
]

Batch = dict[str, torch.Tensor]


def per_rank_mini_batch(mini_batch_prompts: int, n: int, world_size: int) -> int:
    """Responses each rank holds in one PPO mini-batch (the runtime's; the plans read it through
    ``rlhf_hpc.ops.step_shape``)."""
    return mini_batch_prompts * n // world_size


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) positions counting valid tokens from 0 (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def make_padded_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, prompt_len: int, response_len: int
) -> Batch:
    """Token lists -> the padded layout above. Raises ValueError when a list is too long."""
    B = len(prompts)
    input_ids = torch.full((B, prompt_len + response_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, prompt_len + response_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) > prompt_len or len(r) > response_len:
            raise ValueError(
                f"row {i}: prompt {len(p)} / response {len(r)} tokens exceed {prompt_len} / {response_len}"
            )
        if p:
            input_ids[i, prompt_len - len(p) : prompt_len] = torch.tensor(p)
            attention_mask[i, prompt_len - len(p) : prompt_len] = 1
        if r:
            input_ids[i, prompt_len : prompt_len + len(r)] = torch.tensor(r)
            attention_mask[i, prompt_len : prompt_len + len(r)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "responses": input_ids[:, prompt_len:].clone(),
        "response_mask": attention_mask[:, prompt_len:].clone(),
    }


def select_rows(batch: Batch, rows: torch.Tensor | list[int] | slice) -> Batch:
    return {k: v[rows] for k, v in batch.items()}


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A micro-batch on the compute device. Step batches stay on the host (they are small: token
    ids and per-token floats); only what one forward needs moves to the accelerator."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def dummy_rows(batch: Batch) -> Batch:
    """A one-row stand-in for an empty micro-batch: it runs the collectives every rank must join,
    and the caller weights its loss by 0."""
    return select_rows(batch, [0])


# ------------------------------------------------------------------------------------ packing
@dataclass
class Packed:
    """One packed row and how to get per-response-token outputs back.

    input_ids, position_ids: (1, N). ``gather_index``: (B, R) positions in the packed row whose
    *logits* predict response token (b, j) -- the position just before it; 0 where masked.
    ``cu_seqlens`` (B+1,) int32 sequence bounds and ``max_len``: the packing metadata varlen and
    flash attention need, known on the host here, so no layer has to find it (a host sync each).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    gather_index: torch.Tensor
    response_mask: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    max_len: int = 0

    def attention_kwargs(self) -> dict:
        """transformers' keyword arguments for packed sequences (``cu_seq_lens_q`` ...), which
        its models hand to every layer's attention function."""
        return dict(
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_len,
            max_length_k=self.max_len,
        )


def pack(batch: Batch) -> Packed:
    mask = batch["attention_mask"].bool()
    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    lengths = mask.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    prompt_lens = mask[:, :P].sum(-1)
    input_ids = batch["input_ids"][mask].unsqueeze(0)
    # one host round trip for the lengths, not one per row (or per layer)
    host_lengths = lengths.tolist()
    position_ids = torch.cat([torch.arange(n) for n in host_lengths]).unsqueeze(0)
    bounds = [0]
    for n in host_lengths:
        if n:  # (an empty row holds no sequence)
            bounds.append(bounds[-1] + n)
    # response token j of row b sits at starts[b] + prompt_lens[b] + j; its logits at one before
    j = torch.arange(R, device=mask.device).unsqueeze(0)
    index = (starts + prompt_lens).unsqueeze(1) + j - 1
    resp_mask = batch["response_mask"].bool()
    index = torch.where(resp_mask, index, torch.zeros_like(index))
    return Packed(
        input_ids=input_ids,
        position_ids=position_ids.to(input_ids.device),
        gather_index=index,
        response_mask=batch["response_mask"],
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32).to(input_ids.device, non_blocking=True),
        max_len=max(host_lengths, default=0),
    )


def unpack_per_token(packed_values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """(1, N) or (N,) values at logit positions -> (B, R) per response token, 0 where masked."""
    flat = packed_values.reshape(-1)
    out = flat[packed.gather_index.reshape(-1)].reshape(packed.gather_index.shape)
    return out * packed.response_mask.to(out.dtype)


# ------------------------------------------------------------------------------ micro-batches
def fixed_micro_batches(n_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be smaller)."""
    return [list(range(i, min(i + micro_batch_size, n_rows))) for i in range(0, n_rows, micro_batch_size)]


def token_budget_micro_batches(seq_lens: list[int] | torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Group rows into as few micro-batches as the token budget allows, balanced by tokens.

    The number of groups is the smallest k with sum(tokens) <= k * max_tokens that the greedy
    assignment below can fit; rows are placed longest first onto the least-loaded group that still
    has room (LPT scheduling), so groups end up with similar token counts. Each returned group is in
    ascending row order; use ``restore_order`` to put per-row outputs back.
    A single row longer than the budget gets a group of its own (it cannot be split).
    """
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if not lens:
        return []
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    k = max(1, -(-sum(lens) // max_tokens))
    while True:
        groups: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        ok = True
        for i in order:
            g = min(range(k), key=lambda g: load[g])
            if load[g] + lens[i] > max_tokens and load[g] > 0:
                ok = False
                break
            groups[g].append(i)
            load[g] += lens[i]
        if ok:
            return [sorted(g) for g in groups if g]
        k += 1


def restore_order(chunks: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Per-group outputs (rows in group order) -> one tensor in the original row order."""
    index = torch.tensor([i for g in groups for i in g])
    out = torch.cat(chunks)
    result = torch.empty_like(out)
    result[index] = out
    return result


def micro_batch_groups(
    batch: Batch, micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int, sync_max=None
) -> list[list[int]]:
    """Row groups for the micro-batches of ``batch``: fixed-size, or by token budget.

    Every rank must run the same number of micro-batches (each forward/backward is a collective
    under FSDP): ``sync_max(k) -> max over ranks`` agrees on the count, and a rank with fewer
    token groups splits its largest groups (or, with fewer rows than groups, repeats nothing and
    returns empty groups that the caller runs as zero-weight dummies).
    """
    n = batch["attention_mask"].shape[0]
    if not use_dynamic_bsz:
        return fixed_micro_batches(n, micro_batch_size)
    lens = batch["attention_mask"].sum(-1)
    groups = token_budget_micro_batches(lens, max_token_len)
    k = sync_max(len(groups)) if sync_max is not None else len(groups)
    while len(groups) < k:
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[big]) <= 1:
            groups.append([])
            continue
        g = groups.pop(big)
        groups += [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups
