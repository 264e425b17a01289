"""Which rank holds which part of a step.

Generation: the step's ``P`` prompts are split into contiguous shares whose sizes differ by at
most one (``prompt_share``), so no prompt is dropped when ``P`` is not a multiple of the ranks.
Training: the ``P * n`` response rows are then redistributed so every rank holds exactly
``P * n / ranks`` of them (validation guarantees divisibility, as verl requires). With
``trainer.balance_batch`` the rows are assigned by a Karmarkar-Karp partition of their token
counts (``balanced_partitions``), so each rank's forward/backward work is as equal as possible;
without it, rank ``r`` takes the ``r``-th contiguous block of rows in prompt order (verl's order
when balancing is off).

Each row keeps ``prompt_pos``, the position of its prompt in the step: responses to one prompt
form a group (GRPO/RLOO) even when they end up on different ranks, and group statistics are
reduced over all ranks (``rlhf_hpc.ops.estimators.group_stats``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.distributed.process_group import all_reduce_max, all_reduce_sum

__all__ = [
    "RolloutRow",
    "balance_ratio",
    "balanced_partitions",
    "contiguous_partitions",
    "coverage",
    "prompt_share",
    "redistribute_rows",
    "resample_rows",
    "share_rows",
]


@dataclass
class RolloutRow:
    """One sampled response and what the trainer needs to rebuild its row on any rank."""

    prompt_pos: int  # position of the prompt in the step's batch: the group id
    example: int  # index of the prompt in the training set (every rank holds the set)
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    mask: Optional[list[int]] = None  # 0 on tool turns (the agent loop); None: all the model's
    num_turns: Optional[int] = None  # the agent loop's (verl's extra_info["num_turns"] for the reward)
    routed_experts: Optional[torch.Tensor] = None  # the engine's routing, (tokens, layers, k) (router_replay R3)
    version: Optional[int] = None  # the split layout: the policy version (updates) of the weights that generated it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def prompt_share(num_prompts: int, world_size: int, rank: int) -> range:
    """Positions of this rank's prompts: contiguous, the first ``num_prompts % world_size`` ranks
    take one more. A rank may get none (fewer prompts than ranks)."""
    base, extra = divmod(num_prompts, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def contiguous_partitions(num_items: int, k: int) -> list[list[int]]:
    """``k`` equal contiguous blocks of ``range(num_items)`` (``num_items`` divisible by ``k``)."""
    per = num_items // k
    return [list(range(i * per, (i + 1) * per)) for i in range(k)]


def balanced_partitions(weights: list[int], k: int) -> list[list[int]]:
    """Split item indices into ``k`` sets of equal size (``len(weights)`` divisible by ``k``)
    whose weight sums are as equal as possible: the largest differencing method
    (Karmarkar-Karp) for k-way partitioning with a cardinality constraint.

    Items are taken in descending weight, ``k`` at a time; each such slice is a partial solution
    of ``k`` one-item sets. Repeatedly the two partial solutions with the largest spread are
    merged, the heaviest set of one with the lightest of the other, which cancels their
    differences. Every merge adds one item to every set, so sizes stay equal. Each returned set
    lists its indices in ascending order; the result is deterministic (ties broken by index)."""
    n = len(weights)
    if n % k:
        raise ValueError(f"{n} items cannot be split into {k} sets of equal size")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    heap, tie = [], 0
    for start in range(0, n, k):
        # a partial solution: k sets as (sum, indices), heaviest first
        sets = sorted(([weights[i], [i]] for i in order[start : start + k]), key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), tie, sets))
        tie += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [[a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]] for i in range(k)]
        merged.sort(key=lambda s: (-s[0], min(s[1])))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    sets = heap[0][2] if heap else [[0, []] for _ in range(k)]
    return sorted((sorted(s[1]) for s in sets), key=lambda s: s[0] if s else n)


def balance_ratio(weights: list[int], partitions: list[list[int]]) -> float:
    """max over ranks of the rank's total weight / the mean over ranks (1.0 = perfectly even)."""
    totals = [sum(weights[i] for i in p) for p in partitions]
    mean = sum(totals) / max(len(totals), 1)
    return max(totals) / mean if mean > 0 else 1.0


