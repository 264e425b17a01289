"""Advantage estimators: the registry of ``algorithm.adv_estimator``.

An estimator is one decorated function (verl's ``register_adv_est``)::

    @register_adv_est("name", needs_critic=False, grouped=True)
    def name(x: AdvantageInputs, cfg) -> tuple[advantages, returns]: ...

``x`` holds the step's per-rank tensors and the all-reduce that makes statistics global; ``cfg`` is
``algorithm`` (gamma, lam, norm_adv_by_std_in_grpo, ...); both outputs are ``(B, T)``, zero where
the response mask is 0. What the entry declares is read by the other layers: ``needs_critic``
(``critic.enable`` defaults to it, and values are computed), ``grouped`` (it compares the responses
to one prompt: ``rollout.n >= 2`` is required), ``needs_greedy_baseline`` (the trainer generates one
greedy response per prompt, scores it, and fills ``x.reward_baselines``: verl's ReMax),
``needs_sum_pi_squared`` (the old-log-prob pass also gives sum_v pi(v)^2 per token, filling
``x.sum_pi_squared`` beside ``x.old_log_probs``: verl's Optimal Token Baseline; it requires
``actor.calculate_sum_pi_squared=true`` and no bypass mode). An unknown name raises with the
registry's names.

Groups span ranks: ``x.index`` is each row's prompt position in the step, ``0..num_groups-1`` on
every rank, and group sums are all-reduced (``group_stats``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf_hpc.config.registry import Registry
from rlhf_hpc.ops.algos import AllReduce, masked_whiten, sum_over_ranks

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageInputs",
    "Estimator",
    "compute_advantages",
    "gae_advantages",
    "gpg_advantages",
    "group_ids",
    "group_stats",
    "group_sums",
    "group_table",
    "grpo_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "register_adv_est",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's rows on this rank: ``token_rewards``, ``response_mask`` (float), ``values`` (the
    critic's, or None) (B, T); ``index`` (B,) group ids, ``num_groups`` of them over all ranks;
    ``all_reduce`` sums over ranks (None: this process only); ``all_reduce_max`` takes the
    element-wise max over ranks (needed by ``grpo_passk`` across ranks); ``reward_baselines`` (B,)
    the score of the greedy response to each row's prompt (estimators declaring
    ``needs_greedy_baseline``); ``old_log_probs``, ``sum_pi_squared`` (B, T): the actor's old-log-prob
    pass (sum_pi_squared only with ``actor.calculate_sum_pi_squared``: estimators declaring
    ``needs_sum_pi_squared``); ``rollout_is_weights`` (B, T): the rollout correction's, where it
    computes them (decoupled mode with ``rollout_is``), else None."""

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: torch.Tensor
    num_groups: Optional[int] = None
    values: Optional[torch.Tensor] = None
    all_reduce: AllReduce = None
    all_reduce_max: AllReduce = None
    reward_baselines: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    sum_pi_squared: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    reward_components: Optional[torch.Tensor] = None  # (B, K): gdpo's reward keys, per row

    @property
    def groups(self) -> dict:
        return dict(all_reduce=self.all_reduce, num_groups=self.num_groups)


@dataclass(frozen=True)
class Estimator:
    """A registered estimator and what the other layers read of it. ``alone``: what a grouped
    estimator gives the response of a group of one (``rollout.n=1``): ``score`` (baseline 0, as verl:
    its own score), ``zero`` (no advantage: nothing is learned) or ``error`` (it cannot run)."""

    name: str
    fn: Callable[[AdvantageInputs, object], tuple[torch.Tensor, torch.Tensor]]
    needs_critic: bool
    grouped: bool
    needs_greedy_baseline: bool = False
    alone: str = "score"
    needs_sum_pi_squared: bool = False
    needs_reward_components: bool = False


ADV_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_est(
    name: str,
    needs_critic: bool = False,
    grouped: bool = False,
    needs_greedy_baseline: bool = False,
    alone: str = "score",
    needs_sum_pi_squared: bool = False,
    needs_reward_components: bool = False,
):
    if alone not in ("score", "zero", "error"):
        raise ValueError(f"advantage estimator '{name}': alone={alone!r} is none of score, zero, error")
    return ADV_ESTIMATORS.decorator(
        name,
        lambda fn: Estimator(
            name, fn, needs_critic, grouped, needs_greedy_baseline, alone, needs_sum_pi_squared, needs_reward_components
        ),
    )


