"""Advantage estimators: the registry of ``algorithm.adv_estimator``.

An estimator is one decorated function (verl's ``register_adv_est``)::

    @register_adv_est("name", needs_critic=False, grouped=True)
    def name(x: AdvantageInputs, cfg) -> tuple[advantages, returns]: ...

``x`` holds the step's per-rank tensors and the all-reduce that makes statistics global; ``cfg`` is
``algorithm`` (gamma, lam, norm_adv_by_std_in_grpo, ...); both outputs are ``(B, T)``, zero where
the response mask is 0. What the entry declares is read by the other layers: ``needs_critic``
(``critic.enable`` defaults to it, and values are computed), ``grouped`` (it compares the responses
to one prompt: ``rollout.n >= 2`` is required). An unknown name raises with the registry's names.

Groups span ranks: ``x.index`` is each row's prompt position in the step, ``0..num_groups-1`` on
every rank, and group sums are all-reduced (``group_stats``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf_hpc.config.registry import Registry
from rlhf_hpc.ops.algos import AllReduce, masked_whiten, sum_over_ranks

__all__ = ["ADV_ESTIMATORS", "AdvantageInputs", "Estimator", "compute_advantages",
           "gae_advantages", "gpg_advantages", "group_stats", "grpo_advantages", "register_adv_est",
           "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_advantages"]


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's rows on this rank: ``token_rewards``, ``response_mask`` (float), ``values`` (the
    critic's, or None) (B, T); ``index`` (B,) group ids, ``num_groups`` of them over all ranks;
    ``all_reduce`` sums over ranks (None: this process only)."""
    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: torch.Tensor
    num_groups: Optional[int] = None
    values: Optional[torch.Tensor] = None
    all_reduce: AllReduce = None

    @property
    def groups(self) -> dict:
        return dict(all_reduce=self.all_reduce, num_groups=self.num_groups)


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[[AdvantageInputs, object], tuple[torch.Tensor, torch.Tensor]]
    needs_critic: bool
    grouped: bool


ADV_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_est(name: str, needs_critic: bool = False, grouped: bool = False):
    return ADV_ESTIMATORS.decorator(name, lambda fn: Estimator(name, fn, needs_critic, grouped))


def compute_advantages(cfg, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of ``cfg.adv_estimator`` (``cfg``: the ``algorithm`` section)."""
    return ADV_ESTIMATORS[cfg.adv_estimator].fn(x, cfg)


# ----------------------------------------------------------------------------- the math
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
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


def group_stats(scores: torch.Tensor, index, all_reduce: AllReduce = None, num_groups: Optional[int] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, unbiased group std, group size) over rows sharing an index; (B,) each.

    ``index`` (B,): group id per row. Locally any ids work. With ``all_reduce`` the groups span
    ranks (a prompt's responses may sit on different ranks): ids must then be ``0..num_groups-1``
    with the same meaning on every rank (the prompt's position in the step), and the per-group
    sums are all-reduced in float64. A group of one response has nothing to compare with: mean 0,
    std 1 (as the reference does)."""
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if num_groups is None:
        if all_reduce is not None:
            raise ValueError("group_stats across ranks needs num_groups (ids 0..num_groups-1 on every rank)")
        dense: dict = {}
        keys = [dense.setdefault(k, len(dense)) for k in keys]
        num_groups = len(dense)
    ids = torch.tensor(keys, dtype=torch.long)
    s = scores.double()
    sums = torch.zeros(num_groups, 3, dtype=torch.float64)
    sums.index_add_(0, ids, torch.stack([s, s * s, torch.ones_like(s)], dim=-1))
    sums = sum_over_ranks(sums, all_reduce)
    total, total_sq, count = sums[ids, 0], sums[ids, 1], sums[ids, 2]
    many = count > 1
    mean = torch.where(many, total / count, torch.zeros_like(total))
    var = (total_sq - total * total / count) / (count - 1).clamp_min(1)
    std = torch.where(many, var.clamp_min(0).sqrt(), torch.ones_like(var))
    return mean.to(scores.dtype), std.to(scores.dtype), count.to(scores.dtype)


def grpo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                    norm_by_std: bool = True, eps: float = 1e-6, all_reduce: AllReduce = None,
                    num_groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps), broadcast over the response.

    Args: token_rewards, response_mask (B, T); index: group id per row (B,) (responses to the same
    prompt share one). score = sum of the row's token rewards. ``norm_by_std=False`` is Dr. GRPO.
    Groups spanning ranks: ``all_reduce`` and ``num_groups`` as in ``group_stats``. Returns (advantages, returns), both (B, T), equal, zero where masked.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, std, _ = group_stats(scores, index, all_reduce, num_groups)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    out = adv.unsqueeze(-1) * mask
    return out, out


def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                    all_reduce: AllReduce = None, num_groups: Optional[int] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* responses of its group, n/(n-1) (score - mean).

    Shapes as ``grpo_advantages``; a group of one keeps its score.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, _, n = group_stats(scores, index, all_reduce, num_groups)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp_min(1), scores)
    out = adv.unsqueeze(-1) * mask
    return out, out


def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
                            all_reduce: AllReduce = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token (reset at masked positions), whitened over
    the batch (global with ``all_reduce``). Returns (advantages, returns), (B, T)."""
    mask = response_mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    adv = masked_whiten(returns, mask, all_reduce=all_reduce) * mask
    return adv, returns * mask


def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                     all_reduce: AllReduce = None, num_groups: Optional[int] = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a baseline: (score - group mean) broadcast over the response, then
    whitened over the batch. Shapes as ``grpo_advantages``."""
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)  # as verl: a row rejected by rollout_rs still counts in its group
    mean, _, _ = group_stats(scores, index, all_reduce if num_groups is not None else None, num_groups)
    centred = (scores - mean).unsqueeze(-1) * mask
    adv = masked_whiten(centred, mask, all_reduce=all_reduce) * mask
    return adv, adv


def gpg_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, index, f_norm: float = 1.0,
                   all_reduce: AllReduce = None, num_groups: Optional[int] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, verl's ``gpg``): alpha (score - group mean) / f_norm, broadcast over the
    response, where alpha = rows / rows with a non-zero score over the whole batch (all ranks with
    ``all_reduce``): a batch where few responses score is scaled up. A group of one: mean 0.
    Shapes as ``grpo_advantages``."""
    mask = response_mask.to(token_rewards.dtype)
    scores = token_rewards.sum(-1)
    mean, _, _ = group_stats(scores, index, all_reduce, num_groups)
    counts = sum_over_ranks(torch.tensor([float(scores.numel()), float(torch.count_nonzero(scores))],
                                  dtype=torch.float64), all_reduce)
    alpha = (counts[0] / counts[1].clamp_min(1)).to(scores.dtype)
    out = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * mask
    return out, out


# ------------------------------------------------------------------------------ the registry
@register_adv_est("gae", needs_critic=True)
def gae(x: AdvantageInputs, cfg):
    adv, ret = gae_advantages(x.token_rewards, x.values, x.response_mask, cfg.gamma, cfg.lam)
    # whitened over the global batch (the reference whitens inside its GAE)
    return masked_whiten(adv, x.response_mask, all_reduce=x.all_reduce) * x.response_mask, ret


@register_adv_est("grpo", grouped=True)
def grpo(x: AdvantageInputs, cfg):
    return grpo_advantages(x.token_rewards, x.response_mask, x.index, norm_by_std=cfg.norm_adv_by_std_in_grpo,
                           **x.groups)


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
