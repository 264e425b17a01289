"""Checks of how a step is spread over ranks, under torchrun on CPU (gloo); test_distribute.py runs it.

    torchrun --nproc-per-node=4 tests/dist_distribute_checks.py OUT

6 prompts x 2 responses on 4 ranks: prompt shares of 2, 2, 1, 1, then 3 rows per rank. Rank 0
writes OUT/distribute.json with what it measured; the test module asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.process_group import all_reduce_sum, exit_process
from rlhf_hpc.distributed.rows import RolloutRow, coverage, prompt_share, redistribute_rows
from rlhf_hpc.ops import estimators
from rlhf_hpc.ops.batching import make_padded_batch
from tests.dist_engine_checks import actor_cfg, full_grads, max_diff, sharded_actor

PROMPTS, N, P, R = 6, 2, 8, 6


def generated_rows(rank: int, world: int) -> list[RolloutRow]:
    """What this rank's engine would return for its prompt share: lengths vary by prompt and
    response, so token counts differ and balancing has something to do."""
    rows = []
    for pos in prompt_share(PROMPTS, world, rank):
        g = torch.Generator().manual_seed(100 + pos)
        prompt = torch.randint(1, 256, (int(torch.randint(2, P + 1, (1,), generator=g)),), generator=g).tolist()
        for i in range(N):
            length = 1 + (pos * 3 + i * 5) % R
            rows.append(
                RolloutRow(
                    prompt_pos=pos,
                    example=pos,
                    prompt_ids=prompt,
                    token_ids=torch.randint(1, 256, (length,), generator=g).tolist(),
                    logprobs=[-1.0] * length,
                    finish_reason="length",
                )
            )
    return rows


def scores_of(rows: list[RolloutRow]) -> torch.Tensor:
    # a deterministic score per response, so a group's statistics are known in advance
    return torch.tensor([float((r.prompt_pos * 7 + len(r.token_ids) * 3) % 5) for r in rows])


def token_rewards(rows: list[RolloutRow]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = make_padded_batch([r.prompt_ids for r in rows], [r.token_ids for r in rows], 0, P, R)
    mask = batch["response_mask"].float()
    last = mask.sum(-1).long() - 1
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(rows)), last] = scores_of(rows)
    return rewards, mask


def gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    local = generated_rows(rank, world)
    res["generated_per_rank"] = [len(x) for x in gather(local)]

    # 1. every response of the step is trained on exactly once, whichever way rows are assigned
    assigned = {}
    for balance in (False, True):
        mine, metrics = redistribute_rows(local, world, rank, balance)
        keys = gather(sorted((r.prompt_pos, tuple(r.token_ids)) for r in mine))
        tokens = gather(sum(r.num_tokens for r in mine))  # prompt + response tokens
        name = "balanced" if balance else "contiguous"
        res[name] = {
            "rows_per_rank": [len(k) for k in keys],
            "rows": [list(map(list, k)) for k in keys],
            "metrics": metrics,
            "coverage": coverage([r.prompt_pos for r in mine], PROMPTS),
            "tokens_per_rank": tokens,
        }
        assigned[name] = mine
    res["all_rows"] = sorted([r.prompt_pos, r.token_ids] for part in gather(local) for r in part)

    # 2. group statistics with a prompt's responses on different ranks == one process on all rows
    mine = assigned["balanced"]
    rewards, mask = token_rewards(mine)
    uid = torch.tensor([r.prompt_pos for r in mine])
    dist_adv = {
        "grpo": estimators.grpo_advantages(rewards, mask, uid, all_reduce=all_reduce_sum, num_groups=PROMPTS)[0],
        "rloo": estimators.rloo_advantages(rewards, mask, uid, all_reduce=all_reduce_sum, num_groups=PROMPTS)[0],
        "rpp_baseline": estimators.reinforce_pp_baseline_advantages(
            rewards, mask, uid, all_reduce=all_reduce_sum, num_groups=PROMPTS
        )[0],
    }
    gathered = gather({k: (uid.tolist(), [r.token_ids for r in mine], v.tolist()) for k, v in dist_adv.items()})
    res["groups_split_over_ranks"] = (
        len({(pos, rk) for rk, part in enumerate(gather(uid.tolist())) for pos in part}) > PROMPTS
    )
    all_rows = [r for part in gather(local) for r in part]
    rewards_all, mask_all = token_rewards(all_rows)
    uid_all = torch.tensor([r.prompt_pos for r in all_rows])
    ref = {
        "grpo": estimators.grpo_advantages(rewards_all, mask_all, uid_all)[0],
        "rloo": estimators.rloo_advantages(rewards_all, mask_all, uid_all)[0],
        "rpp_baseline": estimators.reinforce_pp_baseline_advantages(rewards_all, mask_all, uid_all)[0],
    }
    key_of = {(r.prompt_pos, tuple(r.token_ids)): i for i, r in enumerate(all_rows)}
    res["adv_max_diff"] = {}
    for k in ref:
        diff = 0.0
        for uids, toks, adv in (g[k] for g in gathered):
            for u, t, a in zip(uids, toks, adv):
                diff = max(diff, (torch.tensor(a) - ref[k][key_of[(u, tuple(t))]]).abs().max().item())
        res["adv_max_diff"][k] = diff
    res["adv_nonzero"] = {k: float(v.abs().sum()) for k, v in ref.items()}

    # 3. balanced and contiguous assignments give the same update (rows only move): one mini-batch
    grads, metrics = {}, {}
    for name, rows in assigned.items():
        cfg = actor_cfg()
        actor = sharded_actor(cfg, fsdp_size=2, world=world)
        batch = make_padded_batch([r.prompt_ids for r in rows], [r.token_ids for r in rows], 0, P, R)
        batch["advantages"] = (
            torch.stack(
                [
                    torch.randn(R, generator=torch.Generator().manual_seed(r.prompt_pos * 101 + len(r.token_ids)))
                    for r in rows
                ]
            )
            * batch["response_mask"]
        )
        batch["ref_log_prob"] = -0.5 * batch["response_mask"].float()
        old_lp, _ = actor.compute_log_prob(batch, micro_batch_size=2)
        batch["old_log_probs"] = old_lp + 0.05 * batch["response_mask"]
        metrics[name] = actor.update_policy(batch, len(rows))
        grads[name] = full_grads(actor.model)
    res["update_grad_max_diff"] = max_diff(grads["balanced"], grads["contiguous"])
    res["update_grad_max"] = max(v.abs().max().item() for v in grads["balanced"].values())
    res["update_metric_diff"] = {
        k: abs(metrics["balanced"][k] - metrics["contiguous"][k])
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm")
    }
    if rank == 0:
        (out / "distribute.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)