def redistribute_rows(
    local: list[RolloutRow], world_size: int, rank: int, balance: bool
) -> tuple[list[RolloutRow], dict[str, float]]:
    """Every rank passes the rows it generated (in prompt order); every rank gets back the rows
    it trains on, in prompt order, and the same metrics: ``perf/balance_ratio`` (after) and
    ``perf/balance_ratio_unbalanced`` (contiguous blocks, i.e. without ``balance_batch``), token
    count max/min/mean per rank under ``global_seqlen/*`` (verl's names)."""
    if world_size > 1:
        gathered: list = [None] * world_size
        with collective(calls=2):  # an object all-gather: the sizes, then the pickled rows
            dist.all_gather_object(gathered, local)
        rows = [r for part in gathered for r in part]
    else:
        rows = list(local)
    return share_rows(rows, world_size, rank, balance)


def share_rows(
    rows: list[RolloutRow], world_size: int, rank: int, balance: bool
) -> tuple[list[RolloutRow], dict[str, float]]:
    """``redistribute_rows`` once every rank holds all the step's ``rows`` (in prompt order): this
    rank's share and the same metrics (not collective)."""
    if len(rows) % world_size:
        raise RuntimeError(
            f"the step has {len(rows)} responses, not divisible by {world_size} ranks "
            f"(data.train_batch_size x rollout.n must be; validation checks it)"
        )
    weights = [r.num_tokens for r in rows]
    plain = contiguous_partitions(len(rows), world_size)
    parts = balanced_partitions(weights, world_size) if balance else plain
    totals = [sum(weights[i] for i in p) for p in parts]
    metrics = {
        "perf/balance_ratio": balance_ratio(weights, parts),
        "perf/balance_ratio_unbalanced": balance_ratio(weights, plain),
        "global_seqlen/max": float(max(totals)),
        "global_seqlen/min": float(min(totals)),
        "global_seqlen/mean": sum(totals) / len(totals),
        "global_seqlen/minmax_diff": float(max(totals) - min(totals)),
    }
    return [rows[i] for i in parts[rank]], metrics


def coverage(prompt_pos: list[int], num_prompts: int) -> dict[str, float]:
    """How much of the step every rank together trains on: distinct prompts and responses (the
    counts a dropped prompt would show). Collective."""
    seen = torch.zeros(num_prompts, dtype=torch.float64)
    seen[torch.tensor(prompt_pos, dtype=torch.long)] = 1.0
    responses = all_reduce_sum(torch.tensor([float(len(prompt_pos))], dtype=torch.float64))
    return {
        "training/prompts_trained": all_reduce_max(seen).sum().item(),
        "training/responses_trained": responses.item(),
    }


def resample_rows(batch: dict, draw, world_size: int, rank: int) -> dict:
    """The step batch resampled over every rank's rows (PF-PPO): every rank passes its rows (tensors,
    one row each along the first dimension) and ``draw``, which maps the (N,) scores of all ranks'
    rows (``token_scores`` summed), in rank order, to N indices into those rows (the same on every
    rank: a generator seeded alike); rank r keeps the r-th contiguous share of the draws."""
    if world_size > 1:
        gathered: list = [None] * world_size
        with collective(calls=2):  # an object all-gather: the sizes, then the pickled rows
            dist.all_gather_object(gathered, batch)
        rows = {k: torch.cat([part[k] for part in gathered]) for k in batch}
    else:
        rows = batch
    total = rows["token_scores"].shape[0]
    indices = draw(rows["token_scores"].sum(-1))
    share = indices[rank * (total // world_size) : (rank + 1) * (total // world_size)]
    return {k: v[share] for k, v in rows.items()}
