"""DAPO's dynamic sampling (``algorithm.filter_groups``, ``data.gen_batch_size``), SPMD.

verl's DAPO trainer generates a batch of ``gen_batch_size`` prompts x n responses, scores it, drops
the groups (a prompt's responses) whose ``filter_groups.metric`` has zero standard deviation
(``np.std``; a group of one response is kept), and generates again until ``train_batch_size``
prompts are kept or ``max_num_gen_batches`` batches were generated (then it raises; <= 0: no
limit); the kept groups, in generation order, are cut to ``train_batch_size`` prompts.

Here every rank generates its share of each generation batch (``prompt_share``: whole prompts, so a
rank holds all n responses of its prompts), scores its rows, and the per-prompt table of metric
values (G x n) is summed over ranks: every rank then takes the same keep/drop decisions from the
same table, before any row is redistributed. The kept rows get their prompt's position among the
kept prompts as ``prompt_pos`` (the group id ``uid`` of the step batch), so the rest of the step
sees an ordinary batch of ``train_batch_size`` prompts. The sampler advances by every generation
batch taken (``StatefulSampler.next_prompts``), so a resumed run draws the same prompts.

The metric per response: ``acc`` and ``score``: the reward function's score (verl's reward manager
reports a float score as ``acc``); ``seq_reward``: the score after the dapo manager's overlong
shaping (verl: ``token_level_scores`` summed); ``seq_final_reward``: the same here, as the KL in
the reward is refused with dynamic sampling (``recipe/config_checks.py``).

Logged: ``train/num_gen_batches`` (verl's name), ``dynamic_sampling/prompts_generated`` and
``dynamic_sampling/prompts_kept`` (before the cut to train_batch_size).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rlhf_hpc.distributed.rows import RolloutRow

__all__ = ["Collected", "collect_groups", "gen_seed", "group_table", "keep_groups"]


def gen_seed(seed: int, step: int, gen_batch: int, dp_rank: int, first: int) -> int:
    """Sampling seed of generation batch ``gen_batch`` (0, 1, ...) of a step: the step's own seed
    (``first``, ``step_batch.step_seed``) for the first, a distinct one for each later batch."""
    if gen_batch == 0:
        return first
    return zlib.crc32(f"{seed}/{step}/{dp_rank}/gen{gen_batch}".encode()) & 0x7FFFFFFF


def group_table(
    values: torch.Tensor,
    rows: list[RolloutRow],
    num_prompts: int,
    n: int,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """(num_prompts, n) float64: the metric of every response of the generation batch, global over
    ranks. ``values[i]`` belongs to this rank's ``rows[i]``; each prompt's responses sit on one rank
    (generation shares are whole prompts), so the sum over ranks places every value once. Collective."""
    table = torch.zeros(num_prompts, n, dtype=torch.float64)
    seen = [0] * num_prompts
    for value, row in zip(values.tolist(), rows):
        table[row.prompt_pos, seen[row.prompt_pos]] = value
        seen[row.prompt_pos] += 1
    return all_reduce(table)


def keep_groups(table: torch.Tensor) -> list[bool]:
    """verl's rule per prompt (a row of ``table``): keep it if its responses' metric has a non-zero
    standard deviation (``np.std``), or if it has a single response."""
    return [bool(np.std(row) > 0) or len(row) == 1 for row in table.numpy()]


@dataclass
class Collected:
    """The step's kept prompts (dataset indices, ``train_batch_size`` of them), this rank's rows of
    them (``prompt_pos``: the position in ``prompts``) and the counts."""

    prompts: list[int]
    rows: list[RolloutRow]
    metrics: dict[str, float]


def collect_groups(
    generate_batch: Callable[[int], tuple[list[int], list[RolloutRow]]],
    metric_values: Callable[[list[RolloutRow]], torch.Tensor],
    train_batch_size: int,
    n: int,
    max_num_gen_batches: int,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> Collected:
    """Generation batches until ``train_batch_size`` prompts have signal. ``generate_batch(k)``: the
    k-th batch's prompts (dataset indices) and this rank's rows of it (``prompt_pos``: position in
    that batch); ``metric_values(rows)``: (len(rows),) the filter metric of this rank's rows.
    Raises ValueError as verl does when ``max_num_gen_batches`` (> 0) batches were not enough."""
    prompts: list[int] = []
    rows: list[RolloutRow] = []
    num_gen_batches = generated = 0
    while True:
        num_gen_batches += 1
        batch_prompts, batch_rows = generate_batch(num_gen_batches - 1)
        generated += len(batch_prompts)
        table = group_table(metric_values(batch_rows), batch_rows, len(batch_prompts), n, all_reduce)
        new_pos: dict[int, int] = {}
        for pos, keep in enumerate(keep_groups(table)):
            if keep:
                new_pos[pos] = len(prompts)
                prompts.append(batch_prompts[pos])
        rows += [
            dataclasses.replace(r, prompt_pos=new_pos[r.prompt_pos]) for r in batch_rows if r.prompt_pos in new_pos
        ]
        if len(prompts) >= train_batch_size:
            break
        if 0 < max_num_gen_batches <= num_gen_batches:
            raise ValueError(
                f"num_gen_batches={num_gen_batches} >= max_num_gen_batches={max_num_gen_batches}: "
                f"{len(prompts)} of data.train_batch_size={train_batch_size} prompts have responses "
                f"that differ in algorithm.filter_groups.metric (verl stops here too): the other groups' "
                f"responses all score alike, the prompts too hard or, once the model has learned them, "
                f"too easy; use harder data, a larger rollout.n, or max_num_gen_batches=0 (no limit)"
            )
    metrics = {
        "train/num_gen_batches": float(num_gen_batches),
        "dynamic_sampling/prompts_generated": float(generated),
        "dynamic_sampling/prompts_kept": float(len(prompts)),
    }
    return Collected(prompts[:train_batch_size], [r for r in rows if r.prompt_pos < train_batch_size], metrics)
