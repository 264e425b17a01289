"""Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's ``ulysses_sequence_parallel_size``).

The ranks are cut into sequence-parallel groups of ``sp`` consecutive ranks. Before a forward the
ranks of a group exchange their rows (``gather_rows``), so all of them hold the same rows; the
rows are packed into one sequence (``rlhf_hpc.ops.batching.pack``), padded to a multiple of ``sp``
and each rank computes a contiguous 1/sp slice of it. Everything outside attention is per token,
so it runs on the slice unchanged. Attention needs the whole sequence: an all-to-all before it
trades the slice of all heads for the whole sequence of 1/sp of the heads, and the inverse
all-to-all after it gives the slice back (``UlyssesAttention``, passed to the model as the
``ulysses`` keyword argument that transformers hands to the registered attention function;
``rlhf_hpc.models.attention`` calls it). The per-token outputs (log-probs, entropies, values) of the
slices are then gathered over the group, so every rank of the group sees the whole rows' outputs
and computes the same loss.

The decoder layers' activation memory per rank falls by ~sp (the slice); the head's logits follow
the response tokens in each slice; the weights are sharded by FSDP as before.
The rows a rank trains on do not change: the trainer's layout, its global statistics and the
batch-size arithmetic are those of sp=1; the group only computes its members' rows together.

Gradients. Every rank of a group computes the same loss L_g over the group's rows, and backward
seeds each rank with the gradient of its own slice only (``_GatherSlices.backward``); the
all-to-all backward carries the cross-slice terms. So the group's gradients sum to dL_g/dθ, and
FSDP's average over all ranks with the loss scaled by the world size (as at sp=1) gives the
gradient of the global loss: a row split over sp ranks counts once.

Grouped-query attention: the heads are split over the group. Query heads must divide by ``sp``;
key/value heads must divide by ``sp`` too, or (fewer KV heads than ranks) ``sp`` must divide by
them, and each KV head is then repeated ``sp / kv_heads`` times so that every rank gets the one its
query heads use.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.models.moe_routing import laid_out
from rlhf_hpc.ops import algos
from rlhf_hpc.ops.batching import Batch, pack, unpack_per_token

__all__ = [
    "KEYS",
    "SequenceParallel",
    "UlyssesAttention",
    "build_sequence_parallel",
    "for_model",
    "gather_rows",
    "heads_problem",
    "per_token_logprobs",
    "per_token_values",
]

# verl's keys, as the validation messages name them
KEYS = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size",
)


def heads_problem(num_heads: int, num_kv_heads: int, sp: int, key: str) -> Optional[str]:
    """Why ``sp`` cannot split this model's attention heads, or None."""
    if sp <= 1:
        return None
    if num_heads % sp:
        return (
            f"{key}={sp}: the model's {num_heads} attention heads do not divide by {sp} (Ulysses gives every rank "
            f"of a sequence-parallel group the same number of heads); use a size that divides {num_heads}"
        )
    if num_kv_heads % sp and sp % num_kv_heads:
        return (
            f"{key}={sp}: the model's {num_kv_heads} key/value heads neither divide by {sp} nor divide it (a "
            f"KV head can be repeated only a whole number of times per rank); use a divisor or a multiple of "
            f"{num_kv_heads} that divides {num_heads}"
        )
    return None


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group. ``group``: the all-to-all/all-gather of activations
    (the default backend); ``rows_group``: gloo, for the host batches exchanged before a forward."""

    size: int
    rank: int
    group: dist.ProcessGroup
    rows_group: dist.ProcessGroup


_GROUPS: dict[int, Optional[SequenceParallel]] = {}


def build_sequence_parallel(size: int) -> Optional[SequenceParallel]:
    """The group of ``size`` consecutive ranks this rank belongs to; None for size 1. Collective
    the first time a size is asked for (every rank creates every group, in the same order)."""
    if size <= 1:
        return None
    if size in _GROUPS:
        return _GROUPS[size]
    world, me = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the {world} ranks")
    mine, host_backend = None, dist.get_backend() == "gloo"
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        rows_group = group if host_backend else dist.new_group(ranks, backend="gloo")
        if me in ranks:
            mine = SequenceParallel(size=size, rank=me - start, group=group, rows_group=rows_group)
    _GROUPS[size] = mine
    return mine


def for_model(size: int, config, key: str) -> Optional[SequenceParallel]:
    """The group for a model with transformers ``config`` (its heads checked); None for size 1."""
    heads = config.num_attention_heads
    problem = heads_problem(heads, getattr(config, "num_key_value_heads", None) or heads, size, key)
    if problem:
        raise ValueError(problem)
    return build_sequence_parallel(size)


# ------------------------------------------------------------------------- collectives with autograd
class _AllToAll(torch.autograd.Function):
    """(sp, ...) -> (sp, ...): block j goes to group rank j, block j of the result came from
    group rank j. The exchange is its own adjoint: backward is the same all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    with collective():
        dist.all_to_all_single(out, x, group=group)
    return out


