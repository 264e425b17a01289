"""verl's advantage estimators added through the registry: ``grpo_vectorized``, ``rloo_vectorized``,
``grpo_passk``, ``opo``, ``remax`` (and its greedy baseline in the trainer), the optimal token
baselines and ``reinforce_plus_plus`` on multi-turn masks. Each equals verl 0.9.1's code (transcribed
below from its wheel's ``trainer/ppo/core_algos.py`` / ``utils/groupwise.py``) on random tensors, and
the grouped ones over two simulated ranks equal the whole batch."""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf_hpc.ops.estimators import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    remax_advantages,
)
from tests.test_algos import LockstepAllReduce, run_ranks


# ----------------------------------------------------------------------- verl's code, transcribed
def verl_group_mean_std(scores, gidx, eps=1e-6):
    """verl.utils.groupwise.group_mean_std (0.9.1: the variance from centred scores)."""
    scores = scores.reshape(-1).to(dtype=torch.float32)
    gidx = gidx.reshape(-1).to(dtype=torch.long)
    G = int(torch.max(gidx).item()) + 1
    ones = torch.ones_like(scores, dtype=torch.float32)
    count = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, ones)
    s1 = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, scores)
    mean = s1 / count.clamp_min(1.0)
    centered = scores - mean[gidx]
    var_num = torch.zeros(G, dtype=torch.float32).index_add_(0, gidx, centered * centered)
    denom = (count - 1.0).clamp_min(1.0)
    var = var_num / denom
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = count <= 1.0
    if torch.any(single):
        mean = mean.clone()
        std = std.clone()
        mean[single] = 0.0
        std[single] = 1.0
    return mean, std, count


def verl_grpo_vectorized(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """0.9.1: group_mean_std(eps=0.0), no variance floor."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g = torch.as_tensor(index, dtype=torch.long)
        mean_g, std_g, _ = verl_group_mean_std(scores, g, eps=0.0)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean_g[g]) / (std_g[g] + epsilon)
        else:
            scalars = scores - mean_g[g]
        advantages = scalars.unsqueeze(-1) * response_mask
        return advantages, advantages


def verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma=1.0):
    """0.9.1's compute_reinforce_plus_plus_outcome_advantage: a masked position carries the return."""
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
        advantages = verl_masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl 0.9.1's compute_grpo_outcome_advantage."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx], id2std[idx] = torch.mean(scores_tensor), torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_gdpo(
    token_level_rewards,
    response_mask,
    index,
    score_list=None,
    reward_weights=None,
    epsilon=1e-6,
    norm_adv_by_std_in_grpo=True,
):
    """verl 0.9.1's compute_gdpo_outcome_advantage, its per-key scores (``score_list``) placed as it places
    them (on each row's last response position)."""
    score_list = score_list if score_list is not None else [token_level_rewards]
    weights = torch.tensor(reward_weights if reward_weights is not None else [1.0] * len(score_list))
    new_advantage = None
    for i in range(len(score_list)):
        normalized_score, _ = verl_grpo(score_list[i].clone(), response_mask, index, epsilon, norm_adv_by_std_in_grpo)
        new_advantage = (
            weights[i] * normalized_score if new_advantage is None else new_advantage + weights[i] * normalized_score
        )
    advantages = verl_masked_whiten(new_advantage, response_mask) * response_mask
    return advantages, advantages


def verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_masked_whiten(values, mask):
    """verl.utils.torch_functional.masked_whiten (masked_var unbiased)."""
    mean = verl_masked_mean(values, mask)
    var = verl_masked_mean((values - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_rloo_vectorized(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        inv = torch.from_numpy(np.unique(index, return_inverse=True)[1]).to(scores.device)
        c = torch.bincount(inv)[inv].to(scores.dtype)
        adv = ((c * scores - torch.bincount(inv, weights=scores)[inv]) / (c - 1).clamp_min(1)) * (c > 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def verl_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, config=None):
    norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores = defaultdict(list)
    id2indices = defaultdict(list)
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            idx = index[i]
            id2scores[idx].append(scores[i])
            id2indices[idx].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])
            if rewards.numel() < 2:
                raise ValueError(
                    f"Pass@k requires at least 2 samples per group. Got {rewards.numel()} for group {idx}."
                )
            topk, topk_idx = torch.topk(rewards, 2)
            r_max, r_second_max = topk[0], topk[1]
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = r_max - r_second_max
            if norm_adv_by_std_in_grpo:
                std = torch.std(rewards)
                advantage = advantage / (std + epsilon)
            advantages[i_max] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def verl_opo(token_level_rewards, response_mask, index):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2len, id2bsl = defaultdict(list), defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_remax(token_level_rewards, reward_baselines, response_mask):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def verl_otb(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights=None,
    handle_zero_tail=True,
    epsilon=1e-8,
):
    """verl's compute_optimal_token_baseline_advantage (0.9.1: handle_zero_tail defaults to True, and
    the trainer never passes it)."""
    with torch.no_grad():
        batch_size, seq_len = token_level_rewards.shape
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        pi_t = torch.exp(old_log_probs)
        w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
        if rollout_is_weights is not None:
            w_per_timestep = w_per_timestep * (rollout_is_weights**2)
        w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
        prompt_groups = defaultdict(list)
        for i in range(batch_size):
            prompt_groups[index[i]].append(i)
        baselines = torch.zeros_like(returns)
        for _, trajectory_indices in prompt_groups.items():
            N = len(trajectory_indices)
            if N == 1:
                continue
            traj_idx = torch.tensor(trajectory_indices)
            returns_group = returns[traj_idx]
            w_cumulative_group = w_cumulative[traj_idx]
            mask_group = response_mask[traj_idx]
            numerator = (returns_group * w_cumulative_group * mask_group).sum(dim=0)
            denominator = (w_cumulative_group * mask_group).sum(dim=0) + epsilon
            baseline_per_step = numerator / denominator
            baselines[traj_idx] = baseline_per_step.unsqueeze(0).expand(N, -1)
            if handle_zero_tail:
                response_lengths = mask_group.sum(dim=-1)
                sorted_lengths, _ = torch.sort(response_lengths)
                max_length = int(sorted_lengths[-1].item())
                second_max_length = int(sorted_lengths[-2].item())
                max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
                if max_length_idx.numel() == 1 and max_length > second_max_length:
                    max_length_traj_idx = trajectory_indices[int(max_length_idx[0])]
                    baselines[max_length_traj_idx, second_max_length:] = 0.0
        advantages = (returns - baselines) * response_mask
    return advantages, returns


def verl_tir_otb(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights=None,
    handle_zero_tail=True,
    epsilon=1e-8,
):
    """verl's compute_multi_turn_optimal_token_baseline_advantage."""
    with torch.no_grad():
        token_returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        pi_t = torch.exp(old_log_probs)
        w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
        if rollout_is_weights is not None:
            w_per_timestep = w_per_timestep * (rollout_is_weights**2)
        w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
        response_lengths = response_mask.sum(dim=-1).to(dtype=torch.long)
        max_response_length = int(response_lengths.max().item()) if response_lengths.numel() > 0 else 0
        all_w_values = w_cumulative.new_zeros((len(response_lengths), max_response_length))
        all_returns = torch.zeros_like(all_w_values)
        for i in range(len(response_lengths)):
            length = int(response_lengths[i].item())
            if length == 0:
                continue
            mask = response_mask[i].bool()
            all_w_values[i, :length] = w_cumulative[i, mask]
            all_returns[i, :length] = token_returns[i, mask]
        prompt_groups = defaultdict(list)
        for i in range(len(response_lengths)):
            if response_lengths[i] == 0:
                continue
            prompt_groups[index[i]].append(i)
        baselines = torch.zeros_like(all_returns)
        for _, trajectory_indices in prompt_groups.items():
            N = len(trajectory_indices)
            traj_idx = torch.tensor(trajectory_indices, device=all_returns.device)
            if N == 1:
                baselines[traj_idx[0]] = 0.0
                continue
            w_group = all_w_values[traj_idx]
            R_group = all_returns[traj_idx]
            b_star = (R_group * w_group).sum(dim=0) / (w_group.sum(dim=0) + epsilon)
            baselines[traj_idx] = b_star.to(baselines.dtype)
            if handle_zero_tail:
                response_lengths_group = response_lengths[traj_idx]
                sorted_lengths, _ = torch.sort(response_lengths_group)
                max_length = int(sorted_lengths[-1].item())
                second_max_length = int(sorted_lengths[-2].item())
                max_length_idx = (response_lengths_group == max_length).nonzero(as_tuple=True)[0]
                if max_length_idx.numel() == 1 and max_length > second_max_length:
                    max_length_traj_idx = trajectory_indices[int(max_length_idx[0])]
                    baselines[max_length_traj_idx, second_max_length:] = 0.0
        all_advantages = all_returns - baselines
        advantages = torch.zeros_like(token_returns)
        for i in range(len(response_lengths)):
            if response_lengths[i] == 0:
                continue
            advantages[i, response_mask[i].bool()] = all_advantages[i, : response_lengths[i]]
        advantages = advantages * response_mask
    return advantages, token_returns


# ----------------------------------------------------------------------------------- helpers
def random_rows(
    seed: int, rows: int = 16, T: int = 7, groups: int = 5, continuous: bool = False, dense_rewards: bool = False
):
    """Right-padded responses; outcome scores on the last token (or rewards on every token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    if continuous:
        scores = torch.randn(rows, generator=g)
    else:
        scores = torch.randint(0, 3, (rows,), generator=g).float() * (torch.rand(rows, generator=g) > 0.3)
    rewards = torch.zeros(rows, T)
    rewards[torch.arange(rows), lengths - 1] = scores
    if dense_rewards:
        rewards = torch.randn(rows, T, generator=g) * mask
    # every group of at least 2 rows (as rollout.n >= 2 makes them)
    index = torch.cat(
        [torch.arange(groups), torch.arange(groups), torch.randint(0, groups, (rows - 2 * groups,), generator=g)]
    )
    index = index[torch.randperm(rows, generator=g)]
    return rewards, mask, index


def cfg(name, norm=True):
    return SimpleNamespace(adv_estimator=name, norm_adv_by_std_in_grpo=norm, gamma=1.0, lam=1.0)


def over_two_ranks(name, rewards, mask, index, groups, norm=True, **extra):
    """The estimator's rows from two simulated ranks (uneven shares, groups split across them), joined."""
    halves = [slice(0, 9), slice(9, rewards.shape[0])]
    maxes = LockstepAllReduce(2, reduce=lambda stacked: stacked.amax(0))
    out = run_ranks(
        2,
        lambda r, ar: compute_advantages(
            cfg(name, norm),
            AdvantageInputs(
                rewards[halves[r]],
                mask[halves[r]],
                index[halves[r]],
                num_groups=groups,
                all_reduce=ar,
                all_reduce_max=maxes.for_rank(r),
                **{k: v[halves[r]] for k, v in extra.items()},
            ),
        ),
    )
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


# ------------------------------------------------------------------------------ the estimators
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_equals_verls_code(seed, norm):
    rewards, mask, index = random_rows(seed, continuous=seed % 2 == 1)
    ours, ret = compute_advantages(cfg("grpo_vectorized", norm), AdvantageInputs(rewards, mask, index))
    ref, _ = verl_grpo_vectorized(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ret)


def test_grpo_vectorized_has_no_variance_floor_as_verl_0_9_1():
    # a group whose scores differ by 1e-4: verl before 0.9.1 floored the variance at 1e-6 (advantage
    # ~0.07); 0.9.1 does not, so the advantage is ~0.7, as grpo's
    rewards = torch.tensor([[1.0, 0.0], [1.0001, 0.0], [0.0, 1.0], [2.0, 0.0]])
    mask, index = torch.ones(4, 2), torch.tensor([0, 0, 1, 1])
    ours, _ = compute_advantages(cfg("grpo_vectorized"), AdvantageInputs(rewards, mask, index))
    ref, _ = verl_grpo_vectorized(rewards, mask, index)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-4)
    plain, _ = compute_advantages(cfg("grpo"), AdvantageInputs(rewards, mask, index))
    torch.testing.assert_close(ours, plain, rtol=1e-3, atol=1e-4)
    assert ours[0, 0].abs() > 0.5


