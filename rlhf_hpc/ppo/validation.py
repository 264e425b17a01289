"""Generation on the validation set (``data.val_files``) and its mean score per data source; with
``trainer.log_val_generations=N``, N of its (prompt, response, score) rows, chosen as verl chooses
them (``select_val_generations``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import Example
from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.distributed.process_group import DistContext, all_reduce_sum
from rlhf_hpc.distributed.rows import prompt_share
from rlhf_hpc.models.hf import torch_dtype
from rlhf_hpc.ppo.step_batch import reward_extra_info, sampling_for, step_seed
from rlhf_hpc.ppo.training_models import TrainingModels
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout

__all__ = [
    "VAL_GENERATIONS_SEED",
    "run_validation",
    "select_val_generations",
    "validation_chunks",
    "validation_sampling",
]

VAL_GENERATIONS_SEED = 42  # verl's fixed seed (RayPPOTrainer._maybe_log_val_generations)


def select_val_generations(inputs: list[str], n: int, count: int) -> list[tuple[int, int]]:
    """The validation rows ``trainer.log_val_generations=count`` logs, in the order logged, as
    (position in the validation set, response index). verl's choice (b178a3c,
    ``_maybe_log_val_generations``): all ``len(inputs) * n`` rows in dataset order with each
    prompt's ``n`` responses next to each other, stably sorted by the prompt's text, shuffled by
    ``numpy.random.RandomState(42)``, the first ``count``. It depends on the prompts only, not on
    the responses, so every rank knows which rows to keep before generating."""
    import numpy as np

    rows = [(i, j) for i in range(len(inputs)) for j in range(n)]
    rows.sort(key=lambda r: inputs[r[0]])  # (stable, as verl's sort of (input, output, score) by input)
    np.random.RandomState(VAL_GENERATIONS_SEED).shuffle(rows)
    return rows[:count]


def validation_chunks(cfg: Config, val: list[Example], world_size: int, rank: int):
    """``(chunk index, its start in the set, this rank's positions in it)`` for each chunk of
    ``data.val_batch_size`` prompts (all at once when null), each split evenly over the ranks."""
    chunk = cfg.data.val_batch_size or len(val)
    for c, start in enumerate(range(0, len(val), chunk)):
        yield c, start, prompt_share(len(val[start : start + chunk]), world_size, rank)


def validation_sampling(cfg: Config, tokenizer, chunk: int, dp_rank: int):
    """Validation's sampling (``rollout.val_kwargs``) for a chunk on an engine's data-parallel rank."""
    return sampling_for(cfg, tokenizer, seed=step_seed(cfg.trainer.seed, -1 - chunk, dp_rank), validation=True)


def run_validation(
    cfg: Config,
    ctx: DistContext,
    models: TrainingModels,
    rollout,
    val: list[Example],
    tokenizer,
    reward_fn: RewardFunction,
    generations: Optional[list[dict]] = None,
    generate: Optional[Callable] = None,
    responses: Optional[dict[int, list]] = None,
) -> dict[str, float]:
    """Generate for the whole validation set (``rollout.val_kwargs``; greedy by default) and report
    the mean score per data source as ``val-core/<data_source>/reward/mean@<n>``. As in verl,
    ``data.val_batch_size`` only sets how many prompts go to the engine at once (all at once when
    null); each such chunk is split evenly over the ranks.

    ``generations``: with ``trainer.log_val_generations`` > 0, rank 0 appends the rows
    ``select_val_generations`` picks, gathered from the ranks that generated them, as
    ``{"input", "output", "score", "data_source"}`` (texts decoded without special tokens, as verl's
    table); other ranks append nothing. ``generate(rows, sampling)``: what generates (the trainer's
    ``Generator``: the agent loop in a multi-turn run); None: the engine on the rows' prompts.
    ``responses``: every row's responses by its position in ``val``, generated elsewhere (the split
    layout's rollout ranks); then nothing is generated here, and ``rollout`` is not used."""
    arr = cfg.actor_rollout_ref
    generate = generate or (lambda rows, sampling: rollout.generate([e.prompt_ids for e in rows], sampling))
    n = arr.rollout.val_kwargs.n
    count = cfg.trainer.log_val_generations if generations is not None else 0
    wanted: dict[tuple[int, int], int] = {}
    if count > 0:
        inputs = [tokenizer.decode(e.prompt_ids, skip_special_tokens=True) for e in val]
        wanted = {row: k for k, row in enumerate(select_val_generations(inputs, n, count))}
    kept: dict[int, dict] = {}
    if responses is None:
        rollout.resume()
        sync_weights_to_rollout(
            models.actor.model, rollout, torch_dtype(arr.rollout.dtype), arr.rollout.update_weights_bucket_mb
        )
    sources = sorted({e.data_source for e in val})
    sums = torch.zeros(len(sources), 2, dtype=torch.float64)
    for c, start, share in validation_chunks(cfg, val, ctx.world_size, ctx.rank):
        mine = [val[start + i] for i in share]
        if responses is None:
            outs = generate(mine, validation_sampling(cfg, tokenizer, c, rollout.dp_rank))
        else:
            outs = [responses[start + i] for i in share]
        for pos, ex, group in zip(share, mine, outs):
            for j, r in enumerate(group):
                text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
                score = reward_fn(
                    ex.data_source, text, ex.ground_truth, reward_extra_info(ex.extra_info, r.num_turns), row=ex.index
                )
                sums[sources.index(ex.data_source)] += torch.tensor([score, 1.0], dtype=torch.float64)
                k = wanted.get((start + pos, j))
                if k is not None:
                    kept[k] = {
                        "input": tokenizer.decode(ex.prompt_ids, skip_special_tokens=True),
                        "output": text,
                        "score": float(score),
                        "data_source": ex.data_source,
                    }
    if responses is None:
        rollout.release()
    sums = all_reduce_sum(sums)
    if count > 0:
        for k, row in sorted(_gather_to_all(kept).items()):
            if ctx.is_main:
                generations.append(row)
    return {
        f"val-core/{s}/reward/mean@{n}": (sums[i, 0] / max(sums[i, 1].item(), 1.0)).item()
        for i, s in enumerate(sources)
    }


def _gather_to_all(kept: dict[int, dict]) -> dict[int, dict]:
    """Every rank's kept rows, merged (at most ``log_val_generations`` rows: small objects)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(kept)
    parts: list = [None] * dist.get_world_size()
    with collective():
        dist.all_gather_object(parts, kept)
    return {k: row for part in parts for k, row in part.items()}