def compute_advantages(cfg, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of ``cfg.adv_estimator`` (``cfg``: the ``algorithm`` section)."""
    return ADV_ESTIMATORS[cfg.adv_estimator].fn(x, cfg)


# ----------------------------------------------------------------------------- the math
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, backwards over the response.

    Args: token_rewards, values, response_mask: (B, T).
    Returns: (advantages, returns), both (B, T), zero where the mask is 0.

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next, where V_next and
    A_next only advance at valid positions, so a masked position (padding, or a tool-output span in
    the middle of a response) neither contributes nor breaks the chain. returns = A + V.
    Differs from verl: the advantages are NOT whitened here (verl whitens inside); the registered
    ``gae`` whitens over the global batch, which a per-rank function cannot see.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advs = []
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = values[:, t] * m + (1 - m) * next_value
        next_adv = adv_t * m + (1 - m) * next_adv
        advs.append(adv_t)
    advantages = torch.stack(advs[::-1], dim=1)
    returns = advantages + values
    return advantages * mask, returns * mask


def group_ids(index, all_reduce: AllReduce = None, num_groups: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """(ids (B,) in 0..G-1, G): ``index`` as dense group ids. Across ranks (``all_reduce``) the ids
    must already be ``0..num_groups-1`` with the same meaning on every rank; locally any ids work."""
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if num_groups is None:
        if all_reduce is not None:
            raise ValueError("group statistics across ranks need num_groups (ids 0..num_groups-1 on every rank)")
        dense: dict = {}
        keys = [dense.setdefault(k, len(dense)) for k in keys]
        num_groups = len(dense)
    return torch.tensor(keys, dtype=torch.long), num_groups


def group_table(
    values: torch.Tensor, index, all_reduce: AllReduce = None, num_groups: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-group sums (G, k) over all ranks, float64; ids (B,)) of ``values`` (B, k)."""
    ids, g = group_ids(index, all_reduce, num_groups)
    sums = torch.zeros(g, values.shape[-1], dtype=torch.float64)
    sums.index_add_(0, ids, values.double())
    return sum_over_ranks(sums, all_reduce), ids


def group_sums(
    values: torch.Tensor, index, all_reduce: AllReduce = None, num_groups: Optional[int] = None
) -> torch.Tensor:
    """Per-row sums over the row's group (all ranks with ``all_reduce``) of ``values`` (B, k):
    (B, k) in float64. Ids as ``group_ids``."""
    sums, ids = group_table(values, index, all_reduce, num_groups)
    return sums[ids]


def group_stats(
    scores: torch.Tensor, index, all_reduce: AllReduce = None, num_groups: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, unbiased group std, group size) over rows sharing an index; (B,) each.

    ``index`` (B,): group id per row. Locally any ids work. With ``all_reduce`` the groups span
    ranks (a prompt's responses may sit on different ranks): ids must then be ``0..num_groups-1``
    with the same meaning on every rank (the prompt's position in the step), and the per-group
    sums are all-reduced in float64. A group of one response has nothing to compare with: mean 0,
    std 1 (as the reference does)."""
    s = scores.double()
    total, total_sq, count = group_sums(
        torch.stack([s, s * s, torch.ones_like(s)], dim=-1), index, all_reduce, num_groups
    ).unbind(-1)
    many = count > 1
    mean = torch.where(many, total / count, torch.zeros_like(total))
    var = (total_sq - total * total / count) / (count - 1).clamp_min(1)
    std = torch.where(many, var.clamp_min(0).sqrt(), torch.ones_like(var))
    return mean.to(scores.dtype), std.to(scores.dtype), count.to(scores.dtype)


def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
    var_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps), broadcast over the response.

    Args: token_rewards, response_mask (B, T); index: group id per row (B,) (responses to the same
    prompt share one). score = sum of the row's token rewards. ``norm_by_std=False`` is Dr. GRPO.
    Groups spanning ranks: ``all_reduce`` and ``num_groups`` as in ``group_stats``. ``var_floor``:
    the group variance is taken as at least this (0: none, as verl 0.9.1's ``grpo`` and
    ``grpo_vectorized``; verl before 0.9.1 floored the vectorized one's at 1e-6). Returns
    (advantages, returns), both (B, T), equal, zero where masked.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, std, n = group_stats(scores, index, all_reduce, num_groups)
    if var_floor > 0:
        std = torch.where(n > 1, std.clamp_min(var_floor**0.5), std)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    out = adv.unsqueeze(-1) * mask
    return out, out


def rloo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
    singleton_keeps_score: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* responses of its group, n/(n-1) (score - mean).

    Shapes as ``grpo_advantages``; a group of one keeps its score (verl's ``rloo``), or gets 0 with
    ``singleton_keeps_score=False`` (verl's ``rloo_vectorized``).
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, _, n = group_stats(scores, index, all_reduce, num_groups)
    alone = scores if singleton_keeps_score else torch.zeros_like(scores)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp_min(1), alone)
    out = adv.unsqueeze(-1) * mask
    return out, out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, all_reduce: AllReduce = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over the valid tokens, whitened over the batch (global
    with ``all_reduce``). A masked position inside a response (a tool's or a user's turn) carries the
    return through unchanged, undiscounted, and adds no reward, as verl 0.9.1 (earlier verl reset
    it there, so a multi-turn response's first turns saw none of the final reward). Returns
    (advantages, returns), (B, T), zero where masked."""
    mask = response_mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        step = (token_rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = step
        running = step + running * (1 - mask[:, t])
    adv = masked_whiten(returns, mask, all_reduce=all_reduce) * mask
    return adv, returns


def reinforce_pp_baseline_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a baseline: (score - group mean) broadcast over the response, then
    whitened over the batch. Shapes as ``grpo_advantages``."""
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, _, _ = group_stats(scores, index, all_reduce if num_groups is not None else None, num_groups)
    centred = (scores - mean).unsqueeze(-1) * mask
    adv = masked_whiten(centred, mask, all_reduce=all_reduce) * mask
    return adv, adv


def gpg_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    f_norm: float = 1.0,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, verl's ``gpg``): alpha (score - group mean) / f_norm, broadcast over the
    response, where alpha = rows / rows with a non-zero score over the whole batch (all ranks with
    ``all_reduce``): a batch where few responses score is scaled up. A group of one: mean 0.
    Shapes as ``grpo_advantages``."""
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)
    mean, _, _ = group_stats(scores, index, all_reduce, num_groups)
    counts = sum_over_ranks(
        torch.tensor([float(scores.numel()), float(torch.count_nonzero(scores))], dtype=torch.float64), all_reduce
    )
    alpha = (counts[0] / counts[1].clamp_min(1)).to(scores.dtype)
    out = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * mask
    return out, out


def grpo_passk_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    all_reduce: AllReduce = None,
    all_reduce_max: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025, arXiv 2503.19595; verl's ``grpo_passk``): only the best response
    of a group gets an advantage, (best score - second best score), divided by (group std + eps)
    with ``norm_by_std``; every other row gets 0 (so does a tied best: the gap is then 0).

    Shapes as ``grpo_advantages``. Every group needs at least 2 responses (ValueError otherwise, on
    every rank alike). Groups spanning ranks: ``all_reduce`` (sums) and ``all_reduce_max`` (the
    group maxima), ids as in ``group_stats``."""
    if all_reduce is not None and all_reduce_max is None:
        raise ValueError("grpo_passk across ranks needs all_reduce_max (the group maxima are global)")
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)
    s = scores.double()
    ids, g = group_ids(index, all_reduce, num_groups)
    count = sum_over_ranks(torch.zeros(g, dtype=torch.float64).index_add_(0, ids, torch.ones_like(s)), all_reduce)
    if bool(((count > 0) & (count < 2)).any()):
        raise ValueError(
            f"grpo_passk (Pass@k) needs at least 2 responses per prompt; "
            f"{int(((count > 0) & (count < 2)).sum())} prompt(s) have 1"
        )

    def group_max(v: torch.Tensor) -> torch.Tensor:
        local = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, ids, v, "amax")
        return sum_over_ranks(local, all_reduce_max)  # (the max over ranks; None: this process)

    best = group_max(s)
    at_best = s == best[ids]
    ties = sum_over_ranks(torch.zeros(g, dtype=torch.float64).index_add_(0, ids, at_best.double()), all_reduce)
    second = torch.where(ties >= 2, best, group_max(torch.where(at_best, -torch.inf, s)))
    gap = torch.where(at_best & (ties[ids] == 1), best[ids] - second[ids], torch.zeros_like(s)).to(scores.dtype)
    if norm_by_std:
        _, std, _ = group_stats(scores, index, all_reduce, num_groups)
        gap = gap / (std + eps)
    out = gap.unsqueeze(-1) * mask
    return out, out


def opo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv 2505.23585; verl's ``opo``): score minus the length-weighted
    mean score of its group, sum(len * score) / sum(len) (len: the row's valid response tokens);
    a group of one has baseline 0. Shapes and ranks as ``grpo_advantages``."""
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)
    lengths = response_mask.sum(-1).double()
    s = scores.double()
    weighted, total_len, n = group_sums(
        torch.stack([lengths * s, lengths, torch.ones_like(s)], dim=-1), index, all_reduce, num_groups
    ).unbind(-1)
    baseline = torch.where(n > 1, weighted / total_len, torch.zeros_like(s))
    out = (scores - baseline.to(scores.dtype)).unsqueeze(-1) * mask
    return out, out


def remax_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505; verl's ``remax``): the reward-to-go of each token
    minus the score of the greedy response to the same prompt.

    Args: token_rewards, response_mask (B, T); reward_baselines (B,): each row's prompt's greedy
    response score. Returns (advantages, returns), (B, T): returns = reverse cumulative sum of the
    masked rewards, advantages = returns - baseline. Per row: nothing global. Zero where masked
    (verl leaves the reward-to-go at a masked position inside a response; no loss reads it)."""
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - reward_baselines.to(token_rewards.dtype).unsqueeze(-1) * mask
    return advantages, returns


def optimal_token_baseline_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
    handle_zero_tail: bool = False,
    by_valid_token: bool = False,
    eps: float = 1e-8,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (verl's ``optimal_token_baseline``; ``by_valid_token=True`` with
    ``handle_zero_tail=True`` is its ``tir_optimal_token_baseline``): a baseline per token position
    and group, B_t = sum_i G_t W_t / (sum_i W_t + eps) over the group's responses valid at t, where
    G_t is the reward-to-go and W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2_j) (times the rollout IS
    weight squared, when given) the cumulative path-variance proxy; advantages G_t - B_t.

    Args: token_rewards, response_mask, old_log_probs (log pi of the sampled token),
    sum_pi_squared (sum over the vocabulary of pi^2), rollout_is_weights: (B, T); index (B,).
    ``by_valid_token``: position t is a token's ordinal among its row's valid tokens (a multi-turn
    response's tool outputs, masked, do not shift its turns against the other responses') and
    rows without a valid token are not in their group. ``handle_zero_tail``: where one response of
    a group is strictly the longest, its tokens past the second longest get baseline 0. A group of
    one: baseline 0. Groups spanning ranks: ``all_reduce`` and ``num_groups`` as ``group_stats``.
    Returns (advantages, returns), (B, T), zero where masked (verl leaves the reward-to-go at a
    masked position inside a response; no loss reads it)."""
    mask = response_mask.to(token_rewards.dtype)
    B, T = mask.shape
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    cum_w = (w * mask).cumsum(-1)
    lengths = mask.sum(-1).long()
    ids, g = group_ids(index, all_reduce, num_groups)
    pos = (mask.cumsum(-1) - 1).clamp_min(0).long() if by_valid_token else torch.arange(T).expand(B, T)
    member = lengths > 0 if by_valid_token else torch.ones(B, dtype=torch.bool)
    valid = mask > 0
    rows = ids[:, None].expand(B, T)
    # per (group, position): sum G W, sum W; per (group, length): responses (one all-reduce)
    sums = torch.zeros(g, T, 2, dtype=torch.float64)
    sums.index_put_(
        (rows[valid], pos[valid]), torch.stack([(returns * cum_w)[valid], cum_w[valid]], -1).double(), accumulate=True
    )
    hist = torch.zeros(g, T + 1, dtype=torch.float64)
    hist.index_put_((ids[member], lengths[member]), torch.ones(int(member.sum()), dtype=torch.float64), accumulate=True)
    both = sum_over_ranks(torch.cat([sums.flatten(), hist.flatten()]), all_reduce)
    sums, hist = both[: g * T * 2].view(g, T, 2), both[g * T * 2 :].view(g, T + 1)
    size = hist.sum(-1)
    baseline = sums[rows, pos, 0] / (sums[rows, pos, 1] + eps)
    baseline = torch.where((size[ids] >= 2)[:, None] & member[:, None], baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        at = torch.arange(T + 1, dtype=torch.float64)
        present = hist > 0
        longest = (present * at).amax(-1)  # (G,) the longest response's length, and how many have it
        n_longest = hist.gather(1, longest.long()[:, None]).squeeze(1)
        second = ((present & (at < longest[:, None])) * at).amax(-1)
        alone = (size[ids] >= 2) & (n_longest[ids] == 1) & (lengths == longest[ids].long()) & member
        tail = alone[:, None] & (pos >= second[ids].long()[:, None])
        baseline = torch.where(tail, torch.zeros_like(baseline), baseline)
    advantages = (returns - baseline.to(returns.dtype)) * mask
    return advantages, returns * mask


# ------------------------------------------------------------------------------ the registry
@register_adv_est("gae", needs_critic=True)
def gae(x: AdvantageInputs, cfg):
    adv, ret = gae_advantages(x.token_rewards, x.values, x.response_mask, cfg.gamma, cfg.lam)
    # whitened over the global batch (the reference whitens inside its GAE)
    return masked_whiten(adv, x.response_mask, all_reduce=x.all_reduce) * x.response_mask, ret


@register_adv_est("grpo", grouped=True)
def grpo(x: AdvantageInputs, cfg):
    return grpo_advantages(
        x.token_rewards, x.response_mask, x.index, norm_by_std=cfg.norm_adv_by_std_in_grpo, **x.groups
    )


@register_adv_est("rloo", grouped=True)
def rloo(x: AdvantageInputs, cfg):
    return rloo_advantages(x.token_rewards, x.response_mask, x.index, **x.groups)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(x: AdvantageInputs, cfg):
    return reinforce_pp_advantages(x.token_rewards, x.response_mask, cfg.gamma, all_reduce=x.all_reduce)


@register_adv_est("reinforce_plus_plus_baseline", grouped=True)
def reinforce_plus_plus_baseline(x: AdvantageInputs, cfg):
    return reinforce_pp_baseline_advantages(x.token_rewards, x.response_mask, x.index, **x.groups)


@register_adv_est("gpg", grouped=True)
def gpg(x: AdvantageInputs, cfg):
    return gpg_advantages(x.token_rewards, x.response_mask, x.index, **x.groups)


# verl's vectorized implementations: the same maths, and verl's edge cases (rloo_vectorized: a group
# of one gets 0; grpo_vectorized: no variance floor in 0.9.1, as grpo)
@register_adv_est("grpo_vectorized", grouped=True)
def grpo_vectorized(x: AdvantageInputs, cfg):
    return grpo_advantages(
        x.token_rewards, x.response_mask, x.index, norm_by_std=cfg.norm_adv_by_std_in_grpo, **x.groups
    )


@register_adv_est("rloo_vectorized", grouped=True, alone="zero")
def rloo_vectorized(x: AdvantageInputs, cfg):
    return rloo_advantages(x.token_rewards, x.response_mask, x.index, singleton_keeps_score=False, **x.groups)


@register_adv_est("grpo_passk", grouped=True, alone="error")
def grpo_passk(x: AdvantageInputs, cfg):
    return grpo_passk_advantages(
        x.token_rewards,
        x.response_mask,
        x.index,
        norm_by_std=cfg.norm_adv_by_std_in_grpo,
        all_reduce_max=x.all_reduce_max,
        **x.groups,
    )


@register_adv_est("opo", grouped=True)
def opo(x: AdvantageInputs, cfg):
    return opo_advantages(x.token_rewards, x.response_mask, x.index, **x.groups)


@register_adv_est("remax", needs_greedy_baseline=True)
def remax(x: AdvantageInputs, cfg):
    if x.reward_baselines is None:
        raise ValueError(
            "algorithm.adv_estimator=remax needs reward_baselines: the score of one greedy response "
            "per prompt (the trainer generates them for an estimator with needs_greedy_baseline)"
        )
    return remax_advantages(x.token_rewards, x.response_mask, x.reward_baselines)


def _otb_inputs(x: AdvantageInputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.sum_pi_squared is None or x.old_log_probs is None:
        raise ValueError(
            f"algorithm.adv_estimator={name} needs old_log_probs and sum_pi_squared from the actor's "
            f"old-log-prob pass: set actor_rollout_ref.actor.calculate_sum_pi_squared=true (and no "
            f"algorithm.rollout_correction.bypass_mode)"
        )
    return x.old_log_probs, x.sum_pi_squared


# verl's Optimal Token Baseline: a baseline per token position, weighted by the path-variance proxy
# that the actor's sum pi^2 gives (and the rollout correction's IS weights, squared, where there are any);
# the strictly longest response's tail past the second longest gets no baseline (verl 0.9.1's default,
# which its trainer never changes)
@register_adv_est("optimal_token_baseline", grouped=True, needs_sum_pi_squared=True)
def optimal_token_baseline(x: AdvantageInputs, cfg):
    lp, spi2 = _otb_inputs(x, "optimal_token_baseline")
    return optimal_token_baseline_advantages(
        x.token_rewards, x.response_mask, x.index, lp, spi2, x.rollout_is_weights, handle_zero_tail=True, **x.groups
    )


@register_adv_est("tir_optimal_token_baseline", grouped=True, needs_sum_pi_squared=True)
def tir_optimal_token_baseline(x: AdvantageInputs, cfg):
    lp, spi2 = _otb_inputs(x, "tir_optimal_token_baseline")
    return optimal_token_baseline_advantages(
        x.token_rewards,
        x.response_mask,
        x.index,
        lp,
        spi2,
        x.rollout_is_weights,
        handle_zero_tail=True,
        by_valid_token=True,
        **x.groups,
    )


def gdpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    components: Optional[torch.Tensor] = None,
    weights: Optional[list[float]] = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    all_reduce: AllReduce = None,
    num_groups: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242; verl's ``gdpo``): each reward component normalised within its group apart
    (GRPO's (r - mean) / (std + eps)), the results summed with ``weights`` (1 each by default), then
    whitened over the batch (global with ``all_reduce``). ``components`` (B, K): the reward function's
    values of ``algorithm.gdpo_reward_keys`` per row; None: the score alone (verl's fallback). Returns
    (advantages, returns), (B, T), equal, zero where masked."""
    mask = response_mask.to(token_rewards.dtype)
    columns = (
        [token_rewards]
        if components is None
        else [components[:, k : k + 1].to(token_rewards.dtype) for k in range(components.shape[1])]
    )
    weights = list(weights) if weights is not None else [1.0] * len(columns)
    if len(weights) != len(columns):
        raise ValueError(f"gdpo: {len(weights)} weights for {len(columns)} reward components")
    total = torch.zeros_like(mask)
    for w, column in zip(weights, columns):
        total = total + w * grpo_advantages(column, mask, index, norm_by_std, eps, all_reduce, num_groups)[0]
    adv = masked_whiten(total, mask, all_reduce=all_reduce) * mask
    return adv, adv


@register_adv_est("gdpo", grouped=True, needs_reward_components=True)
def gdpo(x: AdvantageInputs, cfg):
    return gdpo_advantages(
        x.token_rewards,
        x.response_mask,
        x.index,
        x.reward_components,
        cfg.gdpo_reward_weights,
        norm_by_std=cfg.norm_adv_by_std_in_grpo,
        **x.groups,
    )