def multi_turn_rows(seed: int, rows: int = 12, T: int = 10):
    """Responses with masked spans inside (a tool's or a user's turn), right padding after, and
    rewards on valid and on masked positions (a reward placed inside a masked span must not count)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    for r in range(rows):
        if lengths[r] >= 5 and torch.rand((), generator=g) < 0.7:
            start = int(torch.randint(1, int(lengths[r]) - 2, (), generator=g))
            mask[r, start : start + int(torch.randint(1, 3, (), generator=g))] = 0.0
    rewards = torch.randn(rows, T, generator=g) * (torch.rand(rows, T, generator=g) < 0.3)
    rewards[torch.arange(rows), lengths - 1] += torch.randint(0, 2, (rows,), generator=g).float()
    return rewards, mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_equals_verls_code_on_multi_turn_masks(seed, gamma):
    rewards, mask = multi_turn_rows(seed)
    assert ((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any()  # a span inside a response
    c = SimpleNamespace(adv_estimator="reinforce_plus_plus", gamma=gamma, lam=1.0, norm_adv_by_std_in_grpo=True)
    ours, ret = compute_advantages(c, AdvantageInputs(rewards, mask, torch.arange(rewards.shape[0])))
    ref, ref_ret = verl_reinforce_plus_plus(rewards, mask, gamma)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_gdpo_equals_verls_code(seed, norm, weights):
    rewards, mask, index = random_rows(seed)
    g = torch.Generator().manual_seed(seed + 100)
    components = torch.randint(0, 2, (rewards.shape[0], 3), generator=g).float() * torch.tensor([1.0, 0.5, 3.0])
    lengths = mask.sum(-1).long()
    placed = []
    for k in range(3):  # verl places each key's score on the row's last response position
        t = torch.zeros_like(rewards)
        t[torch.arange(rewards.shape[0]), lengths - 1] = components[:, k]
        placed.append(t)
    c = SimpleNamespace(
        adv_estimator="gdpo", norm_adv_by_std_in_grpo=norm, gamma=1.0, lam=1.0, gdpo_reward_weights=weights
    )
    ours, ret = compute_advantages(c, AdvantageInputs(rewards, mask, index, reward_components=components))
    ref, _ = verl_gdpo(rewards, mask, index.tolist(), placed, weights, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ret)
    # without keys: verl's fallback, the score alone (the dry run requires keys of a run)
    ours, _ = compute_advantages(
        SimpleNamespace(**{**vars(c), "gdpo_reward_weights": None}), AdvantageInputs(rewards, mask, index)
    )
    ref, _ = verl_gdpo(rewards, mask, index.tolist(), norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # two ranks holding halves give the whole batch's
    halves = [slice(0, 9), slice(9, 16)]
    out = run_ranks(
        2,
        lambda r, ar: compute_advantages(
            c,
            AdvantageInputs(
                rewards[halves[r]],
                mask[halves[r]],
                index[halves[r]],
                num_groups=5,
                all_reduce=ar,
                reward_components=components[halves[r]],
            ),
        ),
    )
    whole, _ = compute_advantages(c, AdvantageInputs(rewards, mask, index, num_groups=5, reward_components=components))
    torch.testing.assert_close(torch.cat([o[0] for o in out]), whole, rtol=1e-6, atol=1e-6)


def test_reinforce_plus_plus_carries_the_final_reward_across_a_tool_turn():
    # the model's first turn (positions 0-1), a tool's turn (2-3, masked), the answer (4) scored 1:
    # the first turn's return is the final reward, not 0 (verl before 0.9.1 reset it at the tool's turn)
    rewards, mask = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]]), torch.tensor([[1.0, 1, 0, 0, 1]])
    _, ret = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_rloo_vectorized_equals_verls_code_with_a_group_of_one(seed):
    rewards, mask, index = random_rows(seed, continuous=True)
    index = index.clone()
    index[0] = 99  # a group of one: verl's vectorized RLOO gives it 0 (its loop version keeps the score)
    ours, ret = compute_advantages(cfg("rloo_vectorized"), AdvantageInputs(rewards, mask, index))
    ref, _ = verl_rloo_vectorized(rewards.clone(), mask, index.numpy())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ret) and torch.all(ours[0] == 0)
    loop, _ = compute_advantages(cfg("rloo"), AdvantageInputs(rewards, mask, index))
    shared = torch.tensor([int((index == i).sum()) > 1 for i in index])
    assert not shared.all()
    torch.testing.assert_close(loop[shared], ours[shared])  # otherwise the same maths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_equals_verls_code(seed, norm):
    rewards, mask, index = random_rows(seed, continuous=seed % 2 == 1)  # even seeds: many tied best scores
    ours, ret = grpo_passk_advantages(rewards, mask, index, norm_by_std=norm)
    ref, _ = verl_grpo_passk(rewards.clone(), mask, index.tolist(), config={"norm_adv_by_std_in_grpo": norm})
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ret)
    # one row per group at most has a non-zero advantage, the group's unique best
    nonzero = ours.abs().sum(-1) > 0
    assert len(set(index[nonzero].tolist())) == int(nonzero.sum())


def test_grpo_passk_refuses_a_group_of_one_as_verl():
    rewards, mask, index = random_rows(0)
    index = index.clone()
    index[3] = 42
    with pytest.raises(ValueError, match="at least 2"):
        verl_grpo_passk(rewards.clone(), mask, index.tolist(), config={})
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        grpo_passk_advantages(rewards, mask, index)


@pytest.mark.parametrize("seed", range(5))
def test_opo_equals_verls_code(seed):
    rewards, mask, index = random_rows(seed, continuous=seed % 2 == 1)
    index = index.clone()
    index[0] = 77  # a group of one: baseline 0
    ours, ret = opo_advantages(rewards, mask, index)
    ref, _ = verl_opo(rewards.clone(), mask, index.tolist())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ret)


@pytest.mark.parametrize("seed", range(4))
def test_remax_equals_verls_code(seed):
    rewards, mask, _ = random_rows(seed, dense_rewards=seed % 2 == 1)
    baselines = torch.randn(rewards.shape[0], generator=torch.Generator().manual_seed(seed))
    ours = compute_advantages(
        cfg("remax"), AdvantageInputs(rewards, mask, torch.arange(rewards.shape[0]), reward_baselines=baselines)
    )
    ref = verl_remax(rewards, baselines, mask)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert remax_advantages(rewards, mask, baselines)[0].shape == rewards.shape


def test_remax_without_baselines_says_what_is_missing():
    rewards, mask, index = random_rows(0)
    with pytest.raises(ValueError, match="remax needs reward_baselines"):
        compute_advantages(cfg("remax"), AdvantageInputs(rewards, mask, index))


def otb_inputs(seed: int, holes: bool = False, rows: int = 16, T: int = 7):
    """random_rows plus the actor's log-probs, sum pi^2 and IS weights; ``holes``: masked spans
    inside responses (a multi-turn response's tool outputs) and an empty response."""
    rewards, mask, index = random_rows(seed, rows=rows, T=T, dense_rewards=seed % 2 == 1)
    g = torch.Generator().manual_seed(seed + 100)
    if holes:
        mask = mask * (torch.rand(mask.shape, generator=g) > 0.25).float()
        mask[:, 0] = 1.0
        mask[5] = 0.0
        rewards = rewards * mask
    probs = torch.softmax(torch.randn(rows, T, 11, generator=g) * 2, -1)
    tokens = torch.randint(0, 11, (rows, T), generator=g)
    old_log_probs = probs.gather(-1, tokens[..., None]).squeeze(-1).log()
    sum_pi_squared = (probs**2).sum(-1)
    is_weights = torch.rand(rows, T, generator=g) * 2
    return rewards, mask, index, old_log_probs, sum_pi_squared, is_weights


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_equals_verls_code(seed, zero_tail, with_is):
    rewards, mask, index, lp, spi2, w = otb_inputs(seed, holes=seed >= 4)
    w = w if with_is else None
    ours = optimal_token_baseline_advantages(rewards, mask, index, lp, spi2, w, handle_zero_tail=zero_tail)
    ref = verl_otb(rewards, mask, index.tolist(), lp, spi2, w, handle_zero_tail=zero_tail)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], ref[1] * mask)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("zero_tail", [True, False])
