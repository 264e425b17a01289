"""PF-PPO (``algorithm.use_pf_ppo``, rlhf_hpc/ops/pf_ppo.py): the weights and draws equal verl 0.9.1's
``compute_pf_ppo_reweight_data`` (transcribed below) on the same generator state; two gloo ranks
holding halves of a step draw the rows one process draws from the whole; verl's PF-PPO example
line dry-runs, and the keys are refused where they would change nothing; the trainer runs it."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.rows import resample_rows
from rlhf_hpc.ops.pf_ppo import pf_ppo_indices, pf_ppo_weights
from rlhf_hpc.recipe.load import load_config


def verl_pf_ppo(token_level_scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0):
    """verl 0.9.1's compute_pf_ppo_reweight_data, its batch reduced to the scores: (weights, indices)."""
    scores = token_level_scores.sum(dim=-1)
    if reweight_method == "pow":
        weights = torch.pow(torch.abs(scores), weight_pow)
    elif reweight_method == "max_min":
        max_score, min_score = torch.max(scores), torch.min(scores)
        weights = torch.where((scores == max_score) | (scores == min_score), 1.0, 0.0)
    elif reweight_method == "max_random":
        weights = torch.where(scores == torch.max(scores), 0.4, 0.1)
    weights = torch.clamp(weights + 1e-8, min=1e-8)
    return weights, torch.multinomial(weights, scores.shape[0], replacement=True)


def step_scores(seed: int, rows: int = 12, T: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.zeros(rows, T)
    scores[torch.arange(rows), torch.randint(0, T, (rows,), generator=g)] = torch.randint(
        -1, 3, (rows,), generator=g
    ).float()
    return scores


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
@pytest.mark.parametrize("seed", range(3))
def test_weights_and_draws_equal_verls(method, seed):
    token_scores = step_scores(seed)
    torch.manual_seed(100 + seed)  # verl draws with torch's global generator
    ref_w, ref_idx = verl_pf_ppo(token_scores, method, 1.5)
    torch.testing.assert_close(pf_ppo_weights(token_scores.sum(-1), method, 1.5), ref_w)
    idx = pf_ppo_indices(token_scores.sum(-1), method, 1.5, torch.Generator().manual_seed(100 + seed))
    assert torch.equal(idx, ref_idx)
    # the draws follow the weights: a zero score (pow) is all but never drawn
    if method == "pow":
        assert not (token_scores.sum(-1)[idx] == 0).any()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_batch(rows: int = 12) -> dict:
    token_scores = step_scores(7, rows)
    return {
        "token_scores": token_scores,
        "advantages": torch.randn(rows, 5, generator=torch.Generator().manual_seed(1)),
        "uid": torch.arange(rows) // 2,
    }


def _draw(scores):
    return pf_ppo_indices(scores, "pow", 2.0, torch.Generator().manual_seed(5))


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        whole = _rank_batch()
        mine = {k: v[rank * 6 : (rank + 1) * 6] for k, v in whole.items()}
        out[rank] = resample_rows(mine, _draw, 2, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_draw_the_rows_one_process_draws():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(_port(), out), nprocs=2)
    whole = resample_rows(_rank_batch(), _draw, 1, 0)
    for key, value in whole.items():
        assert torch.equal(torch.cat([out[0][key], out[1][key]]), value), key
    # the rows move whole: each drawn row keeps its own score, advantages and group
    base = _rank_batch()
    idx = _draw(base["token_scores"].sum(-1))
    assert torch.equal(whole["advantages"], base["advantages"][idx]) and torch.equal(whole["uid"], base["uid"][idx])


def test_verls_pf_ppo_line_dry_runs_and_the_keys_are_refused_where_they_change_nothing():
    keys = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_pf_ppo=True",
        "algorithm.pf_ppo.reweight_method=pow",
        "algorithm.pf_ppo.weight_pow=2.0",
    ]
    cfg, _ = load_config("tiny_klppo", keys)
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo.reweight_method == "pow"
    with pytest.raises(ConfigError, match="algorithm.use_pf_ppo=true resamples after GAE's advantages only"):
        load_config("tiny_klppo", keys + ["algorithm.adv_estimator=grpo", "critic.enable=false"])
    with pytest.raises(ConfigError, match=r"algorithm.pf_ppo.\* is read only with algorithm.use_pf_ppo=true"):
        load_config("tiny_klppo", ["algorithm.pf_ppo.reweight_method=max_min"])
    with pytest.raises(ConfigError, match="reweight_method"):
        load_config("tiny_klppo", keys + ["algorithm.pf_ppo.reweight_method=median"])


@pytest.mark.slow
def test_pf_ppo_trains_through_the_trainer_and_a_resume_draws_the_same_rows(tmp_path):
    from rlhf_hpc.observability.tracking import read_metrics
    from tests.conftest import run_launch

    common = [
        "recipe=tiny_klppo",
        "algorithm.use_pf_ppo=true",
        "algorithm.pf_ppo.reweight_method=max_random",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=1",
        "actor_rollout_ref.rollout.name=hf",  # (what is asserted is the trainer's: no engine start-up)
    ]
    full = run_launch(*common, f"trainer.default_local_dir={tmp_path / 'full'}", timeout=600)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    resumed = run_launch(
        *common,
        f"trainer.default_local_dir={tmp_path / 'resumed'}",
        f"trainer.resume_mode={tmp_path / 'full' / 'global_step_1'}",
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert [m["training/global_step"] for m in a] == [1, 2] and b[-1]["training/global_step"] == 2
    for key in ("critic/score/mean", "critic/advantages/mean", "actor/pg_loss", "critic/vf_loss"):
        assert b[-1][key] == a[-1][key], key