class _GatherSlices(torch.autograd.Function):
    """(n, ...) slice per rank -> (sp * n, ...) in group-rank order, the same on every rank.
    Every rank computes the same loss from the result, so backward keeps only the gradient of
    this rank's own slice (summing the copies would count the loss sp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp, ctx.n = sp, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        with collective():
            dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.sp.rank * ctx.n
        return grad[start : start + ctx.n].contiguous(), None


def gather_slices(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _GatherSlices.apply(x, sp)


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(n, H, D) all heads of this rank's slice -> (sp * n, H / sp, D) this rank's heads of the
    whole sequence."""
    n, H, D = x.shape
    blocks = x.reshape(n, sp.size, H // sp.size, D).transpose(0, 1)  # block j: the heads of rank j
    return _AllToAll.apply(blocks, sp.group).reshape(sp.size * n, H // sp.size, D)


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of ``heads_to_sequence``: (sp * n, h, D) -> (n, sp * h, D)."""
    N, h, D = x.shape
    blocks = _AllToAll.apply(x.reshape(sp.size, N // sp.size, h, D), sp.group)  # block j: rank j's heads
    return blocks.transpose(0, 1).reshape(N // sp.size, sp.size * h, D)


# ------------------------------------------------------------------------------------ attention
@dataclass
class UlyssesAttention:
    """What the attention function needs to attend over the whole packed sequence from a slice:
    the group and the (1, N) position ids of the whole sequence (they say where sequences start).
    Passed as ``model(..., ulysses=UlyssesAttention(...))``; transformers forwards it to the
    attention function of every layer (also when activation checkpointing recomputes a layer)."""

    sp: SequenceParallel
    position_ids: torch.Tensor

    def __call__(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend, **kwargs
    ) -> tuple[torch.Tensor, None]:
        """query (1, H, n, D), key/value (1, Hkv, n, D) of this rank's slice -> ((1, n, H, D), None).
        ``attend``: the packed attention function run on this rank's heads of the whole sequence."""
        sp = self.sp
        kv_heads = key.shape[1]
        if kv_heads % sp.size:  # fewer KV heads than ranks: each rank needs a copy of its group's one
            key = key.repeat_interleave(sp.size // kv_heads, dim=1)
            value = value.repeat_interleave(sp.size // kv_heads, dim=1)

        def exchange(t: torch.Tensor) -> torch.Tensor:  # (1, h, n, D) -> (1, h / sp, N, D)
            return heads_to_sequence(t[0].transpose(0, 1), sp).transpose(0, 1).unsqueeze(0)

        out, _ = attend(
            module, exchange(query), exchange(key), exchange(value), None, position_ids=self.position_ids, **kwargs
        )  # (1, N, H / sp, D)
        return sequence_to_heads(out[0], sp).unsqueeze(0), None


# ------------------------------------------------------------------------------- rows and slices
def gather_rows(batch: Batch, sp: SequenceParallel) -> tuple[Batch, slice]:
    """The rows of every rank of the group, in group-rank order (host tensors), and where this
    rank's own rows sit among them."""
    parts: list = [None] * sp.size
    with collective(calls=2, host=True):
        dist.all_gather_object(parts, {k: v.cpu() for k, v in batch.items()}, group=sp.rows_group)
    sizes = [p["responses"].shape[0] for p in parts]
    start = sum(sizes[: sp.rank])
    return {k: torch.cat([p[k] for p in parts]) for k in batch}, slice(start, start + sizes[sp.rank])


@dataclass
class Slice:
    """This rank's slice of a packed sequence padded to a multiple of sp. ids/positions (1, n);
    ``ulysses`` carries the (1, N) position ids of the whole padded sequence."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    start: int
    ulysses: UlyssesAttention


def slice_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, sp: SequenceParallel) -> Slice:
    """(1, N) packed row -> this rank's slice. The padding at the end is a sequence of its own
    (positions from 0), so no real token attends to it; nothing reads its outputs."""
    N = input_ids.shape[1]
    pad = -N % sp.size
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], 1)
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).unsqueeze(0)], 1)
    n = (N + pad) // sp.size
    a = sp.rank * n
    return Slice(input_ids[:, a : a + n], position_ids[:, a : a + n], a, UlyssesAttention(sp, position_ids))


def per_token_logprobs(
    model: nn.Module,
    batch: Batch,
    sp: SequenceParallel,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    routing=None,
    routing_key: str = "routed_experts",
    routing_out: Optional[list] = None,
) -> tuple:
    """``rlhf_hpc.ppo.actor.per_token_logprobs`` (packed rows) with the sequence split over ``sp``:
    the same (B, R) log-probs (and entropies, and sum pi^2 with ``with_sum_pi_squared``), zero where
    ``response_mask`` is 0, on every rank of the group. The head runs only on this slice's positions
    that predict a response token. ``routing``, ``routing_key``, ``routing_out``: a mixture of
    experts' routing replayed or recorded as there (``rlhf_hpc.models.moe_routing``); the routers
    see this slice's tokens, so each rank replays its slice of the targets, and what a recording
    pass chose is gathered from the slices (the same on every rank of the group)."""
    mask = batch["response_mask"].bool()
    packed = pack(batch)
    part = slice_packed(packed.input_ids, packed.position_ids, sp)
    n, N = part.input_ids.shape[1], part.ulysses.position_ids.shape[1]
    device = packed.input_ids.device
    # per position of the padded row: does its logit predict a response token, and which one
    predicts = packed.gather_index[mask]
    label_at = torch.zeros(N, dtype=torch.long, device=device).index_put((predicts,), batch["responses"][mask])
    kept_at = torch.zeros(N, dtype=torch.bool, device=device).index_fill(0, predicts, True)
    local = kept_at[part.start : part.start + n].nonzero().flatten()
    valid = batch["attention_mask"].bool()
    replay = contextlib.nullcontext()
    if routing is not None:
        targets = None
        if routing_key in batch:  # this slice's (the padding after the rows: no record, routed itself)
            routed = batch[routing_key][valid].long()  # (valid tokens, layers, k)
            targets = routed.new_zeros(N, *routed.shape[1:])
            targets[: len(routed)] = routed
            targets = targets[part.start : part.start + n]
        replay = routing.around_forward(targets, record=routing_out is not None)
    with replay:
        logits = model(
            input_ids=part.input_ids,
            position_ids=part.position_ids,
            attention_mask=None,
            use_cache=False,
            logits_to_keep=local,
            ulysses=part.ulysses,
        ).logits[0]  # (kept here, V)
    if routing_out is not None:  # every slice's, then the valid tokens' (gloo gathers no int16)
        chosen = gather_slices(routing.chosen().to(device, torch.int32), sp)[: packed.input_ids.shape[1]]
        routing_out.append(laid_out(chosen, valid))
    labels = label_at[part.start : part.start + n][local]
    values, entropies = algos.token_logprobs_chunked(logits, labels, temperature, with_entropy, entropy_grad)
    if logits.requires_grad and not values.requires_grad:
        # no response token in this slice: keep the graph, so this rank's backward runs the
        # collectives the other ranks' backward waits for
        values = values + logits.sum() * 0

    def whole(v: torch.Tensor) -> torch.Tensor:  # kept values of the slice -> (B, R)
        at = torch.zeros(n, dtype=v.dtype, device=device).index_put((local,), v)
        return unpack_per_token(gather_slices(at, sp), packed)

    lp = whole(values)
    ent = whole(entropies) if with_entropy else None
    if with_sum_pi_squared:
        return lp, ent, whole(algos.sum_pi_squared_chunked(logits.detach(), temperature))
    return lp, ent


def per_token_values(model: nn.Module, batch: Batch, sp: SequenceParallel) -> torch.Tensor:
    """``rlhf_hpc.ppo.critic.per_token_values`` (packed rows) with the sequence split over ``sp``:
    (B, R), zero where masked, the same on every rank of the group."""
    packed = pack(batch)
    part = slice_packed(packed.input_ids, packed.position_ids, sp)
    values = model(
        input_ids=part.input_ids, position_ids=part.position_ids, attention_mask=None, ulysses=part.ulysses
    )  # (1, n)
    return unpack_per_token(gather_slices(values[0], sp), packed)