def test_tir_optimal_token_baseline_equals_verls_code(seed, zero_tail):
    rewards, mask, index, lp, spi2, w = otb_inputs(seed, holes=seed % 2 == 0)
    ours = optimal_token_baseline_advantages(
        rewards, mask, index, lp, spi2, w, handle_zero_tail=zero_tail, by_valid_token=True
    )
    ref = verl_tir_otb(rewards, mask, index.tolist(), lp, spi2, w, handle_zero_tail=zero_tail)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], ref[1] * mask)


@pytest.mark.parametrize("seed", range(4))
def test_the_optimal_token_baseline_entry_equals_verls_code_with_its_defaults(seed):
    rewards, mask, index, lp, spi2, w = otb_inputs(seed, holes=seed % 2 == 1)
    c = SimpleNamespace(adv_estimator="optimal_token_baseline", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    ours, _ = compute_advantages(
        c, AdvantageInputs(rewards, mask, index, old_log_probs=lp, sum_pi_squared=spi2, rollout_is_weights=w)
    )
    ref, _ = verl_otb(rewards, mask, index.tolist(), lp, spi2, w)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_a_strictly_longest_response_gets_no_baseline_past_the_second_longest():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    lp, spi2, index = torch.full((2, 4), -1.0), torch.full((2, 4), 0.3), torch.tensor([0, 0])
    adv, ret = optimal_token_baseline_advantages(rewards, mask, index, lp, spi2, handle_zero_tail=True)
    torch.testing.assert_close(adv[0, 2:], ret[0, 2:])  # its tail: advantage = return
    plain, _ = optimal_token_baseline_advantages(rewards, mask, index, lp, spi2)
    assert not torch.allclose(plain[0, 2:], ret[0, 2:])


@pytest.mark.parametrize("by_valid_token", [False, True])
def test_optimal_token_baseline_over_two_ranks_equals_the_whole_batch(by_valid_token):
    for seed in range(3):
        rewards, mask, index, lp, spi2, w = otb_inputs(seed, holes=True)
        kw = dict(handle_zero_tail=True, by_valid_token=by_valid_token, num_groups=5)
        whole = optimal_token_baseline_advantages(rewards, mask, index, lp, spi2, w, **kw)
        halves = [slice(0, 9), slice(9, 16)]
        out = run_ranks(
            2,
            lambda r, ar: optimal_token_baseline_advantages(
                *(t[halves[r]] for t in (rewards, mask, index, lp, spi2, w)), all_reduce=ar, **kw
            ),
        )
        for i in range(2):
            torch.testing.assert_close(torch.cat([o[i] for o in out]), whole[i], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- global over ranks
@pytest.mark.parametrize("name", ["grpo_vectorized", "rloo_vectorized", "grpo_passk", "opo", "remax"])
@pytest.mark.parametrize("norm", [True, False])
def test_two_ranks_equal_the_whole_batch(name, norm):
    for seed in range(3):
        rewards, mask, index = random_rows(seed + 10, continuous=seed == 1)
        extra = {}
        if ADV_ESTIMATORS[name].needs_greedy_baseline:
            extra["reward_baselines"] = torch.randn(rewards.shape[0])
        whole = compute_advantages(cfg(name, norm), AdvantageInputs(rewards, mask, index, num_groups=5, **extra))
        split = over_two_ranks(name, rewards, mask, index, 5, norm, **extra)
        for a, b in zip(split, whole):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_grpo_passk_across_ranks_needs_the_max_reduction():
    rewards, mask, index = random_rows(1)
    with pytest.raises(ValueError, match="all_reduce_max"):
        grpo_passk_advantages(rewards, mask, index, all_reduce=lambda t: t, num_groups=5)


def test_the_entries_declare_what_they_need():
    e = ADV_ESTIMATORS
    for name in ("grpo_vectorized", "rloo_vectorized", "grpo_passk", "opo"):
        assert e[name].grouped and not e[name].needs_critic and not e[name].needs_greedy_baseline, name
    assert e["remax"].needs_greedy_baseline and not e["remax"].grouped and not e["remax"].needs_critic
    assert not any(e[n].needs_greedy_baseline for n in e if n != "remax")


# --------------------------------------------------------------- ReMax's greedy baseline, trainer
class FakeEngine:
    """A rollout engine answering every prompt with "1" when greedy (copy score 1.0) and with
    "12" / "2" when sampling (n of them), recording the sampling settings it was asked for."""

    dp_rank = 0

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, sampling):
        from rlhf_hpc.rollout.base import Response

        self.calls.append(sampling)
        texts = ["1"] if sampling.greedy else ["12", "2", "1"][: sampling.n]
        out = []
        for _ in prompts:
            group = []
            for t in texts:
                ids = self.tok.encode(t, add_special_tokens=False)
                group.append(Response(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
            out.append(group)
        return out

    def release(self):
        pass


def test_remax_trainer_generates_and_scores_one_greedy_response_per_prompt():
    from rlhf_hpc.data.dataset import Example
    from rlhf_hpc.distributed.process_group import all_reduce_max, all_reduce_sum
    from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
    from rlhf_hpc.observability.perf import Timer
    from rlhf_hpc.ppo.generation import Generator
    from rlhf_hpc.ppo.trainer import PPOTrainer
    from rlhf_hpc.recipe.load import load_config
    from rlhf_hpc.rewards import RewardFunction

    config, _ = load_config("tiny_klppo", ["algorithm.adv_estimator=remax"])
    assert config.critic.enable is False
    tok = build_tiny_tokenizer()
    t = object.__new__(PPOTrainer)  # the two phases alone: no models, no process group
    t.cfg, t.tokenizer = config, tok
    t.ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    t.train_set = [
        Example(
            prompt_ids=tok.encode(f"copy: {i}", add_special_tokens=False),
            data_source="synthetic/copy",
            ground_truth="1",
            index=i,
        )
        for i in range(4)
    ]
    t.sampler = SimpleNamespace(next_batch=lambda: [2, 0, 3])
    t.rollout, t.faults = FakeEngine(tok), SimpleNamespace(after_generation=lambda step: None)
    t.generator = Generator(config, t.rollout, tok, [])  # single-turn: the engine itself
    t.reward_fn, t.reward_model = RewardFunction(config.custom_reward_function), None
    t.overlong = False  # (no dapo reward manager)
    t.greedy_baseline, t.greedy_rows = True, None
    timer, metrics = Timer(), {}

    batch, rows, prompts = t.generate(1, timer, metrics)
    assert [s.greedy for s in t.rollout.calls] == [False, True] and t.rollout.calls[1].n == 1
    assert "timing_s/gen_max" in timer.times  # verl's timer name for ReMax's greedy generation
    scores = t.score(batch, rows, timer, metrics)
    batch["reward_baselines"] = t.baseline_scores(batch, rows, len(prompts), timer, metrics)
    assert batch["reward_baselines"].shape == (len(rows),) and t.greedy_rows is None
    torch.testing.assert_close(batch["reward_baselines"], torch.ones(len(rows)))  # "1" copies "1": score 1
    assert metrics["reward/greedy_baseline/mean"] == 1.0

    from rlhf_hpc.ppo.step_batch import scores_on_last_token

    rewards = scores_on_last_token(scores, batch["response_mask"])
    mask = batch["response_mask"].float()
    ours = compute_advantages(
        config.algorithm,
        AdvantageInputs(
            rewards,
            mask,
            batch["uid"],
            num_groups=len(prompts),
            all_reduce=all_reduce_sum,
            all_reduce_max=all_reduce_max,
            reward_baselines=batch["reward_baselines"],
        ),
    )
    ref = verl_remax(rewards, batch["reward_baselines"], mask)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert (ours[0].sum(-1) != 0).any()


@pytest.mark.parametrize("name", ["grpo_vectorized", "rloo_vectorized", "grpo_passk", "opo", "remax"])
def test_verls_names_are_chosen_by_its_key_without_a_critic(name):
    from rlhf_hpc.recipe.load import load_config

    config, _ = load_config("tiny_klppo", [f"algorithm.adv_estimator={name}"])
    assert config.algorithm.adv_estimator == name and config.critic.enable is False


def test_remax_baselines_are_shared_over_ranks(monkeypatch):
    """Each rank scores the greedy responses to the prompts it generated for; a row's prompt may
    have been generated on the other rank (rows are redistributed): the table is summed over ranks."""
    import rlhf_hpc.ppo.trainer as trainer_mod
    from rlhf_hpc.data.dataset import Example
    from rlhf_hpc.distributed.rows import prompt_share
    from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
    from rlhf_hpc.observability.perf import Timer
    from rlhf_hpc.ppo.step_batch import rollout_rows, sampling_for
    from rlhf_hpc.recipe.load import load_config
    from rlhf_hpc.rewards import RewardFunction

    config, _ = load_config("tiny_klppo", ["algorithm.adv_estimator=remax"])
    tok = build_tiny_tokenizer()
    # the greedy answer is always "1": prompts whose target is "1" score 1, the others 0
    train = [
        Example(
            prompt_ids=tok.encode(f"copy: {i}", add_special_tokens=False),
            data_source="synthetic/copy",
            ground_truth="1" if i % 2 else "2",
            index=i,
        )
        for i in range(6)
    ]
    prompts = [5, 2, 3, 0, 1]  # dataset indices of the step's prompts; expected baselines by position:
    expected = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    uids = [torch.tensor([4, 0, 3, 3]), torch.tensor([1, 2, 0, 4])]  # rows of each rank, prompts of both
    reducers = {}
    monkeypatch.setattr(trainer_mod, "all_reduce_sum", lambda t: reducers[threading.get_ident()](t))

    def rank_fn(rank, ar):
        reducers[threading.get_ident()] = ar
        t = object.__new__(trainer_mod.PPOTrainer)
        t.cfg, t.tokenizer, t.train_set = config, tok, train
        t.ctx = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
        t.reward_fn, t.reward_model = RewardFunction(config.custom_reward_function), None
        t.overlong = False  # (no dapo reward manager)
        mine = prompt_share(len(prompts), 2, rank)
        t.greedy_rows = rollout_rows(
            train,
            prompts,
            mine,
            FakeEngine(tok).generate(
                [train[prompts[p]].prompt_ids for p in mine], sampling_for(config, tok, greedy=True)
            ),
        )
        metrics = {}
        out = t.baseline_scores({"uid": uids[rank]}, [], len(prompts), Timer(), metrics)
        return out, metrics["reward/greedy_baseline/mean"]

    results = run_ranks(2, rank_fn)
    for rank, (out, mean) in enumerate(results):
        torch.testing.assert_close(out, expected[uids[rank]])
        assert mean == pytest.approx(float(expected.mean()))


# ----------------------------------------------------------------------- gdpo through the trainer
GDPO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fmt = float(sum(map(ord, solution_str)) % 2)  # (varies from response to response)
    acc = float(solution_str.strip().startswith(str(ground_truth)[:1]))
    return {"score": fmt + acc, "format_reward": fmt, "accuracy_reward": acc}
"""


def test_gdpo_reads_its_keys_from_the_reward_functions_dict_and_refuses_what_it_cannot_run(tmp_path):
    from rlhf_hpc.config.errors import ConfigError
    from rlhf_hpc.ppo.step_batch import score_responses
    from rlhf_hpc.recipe.load import load_config
    from rlhf_hpc.rewards import RewardFunction

    fn = tmp_path / "reward.py"
    fn.write_text(GDPO_REWARD)
    base = ["algorithm.adv_estimator=gdpo", f"custom_reward_function.path={fn}", "critic.enable=false"]
    cfg, _ = load_config(
        "tiny_klppo",
        base
        + ["algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]", "algorithm.gdpo_reward_weights=[1.0,2.0]"],
    )
    assert cfg.algorithm.gdpo_reward_keys == ["format_reward", "accuracy_reward"]
    for extra, message in (
        (["critic.enable=false"], "set algorithm.gdpo_reward_keys"),
        (
            ["algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
            "gdpo_reward_weights has 1 entries for 2",
        ),
        (["algorithm.adv_estimator=grpo", "algorithm.gdpo_reward_keys=[a]"], "read only by adv_estimator=gdpo"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("tiny_klppo", base + extra)
    # the keys reach the batch, row by row; a key the result lacks is named with its row
    reward = RewardFunction(cfg.custom_reward_function)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    rows = [SimpleNamespace(example=i, num_turns=None) for i in range(3)]
    train = [SimpleNamespace(data_source="x", ground_truth=g, extra_info={}, index=i) for i, g in enumerate("abz")]
    batch = {"responses": torch.tensor([[0, 1], [1, 0], [2, 2]]), "attention_mask": torch.ones(3, 2, dtype=torch.long)}
    scores = score_responses(reward, Tok(), train, rows, batch, ("format_reward", "accuracy_reward"))
    torch.testing.assert_close(scores, torch.tensor([2.0, 2.0, 0.0]))
    torch.testing.assert_close(batch["reward_components"], torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(
        RuntimeError,
        match=r"on prompt row 0: algorithm.gdpo_reward_keys names missing_key, which "
        r"its result lacks \(it returned score, format_reward, accuracy_reward\)",
    ):
        score_responses(reward, Tok(), train, rows, dict(batch), ("missing_key",))


@pytest.mark.slow
def test_gdpo_trains_through_the_trainer(tmp_path):
    from rlhf_hpc.observability.tracking import read_metrics
    from tests.conftest import run_launch

    fn = tmp_path / "reward.py"
    fn.write_text(GDPO_REWARD)
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]",
        "critic.enable=false",
        f"custom_reward_function.path={fn}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.name=hf",  # (what is asserted is the estimator's: no engine start-up)
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["training/global_step"] for m in metrics] == [1, 2]
    for m in metrics:  # whitened over the batch: mean 0
        assert abs(m["critic/advantages/mean"]) < 1e-5 and m["critic/advantages/max"] > 0 and m["actor/grad_norm"] > 0
