"""GPG (Chu et al. 2025), verl's ``gpg`` advantage estimator and ``gpg`` policy loss, added through
the registries (docs/extending.md: one function in ops/estimators.py, one in ops/policy_losses.py):
equal to verl's code (transcribed below from verl's ``core_algos.py``) on random tensors, global over
ranks, and selected by verl's keys with a typo refused by name."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.ops.algos import agg_loss
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS, AdvantageInputs, compute_advantages, gpg_advantages
from rlhf_hpc.ops.policy_losses import POLICY_LOSSES
from rlhf_hpc.recipe.load import load_config
from tests.test_algos import run_ranks


def verl_gpg_advantage(token_level_rewards, response_mask, index, f_norm=1.0):
    """verl's compute_gpg_outcome_advantage, as written there (loops and all)."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        m = torch.count_nonzero(scores)
        alpha = bsz / m.clamp(min=1)
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = alpha * (scores[i] - id2mean[index[i]]) / f_norm
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_gpg_loss(log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights=None):
    """verl's compute_policy_loss_gpg: -log_prob * A (times the IS weights), aggregated."""
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode)


def random_rows(seed: int, rows: int = 12, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    scores = torch.randint(0, 3, (rows,), generator=g).float() * (torch.rand(rows, generator=g) > 0.3)
    rewards = torch.zeros(rows, T)
    rewards[torch.arange(rows), lengths - 1] = scores
    index = torch.randint(0, 5, (rows,), generator=g)
    return rewards, mask, index


@pytest.mark.parametrize("seed", range(5))
def test_gpg_advantages_equal_verls_code(seed):
    rewards, mask, index = random_rows(seed)
    ours, ret = gpg_advantages(rewards, mask, index)
    ref, _ = verl_gpg_advantage(rewards.clone(), mask, index.tolist())
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours, ret)


def test_gpg_advantages_over_two_ranks_equal_the_whole_batch():
    rewards, mask, index = random_rows(7, rows=16)
    whole, _ = compute_advantages(
        SimpleNamespace(adv_estimator="gpg"), AdvantageInputs(rewards, mask, index, num_groups=5)
    )
    halves = [slice(0, 9), slice(9, 16)]  # uneven shares, groups split across the two ranks
    out = run_ranks(
        2,
        lambda r, ar: compute_advantages(
            SimpleNamespace(adv_estimator="gpg"),
            AdvantageInputs(rewards[halves[r]], mask[halves[r]], index[halves[r]], num_groups=5, all_reduce=ar),
        )[0],
    )
    torch.testing.assert_close(torch.cat(out), whole, rtol=1e-6, atol=1e-6)
    # alpha is global: rows / rows that scored over the whole batch, not each rank's share
    assert ADV_ESTIMATORS["gpg"].grouped and not ADV_ESTIMATORS["gpg"].needs_critic


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gpg_loss_equals_verls_code_and_its_gradient(mode):
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(5, 7, generator=g)).requires_grad_()
    adv, mask = torch.randn(5, 7, generator=g), (torch.rand(5, 7, generator=g) > 0.2).float()
    w = torch.rand(5, 7, generator=g) * 2
    cfg = SimpleNamespace(loss_agg_mode=mode)
    for weights in (None, w):
        ours, metrics = POLICY_LOSSES["gpg"](lp.detach() + 0.1, lp, adv, mask, cfg, is_weights=weights)
        ref = verl_gpg_loss(lp, adv, mask, mode, weights)
        torch.testing.assert_close(ours, ref)
        (g_ours,), (g_ref,) = torch.autograd.grad(ours, lp), torch.autograd.grad(ref, lp)
        torch.testing.assert_close(g_ours, g_ref)
        assert metrics == {}  # verl reports no clip figures for GPG


def test_gpg_is_chosen_by_verls_keys_and_a_typo_is_refused_by_name():
    cfg, _ = load_config(
        "tiny_klppo", ["algorithm.adv_estimator=gpg", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"]
    )
    assert cfg.critic.enable is False  # the estimator needs no critic: none is built
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref.actor.policy_loss.loss_mode: unknown policy loss "
        r"'gpgg' \(did you mean 'gpg'\?\); registered: vanilla, reinforce, gpg",
    ):
        load_config("tiny_klppo", ["actor_rollout_ref.actor.policy_loss.loss_mode=gpgg"])
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator: unknown advantage estimator 'gpo'"):
        load_config("tiny_klppo", ["algorithm.adv_estimator=gpo"])
    # at verl's default n=1 it runs as verl's does (a group of one: mean 0), with a warning
    _, warnings = load_config("tiny_klppo", ["algorithm.adv_estimator=gpg", "actor_rollout_ref.rollout.n=1"])
    assert any(
        w.startswith("algorithm.adv_estimator=gpg with actor_rollout_ref.rollout.n=1: every group holds one response")
        for w in warnings
    ), warnings
