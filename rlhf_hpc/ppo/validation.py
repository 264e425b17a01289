"""Generation on the validation set (``data.val_files``) and its mean score per data source."""
from __future__ import annotations

import torch

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import Example
from rlhf_hpc.distributed.process_group import DistContext, all_reduce_sum
from rlhf_hpc.distributed.rows import prompt_share
from rlhf_hpc.models.hf import torch_dtype
from rlhf_hpc.ppo.step_batch import sampling_for, step_seed
from rlhf_hpc.ppo.training_models import TrainingModels
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout

__all__ = ["run_validation"]


def run_validation(cfg: Config, ctx: DistContext, models: TrainingModels, rollout, val: list[Example], tokenizer,
             reward_fn: RewardFunction) -> dict[str, float]:
    """Generate for the whole validation set (``rollout.val_kwargs``; greedy by default) and report
    the mean score per data source as ``val-core/<data_source>/reward/mean@<n>``. As in verl,
    ``data.val_batch_size`` only sets how many prompts go to the engine at once (all at once when
    null); each such chunk is split evenly over the ranks."""
    arr = cfg.actor_rollout_ref
    rollout.resume()
    sync_weights_to_rollout(models.actor.model, rollout, torch_dtype(arr.rollout.dtype), arr.rollout.update_weights_bucket_mb)
    sources = sorted({e.data_source for e in val})
    sums = torch.zeros(len(sources), 2, dtype=torch.float64)
    chunk = cfg.data.val_batch_size or len(val)
    for c, start in enumerate(range(0, len(val), chunk)):
        part = val[start:start + chunk]
        mine = [part[i] for i in prompt_share(len(part), ctx.world_size, ctx.rank)]
        sampling = sampling_for(cfg, tokenizer, seed=step_seed(cfg.trainer.seed, -1 - c, rollout.dp_rank),
                                validation=True)
        outs = rollout.generate([e.prompt_ids for e in mine], sampling)
        for ex, group in zip(mine, outs):
            for r in group:
                text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
                score = reward_fn(ex.data_source, text, ex.ground_truth, ex.extra_info, row=ex.index)
                sums[sources.index(ex.data_source)] += torch.tensor([score, 1.0], dtype=torch.float64)
    rollout.release()
    sums = all_reduce_sum(sums)
    n = arr.rollout.val_kwargs.n
    return {f"val-core/{s}/reward/mean@{n}": (sums[i, 0] / max(sums[i, 1].item(), 1.0)).item()
            for i, s in enumerate(sources)}
