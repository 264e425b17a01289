"""Policy-gradient losses: the registry of ``actor_rollout_ref.actor.policy_loss.loss_mode``.

A loss is one decorated function (verl's ``register_policy_loss``)::

    @register_policy_loss("name")
    def name(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
        ...
        return loss, metrics

All tensors ``(B, T)``; ``cfg`` is the actor's config section (its clip ratios, ``loss_agg_mode``,
``policy_loss``); ``is_weights`` the rollout correction's detached importance weights (or None);
``agg_kwargs`` the global batch counts for ``algos.agg_loss`` (pass them on, so the loss does not
depend on how the mini-batch was split). ``metrics`` are per-token means, logged as
``actor/<name>``. An unknown name raises with the registry's names.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from rlhf_hpc.config.registry import Registry
from rlhf_hpc.ops.algos import agg_loss, masked_mean

__all__ = ["POLICY_LOSSES", "PolicyLossFn", "ppo_clip_loss", "register_policy_loss", "reinforce_loss"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")
register_policy_loss = POLICY_LOSSES.decorator


# ------------------------------------------------------------------------------------ the math
def ppo_clip_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                  is_weights: Optional[torch.Tensor] = None, **agg_kwargs) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with dual clip. All inputs (B, T).

    ratio = exp(clamp(lp - old, -20, 20)); L = max(-A ratio, -A clip(ratio, 1 - low, 1 + high));
    for A < 0 additionally min(L, -A clip_ratio_c) (dual clip: bounds the loss of a token whose
    ratio exploded while its advantage is negative). ``is_weights`` (B, T), detached: the rollout
    correction's importance weights, multiplying each token's loss after the clip.
    ``agg_kwargs`` go to ``agg_loss``.
    Returns (loss, metrics): ``pg_clipfrac`` (share of tokens where the clip was active),
    ``pg_clipfrac_lower`` (share where the dual clip was active), ``ppo_kl`` (mean old - lp).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (got {clip_ratio_c}): it is the dual-clip bound "
                         f"on the ratio of negative-advantage tokens")
    mask = response_mask.to(logprob.dtype)
    neg_approx_kl = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    pg_losses = torch.where(advantages < 0, dual, clipped)
    if is_weights is not None:  # rollout correction (truncated IS), after the clip as verl
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask),
            "pg_clipfrac_lower": masked_mean((torch.gt(clipped, loss3) & (advantages < 0)).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-neg_approx_kl, mask),
        }
    return loss, metrics


def reinforce_loss(rollout_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                   is_weights: Optional[torch.Tensor] = None, **agg_kwargs) -> tuple[torch.Tensor, dict]:
    """verl's bypass-mode REINFORCE loss (``rollout_correction.loss_type: reinforce``): per token
    -A * log pi * w, no ratio and no clip; ``w`` the detached IS weights, or 1. All inputs (B, T).
    Returns (loss, metrics): ``ppo_kl`` (mean rollout - current log-prob, as verl reports it)."""
    weighted = logprob if is_weights is None else logprob * is_weights
    loss = agg_loss(-advantages * weighted, response_mask.to(logprob.dtype), loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(rollout_logprob - logprob, response_mask.to(logprob.dtype))}
    return loss, metrics


# ------------------------------------------------------------------------------ the registry
@register_policy_loss("vanilla")
def vanilla(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """PPO's clipped ratio with dual clip (verl's ``vanilla``)."""
    return ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                         cfg.clip_ratio_c, cfg.loss_agg_mode, is_weights=is_weights, **agg_kwargs)


@register_policy_loss("reinforce")
def reinforce(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """-A log pi w (what ``algorithm.rollout_correction.loss_type=reinforce`` trains in bypass mode)."""
    return reinforce_loss(old_log_prob, log_prob, advantages, response_mask, cfg.loss_agg_mode,
                          is_weights=is_weights, **agg_kwargs)


@register_policy_loss("gpg")
def gpg(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """GPG (Chu et al. 2025, verl's ``gpg``): the plain policy gradient -A log pi (times the rollout
    correction's weights), no ratio, no clip; no metrics, as verl."""
    losses = -log_prob * advantages
    if is_weights is not None:
        losses = losses * is_weights
    return agg_loss(losses, response_mask.to(log_prob.dtype), cfg.loss_agg_mode, **agg_kwargs), {}
