"""The RL math shared by estimators and losses: masked statistics, KL estimators and controllers,
loss aggregation, the value loss, log-probs and entropies from logits. The advantage estimators
are in ``estimators.py``, the policy losses in ``policy_losses.py`` (one registry each).

Pure torch, no distributed code. Semantics follow the reference system (verl's ``core_algos.py``);
each deviation is stated where it happens.

Shapes: per-token tensors are ``(batch, response_len)``, written ``(B, T)``, with a 0/1
``response_mask`` of the same shape (1 = a generated token that counts). Per-sequence tensors are
``(B,)``.

Global normalisation. A PPO mini-batch is split into micro-batches (gradient accumulation) and
across data-parallel ranks. ``agg_loss`` divides by counts of the *whole* mini-batch, passed in as
``global_tokens`` / ``global_seqs`` (see ``global_batch_counts``), so a micro-batch's loss is its
share of the mini-batch loss: summing micro-batch losses gives the mini-batch loss however the batch
was split and however much padding each micro-batch holds. When gradients are averaged over
``dp_size`` ranks (FSDP's reduce-scatter averages), scale each rank's loss by ``dp_size`` before
``backward()`` so the average of the ranks' gradients equals the gradient of that sum.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "AdaptiveKLController",
    "AllReduce",
    "FixedKLController",
    "LOSS_AGG_MODES",
    "agg_loss",
    "apply_kl_to_rewards",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "global_batch_counts",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "sum_over_ranks",
    "sum_pi_squared_chunked",
    "token_logprobs_chunked",
    "value_loss",
]

# Sums a tensor over data-parallel ranks (e.g. an all_reduce wrapper). None = this process only.
AllReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


# ------------------------------------------------------------------------------ masked statistics
def sum_over_ranks(t: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    """``t`` summed over ranks with ``all_reduce``; ``t`` itself without one."""
    return all_reduce(t) if all_reduce is not None else t


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None, all_reduce: AllReduce = None
) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1 (over everything, or along ``dim``); 0 where nothing is
    valid. ``all_reduce`` (whole-tensor mean only) makes it the mean over all ranks' elements."""
    if dim is not None:
        return masked_sum(x, mask, dim) / mask.sum(dim).clamp_min(1)
    stats = sum_over_ranks(torch.stack([masked_sum(x, mask), mask.sum().to(x.dtype)]), all_reduce)
    return stats[0] / stats[1].clamp_min(1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, all_reduce: AllReduce = None
) -> torch.Tensor:
    """Variance of the valid elements of ``x`` (unbiased: divides by n - 1, as the reference)."""
    mean = masked_mean(x, mask, all_reduce=all_reduce)
    stats = sum_over_ranks(torch.stack([masked_sum((x - mean) ** 2, mask), mask.sum().to(x.dtype)]), all_reduce)
    n = stats[1]
    if n == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased:
        if n == 1:
            raise ValueError("masked_var: an unbiased variance needs at least 2 valid elements")
        return stats[0] / (n - 1)
    return stats[0] / n


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, all_reduce: AllReduce = None
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid elements (global with ``all_reduce``);
    ``shift_mean=False`` adds the mean back (scale only)."""
    mean = masked_mean(x, mask, all_reduce=all_reduce)
    var = masked_var(x, mask, all_reduce=all_reduce)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


# ---------------------------------------------------------------------------------------- KL
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS_ALL = KL_KINDS + tuple(k + "+" for k in KL_KINDS)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi. (B, T) -> (B, T).

    ``kl``/``k1``: lp - ref (unbiased, can be negative); ``abs``: |lp - ref|; ``mse``/``k2``:
    0.5 (lp - ref)^2; ``low_var_kl``/``k3``: exp(ref - lp) - (ref - lp) - 1 (unbiased, >= 0), with
    the log-ratio clamped to [-20, 20] and the result to [-10, 10] as in the reference.
    A trailing ``+`` (``k3+``): the value of that estimator with the gradient of k2 (straight
    through), whose gradient is the unbiased gradient of KL.
    """
    if kind.endswith("+") and kind[:-1] in KL_KINDS:
        value = kl_penalty(logprob, ref_logprob, kind[:-1])
        k2 = kl_penalty(logprob, ref_logprob, "k2")
        return k2 + (value - k2).detach()
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)
        # expm1(x) - x rather than exp(x) - x - 1: no cancellation for small x, so the estimate
        # stays >= 0 (the plain form gives -6e-8 at x = 1e-5 in fp32)
        return torch.clamp(torch.expm1(log_ratio) - log_ratio, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator '{kind}'; valid kinds: {', '.join(KL_KINDS_ALL)}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the KL coefficient towards a target KL.

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0 (got {target_kl}, {horizon})")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(kl_ctrl) -> FixedKLController | AdaptiveKLController:
    """From ``algorithm.kl_ctrl`` (type fixed|adaptive, kl_coef, target_kl, horizon)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: unknown controller '{kl_ctrl.type}'; use fixed or adaptive")


def apply_kl_to_rewards(
    token_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    controller,
    kind: str = "kl",
    all_reduce: AllReduce = None,
) -> tuple[torch.Tensor, dict]:
    """KL in the reward: token_rewards = token_scores - beta * kl * mask, then update the controller.

    Args: token_scores, logprob, ref_logprob, response_mask: (B, T).
    Returns: token_rewards (B, T) and metrics: ``actor/reward_kl_penalty`` (the current KL: batch
    mean of per-sequence masked means), ``actor/reward_kl_penalty_coeff`` (beta used).
    With ``all_reduce`` the current KL and the controller's ``n_steps`` (the batch size) are over
    all ranks, so every rank's controller takes the same update and stays in step.
    """
    mask = response_mask.to(token_scores.dtype)
    kl = kl_penalty(logprob, ref_logprob, kind) * mask
    beta = controller.value
    token_rewards = token_scores - beta * kl
    per_seq = masked_mean(kl, mask, dim=-1)
    stats = sum_over_ranks(
        torch.stack([per_seq.sum(), torch.tensor(float(per_seq.numel()), dtype=per_seq.dtype, device=per_seq.device)]),
        all_reduce,
    )
    current_kl = (stats[0] / stats[1].clamp_min(1)).item()
    controller.update(current_kl=current_kl, n_steps=int(stats[1].item()))
    return token_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


# ----------------------------------------------------------------------------- loss aggregation
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_batch_counts(
    response_masks: torch.Tensor | list[torch.Tensor], all_reduce: AllReduce = None
) -> tuple[float, float]:
    """(valid tokens, sequences) of a whole mini-batch: pass every micro-batch mask of this rank;
    ``all_reduce`` adds the other ranks'. Feed the result to ``agg_loss``."""
    masks = [response_masks] if isinstance(response_masks, torch.Tensor) else list(response_masks)
    counts = torch.tensor(
        [float(sum(m.sum().item() for m in masks)), float(sum(m.shape[0] for m in masks))],
        dtype=torch.float64,
        device=masks[0].device,
    )
    counts = sum_over_ranks(counts, all_reduce)
    return float(counts[0].item()), float(counts[1].item())


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_const: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss into a scalar.

    token-mean: sum over valid tokens / valid tokens of the global mini-batch;
    seq-mean-token-sum: per-sequence token sums, summed / sequences of the global mini-batch;
    seq-mean-token-mean: per-sequence token means, summed / global sequences;
    seq-mean-token-sum-norm (Dr. GRPO): per-sequence token sums / ``norm_const`` (default T),
    summed / global sequences (verl 0.9.1's);
    token-sum: the sum over valid tokens (verl 0.9.1's; the loss grows with the batch).
    Without ``global_*`` the counts of this tensor are used (a batch that is not split). A
    mini-batch with no valid token (every row rejected by the rollout correction) gives 0, not 0/0.
    """
    mask = response_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = max(global_tokens, 1.0) if global_tokens is not None else mask.sum().clamp_min(1)
        return masked_sum(loss_mat, mask) / denom
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seqs = global_seqs if global_seqs is not None else max(loss_mat.shape[0], 1)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        const = norm_const if norm_const is not None else loss_mat.shape[-1]
        return (masked_sum(loss_mat, mask, dim=-1) / const).sum() / seqs
    raise ValueError(f"unknown loss_agg_mode '{mode}'; valid modes: {', '.join(LOSS_AGG_MODES)}")


# -------------------------------------------------------------------------------------- losses
def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)).

    All inputs (B, T). Returns (loss, vf_clipfrac: share of tokens where the clipped term won).
    """
    mask = response_mask.to(values.dtype)
    # clamp v itself (not old + clamp(v - old)): inside the range the clipped value is exactly v
    v_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (values - returns) ** 2
    loss2 = (v_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        clipfrac = masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask)
    return loss, clipfrac


# --------------------------------------------------------------------------- logits -> per token
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32. (..., V) -> (...).

    Computed as -sum(p log p) from the log-softmax, not as the reference's logsumexp(z) - sum(p z):
    that difference of two large numbers loses digits when the logits carry a large common offset
    (1.6e-5 absolute error at an offset of 123 in fp32). Tokens with p = 0 (logit -inf) add 0.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """``entropy_from_logits`` over ``chunk_size`` positions at a time, so the fp32 softmax of a large
    vocabulary exists for one chunk only. With gradients, each chunk is recomputed in backward
    (activation checkpointing) instead of keeping every chunk's softmax alive."""
    flat = logits.reshape(-1, logits.shape[-1])
    outs = []
    for chunk in flat.split(chunk_size, dim=0):
        if chunk.requires_grad:
            outs.append(checkpoint(entropy_from_logits, chunk, use_reentrant=False))
        else:
            outs.append(entropy_from_logits(chunk))
    return torch.cat(outs).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] without a (..., V) log-softmax tensor: (..., V), (...) -> (...)."""
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return entropy_from_logits(logits.float() / temperature)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[labels] in fp32 chunks, with its gradient written out:
    d lp / d logits = (onehot(label) - softmax(logits / T)) / T. Backward keeps only the logits and
    each row's logsumexp, and rebuilds one chunk's softmax from them (one exp), where activation
    checkpointing would rerun the chunk's forward and then autograd's backward through it."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        lps, lses = [], []
        for z, y in zip(logits.split(chunk_size), labels.split(chunk_size)):
            z = z.float() / temperature
            lse = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse)
            lses.append(lse)
        empty = logits.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(logits, labels, torch.cat(lses) if lses else empty)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return torch.cat(lps) if lps else empty

    @staticmethod
    def backward(ctx, grad_lp):
        logits, labels, lse = ctx.saved_tensors
        t, n = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], n):
            g = grad_lp[i : i + n, None].float() / t
            p = logits[i : i + n].to(torch.float32, copy=True)  # (a copy: the steps below are in place)
            p.div_(t).sub_(lse[i : i + n, None]).exp_().mul_(-g).scatter_add_(-1, labels[i : i + n, None], g)
            grad[i : i + n].copy_(p)
        return grad, None, None, None


def token_logprobs_chunked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``labels`` (and entropies) under softmax(logits / temperature), computed in fp32
    one chunk of ``chunk_size`` rows at a time: (n, V) logits in any dtype, (n,) labels ->
    (n,) fp32 log-probs, (n,) fp32 entropies or None.

    No (n, V) fp32 copy exists (a full-vocabulary upcast is ~12 GB at 20k tokens of a 152k
    vocabulary): with gradients the log-probs' backward (``_TokenLogProbs``) and the entropies'
    (activation checkpointing) rebuild one chunk at a time, so only the logits themselves and one
    chunk's fp32 temporaries are alive. The same operations per row as the unchunked
    ``logprobs_from_logits(logits.float() / temperature)``.
    ``entropy_grad=False``: entropies for metrics only (no graph)."""
    lp = _TokenLogProbs.apply(logits, labels, temperature, chunk_size)  # (no graph: its forward alone)
    if not with_entropy:
        return lp, None
    ents = []
    for z in logits.split(chunk_size):
        if z.requires_grad and entropy_grad:
            ents.append(checkpoint(_chunk_entropy, z, temperature, use_reentrant=False))
        else:
            with torch.no_grad():
                ents.append(_chunk_entropy(z, temperature))
    return lp, torch.cat(ents) if ents else logits.new_zeros(0, dtype=torch.float32)


def _chunk_sum_pi_squared(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float() / temperature
    z = z - z.amax(dim=-1, keepdim=True)  # (logsumexp adds the max back: a difference of large numbers)
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))


@torch.no_grad()
def sum_pi_squared_chunked(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """sum over the vocabulary of pi(v)^2, pi = softmax(logits / temperature), per row: (n, V) logits
    in any dtype -> (n,) fp32, computed one chunk of ``chunk_size`` rows at a time in fp32 and without
    a graph (the Optimal Token Baseline reads it from the old-log-prob pass). verl's
    ``calculate_sum_pi_squared_from_logits``: exp(logsumexp(2 z) - 2 logsumexp(z)), no (n, V)
    probability tensor; here on z minus its row max, which is the same sum without verl's rounding
    of two large logsumexps (1e-5 relative at logits ~50 in fp32)."""
    parts = [_chunk_sum_pi_squared(z, temperature) for z in logits.split(chunk_size)]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
