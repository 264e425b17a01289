"""Policy-gradient losses: the registry of ``actor_rollout_ref.actor.policy_loss.loss_mode``.

A loss is one decorated function (verl's ``register_policy_loss``)::

    @register_policy_loss("name", clip=PPO_RATIO, keys=())
    def name(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
        ...
        return loss, metrics

All tensors ``(B, T)``; ``cfg`` is the actor's config section (its clip ratios, ``loss_agg_mode``,
``policy_loss``); ``is_weights`` the rollout correction's detached importance weights (or None);
``agg_kwargs`` the global batch counts for ``algos.agg_loss`` (pass them on, so the loss does not
depend on how the mini-batch was split). ``metrics`` are per-token means, logged as
``actor/<name>``. An unknown name raises with the registry's names.

What the checks read is a field of the entry: ``clip`` says what ``clip_ratio_low`` /
``clip_ratio_high`` bound for this loss (PPO's ratio, GMPO's log-ratio, CISPO's importance weight),
hence which values make sense; ``keys`` are the actor keys (relative to ``actor_rollout_ref.actor``)
that only this loss reads: set away from their default while another loss is selected, they are
refused (they would be ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf_hpc.config.registry import Registry
from rlhf_hpc.ops.algos import agg_loss, masked_mean

__all__ = [
    "DIVERGENCE",
    "IS_WEIGHT",
    "LOG_RATIO",
    "POLICY_LOSSES",
    "PPO_RATIO",
    "ClipRange",
    "PolicyLoss",
    "PolicyLossFn",
    "ppo_clip_loss",
    "register_policy_loss",
    "reinforce_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class ClipRange:
    """What a loss's ``clip_ratio_low`` / ``clip_ratio_high`` bound: ``meaning`` (for messages) and
    ``low_below``, the (exclusive) upper limit of a sensible ``clip_ratio_low`` (None: any value >= 0)."""

    meaning: str
    low_below: Optional[float] = None


PPO_RATIO = ClipRange("PPO's ratio pi/pi_old, clipped to [1 - low, 1 + high]", low_below=1.0)
LOG_RATIO = ClipRange("the log-ratio log(pi/pi_old), clipped to [-low, high]")
IS_WEIGHT = ClipRange(
    "the detached importance weight pi/pi_old, clipped to [1 - low, 1 + high] (low >= 1: no lower bound)"
)
DIVERGENCE = ClipRange(
    "the divergence of pi from pi_old past which a token loses its gradient (dppo_tv: pi - pi_old; "
    "dppo_kl: their binary KL), low for negative advantages, high for positive"
)


@dataclass(frozen=True)
class PolicyLoss:
    """A registry entry: ``fn`` and what the checks read (see the module's docstring). Called as
    the function itself."""

    name: str
    fn: PolicyLossFn
    clip: ClipRange = PPO_RATIO
    keys: tuple[str, ...] = ()
    # the actor config's problems for this loss, one line each (run at the dry run)
    check: Optional[Callable[[object], list[str]]] = None
    bypass_only: bool = False  # the loss of algorithm.rollout_correction.bypass_mode=true: refused without it

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, dict]:
        return self.fn(*args, **kwargs)


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")


def register_policy_loss(
    name: str,
    clip: ClipRange = PPO_RATIO,
    keys: tuple[str, ...] = (),
    check: Optional[Callable[[object], list[str]]] = None,
    bypass_only: bool = False,
):
    """``@register_policy_loss(name)``: registers the function as ``PolicyLoss(name, fn, clip, keys, check)``.
    ``clip``: what its clip ratios bound (PPO_RATIO also for a loss that reads none: the range
    checks stay PPO's); ``keys``: the actor keys only this loss reads; ``check``: the actor
    config's problems for this loss; ``bypass_only``: refused without rollout correction's bypass mode."""
    return POLICY_LOSSES.decorator(name, lambda fn: PolicyLoss(name, fn, clip, tuple(keys), check, bypass_only))


# ------------------------------------------------------------------------------------ the math
def ppo_clip_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[torch.Tensor] = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict]:
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
        raise ValueError(
            f"clip_ratio_c must be > 1.0 (got {clip_ratio_c}): it is the dual-clip bound "
            f"on the ratio of negative-advantage tokens"
        )
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


def reinforce_loss(
    rollout_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[torch.Tensor] = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict]:
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
    return ppo_clip_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cfg.clip_ratio_low,
        cfg.clip_ratio_high,
        cfg.clip_ratio_c,
        cfg.loss_agg_mode,
        is_weights=is_weights,
        **agg_kwargs,
    )


@register_policy_loss("reinforce")
def reinforce(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """-A log pi w (what ``algorithm.rollout_correction.loss_type=reinforce`` trains in bypass mode)."""
    return reinforce_loss(
        old_log_prob, log_prob, advantages, response_mask, cfg.loss_agg_mode, is_weights=is_weights, **agg_kwargs
    )


@register_policy_loss("gpg")
def gpg(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """GPG (Chu et al. 2025, verl's ``gpg``): the plain policy gradient -A log pi (times the rollout
    correction's weights), no ratio, no clip; no metrics, as verl."""
    losses = -log_prob * advantages
    if is_weights is not None:
        losses = losses * is_weights
    return agg_loss(losses, response_mask.to(log_prob.dtype), cfg.loss_agg_mode, **agg_kwargs), {}


def _global_rows(agg_kwargs: dict, rows: int) -> float:
    """The rows (sequences) of the whole mini-batch: ``global_seqs`` where given, else this tensor's."""
    seqs = agg_kwargs.get("global_seqs")
    return seqs if seqs is not None else max(rows, 1)


@register_policy_loss("gspo")
def gspo(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071; verl's ``gspo``): PPO's clip on the sequence-level
    ratio s_i = exp(mean_t(lp - old)) (the length-normalised log-ratio, clamped at 10 in log space),
    written per token as sg[s_i] * pi / sg[pi] so each token's gradient is s_i's. The IS weights
    multiply each token's loss after the clip. Aggregated by ``loss_agg_mode`` with the global
    counts, as verl 0.9.1 (the paper's, and verl's GSPO recipes', is ``seq-mean-token-mean``; before
    0.9.1 verl always used it). Metrics: ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower`` (0, as verl)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # per row, over its valid tokens
    log_seq_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    seq_ratio = torch.exp(log_seq_ratio)
    loss1 = -advantages * seq_ratio
    loss2 = -advantages * torch.clamp(seq_ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(loss1, loss2)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
        }
    return loss, metrics


@register_policy_loss("sapo", keys=("tau_pos", "tau_neg"))
def sapo(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """SAPO (arXiv 2511.20347; verl's ``sapo``): no clip; each token's ratio r (log-ratio clamped to
    [-20, 20]) passes through the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau =
    ``actor.tau_pos`` where A > 0, else ``actor.tau_neg``; loss -f(r) A, times the IS weights.
    Aggregated as ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says, as verl, with the global
    counts. Metrics: ``ppo_kl``, and ``pg_clipfrac`` / ``pg_clipfrac_lower`` (0, as verl)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(cfg.tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(cfg.tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gate * advantages
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, "seq-mean-token-mean", **agg_kwargs)
    with torch.no_grad():
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        metrics = {"pg_clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, mask), "pg_clipfrac_lower": zero.clone()}
    return loss, metrics


@register_policy_loss(
    "clip_cov", keys=("policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub")
)
def clip_cov(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617; verl's ``clip_cov``): PPO's clipped ratio (no
    dual clip, no clamp of the log-ratio, as verl), where in addition a random share of the tokens
    the clip left alone whose covariance (A - mean A)(lp - mean lp) lies in (``clip_cov_lb``,
    ``clip_cov_ub``) lose their gradient (their loss is zeroed): ``max(1, int(clip_cov_ratio x
    valid tokens))`` of them. The means, the count and the selection are over the micro-batch this
    function gets (as verl: per micro-batch, drawn with torch's global generator), so the loss is
    not split-invariant; the aggregation is ``loss_agg_mode`` with the global counts. IS weights
    multiply each token's loss. Metrics: ``pg_clipfrac`` (share of zeroed tokens, as verl), ``ppo_kl``."""
    pl = cfg.policy_loss
    if pl.clip_cov_ratio <= 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0 (got {pl.clip_cov_ratio})")
    mask = response_mask.to(log_prob.dtype)
    valid = response_mask > 0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    with torch.no_grad():
        lp = log_prob.detach()
        cov = (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))
        candidates = valid & ~(loss2 > loss1) & (cov > pl.clip_cov_lb) & (cov < pl.clip_cov_ub)
        where = torch.nonzero(candidates)  # (n, 2), row-major
        keep = torch.ones_like(advantages)
        if len(where) > 0:
            n_clip = max(int(pl.clip_cov_ratio * mask.sum().item()), 1)
            chosen = where[torch.randperm(len(where))[:n_clip].to(where.device)]
            keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = torch.maximum(loss1, loss2) * keep
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((keep == 0).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


@register_policy_loss("kl_cov", keys=("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"))
def kl_cov(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617; verl's ``kl_cov``): the unclipped surrogate -A r,
    plus ``ppo_kl_coef`` |lp - old| on the ``max(1, int(kl_cov_ratio x valid tokens))`` valid tokens
    of largest covariance (A - mean A)(lp - mean lp). The means, the count and the top-k are over
    the micro-batch this function gets (as verl), so the loss is not split-invariant; the
    aggregation is ``loss_agg_mode`` with the global counts. Clip ratios are not read. IS weights
    multiply each token's loss. Metrics: ``ppo_kl`` (the mean |lp - old|, as verl reports it)."""
    pl = cfg.policy_loss
    if pl.kl_cov_ratio <= 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0 (got {pl.kl_cov_ratio})")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    surrogate = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        flat = torch.nonzero(response_mask.reshape(-1) > 0, as_tuple=True)[0]
        penalised = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        if len(flat) > 0:
            adv_v, lp_v = advantages.detach().reshape(-1)[flat], log_prob.detach().reshape(-1)[flat]
            cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
            top = torch.topk(cov, max(1, int(len(cov) * pl.kl_cov_ratio)), largest=True).indices
            penalised[flat[top]] = True
    pg_losses = torch.where(penalised.view_as(advantages), surrogate + pl.ppo_kl_coef * abs_kl, surrogate)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(abs_kl, mask)}
    return loss, metrics


@register_policy_loss("geo_mean", clip=LOG_RATIO)
def geo_mean(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's ``geo_mean``): per sequence, the geometric
    mean of the token ratios, each token's log-ratio clipped to [-``clip_ratio_low``,
    ``clip_ratio_high``] on the side that bounds the objective (sign(A)); loss -mean_t(A) x that
    ratio per sequence, averaged over sequences. ``loss_agg_mode`` is not read (verl takes the mean
    over rows); the mean is over the mini-batch's rows (``global_seqs``), so it is split-invariant
    and equal to verl's on an unsplit batch. IS weights enter as each sequence's geometric mean
    (verl's). Metrics: ``pg_clipfrac`` (clipped tokens with A > 0), ``pg_clipfrac_lower`` (A < 0),
    ``ppo_kl``."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # not clamped, as verl
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((log_ratio_min * mask).sum(dim=-1) / lengths)
    seq_adv = (advantages * mask).sum(dim=-1) / lengths  # sequence-level advantages assumed, as verl
    pg_losses = -seq_adv * seq_ratio
    if is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    loss = pg_losses.sum() / _global_rows(agg_kwargs, pg_losses.shape[0])
    with torch.no_grad():
        clipped = torch.ne(log_ratio, clamped)
        metrics = {
            "pg_clipfrac": masked_mean((clipped & (advantages > 0)).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).to(mask.dtype), mask),
        }
    return loss, metrics


@register_policy_loss("cispo", clip=IS_WEIGHT)
def cispo(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """CISPO (MiniMax-M1, arXiv 2506.13585; verl's ``cispo``): -sg[clip(r, 1 - low, 1 + high)] A lp,
    r the token ratio (log-ratio clamped to [-20, 20]): the clip bounds a detached importance
    weight, no token loses its gradient; ``clip_ratio_low`` >= 1 leaves no lower bound (the
    paper's setting). IS weights multiply each token's loss; ``loss_agg_mode`` with the global
    counts. Metrics: ``pg_clipfrac`` (share of clipped weights), ``ppo_kl``, ``pg_clipfrac_lower`` (0,
    as verl)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high).detach()
    pg_losses = -weight * advantages * log_prob
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != weight).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
        }
    return loss, metrics


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights, agg_kwargs, kept_fn):
    """DPPO (arXiv 2602.04879; verl's ``dppo_tv`` / ``dppo_kl``): -A sg[min(r, clip_ratio_c)] lp on the
    tokens ``kept_fn(p, p_old, advantages)`` keeps (a divergence within its bound, or moving away from
    the side the advantage pushes), 0 elsewhere: truncated IS in place of the dual clip. Metrics:
    ``pg_clipfrac`` (share of dropped tokens), ``ppo_kl``, ``pg_clipfrac_lower`` (kept tokens whose
    ratio was truncated), as verl."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=cfg.clip_ratio_c).detach()
    kept = kept_fn(torch.exp(log_prob), torch.exp(old_log_prob), advantages).detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated * log_prob * kept
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(1.0 - kept, mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "pg_clipfrac_lower": masked_mean((ratio > cfg.clip_ratio_c).to(mask.dtype) * kept, mask),
        }
    return loss, metrics


@register_policy_loss("dppo_tv", clip=DIVERGENCE)
def dppo_tv(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """DPPO-Binary-TV: a token with A > 0 keeps its gradient while pi - pi_old <= clip_ratio_high, one
    with A <= 0 while pi - pi_old >= -clip_ratio_low."""

    def kept(p, p_old, adv):
        return torch.where(adv > 0, (p - p_old) <= cfg.clip_ratio_high, (p - p_old) >= -cfg.clip_ratio_low)

    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights, agg_kwargs, kept)


@register_policy_loss("dppo_kl", clip=DIVERGENCE)
def dppo_kl(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """DPPO-Binary-KL: the binary KL between (pi_old, 1 - pi_old) and (pi, 1 - pi) bounds a token's
    move in the advantage's direction (clip_ratio_high for A > 0, clip_ratio_low otherwise); a move
    the other way always keeps its gradient."""

    def kept(p, p_old, adv):
        binary_kl = p_old * (torch.log(p_old) - torch.log(p)) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
        )
        return torch.where(
            adv > 0, (binary_kl <= cfg.clip_ratio_high) | (p <= p_old), (binary_kl <= cfg.clip_ratio_low) | (p >= p_old)
        )

    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights, agg_kwargs, kept)


def _dro_problems(actor) -> list[str]:
    beta = actor.policy_loss.dro_beta
    if beta is None or beta <= 0:
        return [
            f"actor_rollout_ref.actor.policy_loss.dro_beta={beta}: policy_loss.loss_mode=dro needs a positive "
            f"beta, the weight of its quadratic log-ratio penalty (e.g. 0.1)"
        ]
    return []


@register_policy_loss("dro", keys=("policy_loss.dro_beta",), check=_dro_problems)
def dro(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """DRO (verl's ``dro``): -(A lp - beta/2 (lp - lp_old)^2), beta ``policy_loss.dro_beta``; no clip.
    IS weights multiply each token's loss. Metrics: ``ppo_kl``."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * cfg.policy_loss.dro_beta * log_ratio.square())
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("bypass_mode", bypass_only=True)
def bypass_mode(old_log_prob, log_prob, advantages, response_mask, cfg, is_weights=None, **agg_kwargs):
    """verl's name for the loss of ``algorithm.rollout_correction.bypass_mode=true`` (verl's trainer
    sets ``loss_mode`` to it itself): pi_old is the engine's log-probs, and with ``loss_type:
    ppo_clip`` this is PPO's clipped ratio, the IS weights reported but not applied (the ratio is
    already current / engine); ``loss_type: reinforce`` trains ``reinforce`` instead (the actor
    chooses it). Refused without bypass mode at the dry run (rlhf_hpc/recipe/algorithm_checks.py)."""
    return ppo_clip_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cfg.clip_ratio_low,
        cfg.clip_ratio_high,
        cfg.clip_ratio_c,
        cfg.loss_agg_mode,
        is_weights=None,
        **agg_kwargs,
    )
